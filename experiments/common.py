"""What the experiments share: statistics, JSON files, the evaluation protocol, tables.

Every experiment is a script (``python experiments/<name>/run.py``) that trains into
``runs/experiments/<name>/`` (not committed), resumes finished jobs, and writes its committed
results (results.json, plots, results.md) next to itself.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


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


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def write_json(path: Path, data: Any) -> None:
    """Atomic: a killed run never leaves half a result that a resume would trust."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


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

    ppl_config = PerplexityConfig(tuple(lengths), n_tokens=eval_windows * max(lengths), seed=0)
    ppl = run_perplexity(
        model, ppl_config, folder / "ppl", tokenizer="bytes", data=data, spec=spec, progress=False
    )
    out: dict[str, Any] = {
        "bpb": {str(r["length"]): r["bits_per_byte"] for r in ppl["results"]},
        "position_nll": {str(r["length"]): r["position_nll"] for r in ppl["results"]},
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
                "accuracy": {str(s["length"]): s["score"] for s in entry["scores"]},
                "cells": entry["cells"],
            }
            for name, entry in summary["tasks"].items()
        }
    return out


def plot_heatmaps(
    panels: dict[str, list[dict[str, Any]]], path: Path, title: str, columns: int = 4
) -> None:
    """A grid of needle heatmaps (length x depth), one panel per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    n = len(panels)
    cols = min(columns, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
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
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------- extension jobs
def base_model(settings: dict[str, Any]) -> tuple[Path, dict[str, Any], bool]:
    """The base model of the extension experiments: the demo's byte-level RoPE decoder
    trained at L with the retrieval mixture (``settings`` override BaseRecipe fields), taken
    from the user cache or trained there once (about 7 minutes on 2 cores)."""
    from ropekit.train.recipe import BaseRecipe, prepare_base_model

    folder, reused, _ = prepare_base_model(BaseRecipe(**settings), log=print)
    return folder, read_json(folder / "pretrain.json"), reused


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


def task_specs(cfg: dict[str, Any]) -> list[Any]:
    return list(cfg["tasks"])


def run_eval(cfg: dict[str, Any], model: Any, folder: Path, spec: str) -> dict[str, Any]:
    path = folder / "eval.json"
    if path.exists():
        return read_json(path)
    start = time.perf_counter()
    result = evaluate(
        model.eval(),
        folder,
        lengths=cfg["eval_lengths"],
        data=cfg["data"],
        eval_windows=cfg["eval_windows"],
        tasks=task_specs(cfg),
        task_lengths=cfg["task_lengths"],
        depths=cfg["depths"],
        samples_per_depth=cfg["samples_per_depth"],
        spec=spec,
    )
    result |= {"spec": spec, "eval_s": time.perf_counter() - start}
    write_json(path, result)
    return result


def extension_job(
    cfg: dict[str, Any],
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
    model and a record with the selection loss and the extension summary."""
    from ropekit.backbone import load_adapter
    from ropekit.model import load_decoder
    from ropekit.results import read_result
    from ropekit.train.extend import ExtendConfig, run_extension

    model = load_decoder(base / "model")
    record_path = folder / "job.json"
    target = cfg["factor"] * model.config.context_length
    if record_path.exists():
        load_adapter(model, folder)
        return model, read_json(record_path)
    config = ExtendConfig(
        method=spec,
        target_length=target,
        samples=cfg["samples"],
        mode=mode,
        lr=lr,
        data=cfg["data"],
        seed=seed,
        **({} if lora_lr is None else {"lora_lr": lora_lr}),
    )
    start = time.perf_counter()
    run_extension(model, config, folder, recipe=recipe, overwrite=True, log=lambda _: None)
    elapsed = time.perf_counter() - start
    loss = selection_loss(
        model, cfg["data"], target, seed, cfg["samples"], cfg["selection_samples"]
    )
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
    write_json(record_path, record)
    return model, record


def parse_args(doc: str, here: Path, runs: Path) -> tuple[Any, dict[str, Any]]:
    """Every experiment's command line (config, runs folder, results folder, threads): parses
    it, creates the results folder, sets torch's thread count and reads the config."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", type=Path, default=here / "config.json")
    parser.add_argument("--runs", type=Path, default=runs, help="training runs go here")
    parser.add_argument("--results", type=Path, default=here, help="committed results go here")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)

    import torch

    torch.set_num_threads(args.threads)
    return args, read_json(args.config)
