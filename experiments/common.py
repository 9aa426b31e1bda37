"""What the experiments share: their configs and command line, statistics, job records, the
evaluation protocol, the extension job, tables, figures and the results files.

Every experiment is a module (``python -m experiments.<name>.run``) that trains into
``runs/experiments/<name>/`` (not committed), resumes finished jobs, and writes its committed
results (results.json, results.md, figures) next to itself. Its settings are one frozen config
dataclass read from ``config.json`` (``read_config``: unknown keys are refused, missing ones
named); the runs and results folders come from the command line (``parse_args``) and are
passed down as arguments.

Files: ``results.json`` is an ``experiment`` result of ``ropekit.results`` (header + payload,
``write_results``); the cached job records under the runs folder (job.json, eval.json, ...)
are plain JSON written atomically and read back by ``read_record`` alone. Nothing in either
depends on the invocation (no wall time, no timestamp), so a rerun on finished jobs writes the
same bytes.

Holds:
    configs      read_config, config_dict, check, set_field, check_ints, check_numbers,
                 check_specs, check_data, check_depths, check_tasks, check_recipe,
                 ByteEvaluation, ExtensionProtocol
    command      EXPERIMENTS_DIR, Invocation, parse_args
    statistics   mean_std, summarize, fmt, markdown_table, series, paired
    files        read_record, write_record, provenance, write_results
    evaluation   evaluate, run_eval, plot_heatmaps
    extension    base_model, selection_loss, extension_job
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import sys
import time
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ropekit.results import digest, read_result, run_metadata, write_result
from ropekit.utils import atomic_write_text

EXPERIMENTS_DIR = Path(__file__).resolve().parent  # each experiment's folder is in here
C = TypeVar("C")


# ----------------------------------------------------------------------------- configs
def read_config(config_type: type[C], path: str | Path) -> C:
    """``path`` (a config.json) as ``config_type``, a frozen config dataclass: every key must
    be one of its fields and every field without a default must be given; a field whose type
    is itself a config dataclass is read from its JSON object the same way. Raises ValueError
    naming the file, the key and what is allowed."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return _from_mapping(config_type, data, str(path))


def _from_mapping(config_type: type[C], data: Any, where: str) -> C:
    name = config_type.__name__
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {name} must be a JSON object, not {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(config_type) if f.init}
    unknown = [key for key in data if key not in fields]
    if unknown:
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r} for {name}; allowed: {', '.join(fields)}"
        )
    missing = [
        key
        for key, f in fields.items()
        if key not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(
            f"{where}: {name} needs key {missing[0]!r} (missing: {', '.join(missing)})"
        )
    hints = typing.get_type_hints(config_type)
    values = {
        key: _from_mapping(hints[key], value, f"{where}: {key}")
        if dataclasses.is_dataclass(hints[key])
        else value
        for key, value in data.items()
    }
    try:
        return config_type(**values)
    except ValueError as e:  # name the file: the message names the field and what is allowed
        raise ValueError(f"{where}: {e}") from None


def config_dict(config: Any) -> dict[str, Any]:
    """A config's JSON form (what ``read_config`` reads back), for result payloads."""
    return dataclasses.asdict(config)


def check(ok: bool, owner: Any, name: str, value: Any, allowed: str) -> None:
    """Raise ``ValueError('<Config>.<field>=<value> is not allowed; <allowed>')`` unless ok."""
    if not ok:
        owner_name = owner if isinstance(owner, str) else type(owner).__name__
        raise ValueError(f"{owner_name}.{name}={value!r} is not allowed; {allowed}")


def set_field(config: Any, name: str, value: Any) -> None:
    """Replace a field of a frozen config in its ``__post_init__`` (normalised forms)."""
    object.__setattr__(config, name, value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_ints(
    config: Any, name: str, *, minimum: int = 1, many: bool = False, distinct: bool = False
) -> None:
    """Check field ``name`` is an integer >= minimum (``many``: a non-empty list of them,
    normalised to a tuple; ``distinct``: without repeats)."""
    value = getattr(config, name)
    if not many:
        check(
            _is_int(value) and value >= minimum,
            config,
            name,
            value,
            f"it must be an integer >= {minimum}",
        )
        return
    ok = isinstance(value, list | tuple) and len(value) > 0
    ok = ok and all(_is_int(v) and v >= minimum for v in value)
    what = f"it must be a non-empty list of integers >= {minimum}"
    check(
        ok and (not distinct or len(set(value)) == len(value)),
        config,
        name,
        value,
        what + (", without repeats" if distinct else ""),
    )
    set_field(config, name, tuple(value))


def check_numbers(
    config: Any, name: str, *, low: float, high: float | None = None, many: bool = False
) -> None:
    """Check field ``name`` is a finite number in (low, high] (``many``: a non-empty list of
    them, normalised to a tuple). Ints stay ints, so the config's JSON form is unchanged."""
    value = getattr(config, name)
    values = value if many else [value]
    ok = isinstance(values, list | tuple) and len(values) > 0
    ok = ok and all(_is_number(v) and v > low and (high is None or v <= high) for v in values)
    bound = f"> {low:g}" + ("" if high is None else f" and <= {high:g}")
    what = "a non-empty list of numbers " if many else "a number "
    check(ok, config, name, value, f"it must be {what}{bound}")
    if many:
        set_field(config, name, tuple(value))


def check_specs(config: Any, name: str, *, original_length: int, empty: bool = False) -> None:
    """Check field ``name`` maps method names to encoding specs that parse and validate for a
    model trained at ``original_length`` (the context ``set_encoding`` gives them), so a bad
    spec fails here rather than hours into a run. Stored as a plain dict (its JSON form)."""
    from ropekit.encodings import Spec

    value = getattr(config, name)
    ok = isinstance(value, Mapping) and (empty or len(value) > 0)
    ok = ok and all(isinstance(k, str) and k and isinstance(s, str) for k, s in value.items())
    check(
        ok,
        config,
        name,
        value,
        "it must map method names to spec strings" + ("" if empty else " (at least one)"),
    )
    for method, spec in value.items():
        try:
            Spec.parse(spec).config(original_length=original_length)
        except ValueError as e:
            raise ValueError(f"{type(config).__name__}.{name}[{method!r}]: {e}") from None
    set_field(config, name, dict(value))


def check_data(config: Any, name: str) -> None:
    """Check field ``name`` names the text (a corpus such as 'shakespeare', or a file); the
    data module says which exist when it loads it."""
    value = getattr(config, name)
    check(
        isinstance(value, str) and bool(value),
        config,
        name,
        value,
        "it must name a corpus (e.g. 'shakespeare') or a file",
    )


def check_depths(config: Any, name: str) -> None:
    """Check field ``name`` is a non-empty list of needle depths in [0, 1] (a tuple after)."""
    value = getattr(config, name)
    ok = isinstance(value, list | tuple) and len(value) > 0
    check(
        ok and all(_is_number(d) and 0 <= d <= 1 for d in value),
        config,
        name,
        value,
        "it must be a non-empty list of numbers in [0, 1]",
    )
    set_field(config, name, tuple(value))


def check_tasks(config: Any, name: str) -> None:
    """Check field ``name`` is a non-empty list of registered task names (ropekit.evals)."""
    from ropekit.evals import get_task

    value = getattr(config, name)
    ok = isinstance(value, list | tuple) and len(value) > 0
    check(
        ok and all(isinstance(t, str) for t in value),
        config,
        name,
        value,
        "it must be a non-empty list of task names",
    )
    for task in value:
        try:
            get_task(task)
        except ValueError as e:
            raise ValueError(f"{type(config).__name__}.{name}: {e}") from None
    set_field(config, name, tuple(value))


def check_recipe(config: Any, name: str, fixed: Iterable[str] = ()) -> Any:
    """The BaseRecipe that field ``name`` (a mapping of BaseRecipe overrides) describes; keys
    in ``fixed`` are set by the experiment itself and refused here."""
    from ropekit.train.recipe import BaseRecipe

    value = getattr(config, name)
    check(
        isinstance(value, Mapping),
        config,
        name,
        value,
        "it must be a JSON object of BaseRecipe fields",
    )
    allowed = [f.name for f in dataclasses.fields(BaseRecipe) if f.name not in set(fixed)]
    for key in value:
        check(
            key in allowed,
            config,
            f"{name}.{key}",
            value[key],
            f"the keys allowed are BaseRecipe's: {', '.join(allowed)}",
        )
    set_field(config, name, dict(value))
    try:
        return BaseRecipe(**value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{type(config).__name__}.{name}: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ByteEvaluation:
    """The evaluation protocol of the byte-level experiments (``evaluate``): bits per byte on
    the same held-out windows at every length, then needle retrieval at every depth."""

    data: str  # corpus: models train on its training split and are scored on its held-out one
    eval_lengths: tuple[int, ...]  # bytes; bits per byte is measured at each
    eval_windows: int  # held-out windows of max(eval_lengths) bytes, re-cut at every length
    tasks: tuple[str, ...]  # retrieval tasks (names registered in ropekit.evals)
    task_lengths: tuple[int, ...]  # bytes; every task is scored at each
    depths: tuple[float, ...]  # needle depths, 0 = start of the haystack, 1 = its end
    samples_per_depth: int  # task samples per depth and length (greedy, scored exactly)

    def __post_init__(self) -> None:
        check_data(self, "data")
        check_ints(self, "eval_lengths", many=True, distinct=True)
        check_ints(self, "eval_windows")
        check_tasks(self, "tasks")
        check_ints(self, "task_lengths", many=True, distinct=True)
        check_depths(self, "depths")
        check_ints(self, "samples_per_depth")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtensionProtocol(ByteEvaluation):
    """What every extension of the shared base model does alike (extend_8x, two_stage): the
    base model, the target length, the samples, the selection split and the seeds."""

    base: dict[str, Any]  # BaseRecipe fields that differ from its defaults ({}: the demo's)
    factor: int  # target length = factor x the base model's training length L
    samples: int  # training samples of factor x L bytes (one epoch, batch 1)
    selection_samples: int  # unseen training-split samples the learning-rate search scores
    seeds: tuple[int, ...]  # seed s draws the same samples for every method: paired by seed

    def __post_init__(self) -> None:
        super().__post_init__()
        check_recipe(self, "base")
        check_ints(self, "factor", minimum=2)
        check_ints(self, "samples")
        check_ints(self, "selection_samples")
        check_ints(self, "seeds", minimum=0, many=True, distinct=True)

    def recipe(self) -> Any:
        """The base model's BaseRecipe."""
        from ropekit.train.recipe import BaseRecipe

        return BaseRecipe(**self.base)


# ----------------------------------------------------------------------------- command line
@dataclasses.dataclass(frozen=True)
class Invocation:
    """What one run of an experiment was told: its config and where its files go."""

    config: Any  # the experiment's config dataclass
    runs: Path  # training runs and cached job records (not committed)
    results: Path  # results.json, results.md and the figures
    command: str  # the command line, recorded in results.json
    workers: int  # jobs run side by side (1 where the experiment has no --workers)


def parse_args(
    name: str,
    doc: str,
    config_type: type,
    argv: Sequence[str] | None = None,
    *,
    workers: bool = False,
) -> Invocation:
    """Every experiment's command line (config, runs folder, results folder, threads, and
    ``--workers`` where the experiment runs jobs side by side): parses it, reads the config,
    creates the results folder and sets torch's thread count. Defaults:
    ``experiments/<name>/config.json``, ``runs/experiments/<name>``, and the experiment's own
    folder for the results."""
    import argparse

    here = EXPERIMENTS_DIR / name
    parser = argparse.ArgumentParser(
        prog=f"python -m experiments.{name}.run", description=doc.splitlines()[0]
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=here / "config.json",
        help="the experiment's settings (default: its committed config.json)",
    )
    parser.add_argument(
        "--runs",
        type=Path,
        default=Path("runs/experiments") / name,
        help="training runs and cached job records go here",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=here,
        help="results.json, results.md and the figures go here",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    if workers:
        parser.add_argument("--workers", type=int, default=1, help="jobs run side by side")
    args = parser.parse_args(argv)
    config = read_config(config_type, args.config)
    args.results.mkdir(parents=True, exist_ok=True)

    import torch

    torch.set_num_threads(args.threads)
    given = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "-m", f"experiments.{name}.run", *given])
    return Invocation(config, args.runs, args.results, command, getattr(args, "workers", 1))


# ----------------------------------------------------------------------------- statistics
def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    values = list(values)
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def summarize(values: Sequence[float]) -> dict[str, Any]:
    m, s = mean_std(values)
    return {"mean": m, "std": s, "n": len(values), "values": list(values)}


def fmt(stat: dict[str, Any] | None, digits: int = 3, percent: bool = False) -> str:
    """``mean ± std`` (just the value for one run; ``-`` when missing)."""
    if stat is None:
        return "-"
    scale, unit = (100, "%") if percent else (1, "")
    d = 0 if percent else digits
    text = f"{scale * stat['mean']:.{d}f}{unit}"
    if stat["n"] > 1:
        text += f" ± {scale * stat['std']:.{d}f}"
    return text


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def series(
    entries: Mapping[str, Mapping[str, Any]], key: str
) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """Means and stds of ``entries[name][key][length]`` (summaries keyed by str length) as
    ``ropekit.figures`` series: what an error-bar figure over lengths draws."""
    means = {n: {int(k): s["mean"] for k, s in e[key].items()} for n, e in entries.items()}
    stds = {n: {int(k): s["std"] for k, s in e[key].items()} for n, e in entries.items()}
    return means, stds


# ----------------------------------------------------------------------------- files
def read_record(path: str | Path) -> dict[str, Any]:
    """A cached job record (job.json, eval.json, ...) as written by ``write_record``."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_record(path: str | Path, data: Any) -> None:
    """Atomic (temp file, fsync, rename): a killed run never leaves half a record that a
    resume would trust. Plain JSON, as the records always were (NaN stays NaN)."""
    atomic_write_text(Path(path), json.dumps(data, indent=2, default=str))


def provenance(name: str, config: Any, **more: Any) -> dict[str, Any]:
    """What produced an experiment's results: the experiment, a digest of its whole config,
    and ``more`` (the base model, ...)."""
    return {"experiment": name, "config": digest(config_dict(config)), **more}


def write_results(
    folder: Path,
    payload: Mapping[str, Any],
    markdown: str,
    *,
    command: str,
    provenance: Mapping[str, Any],
) -> None:
    """``results.md`` (the tables) and ``results.json`` (an ``experiment`` result: kind,
    format version, run metadata and provenance, then ``payload``), both atomically."""
    atomic_write_text(folder / "results.md", markdown)
    write_result(
        folder / "results.json",
        "experiment",
        payload,
        meta=run_metadata(command),
        provenance=provenance,
    )


# ----------------------------------------------------------------------------- evaluation
def evaluate(
    model: Any,
    folder: Path,
    *,
    lengths: Sequence[int],
    data: str,
    eval_windows: int,
    tasks: Sequence[Any],
    task_lengths: Sequence[int],
    depths: Sequence[float],
    samples_per_depth: int,
    spec: str,
) -> dict[str, Any]:
    """The shared protocol: bits per byte on the same held-out windows at every length (seed 0
    for every method, so methods are compared on identical bytes), then retrieval tasks at
    ``task_lengths`` with needles at ``depths``. Returns the numbers; the files stay in
    ``folder/ppl`` and ``folder/tasks``."""
    from ropekit.evals import EvalConfig, PerplexityConfig, run_perplexity, run_tasks
    from ropekit.results import encode

    ppl_config = PerplexityConfig(tuple(lengths), n_tokens=eval_windows * max(lengths), seed=0)
    ppl = run_perplexity(
        model, ppl_config, folder / "ppl", tokenizer="bytes", data=data, spec=spec, progress=False
    ).result
    out: dict[str, Any] = {
        "bpb": {str(r.length): r.bits_per_byte for r in ppl.results},
        "position_nll": {str(r.length): encode(r.position_nll) for r in ppl.results},
    }
    if tasks:
        task_config = EvalConfig(
            tuple(task_lengths), samples=samples_per_depth, depths=tuple(depths), seed=0,
            batch_size=10,
        )  # fmt: skip
        summary = run_tasks(
            model, list(tasks), task_config, folder / "tasks", tokenizer="bytes",
            kind="retrieval", spec=spec, progress=False,
        )  # fmt: skip
        out["tasks"] = {
            name: {
                "accuracy": {str(n): score for n, score in entry.by_length().items()},
                "cells": encode(entry.cells),
            }
            for name, entry in summary.tasks.items()
        }
    return out


def run_eval(cfg: ByteEvaluation, model: Any, folder: Path, spec: str) -> dict[str, Any]:
    """``evaluate`` once per job folder: the numbers, the spec and the wall time (``eval_s``)
    are cached in ``folder/eval.json`` and read back on a rerun."""
    path = folder / "eval.json"
    if path.exists():
        return read_record(path)
    start = time.perf_counter()
    result = evaluate(
        model.eval(),
        folder,
        lengths=cfg.eval_lengths,
        data=cfg.data,
        eval_windows=cfg.eval_windows,
        tasks=cfg.tasks,
        task_lengths=cfg.task_lengths,
        depths=cfg.depths,
        samples_per_depth=cfg.samples_per_depth,
        spec=spec,
    )
    result |= {"spec": spec, "eval_s": time.perf_counter() - start}
    write_record(path, result)
    return result


def plot_heatmaps(
    panels: dict[str, list[dict[str, Any]]], path: Path, title: str, columns: int = 4
) -> None:
    """A grid of needle heatmaps (length x depth), one panel per method."""
    import numpy as np

    from ropekit.figures import figure, save

    n = len(panels)
    cols = min(columns, n)
    rows = math.ceil(n / cols)
    # Constrained layout leaves room for the suptitle and the shared colour bar.
    fig, axes = figure(3.2 * cols, 2.6 * rows, rows, cols, constrained=True)
    image = None
    for ax, (name, cells) in zip(axes.flat, panels.items(), strict=False):
        lengths = sorted({c["length"] for c in cells})
        depths = sorted({c["depth"] for c in cells})
        grid = np.full((len(depths), len(lengths)), np.nan)
        for c in cells:
            grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["score"]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(lengths)), [str(v) for v in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
        ax.set_xlabel("length (bytes)", fontsize=7)
        ax.set_ylabel("needle depth", fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="accuracy")
    fig.suptitle(title)
    save(fig, path)


# ----------------------------------------------------------------------------- extension jobs
def base_model(cfg: ExtensionProtocol) -> tuple[Path, dict[str, Any], bool]:
    """The base model of the extension experiments: the demo's byte-level RoPE decoder
    trained at L with the retrieval mixture (``cfg.base`` overrides BaseRecipe fields), taken
    from the user cache or trained there once (about 7 minutes on 2 cores). Returns its
    folder, its pretrain summary and whether it was reused."""
    from ropekit.train.recipe import prepare_base_model

    folder, reused, _ = prepare_base_model(cfg.recipe(), log=print)
    return folder, read_result(folder / "pretrain.json", "pretrain"), reused


def selection_loss(model: Any, data: str, length: int, seed: int, first: int, n: int) -> float:
    """Mean next-byte loss on training-split samples ``first .. first+n-1`` of the seeded
    order: the extension trains on samples 0..first-1, so these are unseen, and they are not
    the held-out split the results are measured on. The learning-rate search selects on it."""
    import torch

    from ropekit.data import make_train_dataset
    from ropekit.train.loss import cross_entropy_sum

    packed = make_train_dataset(data, "bytes", length, seed=seed)
    total, count = 0.0, 0.0
    model.eval()
    with torch.no_grad():
        for i in range(first, first + n):
            item = packed[i]
            logits = model(input_ids=item["input_ids"][None]).logits
            s, c = cross_entropy_sum(logits, item["labels"][None])
            total, count = total + float(s), count + float(c)
    return total / count


def extension_job(
    cfg: ExtensionProtocol,
    base: Path,
    spec: str,
    folder: Path,
    *,
    lr: float,
    seed: int,
    mode: str = "positional",
    recipe: str | None = None,
    lora_lr: float | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Extend a fresh copy of the base model (or reload a finished extension); returns the
    model and a record with the selection loss and the extension summary (``job.json``)."""
    from ropekit.backbone import load_adapter
    from ropekit.model import load_decoder
    from ropekit.train.extend import ExtendConfig, run_extension

    model = load_decoder(base / "model")
    record_path = folder / "job.json"
    target = cfg.factor * model.config.context_length
    if record_path.exists():
        load_adapter(model, folder)
        return model, read_record(record_path)
    config = ExtendConfig(
        method=spec,
        target_length=target,
        samples=cfg.samples,
        mode=mode,
        lr=lr,
        data=cfg.data,
        seed=seed,
        **({} if lora_lr is None else {"lora_lr": lora_lr}),
    )
    start = time.perf_counter()
    run_extension(model, config, folder, recipe=recipe, overwrite=True, log=lambda _: None)
    elapsed = time.perf_counter() - start
    loss = selection_loss(model, cfg.data, target, seed, cfg.samples, cfg.selection_samples)
    summary = read_result(folder / "extend.json", "extend")
    record = {
        "spec": summary["spec"],
        "lr": lr,
        "seed": seed,
        "mode": mode,
        "recipe": recipe,
        "lora_lr": lora_lr,
        "trainable": summary["trainable"],
        "final_loss": summary["final_loss"],
        "selection_loss": loss,
        "extend_s": elapsed,
    }
    write_record(record_path, record)
    return model, record


def paired(
    rows: Sequence[Mapping[str, Any]],
    pairs: Iterable[tuple[str, str]],
    seeds: Sequence[int],
    key: str = "bpb",
) -> dict[str, dict[str, dict[str, Any]]]:
    """``a - b`` of ``row[key][length]`` per seed, summarised, for each pair of trained
    methods both present in ``rows`` (a seed draws the same samples for every method)."""
    by = {(r["name"], r["seed"]): r for r in rows}
    names = {r["name"] for r in rows if r["seed"] is not None}
    out = {}
    for a, b in pairs:
        if a in names and b in names:
            out[f"{a} - {b}"] = {
                n: summarize([by[(a, s)][key][n] - by[(b, s)][key][n] for s in seeds])
                for n in rows[0][key]
            }
    return out
