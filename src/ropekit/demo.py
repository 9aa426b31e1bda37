"""`ropekit demo`: the main job end to end on an embedded default, on a laptop CPU.

A small byte-level RoPE decoder is trained at a short context L (or reused from the user
cache), extended to 8L by every method (the unmodified `rope` baseline, `linear`, `ntk`,
`yarn`, `tuned-yarn`, `adarope`), evaluated at L..8L (bits per byte on held-out plays, passkey
and key-value retrieval), its AdaRoPE heads analysed, and a report written (Markdown +
self-contained HTML) from the run's JSON.

The base model is ``ropekit.train.recipe``'s two-stage retrieval recipe (``BaseRecipe``),
trained once and cached; the experiments use the same recipe.

Holds:
- `PRESETS` of `DemoConfig` (`full`, `quick`, and `tiny` for the test suite).
- `DemoConfig` and `DemoResult` (demo.json) live in ``ropekit.report.demo_record``, below this
  module, because the report reads them; they are imported here under the same names.
- `run_demo(out_dir, config)`: the pipeline; returns a `DemoRun` (the record, where it is and
  the report's paths).
- `summary_table`: the terminal table; `check_data`, `claim_out_dir`.

Layout of ``out_dir`` (every file but the report is JSON or a PNG drawn from JSON):

    demo.json                   config; once done, base model, per-method numbers, notes, timings
    report.md, report.html      `ropekit.report.build_report(out_dir)`
    bpb_vs_length.png, nll_vs_position.png, retrieval_vs_length.png
    base/pretrain.json          the base model's training summary (copied from the cache)
    methods/<name>/extend.json  extension (adapter/ beside it); none for `rope`
    methods/<name>/ppl/         ppl.json + ppl.png (`ropekit eval ppl`)
    methods/<name>/tasks/       summary.json + plots (`ropekit eval passkey|needle`)
    analysis/                   analysis.json + head figures of the AdaRoPE model
    schedules/                  schedules.json + schedules.png (the fixed schedules at init)

The base model lives in ``$ROPEKIT_CACHE/demo/<key>/`` (``ropekit.train.recipe``).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ropekit.report.demo_record import (
    VERSION as VERSION,  # re-exported: the demo.json version its callers check
)
from ropekit.report.demo_record import (
    BaseModel,
    BaseStage,
    DemoConfig,
    DemoResult,
    MethodFiles,
    MethodRow,
    Outcome,
)
from ropekit.train.recipe import BaseRecipe

if TYPE_CHECKING:  # imported where used: the demo's commands load what they need
    from ropekit.analysis import AnalysisRun
    from ropekit.evals.perplexity import PerplexityResult
    from ropekit.report.build import ReportPaths
    from ropekit.train.extend import ExtendRecord

METHODS: tuple[str, ...] = ("rope", "linear", "ntk", "yarn", "tuned-yarn", "adarope")
DEMO_JSON = "demo.json"
# What an earlier `make demo` (the schedule comparison) left in runs/demo: safe to replace.
_OLD_DEMO_FILES = {"schedules.json", "schedules.png"}


PRESETS: dict[str, DemoConfig] = {
    "full": DemoConfig(preset="full"),
    # Under 3 minutes on 2 cores: a shorter context (the shortest that holds a record and its
    # question), a smaller model, fewer of everything.
    "quick": DemoConfig(
        base=BaseRecipe(
            context=96, d_model=128, n_layers=4, n_heads=4, recall_steps=400, base_steps=100
        ),
        extend_samples=32,
        length_multiples=(1, 2, 8),
        eval_windows=8,
        task_samples=10,
        analysis_windows=2,
        influence_windows=1,
        preset="quick",
    ),
    # The test suite's end-to-end run: every stage, as small as it goes (seconds).
    "tiny": DemoConfig(
        base=BaseRecipe(
            context=96,
            d_model=32,
            n_layers=2,
            n_heads=2,
            recall_steps=3,
            recall_batch_size=2,
            base_steps=3,
            batch_size=4,
            warmup=1,
        ),
        factor=2,
        extend_samples=3,
        length_multiples=(1, 2),
        eval_windows=1,
        tasks=("passkey_shakespeare",),
        task_samples=2,
        analysis_windows=1,
        influence_windows=1,
        preset="tiny",
    ),
}


@dataclasses.dataclass(frozen=True)
class DemoRun:
    """What ``run_demo`` returns: the finished result and where it and the report are."""

    result: DemoResult
    json: Path  # demo.json
    report: ReportPaths


# ----------------------------------------------------------------------------- preparation
def check_data(config: DemoConfig) -> None:
    """Raise FileNotFoundError naming `make setup` when the demo's corpus is not installed."""
    from ropekit.data import CorpusNotInstalledError, load_corpus

    try:
        load_corpus(config.data, "validation")
    except CorpusNotInstalledError as e:
        raise FileNotFoundError(
            f"the demo needs the {config.data!r} corpus, which is not installed. Run `make "
            f"setup` (it installs every corpus ropekit uses), then `make demo`. ({e})"
        ) from None


def _contents(out: Path) -> list[Path]:
    """What ``out`` holds besides the run lock (ropekit.outdir) the command may hold on it."""
    from ropekit.outdir import LOCK_FILE

    return [p for p in out.iterdir() if p.name != LOCK_FILE]


def _is_previous_demo(out: Path) -> bool:
    from ropekit.results import result_kind

    marker = out / DEMO_JSON
    if marker.is_file():
        return result_kind(marker) == "demo"
    return {p.name for p in _contents(out)} <= _OLD_DEMO_FILES


def claim_out_dir(out: Path, overwrite: bool) -> bool:
    """Make ``out`` ready: create it, or empty a previous demo's folder (or any folder when
    ``overwrite``), leaving a run lock in place. Returns whether something was replaced."""
    if not out.exists() or (out.is_dir() and not _contents(out)):
        out.mkdir(parents=True, exist_ok=True)
        return False
    if not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; choose a folder")
    if not (overwrite or _is_previous_demo(out)):
        raise FileExistsError(
            f"{out} holds files that are not from a previous `ropekit demo`; choose another "
            "--out, or pass --overwrite to replace them"
        )
    resolved, here = out.resolve(), Path.cwd().resolve()
    if resolved == here or resolved in here.parents or resolved == Path.home().resolve():
        raise ValueError(f"refusing to replace {out}: it holds the current folder or home")
    for path in _contents(out):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return True


def _read_json(path: Path) -> dict[str, Any]:
    from ropekit.results import read_result

    return read_result(path)


def _perplexity(path: Path) -> PerplexityResult:
    from ropekit.evals.perplexity import PerplexityResult
    from ropekit.results import read_record

    return read_record(path, PerplexityResult)


# ----------------------------------------------------------------------------- stages
def _evaluate(model: Any, config: DemoConfig, folder: Path, spec: str, command: str) -> None:
    """Bits per byte (``folder/ppl``) and retrieval accuracy (``folder/tasks``) at every
    length of ``config``."""
    from ropekit.evals import EvalConfig, PerplexityConfig, run_perplexity, run_tasks

    lengths = tuple(config.lengths)
    perplexity = PerplexityConfig(
        lengths, n_tokens=config.eval_windows * max(lengths), seed=config.seed
    )
    run_perplexity(model, perplexity, folder / "ppl", data=config.data, spec=spec, command=command)
    tasks = EvalConfig(lengths, samples=config.task_samples, seed=config.seed, batch_size=8)
    run_tasks(
        model, list(config.tasks), tasks, folder / "tasks", kind="retrieval", spec=spec,
        command=command,
    )  # fmt: skip


def _method_row(
    name: str, spec: str, folder: Path, out: Path, extend: ExtendRecord | None
) -> MethodRow:
    """One method's numbers, read back from the JSON its stages wrote."""
    from ropekit.evals.runner import TasksResult
    from ropekit.results import read_record

    ppl = _perplexity(folder / "ppl" / "ppl.json")
    tasks = read_record(folder / "tasks" / "summary.json", TasksResult)
    files = MethodFiles(
        ppl=(folder / "ppl" / "ppl.json").relative_to(out).as_posix(),
        tasks=(folder / "tasks" / "summary.json").relative_to(out).as_posix(),
        extend=None if extend is None else (folder / "extend.json").relative_to(out).as_posix(),
    )
    return MethodRow(
        name=name,
        spec=spec,
        trainable=0 if extend is None else extend.trainable.total,
        extend_s=None if extend is None else extend.elapsed_s,
        final_loss=None if extend is None else extend.final_loss,
        bpb={r.length: r.bits_per_byte for r in ppl.results},
        tasks={t: entry.by_length() for t, entry in tasks.tasks.items()},
        files=files,
    )


def _figures(out: Path, config: DemoConfig, rows: list[MethodRow]) -> dict[str, str]:
    """The comparison figures, drawn from the methods' JSON; returns file -> caption."""
    from ropekit.figures import plot_vs_length
    from ropekit.report.plots import plot_nll_vs_position, plot_tasks_vs_length

    L = config.context
    bpb = {r.name: r.bpb for r in rows}
    plot_vs_length(
        bpb,
        out / "bpb_vs_length.png",
        ylabel="bits per byte (held-out)",
        title=f"Trained at {L}, extended to {config.target_length}",
        train_length=L,
    )
    longest = max(config.lengths)
    curves = {}
    for r in rows:
        at = _perplexity(out / r.files.ppl).at(longest)
        if at.position_nll is not None:
            curves[r.name] = at.position_nll
    plot_nll_vs_position(curves, out / "nll_vs_position.png", length=longest, train_length=L)
    tasks = {t: {r.name: r.tasks[t] for r in rows} for t in config.tasks}
    plot_tasks_vs_length(tasks, out / "retrieval_vs_length.png", train_length=L)
    return {
        "bpb_vs_length.png": "Bits per byte vs evaluation length, one line per method.",
        "nll_vs_position.png": f"NLL vs token position in windows of {longest} bytes: a method "
        f"that generalises keeps falling (or stays flat) past position {L}.",
        "retrieval_vs_length.png": "Retrieval accuracy vs evaluation length, one panel per task.",
    }


def _notes(config: DemoConfig, rows: list[MethodRow]) -> list[str]:
    """Plain-language readings of the numbers (computed here, never written by hand)."""
    L, longest = config.context, max(config.lengths)
    rope = next((r for r in rows if r.name == "rope"), None)
    if rope is None:  # the readings compare every method with unmodified RoPE
        return []
    notes = []
    scored = [r for r in rows if longest in r.bpb and not math.isnan(r.bpb[longest])]
    if scored:
        best = min(scored, key=lambda r: r.bpb[longest])
        notes.append(
            f"At {longest} bytes the lowest bits per byte is {best.name} "
            f"({best.bpb[longest]:.3f}), against {rope.bpb[longest]:.3f} for unmodified RoPE "
            f"and {rope.bpb[L]:.3f} for RoPE at its training length {L}."
        )
    for task in rope.tasks:
        at_l = rope.score(task, L)
        if at_l is None:
            notes.append(f"{task} does not fit in {L} bytes; it is scored at longer lengths only.")
        elif at_l < 0.5:
            notes.append(
                f"The base model scores {100 * at_l:.0f}% on {task} at its own training length "
                f"{L}: it has not learned this retrieval reliably, so {task} at longer lengths "
                "says little about the extension methods."
            )
        else:
            far = {r.name: r.score(task, longest) for r in rows}
            scores = {name: v for name, v in far.items() if v is not None}
            if scores:
                best_score = max(scores.values())
                winners = ", ".join(name for name, v in scores.items() if v == best_score)
                at_far = (
                    f"no method retrieves it at {longest} bytes"
                    if best_score == 0
                    else f"at {longest} bytes the best is {winners} with {100 * best_score:.0f}% "
                    f"(unmodified RoPE {100 * (far['rope'] or 0):.0f}%)"
                )
                notes.append(
                    f"The base model retrieves on {task} at its training length ({100 * at_l:.0f}% "
                    f"at {L}); {at_far}."
                )
    return notes


# ----------------------------------------------------------------------------- the pipeline
def _extend_all(
    config: DemoConfig, base_dir: Path, out: Path, command: str, log: Callable[[str], None]
) -> tuple[list[MethodRow], Any]:
    """Stage 2: extend a fresh copy of the base model with every method and evaluate it;
    returns the method rows and the AdaRoPE model (analysed next)."""
    from ropekit.backbone import as_backbone
    from ropekit.model import load_decoder
    from ropekit.results import read_record
    from ropekit.train.extend import ExtendConfig, ExtendRecord, extend

    rows, adarope_model = [], None
    for i, name in enumerate(METHODS, 1):
        folder = out / "methods" / name
        model = load_decoder(base_dir / "model").eval()
        record = None
        if name != "rope":
            log(f"  ({i}/{len(METHODS)}) {name}: extending")
            extension = ExtendConfig(
                method=config.method_spec(name),
                target_length=config.target_length,
                samples=config.extend_samples,
                lr=config.extend_lr,
                data=config.data,
                seed=config.seed,
            )
            result = extend(
                model, extension, folder, command=command, log=lambda line: log(f"      {line}")
            )
            record = read_record(result.summary, ExtendRecord)
        spec = as_backbone(model).encoding.spec
        log(f"  ({i}/{len(METHODS)}) {name}: evaluating `{spec}`")
        _evaluate(model.eval(), config, folder, spec, command)
        rows.append(_method_row(name, spec, folder, out, record))
        if name == "adarope":
            adarope_model = model
    return rows, adarope_model


def _analyze(config: DemoConfig, model: Any, out: Path, command: str) -> AnalysisRun:
    """Stage 3: inside the AdaRoPE model."""
    from ropekit.analysis import AnalysisConfig, analyze

    analysis = AnalysisConfig(
        tuple(config.lengths),
        n_windows=config.analysis_windows,
        influence_windows=config.influence_windows,
        target_length=config.target_length,
        seed=config.seed,
    )
    return analyze(model, analysis, out / "analysis", data=config.data, command=command)


def _all_figures(
    config: DemoConfig, out: Path, rows: list[MethodRow], command: str
) -> dict[str, str]:
    """Stage 4: the fixed schedules at init and the comparison figures."""
    from ropekit.report.schedules import compare_schedules, write_schedules

    write_schedules(
        compare_schedules(
            # tuned-yarn and adarope start from yarn; analysis/ shows what they learned.
            [m for m in METHODS if m not in ("tuned-yarn", "adarope")],
            head_dim=config.base.model_config().head_dim,
            factor=config.factor,
            original_length=config.context,
        ),
        out / "schedules",
        command=command,
    )
    return _figures(out, config, rows)


def _base_record(config: DemoConfig, base_dir: Path, reused: bool) -> BaseModel:
    """The base model as pretrain.json (an untyped kind) describes it."""
    base = _read_json(base_dir / "pretrain.json")
    stages = tuple(
        BaseStage(st["name"], st["context"], st["steps"], st["batch_size"], st["retrieval_ratio"])
        for st in base["stages"]
    )
    return BaseModel(
        key=config.base.key(),
        path=str(base_dir),
        reused=reused,
        encoding=base["encoding"],
        parameters=base["parameters"],
        steps=base["steps"],
        stages=stages,
        final_loss=base["final_loss"],
        elapsed_s=base["elapsed_s"],
        tokens_per_s=base["tokens_per_s"],
        settings=config.base.settings(),
    )


def run_demo(
    out_dir: str | Path = "runs/demo",
    config: DemoConfig | None = None,
    *,
    overwrite: bool = False,
    command: str = "",
    log: Callable[[str], None] = print,
) -> DemoRun:
    """Run the whole demo into ``out_dir`` (see the module docstring); returns demo.json's
    record and where it and the report are."""
    from ropekit.report.build import build_report
    from ropekit.results import run_metadata, write_result
    from ropekit.train.recipe import prepare_base_model

    config = config or PRESETS["full"]
    out = Path(out_dir)
    started = time.perf_counter()
    check_data(config)
    replaced = claim_out_dir(out, overwrite)
    meta = run_metadata(command, seed=config.seed)
    # Marks the folder as a demo's from the start.
    write_result(out / DEMO_JSON, "demo", DemoResult(meta, {}, "running", config, None))
    if replaced:
        log(f"replaced the previous demo in {out}")
    timings: dict[str, float] = {}
    titles = (
        f"base model: byte-level RoPE decoder at L={config.context}",
        f"extend to {config.target_length} and evaluate at {config.lengths}",
        "analyze the AdaRoPE heads (effective length, schedules, influence)",
        "figures",
        "report",
    )
    clock = [time.perf_counter()]

    def stage(i: int, done: str | None = None) -> None:
        if done is not None:
            timings[done] = time.perf_counter() - clock[0]
        log(f"[{i}/{len(titles)}] {titles[i - 1]}")
        clock[0] = time.perf_counter()

    stage(1)
    base_dir, reused, _ = prepare_base_model(config.base, log)
    (out / "base").mkdir()
    shutil.copy2(base_dir / "pretrain.json", out / "base" / "pretrain.json")
    stage(2, "base model" + (" (reused)" if reused else ""))
    rows, adarope_model = _extend_all(config, base_dir, out, command, log)
    stage(3, "extension + evaluation")
    analysis = _analyze(config, adarope_model, out, command)
    stage(4, "analysis")
    figures = _all_figures(config, out, rows, command)
    stage(5, "figures")
    timings["total (before the report)"] = time.perf_counter() - started
    outcome = Outcome(
        base=_base_record(config, base_dir, reused),
        methods=tuple(rows),
        analysis=analysis.json.relative_to(out).as_posix(),
        figures=figures,
        notes=tuple(_notes(config, rows)),
        timings=timings,
    )
    result = DemoResult(meta, {}, "done", config, outcome)
    path = write_result(out / DEMO_JSON, "demo", result)
    title = f"ropekit demo: a small byte-level model extended {config.factor}x"
    return DemoRun(result, path, build_report(out, title=title))


def summary_table(result: DemoResult) -> list[str]:
    """The terminal summary: bits per byte and retrieval accuracy per method and length (a
    length a task does not fit is "-")."""
    config, lengths = result.config, result.config.lengths
    columns: list[tuple[str, str | None, int]] = [("bpb", None, n) for n in lengths]
    columns += [(t.removesuffix("_shakespeare"), t, n) for t in config.tasks for n in lengths]
    width = max(8, *(len(f"{name}@{n}") + 1 for name, _, n in columns))
    header = f"{'method':<11} {'trained':>7} " + "".join(
        f"{f'{name}@{n}':>{width}}" for name, _, n in columns
    )
    lines = [header, "-" * len(header)]
    for m in result.finished().methods:
        cells = []
        for _, task, n in columns:
            if task is None:
                text = f"{m.bpb[n]:.3f}"
            else:
                value = m.score(task, n)
                text = "-" if value is None else f"{value:.0%}"
            cells.append(f"{text:>{width}}")
        lines.append(f"{m.name:<11} {m.trainable:>7,} " + "".join(cells))
    return lines
