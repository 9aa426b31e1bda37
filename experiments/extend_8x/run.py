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

import time
from pathlib import Path
from typing import Any

from experiments.common import (
    base_model,
    extension_job,
    fmt,
    markdown_table,
    parse_args,
    plot_heatmaps,
    read_json,
    run_eval,
    summarize,
    write_json,
)

HERE = Path(__file__).resolve().parent
RUNS = Path("runs/experiments/extend_8x")


def run_trained(
    cfg: dict[str, Any], base: Path, name: str, spec: str, **job: Any
) -> list[dict[str, Any]]:
    """The learning-rate search at seed 0, then every seed at the chosen rate, each scored."""
    search = {}
    for lr in cfg["lr_grid"]:
        folder = RUNS / name / f"lr{lr:g}-s0"
        print(f"  {name}: lr {lr:g}, seed 0", flush=True)
        _, record = extension_job(cfg, base, spec, folder, lr=lr, seed=0, **job)
        search[lr] = record["selection_loss"]
    chosen = min(search, key=search.get)
    rows = []
    for seed in cfg["seeds"]:
        folder = RUNS / name / f"lr{chosen:g}-s{seed}"
        print(f"  {name}: lr {chosen:g}, seed {seed}", flush=True)
        model, record = extension_job(cfg, base, spec, folder, lr=chosen, seed=seed, **job)
        scores = run_eval(cfg, model, folder, record["spec"])
        rows.append({"name": name, **record, "search": search, **scores})
    return rows


def run_untuned(cfg: dict[str, Any], base: Path, name: str, spec: str) -> dict[str, Any]:
    from ropekit.backbone import as_backbone
    from ropekit.model import load_decoder

    backbone = as_backbone(load_decoder(base / "model"))
    if spec != "rope":
        backbone.set_encoding(spec)
    print(f"  {name}: {backbone.encoding.spec}", flush=True)
    scores = run_eval(cfg, backbone.model, RUNS / name, backbone.encoding.spec)
    return {"name": name, "seed": None, "trainable": {"total": 0}, **scores}


# ----------------------------------------------------------------------------- aggregation
def aggregate(cfg: dict[str, Any], rows: list[dict[str, Any]], base: dict[str, Any]) -> dict:
    names = list(cfg["untuned"]) + list(cfg["trained"])
    methods = {}
    for name in names:
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
        if name in cfg["trained"]:
            entry |= {
                "lr": runs[0]["lr"],
                "lr_search": runs[0]["search"],
                "extend_s": summarize([r["extend_s"] for r in runs]),
                "final_loss": summarize([r["final_loss"] for r in runs]),
            }
        methods[name] = entry
    # Paired differences (same samples per seed): is head-wise structure worth it over the
    # global learned schedule, and over a tuned global YaRN?
    paired = {}
    longest = str(max(cfg["eval_lengths"]))
    by = {(r["name"], r["seed"]): r for r in rows}
    for a, b in (
        ("adarope", "adarope-global"),
        ("adarope", "tuned-yarn"),
        ("adarope-global", "tuned-yarn"),
        ("adarope", "adarope-per-layer"),
        ("adarope", "adarope-no-freq"),
        ("adarope", "adarope-no-scale"),
    ):
        diffs = {
            n: [by[(a, s)]["bpb"][n] - by[(b, s)]["bpb"][n] for s in cfg["seeds"]]
            for n in rows[0]["bpb"]
        }
        paired[f"{a} - {b}"] = {n: summarize(v) for n, v in diffs.items()}
    return {
        "config": cfg,
        "base": {k: base[k] for k in ("encoding", "parameters", "steps", "final_loss", "elapsed_s")}
        | {"context": base["model"]["context_length"], "stages": base["stages"]},
        "methods": methods,
        "paired_bpb_differences": paired,
        "longest": longest,
    }


def write_outputs(result: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    from ropekit.report.plots import plot_nll_vs_position, plot_tasks_vs_length

    cfg, methods = result["config"], result["methods"]
    lengths = [str(n) for n in cfg["eval_lengths"]]
    task_lengths = [str(n) for n in cfg["task_lengths"]]
    L = result["base"]["context"]
    _plot_bpb(result, HERE / "bpb_vs_length.png", L)
    # NLL by position at 8L, averaged over seeds (identical windows for every method).
    longest = result["longest"]
    curves = {}
    for name in methods:
        runs = [r for r in rows if r["name"] == name]
        first = runs[0]["position_nll"][longest]
        nll = [sum(r["position_nll"][longest]["nll"][i] for r in runs) / len(runs) for i in
               range(len(first["nll"]))]  # fmt: skip
        curves[name] = {**first, "nll": nll}
    plot_nll_vs_position(curves, HERE / "nll_vs_position.png", length=int(longest), train_length=L)
    plot_tasks_vs_length(
        {
            t: {
                name: {int(n): m["tasks"][t][n]["mean"] for n in m["tasks"][t]}
                for name, m in methods.items()
            }
            for t in cfg["tasks"]
        },
        HERE / "retrieval_vs_length.png",
        train_length=L,
    )
    for task in cfg["tasks"]:
        panels = {
            name: next(r for r in rows if r["name"] == name)["tasks"][task]["cells"]
            for name in methods
        }
        plot_heatmaps(
            panels,
            HERE / f"heatmap_{task}.png",
            f"{task}: accuracy by length and needle depth (seed 0 for trained methods)",
        )
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
    for t in cfg["tasks"]:
        tasks.append(
            markdown_table(
                ["method"] + [f"{t} @{n}" for n in task_lengths],
                [
                    [f"`{name}`"] + [fmt(m["tasks"][t].get(n), percent=True) for n in task_lengths]
                    for name, m in methods.items()
                ],
            )
        )
    paired = markdown_table(
        ["difference (bpb, paired by seed)"] + [f"@{n}" for n in lengths],
        [
            [name] + [fmt(d[n]) for n in lengths]
            for name, d in result["paired_bpb_differences"].items()
        ],
    )
    text = "\n\n".join([table, *tasks, paired]) + "\n"
    (HERE / "results.md").write_text(text)
    write_json(HERE / "results.json", result)
    return text


def _plot_bpb(result: dict[str, Any], path: Path, train_length: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for name, m in result["methods"].items():
        xs = sorted(int(n) for n in m["bpb"])
        ax.errorbar(
            xs,
            [m["bpb"][str(n)]["mean"] for n in xs],
            yerr=[m["bpb"][str(n)]["std"] for n in xs],
            marker="o",
            capsize=3,
            label=name,
            ls="-" if name in result["config"]["trained"] else "--",
        )
    ax.axvline(train_length, color="k", ls=":", lw=1)
    ax.set(
        xscale="log",
        xlabel="evaluation length (bytes)",
        ylabel="held-out bits per byte",
        title="Extended 8x on 100 samples (trained: mean ± std over 3 seeds)",
    )
    ax.set_xticks(xs, [str(n) for n in xs])
    ax.set_ylim(top=min(ax.get_ylim()[1], 4.5))
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    global RUNS, HERE
    args, cfg = parse_args(__doc__, HERE, RUNS)
    RUNS, HERE = args.runs, args.results
    start = time.perf_counter()
    base_dir, base, reused = base_model(cfg["base"])
    rows = [run_untuned(cfg, base_dir, n, s) for n, s in cfg["untuned"].items()]
    for name, spec in cfg["trained"].items():
        rows += run_trained(cfg, base_dir, name, spec)
    result = aggregate(cfg, rows, base)
    # Compute spent on this experiment's jobs (the learning-rate search included), summed
    # from their records so that a resumed run reports the whole cost, not the last piece.
    result["compute_s"] = {
        "extension": sum(read_json(p)["extend_s"] for p in RUNS.glob("*/*/job.json")),
        "evaluation": sum(read_json(p)["eval_s"] for p in RUNS.glob("**/eval.json")),
        "base model (cached if 0 here)": 0.0 if reused else base["elapsed_s"],
    }
    result["wall_s_this_invocation"] = time.perf_counter() - start
    print(write_outputs(result, rows))
    took = result["wall_s_this_invocation"]
    print(f"compute: {result['compute_s']}; this invocation {took:.0f} s")


if __name__ == "__main__":
    main()
