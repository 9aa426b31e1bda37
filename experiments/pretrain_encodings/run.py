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

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.common import (
    ByteEvaluation,
    check_ints,
    check_recipe,
    check_specs,
    config_dict,
    evaluate,
    fmt,
    markdown_table,
    parse_args,
    provenance,
    read_record,
    series,
    summarize,
    write_record,
    write_results,
)

NAME = "pretrain_encodings"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainEncodingsConfig(ByteEvaluation):
    """Experiment A's settings (config.json): the encodings, the seeds, the shared recipe and
    the evaluation protocol. Lengths in bytes."""

    encodings: dict[str, str]  # name -> spec of the encoding each model is pretrained with
    seeds: tuple[int, ...]  # seed s: initialisation and data order, the same for every encoding
    # BaseRecipe fields every model shares (its encoding, seed and data are set above).
    model: dict[str, Any]
    description: str = ""  # what the experiment asks (for the reader of config.json)

    def __post_init__(self) -> None:
        super().__post_init__()
        recipe = check_recipe(self, "model", fixed=("encoding", "seed", "data"))
        check_specs(self, "encodings", original_length=recipe.context)
        check_ints(self, "seeds", minimum=0, many=True, distinct=True)

    def recipe(self, spec: str, seed: int) -> Any:
        """The BaseRecipe of one model."""
        from ropekit.train.recipe import BaseRecipe

        return BaseRecipe(encoding=spec, seed=seed, data=self.data, **self.model)


def job(cfg: PretrainEncodingsConfig, name: str, spec: str, seed: int, runs: Path) -> dict:
    """Pretrain (or reuse) one model and score it; the row is cached in its eval.json."""
    from ropekit.model import load_decoder
    from ropekit.results import read_result
    from ropekit.train.recipe import prepare_base_model

    folder = runs / f"{name}-s{seed}"
    path = folder / "eval.json"
    if path.exists():
        return read_record(path)
    print(f"{name} seed {seed}: pretraining `{spec}`", flush=True)
    model_dir, _, _ = prepare_base_model(cfg.recipe(spec, seed), log=lambda _: None)
    pretrain = read_result(model_dir / "pretrain.json", "pretrain")
    model = load_decoder(model_dir / "model").eval()
    start = time.perf_counter()
    scores = evaluate(
        model,
        folder,
        lengths=cfg.eval_lengths,
        data=cfg.data,
        eval_windows=cfg.eval_windows,
        tasks=cfg.tasks,
        task_lengths=cfg.task_lengths,
        depths=cfg.depths,
        samples_per_depth=cfg.samples_per_depth,
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
    write_record(path, row)
    return row


def aggregate(cfg: PretrainEncodingsConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    encodings = {}
    for name in cfg.encodings:
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
        "config": config_dict(cfg),
        "encodings": encodings,
        "compute_s": sum(r["train_s"] + r["eval_s"] for r in rows),
    }


def write_outputs(
    cfg: PretrainEncodingsConfig, result: dict[str, Any], results: Path, *, command: str
) -> str:
    """The figure, results.md and results.json in ``results``; returns the table."""
    from ropekit.figures import plot_vs_length

    lengths = [str(n) for n in cfg.eval_lengths]
    L = cfg.recipe("rope", 0).context
    means, stds = series(result["encodings"], "bpb")
    plot_vs_length(
        means,
        results / "bpb_vs_length.png",
        ylabel="held-out bits per byte",
        title=f"Pretrained at {L} bytes (mean ± std, {len(cfg.seeds)} seeds)",
        errors=stds,
        train_length=L,
        xlabel="evaluation length (bytes)",
    )
    at = str(cfg.task_lengths[0])
    table = markdown_table(
        ["encoding", "parameters", "final train loss"]
        + [f"bpb @{n} ({int(n) // L}x)" for n in lengths]
        + [f"{t} @{at}" for t in cfg.tasks],
        [
            [f"`{name}`", f"{e['parameters']:,}", fmt(e["final_loss"])]
            + [fmt(e["bpb"][n]) for n in lengths]
            + [fmt(e["tasks"][t][at], percent=True) for t in cfg.tasks]
            for name, e in result["encodings"].items()
        ],
    )
    write_results(results, result, table + "\n", command=command, provenance=provenance(NAME, cfg))
    return table


def run(cfg: PretrainEncodingsConfig, runs: Path, results: Path, command: str) -> tuple[dict, str]:
    """Every model (finished jobs are reused), then the results; returns them and the table."""
    rows = [
        job(cfg, name, spec, seed, runs)
        for seed in cfg.seeds
        for name, spec in cfg.encodings.items()
    ]
    result = aggregate(cfg, rows)
    return result, write_outputs(cfg, result, results, command=command)


def main(argv: Sequence[str] | None = None) -> None:
    invocation = parse_args(NAME, __doc__, PretrainEncodingsConfig, argv)
    # The recipe caches its models under $ROPEKIT_CACHE; keep this experiment's with its runs.
    os.environ["ROPEKIT_CACHE"] = str((invocation.runs / "models").resolve())
    result, text = run(invocation.config, invocation.runs, invocation.results, invocation.command)
    print(text)
    print(f"compute: {result['compute_s']:.0f} s")
    print(f"results in {invocation.results}")


if __name__ == "__main__":
    main()
