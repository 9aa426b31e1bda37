"""Atomic training checkpoints.

Holds:
    CheckpointState     the numbers a checkpoint records besides tensors (step, data position...).
    save_checkpoint     write one checkpoint atomically (temp dir, fsync, rename); keep the last K.
    load_checkpoint     load weights (and optionally optimizer and scheduler state) into objects.
    read_checkpoint_state   what a checkpoint records besides tensors (step, config, provenance).
    latest_checkpoint   the newest complete checkpoint of a run folder, or None.
    restore_rng         put this process's python/numpy/torch RNG streams back as they were saved.

Layout, under `<out_dir>/checkpoints/`:

    step-00000500/
        model.safetensors   trainable parameters and persistent buffers (all weights with
                            save_frozen); frozen weights otherwise come from the model passed in
        optimizer.pt        AdamW state_dict
        scheduler.pt        LambdaLR state_dict
        rng-<rank>.pt       python, numpy, torch (and CUDA) RNG states of each process
        state.json          CheckpointState without its config
        config.json         the TrainConfig, as TrainConfig.to_dict()

Weights are safetensors (no pickle). The `.pt` files hold only tensors, numbers, strings,
lists, tuples and dicts, and are always read with `torch.load(..., weights_only=True)`, which
refuses anything else. A checkpoint is complete the moment its folder is renamed from
`.tmp-step-*` to `step-*`; readers look only at `step-*` names, so a crash mid-write leaves
nothing that looks like a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

CHECKPOINTS = "checkpoints"
MODEL_FILE = "model.safetensors"
_STEP_DIR = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class CheckpointState:
    """What a checkpoint records besides tensors."""

    step: int  # optimizer steps completed
    samples_seen: int  # data position: global-batch items consumed, step * batch_size
    tokens: int  # input tokens trained on, all processes together
    loss: float  # loss of the last step taken
    elapsed_s: float  # wall-clock seconds of training so far, all sessions together
    num_processes: int  # processes that wrote it (each wrote its own rng-<rank>.pt)
    dataset_len: int  # the data order depends on it, so resuming checks it
    config: dict[str, Any]  # TrainConfig.to_dict() of the run
    # What the run trains (model, encoding, data, tokenizer...: ropekit.results provenance);
    # resuming refuses a checkpoint whose provenance differs, naming the field.
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in `out_dir`, or None if there is none."""
    steps = _step_dirs(Path(out_dir) / CHECKPOINTS)
    return steps[max(steps)] if steps else None


def save_checkpoint(
    out_dir: Path,
    state: CheckpointState,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    accelerator: Accelerator,
    save_frozen: bool,
    keep_last: int,
) -> Path:
    """Write `state` and the objects' state as `<out_dir>/checkpoints/step-<step>`; returns it.

    Every process must call it (each saves its own RNG streams); the main process writes the
    rest, which DDP keeps identical on every process. `model` is the unwrapped module.
    """
    root = out_dir / CHECKPOINTS
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        _remove_leftovers(root)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        torch.save(_rng_state(), tmp / f"rng-{accelerator.process_index}.pt")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            # "format": "pt" is what Hugging Face loaders expect of a PyTorch safetensors file.
            save_file(_model_tensors(model, save_frozen), tmp / MODEL_FILE, {"format": "pt"})
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            fields = dataclasses.asdict(state)
            (tmp / "config.json").write_text(json.dumps(fields.pop("config"), indent=2))
            (tmp / "state.json").write_text(json.dumps(fields, indent=2))
            # Data first, then the folder entry, then the rename, then the parent's entry:
            # after a power cut the rename is either absent or points at complete files.
            for path in tmp.iterdir():
                _fsync(path)
            _fsync(tmp)
            os.replace(tmp, final)
            _fsync(root)
            _prune(root, keep_last)
    except BaseException:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> CheckpointState:
    """Load a checkpoint folder's weights into `model` (and state into the others, if given).

    Weights missing from the checkpoint (frozen ones, unless it was saved with save_frozen)
    keep the values they have in `model`; a checkpoint weight the model lacks is an error.
    """
    path = Path(path)
    missing = [
        name for name in (MODEL_FILE, "state.json", "config.json") if not (path / name).is_file()
    ]
    if missing:
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint: {', '.join(missing)} missing"
        )
    unexpected = model.load_state_dict(load_file(path / MODEL_FILE), strict=False).unexpected_keys
    if unexpected:
        raise ValueError(
            f"{path / MODEL_FILE} holds {len(unexpected)} weights the model does not have, "
            f"e.g. {unexpected[:3]}: was it saved from a different model?"
        )
    if optimizer is not None:
        optimizer.load_state_dict(_load_pt(path / "optimizer.pt"))
    if scheduler is not None:
        scheduler.load_state_dict(_load_pt(path / "scheduler.pt"))
    return read_checkpoint_state(path)


def read_checkpoint_state(path: str | Path) -> CheckpointState:
    """The numbers, config and provenance a checkpoint folder records (no tensors loaded)."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    return CheckpointState(**state, config=json.loads((path / "config.json").read_text()))


def restore_rng(path: str | Path, rank: int) -> None:
    """Restore process `rank`'s RNG streams from checkpoint `path`.

    A checkpoint written by fewer processes has no streams for the extra ranks: they keep their
    fresh seeds, which changes only random ops (dropout), never the data order.
    """
    file = Path(path) / f"rng-{rank}.pt"
    if not file.is_file():
        warnings.warn(f"{file} not found: process {rank} keeps fresh RNG seeds", stacklevel=2)
        return
    state = _load_pt(file)
    random.setstate(state["python"])
    numpy = state["numpy"]
    key = numpy["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state({**numpy, "state": {**numpy["state"], "key": key}})
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def _rng_state() -> dict[str, Any]:
    numpy = np.random.get_state(legacy=False)
    # The MT19937 key as a tensor, because weights_only loading refuses numpy arrays.
    key = torch.from_numpy(numpy["state"]["key"].astype(np.int64))
    return {
        "python": random.getstate(),
        "numpy": {**numpy, "state": {**numpy["state"], "key": key}},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _model_tensors(model: nn.Module, save_frozen: bool) -> dict[str, Tensor]:
    # named_parameters lists a tied weight once, which safetensors requires; state_dict's keys
    # tell persistent buffers (part of the model's state) from scratch ones.
    persistent = model.state_dict().keys()
    tensors = {n: p for n, p in model.named_parameters() if p.requires_grad or save_frozen}
    tensors |= {n: b for n, b in model.named_buffers() if n in persistent}
    return {n: t.detach().cpu().contiguous() for n, t in tensors.items()}


def _load_pt(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_dirs(root: Path) -> dict[int, Path]:
    if not root.is_dir():
        return {}
    return {int(m[1]): p for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))}


def _prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints."""
    steps = _step_dirs(root)
    for step in sorted(steps)[:-keep_last]:
        old = steps[step]
        # Renamed first, so a crash while deleting never leaves a half-deleted step-*.
        trash = root / f".trash-{old.name}"
        os.replace(old, trash)
        shutil.rmtree(trash)


def _remove_leftovers(root: Path) -> None:
    """Delete temp and trash folders a crashed save left behind."""
    if root.is_dir():
        for path in [*root.glob(".tmp-*"), *root.glob(".trash-*")]:
            shutil.rmtree(path)
