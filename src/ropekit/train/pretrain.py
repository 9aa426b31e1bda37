"""Pretraining a reference decoder with any encoding: data in, trained model out.

Holds: PretrainResult, pretrain (what `ropekit pretrain` runs), measure_matmul_flops.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from ropekit.data import RetrievalConfig, make_train_dataset
from ropekit.distributed import processes
from ropekit.model import Decoder, DecoderConfig, count_parameters, flops_per_token, save_decoder
from ropekit.results import run_metadata, write_result

from .config import TrainConfig
from .loop import TrainResult, train


@dataclasses.dataclass(frozen=True)
class PretrainResult:
    model_dir: Path  # the trained decoder (safetensors + config.json)
    summary: Path  # pretrain.json: spec, sizes, throughput, MFU, versions, command
    train: TrainResult


def measure_matmul_flops(n: int = 1024, repeats: int = 10) -> float:
    """This machine's fp32 matmul throughput (FLOP/s) on n x n matrices: the MFU ceiling."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def pretrain(
    out_dir: str | Path,
    *,
    model: DecoderConfig,
    train_config: TrainConfig | None = None,
    data: str | list[str] = "shakespeare",
    retrieval: RetrievalConfig | None = None,
    tokenizer: str = "bytes",
    command: str = "",
) -> PretrainResult:
    """Train ``model`` from scratch on ``data`` at ``model.context_length``.

    Checkpoints, metrics.jsonl and the training summary go to ``out_dir``; the final model
    to ``out_dir/model``; ``out_dir/pretrain.json`` records what was trained and how fast.
    Launched as several processes, they train data parallel and the main process writes.
    """
    out_dir = Path(out_dir)
    train_config = train_config or TrainConfig(out_dir=out_dir)
    if Path(train_config.out_dir) != out_dir:
        train_config = dataclasses.replace(train_config, out_dir=out_dir)
    dataset = make_train_dataset(
        data, tokenizer, model.context_length, retrieval=retrieval, seed=train_config.seed
    )
    torch.manual_seed(train_config.seed)
    decoder = Decoder(model)
    # Resuming checks these (naming the field): another encoding, spec option, model shape,
    # tokenizer or data (a digest of every token, so other files of the same size differ).
    provenance = {
        "model": model.to_dict(), "spec": decoder.encoding.spec, "data": dataset.identity(),
    }  # fmt: skip
    result = train(decoder, dataset, train_config, provenance=provenance, command=command)
    model_dir, path = out_dir / "model", out_dir / "pretrain.json"
    # Under `accelerate launch` every process holds the same trained weights (DDP keeps them
    # equal); the main process alone writes them, and the others wait until it has.
    procs = processes()
    if procs.is_main:
        save_decoder(decoder, model_dir)
        peak = measure_matmul_flops()
        fpt = flops_per_token(model)
        summary: dict[str, Any] = {
            "encoding": decoder.encoding.spec,
            "model": model.to_dict(),
            "parameters": count_parameters(decoder),
            "steps": train_config.steps,
            "stages": [],  # one run; the base recipe (train/recipe.py) records its stages here
            "train": train_config.to_dict(),
            "data": data,
            "retrieval": None if retrieval is None else dataclasses.asdict(retrieval),
            "final_loss": result.final_loss,
            "tokens": result.tokens,
            "elapsed_s": result.elapsed_s,
            "tokens_per_s": result.tokens_per_s,
            "num_processes": procs.world,
            "flops_per_token": fpt,
            "matmul_flops_per_s": peak,
            # The peak is one process's (each computes with its own threads); the run had
            # `procs.world` of them.
            "mfu": result.tokens_per_s * fpt / (peak * procs.world),
        }
        meta = run_metadata(command, spec=decoder.encoding.spec, seed=train_config.seed)
        write_result(path, "pretrain", summary, meta=meta, provenance=provenance)
    procs.barrier()
    return PretrainResult(model_dir=model_dir, summary=path, train=result)
