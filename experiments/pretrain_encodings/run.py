"""Experiment A (the AdaRoPE paper's Table 1 in miniature): small byte-level decoders with
RoPE, partial RoPE, ALiBi, NoPE and AdaRoPE pretrained on the same data with the same budget,
three seeds; held-out bits per byte at 1x, 2x and 4x the training length and retrieval
accuracy at 1x, mean ± std.

    python -m experiments.pretrain_encodings.run     # everything; finished jobs are reused

Every model follows the base recipe (ropekit.train.recipe.prepare_base_model): a recall
stage where every 96-byte sample carries a passkey or key-value record, then text at
L = 128 bytes with half the samples carrying one. Only the encoding and the seed change. The
seed draws the initialisation and the data order; seed s gives every encoding the same data.

Models go to runs/experiments/pretrain_encodings/ (not committed); results.json,
results.md and the figure are written next to this file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from experiments.common import (
    evaluate,
    fmt,
    markdown_table,
    parse_args,
    read_json,
    summarize,
    write_json,
)

HERE = Path(__file__).resolve().parent
RUNS = Path("runs/experiments/pretrain_encodings")


def job(cfg: dict[str, Any], name: str, spec: str, seed: int) -> dict[str, Any]:
    """Pretrain (or reuse) one model and score it."""
    from ropekit.model import load_decoder
    from ropekit.train.recipe import BaseRecipe, prepare_base_model

    folder = RUNS / f"{name}-s{seed}"
    path = folder / "eval.json"
    if path.exists():
        return read_json(path)
    config = BaseRecipe(encoding=spec, seed=seed, data=cfg["data"], **cfg["model"])
    print(f"{name} seed {seed}: pretraining `{spec}`", flush=True)
    model_dir, _, _ = prepare_base_model(config, log=lambda _: None)
    pretrain = read_json(model_dir / "pretrain.json")
    model = load_decoder(model_dir / "model").eval()
    start = time.perf_counter()
    tasks = list(cfg["tasks"])
    scores = evaluate(
        model,
        folder,
        lengths=cfg["eval_lengths"],
        data=cfg["data"],
        eval_windows=cfg["eval_windows"],
        tasks=tasks,
        task_lengths=cfg["task_lengths"],
        depths=cfg["depths"],
        samples_per_depth=cfg["samples_per_depth"],
        spec=model.encoding.spec,
    )
    row = {
        "name": name,
        "spec": model.encoding.spec,
        "seed": seed,
        "parameters": pretrain["parameters"],
        "final_loss": pretrain["final_loss"],
        "stage_losses": {s["name"]: s["final_loss"] for s in pretrain["stages"]},
        "train_s": pretrain["elapsed_s"],
        "tokens_per_s": pretrain["tokens_per_s"],
        "eval_s": time.perf_counter() - start,
        "model": str(model_dir),
        **scores,
    }
    write_json(path, row)
    return row


def aggregate(cfg: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    encodings = {}
    for name in cfg["encodings"]:
        runs = [r for r in rows if r["name"] == name]
        encodings[name] = {
            "spec": runs[0]["spec"],
            "parameters": runs[0]["parameters"],
            "bpb": {n: summarize([r["bpb"][n] for r in runs]) for n in runs[0]["bpb"]},
            "tasks": {
                t: {n: summarize([r["tasks"][t]["accuracy"][n] for r in runs]) for n in acc}
                for t, acc in ((t, v["accuracy"]) for t, v in runs[0]["tasks"].items())
            },
            "final_loss": summarize([r["final_loss"] for r in runs]),
            "train_s": summarize([r["train_s"] for r in runs]),
        }
    return {
        "config": cfg,
        "encodings": encodings,
        "compute_s": sum(r["train_s"] + r["eval_s"] for r in rows),
    }


def write_outputs(result: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    lengths = [str(n) for n in cfg["eval_lengths"]]
    L = cfg["model"]["context"]
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    xs = [int(n) for n in lengths]
    for name, e in result["encodings"].items():
        ax.errorbar(
            xs,
            [e["bpb"][n]["mean"] for n in lengths],
            yerr=[e["bpb"][n]["std"] for n in lengths],
            marker="o",
            capsize=3,
            label=name,
        )
    ax.axvline(L, color="k", ls=":", lw=1, label="training length")
    ax.set(
        xscale="log",
        xlabel="evaluation length (bytes)",
        ylabel="held-out bits per byte",
        title=f"Pretrained at {L} bytes (mean ± std, {len(cfg['seeds'])} seeds)",
    )
    ax.set_xticks(xs, lengths)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "bpb_vs_length.png", dpi=120)
    plt.close(fig)
    at = str(cfg["task_lengths"][0])
    table = markdown_table(
        ["encoding", "parameters", "final train loss"]
        + [f"bpb @{n} ({int(n) // L}x)" for n in lengths]
        + [f"{t} @{at}" for t in cfg["tasks"]],
        [
            [f"`{name}`", f"{e['parameters']:,}", fmt(e["final_loss"])]
            + [fmt(e["bpb"][n]) for n in lengths]
            + [fmt(e["tasks"][t][at], percent=True) for t in cfg["tasks"]]
            for name, e in result["encodings"].items()
        ],
    )
    (HERE / "results.md").write_text(table + "\n")
    write_json(HERE / "results.json", result)
    return table


def main() -> None:
    global RUNS, HERE
    args, cfg = parse_args(__doc__, HERE, RUNS)
    RUNS, HERE = args.runs, args.results
    # The recipe caches its models under $ROPEKIT_CACHE; keep this experiment's with its runs.
    os.environ["ROPEKIT_CACHE"] = str((RUNS / "models").resolve())
    rows = [
        job(cfg, name, spec, seed)
        for seed in cfg["seeds"]
        for name, spec in cfg["encodings"].items()
    ]
    result = aggregate(cfg, rows)
    print(write_outputs(result))
    print(f"compute: {result['compute_s']:.0f} s")


if __name__ == "__main__":
    main()
