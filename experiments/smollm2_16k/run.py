"""Experiment D: a real model extended. SmolLM2-135M (a Llama-architecture RoPE model trained
at 8,192 tokens, installed offline from its package) taken to 16,384 tokens.

    python -m experiments.smollm2_16k.run        # everything; finished pieces are reused

Methods: the unmodified model, untuned schedules (linear, NTK-aware, dynamic NTK, YaRN x2 and
x4) and three trained with the backbone frozen: tuned-yarn (YaRN's 4 global knobs), AdaRoPE
shared across heads and layers (the review's global control) and AdaRoPE. Every trained method
sees the same 16 training samples of 16,384 tokens from the Shakespeare training plays, as
PoSE windows (Zhu et al. 2023) of 2,048 tokens whose positions span 16,384, with gradient
checkpointing, at one learning rate (no search), for three seeds (a seed draws the samples
and the PoSE positions, the same for every method: differences are paired by seed).

Evaluation, identical for every method: perplexity on the same span of the held-out plays
(Hamlet, Much Ado, Richard III, The Winter's Tale; never trained on) at 2k, 8k and 16k tokens,
whole window and last quarter, then passkey (noise haystack) and needle (essay haystack)
at 8k and 16k (trained methods: their first seed). The work runs in stages, the must-haves
first (untuned perplexity, training and perplexity of the first seed, tasks at 8k, tasks at
16k, the other seeds) and the results files are rewritten after each stage, so an
interrupted run leaves honest partial results ("-" where not run).

On a GPU the same command runs there (the model is moved to CUDA; training follows it).
Runs go to runs/experiments/smollm2_16k/ (not committed); results.json, results.md and the
figures are written next to this file.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.common import (
    check,
    check_data,
    check_depths,
    check_ints,
    check_numbers,
    check_specs,
    check_tasks,
    config_dict,
    fmt,
    markdown_table,
    parse_args,
    provenance,
    read_record,
    summarize,
    write_record,
    write_results,
)

NAME = "smollm2_16k"
# SmolLM2-135M's training length (its max_position_embeddings): the window the untuned
# schedules extend from and the line the figures draw.
ORIGINAL_LENGTH = 8192


@dataclasses.dataclass(frozen=True)
class PoseTraining:
    """How each trained method trains (the same for every method and seed)."""

    samples: int  # training samples of target_length tokens (one epoch, batch 1)
    pose_window: int  # tokens per PoSE window; its positions span target_length
    lr: float  # peak learning rate (no search: one rate for every method)
    seeds: tuple[int, ...]  # seed s draws the samples and PoSE positions: paired by seed
    grad_checkpointing: bool  # recompute activations in backward (memory for time)

    def __post_init__(self) -> None:
        check_ints(self, "samples")
        check_ints(self, "pose_window")
        check_numbers(self, "lr", low=0)
        check_ints(self, "seeds", minimum=0, many=True, distinct=True)
        check(
            isinstance(self.grad_checkpointing, bool),
            self,
            "grad_checkpointing",
            self.grad_checkpointing,
            "it must be true or false",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmolLM2Config:
    """Experiment D's settings (config.json). Lengths in the model's tokens."""

    model: str  # a model ropekit installs offline (ropekit.hf.KNOWN_MODELS)
    data: str  # corpus: trained on its training split, scored on its held-out documents
    target_length: int  # tokens the trained methods are extended to
    train: PoseTraining
    untuned: dict[str, str]  # name -> spec applied without training ("rope": the model as is)
    trained: dict[str, str]  # name -> spec whose positional parameters train
    eval_lengths: tuple[int, ...]  # perplexity window lengths (whole window and last quarter)
    eval_spans: int  # held-out spans of max(eval_lengths) tokens, re-cut at every length
    eval_seed: int  # draws where the spans start in the held-out documents
    tasks: tuple[str, ...]  # retrieval tasks (names registered in ropekit.evals)
    task_lengths: tuple[int, ...]  # tokens; every task is scored at each (first seed only)
    depths: tuple[float, ...]  # needle depths, 0 = start of the haystack, 1 = its end
    samples_per_depth: int  # task samples per depth and length
    description: str = ""  # what the experiment asks (for the reader of config.json)

    def __post_init__(self) -> None:
        from ropekit.hf import KNOWN_MODELS

        check(
            self.model in KNOWN_MODELS,
            self,
            "model",
            self.model,
            f"known models: {', '.join(KNOWN_MODELS)}",
        )
        check_data(self, "data")
        check_ints(self, "target_length", minimum=ORIGINAL_LENGTH + 1)
        check(
            isinstance(self.train, PoseTraining),
            self,
            "train",
            self.train,
            "it must be a PoseTraining",
        )
        check(
            self.train.pose_window <= self.target_length,
            self,
            "train.pose_window",
            self.train.pose_window,
            f"it must be <= target_length={self.target_length}",
        )
        check_specs(self, "untuned", original_length=ORIGINAL_LENGTH)
        check_specs(self, "trained", original_length=ORIGINAL_LENGTH)
        both = sorted(set(self.untuned) & set(self.trained))
        check(not both, self, "trained", both, "a method name is either untuned or trained")
        check_ints(self, "eval_lengths", many=True, distinct=True)
        check_ints(self, "eval_spans")
        check_ints(self, "eval_seed", minimum=0)
        check_tasks(self, "tasks")
        check_ints(self, "task_lengths", many=True, distinct=True)
        check_depths(self, "depths")
        check_ints(self, "samples_per_depth")


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def open_model(cfg: SmolLM2Config) -> tuple[Any, Any]:
    """A fresh copy of the base model (float32) and its ropekit tokenizer."""
    from ropekit.backbone import open_backbone
    from ropekit.hf import install_model

    install_model(cfg.model)
    backbone = open_backbone(cfg.model)
    return backbone.model.to(device()), backbone.tokenizer


def job_folder(cfg: SmolLM2Config, runs: Path, name: str, seed: int | None) -> Path:
    """Where a job lives: <runs>/<method> for an untuned method, <runs>/<method>/s<seed> for a
    trained one."""
    return runs / name if name in cfg.untuned else runs / name / f"s{seed}"


def method_model(
    cfg: SmolLM2Config, runs: Path, name: str, seed: int | None
) -> tuple[Any, Any, dict[str, Any]]:
    """The model of one job, ready to score: untuned methods patched, trained ones trained at
    ``seed`` (or reloaded from the finished run). Returns it with its training record."""
    from ropekit.backbone import load_adapter
    from ropekit.hf import patch
    from ropekit.results import read_result
    from ropekit.train.extend import ExtendConfig, extend

    model, tokenizer = open_model(cfg)
    folder = job_folder(cfg, runs, name, seed)
    if name in cfg.untuned:
        spec = cfg.untuned[name]
        if spec != "rope":  # "rope" is the unmodified model: transformers' own attention
            patch(model, spec)
        return model, tokenizer, {"spec": spec, "trainable": {"total": 0}, "extend_s": 0.0}
    record_path = folder / "job.json"
    if record_path.exists():
        load_adapter(model, folder)
        return model, tokenizer, read_record(record_path)
    train = cfg.train
    config = ExtendConfig(
        method=cfg.trained[name],
        target_length=cfg.target_length,
        samples=train.samples,
        lr=train.lr,
        seed=seed,
        data=cfg.data,
        pose=True,
        pose_window=train.pose_window,
        grad_checkpointing=train.grad_checkpointing,
    )
    samples = f"{config.samples} PoSE samples"
    print(f"  {name}, seed {seed}: training {config.method} ({samples})", flush=True)
    result = extend(model, config, folder, tokenizer=tokenizer, overwrite=True, log=print)
    summary = read_result(folder / "extend.json", "extend")
    record = {
        "spec": result.spec,
        "trainable": result.trainable,
        "final_loss": result.final_loss,
        "tokens": result.tokens,
        "extend_s": result.elapsed_s,
        "seed": seed,
        "device": device(),
        "losses": _losses(folder),
        "config": summary["config"],
    }
    write_record(record_path, record)
    return model.eval(), tokenizer, record


def _losses(folder: Path) -> list[float]:
    """The training loss at each logged step, from the loop's metrics log."""
    from ropekit.results import read_records
    from ropekit.train.loop import METRICS

    return [r["loss"] for r in read_records(folder / "train" / METRICS) if "loss" in r]


def _cached(path: Path, score: Any) -> dict[str, Any]:
    """``score()``'s numbers with its wall time as ``eval_s``, written to ``path`` once; a
    finished piece is read back instead of scored again."""
    if path.exists():
        return read_record(path)
    start = time.perf_counter()
    out = score() | {"eval_s": time.perf_counter() - start}
    write_record(path, out)
    return out


def score_perplexity(
    cfg: SmolLM2Config, folder: Path, model: Any, tokenizer: Any, spec: str
) -> dict[str, Any]:
    from ropekit.evals import PerplexityConfig, run_perplexity
    from ropekit.results import encode

    def score() -> dict[str, Any]:
        config = PerplexityConfig(
            cfg.eval_lengths,
            n_tokens=cfg.eval_spans * max(cfg.eval_lengths),
            seed=cfg.eval_seed,
            batch_tokens=max(cfg.eval_lengths),
        )
        result = run_perplexity(
            model.eval(), config, folder / "ppl", tokenizer=tokenizer, data=cfg.data,
            spec=spec, progress=False,
        ).result  # fmt: skip
        return {
            str(r.length): {
                "perplexity": r.perplexity,
                "nll": r.nll,
                "last_quarter_nll": r.last_quarter_nll,
                "last_quarter_perplexity": _exp(r.last_quarter_nll),
                "windows": r.windows,
                "tokens": r.tokens,
                "position_nll": encode(r.position_nll),
            }
            for r in result.results
        } | {"start": result.start}

    return _cached(folder / "perplexity.json", score)


def _exp(x: float | None) -> float | None:
    import math

    return None if x is None else math.exp(x)


def score_tasks(
    cfg: SmolLM2Config, folder: Path, model: Any, tokenizer: Any, spec: str, n: int
) -> dict[str, Any]:
    from ropekit.evals import EvalConfig, run_tasks

    def score() -> dict[str, Any]:
        config = EvalConfig(
            (n,), samples=cfg.samples_per_depth, depths=cfg.depths, seed=0,
            batch_size=1,
        )  # fmt: skip
        summary = run_tasks(
            model.eval(), list(cfg.tasks), config, folder / f"tasks-{n}",
            tokenizer=tokenizer, spec=spec, progress=False, overwrite=True,
        )  # fmt: skip
        return {
            task: {"score": entry.scores[0].score, "samples": entry.scores[0].n}
            for task, entry in summary.tasks.items()
        }

    return _cached(folder / f"tasks-{n}.json", score)


# ----------------------------------------------------------------------------- stages
def names(cfg: SmolLM2Config) -> list[str]:
    return [*cfg.untuned, *cfg.trained]


def run_stage(
    cfg: SmolLM2Config, runs: Path, jobs: list[tuple[str, int | None]], pieces: list[Any]
) -> None:
    """Score ``pieces`` ("perplexity" or a task length) for each (method, seed) job, opening
    (and, for a trained method, training) each model only when something is left to do."""
    for name, seed in jobs:
        folder = job_folder(cfg, runs, name, seed)
        todo = [p for p in pieces if not (folder / _file(p)).exists()]
        if not todo:
            continue
        model, tokenizer, record = method_model(cfg, runs, name, seed)
        for piece in todo:
            what = (
                f"perplexity at {list(cfg.eval_lengths)}"
                if piece == "perplexity"
                else (f"{', '.join(cfg.tasks)} at {piece}")
            )
            print(f"  {folder.relative_to(runs)}: {what}", flush=True)
            if piece == "perplexity":
                score_perplexity(cfg, folder, model, tokenizer, record["spec"])
            else:
                score_tasks(cfg, folder, model, tokenizer, record["spec"], piece)
        del model


def _file(piece: Any) -> str:
    return "perplexity.json" if piece == "perplexity" else f"tasks-{piece}.json"


def collect_job(
    cfg: SmolLM2Config, runs: Path, name: str, seed: int | None
) -> dict[str, Any] | None:
    """One job's finished pieces (None when nothing is finished)."""
    folder = job_folder(cfg, runs, name, seed)
    job = read_record(folder / "job.json") if (folder / "job.json").exists() else {}
    run: dict[str, Any] = {
        "seed": seed,
        "extend_s": job.get("extend_s", 0.0 if seed is None else None),
        "final_loss": job.get("final_loss"),
        "losses": job.get("losses"),
        "trainable": job.get("trainable", {}).get("total", 0 if seed is None else None),
        "perplexity": None,
        "tasks": {},
        "eval_s": 0.0,
    }
    if (folder / "perplexity.json").exists():
        ppl = read_record(folder / "perplexity.json")
        run["eval_s"] += ppl.pop("eval_s")
        ppl.pop("start", None)
        run["perplexity"] = ppl
    for n in cfg.task_lengths:
        if (folder / f"tasks-{n}.json").exists():
            tasks = read_record(folder / f"tasks-{n}.json")
            run["eval_s"] += tasks.pop("eval_s")
            run["tasks"][str(n)] = tasks
    return run if job or run["perplexity"] or run["tasks"] else None


def collect(cfg: SmolLM2Config, runs: Path) -> dict[str, Any]:
    """Everything finished so far, per method: each run, and perplexity summarised over the
    seeds scored (tasks are scored on the first seed only)."""
    methods = {}
    for name in names(cfg):
        untuned = name in cfg.untuned
        seeds = [None] if untuned else cfg.train.seeds
        done = [r for r in (collect_job(cfg, runs, name, s) for s in seeds) if r is not None]
        scored = [r for r in done if r["perplexity"] is not None]
        entry: dict[str, Any] = {
            "spec": cfg.untuned[name] if untuned else cfg.trained[name],
            "trained": not untuned,
            "trainable": done[0]["trainable"] if done else None,
            "extend_s": summarize([r["extend_s"] for r in done if r["extend_s"] is not None])
            if done and not untuned
            else None,
            "perplexity": _summarize_perplexity(scored) if scored else None,
            "tasks": done[0]["tasks"] if done else {},
            "tasks_seed": done[0]["seed"] if done else None,
            "eval_s": sum(r["eval_s"] for r in done),
            "runs": done,
        }
        methods[name] = entry
    return methods


def _summarize_perplexity(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per length: perplexity and last-quarter perplexity over the runs (mean ± std), and the
    NLL-by-position curve averaged over them."""
    out = {}
    for n, first in runs[0]["perplexity"].items():
        curves = [r["perplexity"][n]["position_nll"] for r in runs]
        out[n] = {
            key: summarize([r["perplexity"][n][key] for r in runs])
            for key in ("perplexity", "last_quarter_perplexity")
        } | {
            "position_nll": {
                **first["position_nll"],
                "nll": [sum(c["nll"][i] for c in curves) / len(curves)
                        for i in range(len(curves[0]["nll"]))],
            }
        }  # fmt: skip
    return out


PAIRS = (("adarope", "adarope-global"), ("adarope", "tuned-yarn"), ("adarope-global", "tuned-yarn"))


def paired_differences(cfg: SmolLM2Config, methods: dict[str, Any]) -> dict[str, Any]:
    """Perplexity differences between trained methods, paired by seed (a seed draws the same
    samples and PoSE positions for every method)."""
    out = {}
    for a, b in PAIRS:
        if a not in methods or b not in methods:
            continue
        runs = {
            name: {r["seed"]: r["perplexity"] for r in methods[name]["runs"] if r["perplexity"]}
            for name in (a, b)
        }
        seeds = sorted(set(runs[a]) & set(runs[b]))
        if seeds:
            out[f"{a} - {b}"] = {
                str(n): summarize(
                    [runs[a][s][str(n)]["perplexity"] - runs[b][s][str(n)]["perplexity"]
                     for s in seeds]
                )
                for n in cfg.eval_lengths
            }  # fmt: skip
    return out


def write_outputs(
    cfg: SmolLM2Config, methods: dict[str, Any], results: Path, *, command: str
) -> str:
    """results.md, results.json and the figure in ``results`` from what is finished; returns
    the tables."""
    lengths = [str(n) for n in cfg.eval_lengths]
    base = (methods.get("rope") or {}).get("perplexity")

    def ppl(m: dict[str, Any], n: str, key: str) -> str:
        return "-" if m["perplexity"] is None else fmt(m["perplexity"][n][key], digits=2)

    def vs_base(m: dict[str, Any], n: str) -> str:
        if m["perplexity"] is None or base is None:
            return "-"
        ratio = m["perplexity"][n]["perplexity"]["mean"] / base[n]["perplexity"]["mean"]
        return f"{100 * (ratio - 1):+.1f}%"

    header = (
        ["method", "trained params", "train time", "seeds"]
        + [f"ppl @{n}" for n in lengths]
        + [f"last-quarter ppl @{n}" for n in lengths]
        + [f"vs rope @{lengths[0]}", "eval time"]
    )
    rows = []
    for name, m in methods.items():
        trained, took = m["trainable"], m["extend_s"]
        scored = m["perplexity"][lengths[0]]["perplexity"]["n"] if m["perplexity"] else 0
        rows.append(
            [
                f"`{name}`",
                "-" if trained is None else f"{trained:,}",
                "0" if not m["trained"] else "-" if not took else f"{took['mean'] / 60:.1f} min",
                str(scored) if m["trained"] else "-",
            ]
            + [ppl(m, n, "perplexity") for n in lengths]
            + [ppl(m, n, "last_quarter_perplexity") for n in lengths]
            + [vs_base(m, lengths[0]), f"{m['eval_s'] / 60:.1f} min"]
        )
    tables = [markdown_table(header, rows)]
    task_header = ["method"] + [f"{t} @{n}" for n in cfg.task_lengths for t in cfg.tasks]
    task_rows = [
        [f"`{name}`"]
        + [
            "-"
            if str(n) not in m["tasks"]
            else fmt({"mean": m["tasks"][str(n)][t]["score"], "n": 1}, percent=True)
            for n in cfg.task_lengths
            for t in cfg.tasks
        ]
        for name, m in methods.items()
    ]
    tables.append(markdown_table(task_header, task_rows))
    paired = paired_differences(cfg, methods)
    if paired:
        tables.append(
            markdown_table(
                ["perplexity difference (paired by seed)"] + [f"@{n}" for n in lengths],
                [[name] + [fmt(d[n], digits=2) for n in lengths] for name, d in paired.items()],
            )
        )
    text = "\n\n".join(tables) + "\n"
    # Compute summed from the job records, so a resumed run reports the whole cost.
    compute = {
        "training_s": sum(r["extend_s"] or 0.0 for m in methods.values() for r in m["runs"]),
        "evaluation_s": sum(m["eval_s"] for m in methods.values()),
    }
    result = {
        "config": config_dict(cfg),
        "methods": methods,
        "paired_perplexity_differences": paired,
        "compute": compute,
        "device": device(),
    }
    write_results(
        results, result, text, command=command, provenance=provenance(NAME, cfg, model=cfg.model)
    )
    _plot(cfg, methods, results / "perplexity.png")
    return text


def _plot(cfg: SmolLM2Config, methods: dict[str, Any], path: Path) -> None:
    """Two panels: perplexity by window length, and NLL by position in the longest window."""
    from ropekit.figures import figure, lines, save, style

    scored = {k: m for k, m in methods.items() if m["perplexity"] is not None}
    if not scored:
        return
    fig, axes = figure(12, 4.6, 1, 2)
    left, right = axes[0]
    xs = cfg.eval_lengths
    longest = str(max(xs))
    dashes = {name: {"ls": "-" if m["trained"] else "--"} for name, m in scored.items()}
    means = {
        name: {n: m["perplexity"][str(n)]["perplexity"]["mean"] for n in xs}
        for name, m in scored.items()
    }
    lines(left, means, train_length=ORIGINAL_LENGTH, styles=dashes)
    for name, m in scored.items():
        curve = m["perplexity"][longest]["position_nll"]
        mids = [(a + b) / 2 for a, b in zip(curve["start"], curve["stop"], strict=True)]
        right.plot(mids, curve["nll"], label=name, **(style(name) | dashes[name]))
    right.axvline(ORIGINAL_LENGTH, color="gray", ls=":", lw=1)
    right.set_xscale("log")
    right.minorticks_off()
    right.grid(alpha=0.3)
    # Keep the methods that work readable: what lies above the top (linear interpolation,
    # the unmodified model past its window) is named in the title instead of squashing them.
    best = min(v for curve in means.values() for v in curve.values())
    top = 1.5 * best
    above = [name for name, curve in means.items() if any(v > top for v in curve.values())]
    left.set_ylim(0.95 * best, top)
    left.set(
        xlabel="evaluation length (tokens)",
        ylabel="held-out perplexity",
        title="SmolLM2-135M: perplexity by window length"
        + (f"\n(off the top: {', '.join(above)})" if above else ""),
    )
    # Position bins below 256 hold a few tokens each of one window: noise, not a trend.
    right.set_xlim(left=256)
    right.set_ylim(3.0, 5.5)
    right.set(
        xlabel=f"position in the {longest}-token window (from 256)",
        ylabel="NLL (nats)",
        title=f"NLL by position at {longest} tokens (log-spaced bins)",
    )
    left.legend(fontsize=7, ncol=2)
    save(fig, path)


def run(cfg: SmolLM2Config, runs: Path, results: Path, command: str) -> str:
    """The stages in order, the must-haves first; the results are rewritten after each, so an
    interrupted run leaves honest partial results. Returns the last tables."""
    first, *more = cfg.train.seeds
    untuned = [(name, None) for name in cfg.untuned]
    trained = [(name, first) for name in cfg.trained]
    stages = [
        ("untuned perplexity", untuned, ["perplexity"]),
        (f"training (seed {first}) + trained perplexity", trained, ["perplexity"]),
        *[(f"tasks at {n}", untuned + trained, [n]) for n in cfg.task_lengths],
        ("more seeds: training + perplexity",
         [(name, s) for s in more for name in cfg.trained], ["perplexity"]),
    ]  # fmt: skip
    text = ""
    for title, jobs, pieces in stages:
        print(f"stage: {title}", flush=True)
        run_stage(cfg, runs, jobs, pieces)
        text = write_outputs(cfg, collect(cfg, runs), results, command=command)
        print(text, flush=True)
    return text


def main(argv: Sequence[str] | None = None) -> None:
    invocation = parse_args(NAME, __doc__, SmolLM2Config, argv)
    start = time.perf_counter()
    run(invocation.config, invocation.runs, invocation.results, invocation.command)
    print(f"this invocation {time.perf_counter() - start:.0f} s; results in {invocation.results}")


if __name__ == "__main__":
    main()
