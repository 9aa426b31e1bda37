"""Experiment C (the AdaRoPE paper's Table 3 in miniature): two-stage extension of the
extend_8x base model to 8L under one budget.

    python -m experiments.two_stage.run          # everything; finished jobs are reused

Recipes: ``yarn->lora`` (LoRA on a fixed YaRN), ``tuned-yarn->lora`` (the warm-up control: a
global schedule tuned in stage 1), ``adarope->lora`` and ``adarope->joint`` (stage 2 keeps
training the AdaRoPE parameters beside LoRA). Stage 1 trains the positional parameters on the
100 samples (learning rate 1e-2, as in extend_8x), stage 2 trains LoRA (rank 8, alpha 16, on
the attention projections) on the same 100 samples. Every recipe gets the same LoRA
learning-rate search (each rate of ``lora_lr_grid`` at seed 0, kept by the loss on 16 unseen
training-split samples), then three seeds at the chosen rate; seed s draws the same samples
for every recipe.

Runs go to runs/experiments/two_stage/ (not committed); results are written next to this file.
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
    read_json,
    run_eval,
    summarize,
    write_json,
)

HERE = Path(__file__).resolve().parent
RUNS = Path("runs/experiments/two_stage")


def slug(recipe: str) -> str:
    return recipe.replace("->", "-to-")


def run_recipe(cfg: dict[str, Any], base: Path, recipe: str, spec: str) -> list[dict[str, Any]]:
    job = {"lr": cfg["positional_lr"], "mode": "lora", "recipe": recipe}
    search = {}
    for lora_lr in cfg["lora_lr_grid"]:
        folder = RUNS / slug(recipe) / f"lora{lora_lr:g}-s0"
        print(f"  {recipe}: LoRA lr {lora_lr:g}, seed 0", flush=True)
        _, record = extension_job(cfg, base, spec, folder, seed=0, lora_lr=lora_lr, **job)
        search[lora_lr] = record["selection_loss"]
    chosen = min(search, key=search.get)
    rows = []
    for seed in cfg["seeds"]:
        folder = RUNS / slug(recipe) / f"lora{chosen:g}-s{seed}"
        print(f"  {recipe}: LoRA lr {chosen:g}, seed {seed}", flush=True)
        model, record = extension_job(cfg, base, spec, folder, seed=seed, lora_lr=chosen, **job)
        stage1 = read_json(folder / "stage1" / "extend.json")
        scores = run_eval(cfg, model, folder, record["spec"])
        rows.append(
            {
                "name": recipe,
                **record,
                "stage1_trainable": stage1["trainable"]["total"],
                "stage1_s": stage1["elapsed_s"],
                "search": search,
                **scores,
            }
        )
    return rows


def aggregate(cfg: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    recipes = {}
    for name in cfg["recipes"]:
        runs = [r for r in rows if r["name"] == name]
        recipes[name] = {
            "spec": runs[0]["spec"],
            "stage1_trainable": runs[0]["stage1_trainable"],
            "stage2_trainable": runs[0]["trainable"]["total"],
            "lora_lr": runs[0]["lora_lr"],
            "lora_lr_search": runs[0]["search"],
            "bpb": {n: summarize([r["bpb"][n] for r in runs]) for n in runs[0]["bpb"]},
            "tasks": {
                t: {n: summarize([r["tasks"][t]["accuracy"][n] for r in runs]) for n in acc}
                for t, acc in ((t, v["accuracy"]) for t, v in runs[0]["tasks"].items())
            },
            "extend_s": summarize([r["extend_s"] for r in runs]),
        }
    by = {(r["name"], r["seed"]): r for r in rows}
    paired = {}
    for a, b in (
        ("adarope->lora", "tuned-yarn->lora"),
        ("adarope->lora", "yarn->lora"),
        ("tuned-yarn->lora", "yarn->lora"),
        ("adarope->joint", "adarope->lora"),
    ):
        paired[f"{a} - {b}"] = {
            n: summarize([by[(a, s)]["bpb"][n] - by[(b, s)]["bpb"][n] for s in cfg["seeds"]])
            for n in rows[0]["bpb"]
        }
    return {"config": cfg, "recipes": recipes, "paired_bpb_differences": paired}


def write_outputs(result: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    lengths = [str(n) for n in cfg["eval_lengths"]]
    xs = [int(n) for n in lengths]
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    for name, r in result["recipes"].items():
        ax.errorbar(
            xs,
            [r["bpb"][n]["mean"] for n in lengths],
            yerr=[r["bpb"][n]["std"] for n in lengths],
            marker="o",
            capsize=3,
            label=name,
        )
    ax.axvline(xs[0], color="k", ls=":", lw=1)
    ax.set(
        xscale="log",
        xlabel="evaluation length (bytes)",
        ylabel="held-out bits per byte",
        title=f"Two-stage extension to {xs[-1]} (mean ± std, {len(cfg['seeds'])} seeds)",
    )
    ax.set_xticks(xs, lengths)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "bpb_vs_length.png", dpi=120)
    plt.close(fig)
    recipes = result["recipes"]
    table = markdown_table(
        ["recipe", "stage 1 params", "stage 2 params", "LoRA lr"] + [f"bpb @{n}" for n in lengths],
        [
            [
                f"`{name}`",
                f"{r['stage1_trainable']:,}",
                f"{r['stage2_trainable']:,}",
                f"{r['lora_lr']:g}",
            ]
            + [fmt(r["bpb"][n]) for n in lengths]
            for name, r in recipes.items()
        ],
    )
    tasks = [
        markdown_table(
            ["recipe"] + [f"{t} @{n}" for n in cfg["task_lengths"]],
            [
                [f"`{name}`"]
                + [fmt(r["tasks"][t].get(str(n)), percent=True) for n in cfg["task_lengths"]]
                for name, r in recipes.items()
            ],
        )
        for t in cfg["tasks"]
    ]
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


def main() -> None:
    global RUNS, HERE
    args, cfg = parse_args(__doc__, HERE, RUNS)
    RUNS, HERE = args.runs, args.results
    start = time.perf_counter()
    base_dir, _, _ = base_model(cfg["base"])
    rows = []
    for recipe, spec in cfg["recipes"].items():
        rows += run_recipe(cfg, base_dir, recipe, spec)
    result = aggregate(cfg, rows)
    result["compute_s"] = {
        "extension": sum(read_json(p)["extend_s"] for p in RUNS.glob("*/*/job.json")),
        "evaluation": sum(read_json(p)["eval_s"] for p in RUNS.glob("*/*/eval.json")),
    }
    result["wall_s_this_invocation"] = time.perf_counter() - start
    print(write_outputs(result))
    print(f"compute: {result['compute_s']}")


if __name__ == "__main__":
    main()
