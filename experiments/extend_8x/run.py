"""Experiment B (the AdaRoPE paper's Table 2 in miniature, with the reviewer's controls):
one base RoPE model trained at L = 128 bytes with the retrieval mixture, extended to 8L by
every method on the same 100 samples with the backbone frozen.

    python -m experiments.extend_8x.run          # everything; finished jobs are reused

Protocol, identical for every trained method:
- the same 100 samples of 8L bytes per seed (the seed draws the sample set and its order, so
  seed s gives every method the same samples: comparisons are paired);
- one epoch, AdamW, 5 warmup steps then cosine, batch 1;
- the same learning-rate search budget: each trained method tries every rate in ``lr_grid``
  at seed 0 and keeps the one with the lowest loss on 16 unseen training-split samples (never
  the held-out split the results are measured on);
- three seeds at the chosen rate.
Untuned schedules have nothing to train and run once. Every model is scored on the same
held-out windows (bits per byte at L..8L, NLL by position) and the same retrieval samples.

Runs go to runs/experiments/extend_8x/ (not committed); results.json, results.md and the
figures are written next to this file.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.common import (
    ExtensionProtocol,
    base_model,
    check,
    check_numbers,
    check_specs,
    config_dict,
    extension_job,
    fmt,
    markdown_table,
    paired,
    parse_args,
    plot_heatmaps,
    provenance,
    read_record,
    run_eval,
    series,
    summarize,
    write_results,
)

NAME = "extend_8x"
# Paired differences reported (same samples per seed): is head-wise structure worth it over
# the global learned schedule, and over a tuned global YaRN? Then each ablation.
PAIRS = (
    ("adarope", "adarope-global"),
    ("adarope", "tuned-yarn"),
    ("adarope-global", "tuned-yarn"),
    ("adarope", "adarope-per-layer"),
    ("adarope", "adarope-no-freq"),
    ("adarope", "adarope-no-scale"),
)
CAP = 4.5  # bits per byte: the top of the bpb figure when a method goes above it


@dataclasses.dataclass(frozen=True, kw_only=True)
class Extend8xConfig(ExtensionProtocol):
    """Experiment B's settings (config.json): the extension protocol, the learning-rate grid
    and the methods. Lengths in bytes."""

    lr_grid: tuple[float, ...]  # peak learning rates each trained method tries at seed 0
    untuned: dict[str, str]  # name -> spec: schedules applied without training, scored once
    trained: dict[str, str]  # name -> spec: methods whose positional parameters train
    description: str = ""  # what the experiment asks (for the reader of config.json)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_numbers(self, "lr_grid", low=0, many=True)
        length = self.recipe().context  # the specs are applied to the base model trained at L
        check_specs(self, "untuned", original_length=length, empty=True)
        check_specs(self, "trained", original_length=length)
        both = sorted(set(self.untuned) & set(self.trained))
        check(not both, self, "trained", both, "a method name is either untuned or trained")


def run_trained(
    cfg: Extend8xConfig, base: Path, name: str, spec: str, runs: Path
) -> list[dict[str, Any]]:
    """The learning-rate search at seed 0, then every seed at the chosen rate, each scored."""
    search = {}
    for lr in cfg.lr_grid:
        folder = runs / name / f"lr{lr:g}-s0"
        print(f"  {name}: lr {lr:g}, seed 0", flush=True)
        _, record = extension_job(cfg, base, spec, folder, lr=lr, seed=0)
        search[lr] = record["selection_loss"]
    chosen = min(search, key=search.get)
    rows = []
    for seed in cfg.seeds:
        folder = runs / name / f"lr{chosen:g}-s{seed}"
        print(f"  {name}: lr {chosen:g}, seed {seed}", flush=True)
        model, record = extension_job(cfg, base, spec, folder, lr=chosen, seed=seed)
        scores = run_eval(cfg, model, folder, record["spec"])
        rows.append({"name": name, **record, "search": search, **scores})
    return rows


def run_untuned(
    cfg: Extend8xConfig, base: Path, name: str, spec: str, runs: Path
) -> dict[str, Any]:
    from ropekit.backbone import as_backbone
    from ropekit.model import load_decoder

    backbone = as_backbone(load_decoder(base / "model"))
    if spec != "rope":
        backbone.set_encoding(spec)
    print(f"  {name}: {backbone.encoding.spec}", flush=True)
    scores = run_eval(cfg, backbone.model, runs / name, backbone.encoding.spec)
    return {"name": name, "seed": None, "trainable": {"total": 0}, **scores}


# ----------------------------------------------------------------------------- aggregation
def aggregate(cfg: Extend8xConfig, rows: list[dict[str, Any]], base: dict[str, Any]) -> dict:
    methods = {}
    for name in [*cfg.untuned, *cfg.trained]:
        runs = [r for r in rows if r["name"] == name]
        entry: dict[str, Any] = {
            "spec": runs[0]["spec"],
            "trainable": runs[0]["trainable"]["total"],
            "runs": len(runs),
            "bpb": {n: summarize([r["bpb"][n] for r in runs]) for n in runs[0]["bpb"]},
            "tasks": {
                t: {n: summarize([r["tasks"][t]["accuracy"][n] for r in runs]) for n in acc}
                for t, acc in ((t, v["accuracy"]) for t, v in runs[0]["tasks"].items())
            },
        }
        if name in cfg.trained:
            entry |= {
                "lr": runs[0]["lr"],
                "lr_search": runs[0]["search"],
                "extend_s": summarize([r["extend_s"] for r in runs]),
                "final_loss": summarize([r["final_loss"] for r in runs]),
            }
        methods[name] = entry
    return {
        "config": config_dict(cfg),
        "base": {k: base[k] for k in ("encoding", "parameters", "steps", "final_loss", "elapsed_s")}
        | {"context": base["model"]["context_length"], "stages": base["stages"]},
        "methods": methods,
        "paired_bpb_differences": paired(rows, PAIRS, cfg.seeds),
        "longest": str(max(cfg.eval_lengths)),
    }


def compute_spent(runs: Path, base: dict[str, Any]) -> dict[str, float]:
    """Compute spent on this experiment's jobs (the learning-rate search included), summed
    from their records so that a resumed run reports the whole cost, not the last piece; the
    base model's training as its summary records it (once, in the cache, whoever trained it)."""
    return {
        "extension": sum(read_record(p)["extend_s"] for p in runs.glob("*/*/job.json")),
        "evaluation": sum(read_record(p)["eval_s"] for p in runs.glob("**/eval.json")),
        "base model": base["elapsed_s"],
    }


def write_outputs(
    cfg: Extend8xConfig,
    result: dict[str, Any],
    rows: list[dict[str, Any]],
    results: Path,
    *,
    command: str,
    base_id: str,
) -> str:
    """The figures, results.md and results.json in ``results``; returns the tables."""
    methods = result["methods"]
    lengths = [str(n) for n in cfg.eval_lengths]
    task_lengths = [str(n) for n in cfg.task_lengths]
    _plots(cfg, result, rows, results)
    header = ["method", "trained params", "lr"] + [f"bpb @{n}" for n in lengths]
    table = markdown_table(
        header,
        [
            [f"`{name}`", f"{m['trainable']:,}", f"{m['lr']:g}" if "lr" in m else "-"]
            + [fmt(m["bpb"][n]) for n in lengths]
            for name, m in methods.items()
        ],
    )
    tasks = []
    for t in cfg.tasks:
        tasks.append(
            markdown_table(
                ["method"] + [f"{t} @{n}" for n in task_lengths],
                [
                    [f"`{name}`"] + [fmt(m["tasks"][t].get(n), percent=True) for n in task_lengths]
                    for name, m in methods.items()
                ],
            )
        )
    differences = markdown_table(
        ["difference (bpb, paired by seed)"] + [f"@{n}" for n in lengths],
        [
            [name] + [fmt(d[n]) for n in lengths]
            for name, d in result["paired_bpb_differences"].items()
        ],
    )
    text = "\n\n".join([table, *tasks, differences]) + "\n"
    write_results(
        results, result, text, command=command, provenance=provenance(NAME, cfg, base_model=base_id)
    )
    return text


def _plots(
    cfg: Extend8xConfig, result: dict[str, Any], rows: list[dict[str, Any]], results: Path
) -> None:
    from ropekit.evals.perplexity import PositionCurve
    from ropekit.figures import plot_vs_length
    from ropekit.report.plots import plot_nll_vs_position, plot_tasks_vs_length

    methods, L = result["methods"], result["base"]["context"]
    means, stds = series(methods, "bpb")
    # The unmodified model (and PI) blow up past L: cap the axis near a byte-unigram model's
    # score (4.78 on the held-out plays) so the rest stay readable, when some line lies below.
    top = max(means[n][k] + stds[n][k] for n in means for k in means[n])
    low = min(v for curve in means.values() for v in curve.values())
    plot_vs_length(
        means,
        results / "bpb_vs_length.png",
        ylabel="held-out bits per byte",
        title=f"Extended {cfg.factor}x on {cfg.samples} samples "
        f"(trained: mean ± std over {len(cfg.seeds)} seeds)",
        errors={n: stds[n] for n in cfg.trained},  # untuned methods run once
        train_length=L,
        ylim=(None, CAP) if low < CAP < top else None,
        xlabel="evaluation length (bytes)",
        styles={n: {"ls": "-" if n in cfg.trained else "--"} for n in methods},
        size=(7.5, 4.6),
    )
    # NLL by position at the longest length, averaged over seeds (identical windows for
    # every method).
    longest = result["longest"]
    curves = {}
    for name in methods:
        runs = [r for r in rows if r["name"] == name]
        first = runs[0]["position_nll"][longest]
        nll = [sum(r["position_nll"][longest]["nll"][i] for r in runs) / len(runs) for i in
               range(len(first["nll"]))]  # fmt: skip
        curves[name] = PositionCurve(tuple(first["start"]), tuple(first["stop"]), tuple(nll))
    plot_nll_vs_position(
        curves, results / "nll_vs_position.png", length=int(longest), train_length=L
    )
    plot_tasks_vs_length(
        {
            t: {
                name: {int(n): m["tasks"][t][n]["mean"] for n in m["tasks"][t]}
                for name, m in methods.items()
            }
            for t in cfg.tasks
        },
        results / "retrieval_vs_length.png",
        train_length=L,
    )
    for task in cfg.tasks:
        panels = {
            name: next(r for r in rows if r["name"] == name)["tasks"][task]["cells"]
            for name in methods
        }
        plot_heatmaps(
            panels,
            results / f"heatmap_{task}.png",
            f"{task}: accuracy by length and needle depth (seed 0 for trained methods)",
        )


def run(cfg: Extend8xConfig, runs: Path, results: Path, command: str) -> tuple[dict, str]:
    """Every job (finished ones are reused), then the results; returns them and the tables."""
    base_dir, base, _ = base_model(cfg)
    rows = [run_untuned(cfg, base_dir, n, s, runs) for n, s in cfg.untuned.items()]
    for name, spec in cfg.trained.items():
        rows += run_trained(cfg, base_dir, name, spec, runs)
    result = aggregate(cfg, rows, base) | {"compute_s": compute_spent(runs, base)}
    text = write_outputs(cfg, result, rows, results, command=command, base_id=base_dir.name)
    return result, text


def main(argv: Sequence[str] | None = None) -> None:
    invocation = parse_args(NAME, __doc__, Extend8xConfig, argv)
    start = time.perf_counter()
    result, text = run(invocation.config, invocation.runs, invocation.results, invocation.command)
    print(text)
    took = time.perf_counter() - start
    print(f"compute: {result['compute_s']}; this invocation {took:.0f} s")
    print(f"results in {invocation.results}")


if __name__ == "__main__":
    main()
