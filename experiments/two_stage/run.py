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
    provenance,
    read_record,
    run_eval,
    series,
    summarize,
    write_results,
)

NAME = "two_stage"
# Paired differences reported (same samples per seed): does the positional warm-up help LoRA,
# and does it help more when it is head-wise; does training the encoding beside LoRA help?
PAIRS = (
    ("adarope->lora", "tuned-yarn->lora"),
    ("adarope->lora", "yarn->lora"),
    ("tuned-yarn->lora", "yarn->lora"),
    ("adarope->joint", "adarope->lora"),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TwoStageConfig(ExtensionProtocol):
    """Experiment C's settings (config.json): the extension protocol, the two stages' learning
    rates and the recipes. Lengths in bytes."""

    positional_lr: float  # stage 1's peak learning rate (the positional parameters)
    lora_lr_grid: tuple[float, ...]  # stage 2's LoRA learning rates, each tried at seed 0
    # recipe -> spec of its stage-1 encoding; a recipe of ropekit.train.extend.RECIPES,
    # "<stage 1>->lora" or "<stage 1>->joint" (stage 2 trains LoRA alone, or LoRA and the
    # encoding together), whose spec is of the stage-1 family.
    recipes: dict[str, str]
    description: str = ""  # what the experiment asks (for the reader of config.json)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_numbers(self, "positional_lr", low=0)
        check_numbers(self, "lora_lr_grid", low=0, many=True)
        check_specs(self, "recipes", original_length=self.recipe().context)
        from ropekit.train.extend import RECIPES

        for name, spec in self.recipes.items():
            check(name in RECIPES, self, "recipes", name, f"recipes are {', '.join(RECIPES)}")
            family = RECIPES[name][0]
            check(
                spec.split(":", 1)[0] == family,
                self,
                f"recipes[{name!r}]",
                spec,
                f"{name} starts from a {family} spec",
            )


def slug(recipe: str) -> str:
    return recipe.replace("->", "-to-")


def run_recipe(
    cfg: TwoStageConfig, base: Path, recipe: str, spec: str, runs: Path
) -> list[dict[str, Any]]:
    """The LoRA learning-rate search at seed 0, then every seed at the chosen rate, each
    scored."""
    job = {"lr": cfg.positional_lr, "mode": "lora", "recipe": recipe}
    search = {}
    for lora_lr in cfg.lora_lr_grid:
        folder = runs / slug(recipe) / f"lora{lora_lr:g}-s0"
        print(f"  {recipe}: LoRA lr {lora_lr:g}, seed 0", flush=True)
        _, record = extension_job(cfg, base, spec, folder, seed=0, lora_lr=lora_lr, **job)
        search[lora_lr] = record["selection_loss"]
    chosen = min(search, key=search.get)
    rows = []
    for seed in cfg.seeds:
        folder = runs / slug(recipe) / f"lora{chosen:g}-s{seed}"
        print(f"  {recipe}: LoRA lr {chosen:g}, seed {seed}", flush=True)
        model, record = extension_job(cfg, base, spec, folder, seed=seed, lora_lr=chosen, **job)
        stage1 = _stage1(folder)
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


def _stage1(folder: Path) -> dict[str, Any]:
    """Stage 1's extension summary (a ropekit ``extend`` result)."""
    from ropekit.results import read_result

    return read_result(folder / "stage1" / "extend.json", "extend")


def aggregate(cfg: TwoStageConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    recipes = {}
    for name in cfg.recipes:
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
    return {
        "config": config_dict(cfg),
        "recipes": recipes,
        "paired_bpb_differences": paired(rows, PAIRS, cfg.seeds),
    }


def compute_spent(runs: Path) -> dict[str, float]:
    """Summed from the job records, so a resumed run reports the whole cost."""
    return {
        "extension": sum(read_record(p)["extend_s"] for p in runs.glob("*/*/job.json")),
        "evaluation": sum(read_record(p)["eval_s"] for p in runs.glob("*/*/eval.json")),
    }


def write_outputs(
    cfg: TwoStageConfig, result: dict[str, Any], results: Path, *, command: str, base_id: str
) -> str:
    """The figure, results.md and results.json in ``results``; returns the tables."""
    from ropekit.figures import plot_vs_length

    lengths = [str(n) for n in cfg.eval_lengths]
    recipes = result["recipes"]
    means, stds = series(recipes, "bpb")
    plot_vs_length(
        means,
        results / "bpb_vs_length.png",
        ylabel="held-out bits per byte",
        title=f"Two-stage extension to {cfg.eval_lengths[-1]} (mean ± std, {len(cfg.seeds)} seeds)",
        errors=stds,
        train_length=cfg.recipe().context,
        xlabel="evaluation length (bytes)",
    )
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
            ["recipe"] + [f"{t} @{n}" for n in cfg.task_lengths],
            [
                [f"`{name}`"]
                + [fmt(r["tasks"][t].get(str(n)), percent=True) for n in cfg.task_lengths]
                for name, r in recipes.items()
            ],
        )
        for t in cfg.tasks
    ]
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


def run(cfg: TwoStageConfig, runs: Path, results: Path, command: str) -> tuple[dict, str]:
    """Every recipe (finished jobs are reused), then the results; returns them and the
    tables."""
    base_dir, _, _ = base_model(cfg)
    rows = []
    for recipe, spec in cfg.recipes.items():
        rows += run_recipe(cfg, base_dir, recipe, spec, runs)
    result = aggregate(cfg, rows) | {"compute_s": compute_spent(runs)}
    text = write_outputs(cfg, result, results, command=command, base_id=base_dir.name)
    return result, text


def main(argv: Sequence[str] | None = None) -> None:
    invocation = parse_args(NAME, __doc__, TwoStageConfig, argv)
    start = time.perf_counter()
    result, text = run(invocation.config, invocation.runs, invocation.results, invocation.command)
    print(text)
    took = time.perf_counter() - start
    print(f"compute: {result['compute_s']}; this invocation {took:.0f} s")
    print(f"results in {invocation.results}")


if __name__ == "__main__":
    main()
