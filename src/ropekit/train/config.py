"""The training configuration.

Holds:
    TrainConfig   frozen, validated settings of one run; `to_dict()` gives its JSON form and
                  `TrainConfig(**that_dict)` rebuilds it.
    RUN_CONTROL   fields that may change when a run is resumed (they do not touch the numbers).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Resuming with a different value of any other field would silently produce a different run
# than the one the checkpoint belongs to, so `train` refuses it.
RUN_CONTROL = frozenset(
    {
        "out_dir",
        "resume",
        "overwrite",
        "log_interval",
        "checkpoint_interval",
        "keep_last",
        "save_frozen",
    }
)


def _require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"TrainConfig.{name}={value!r} is invalid: {allowed}")


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (pretraining or context extension).

    Batch arithmetic: `batch_size` sequences make one optimizer step, summed over every process,
    so a run means the same thing on 1 or N processes. Each process takes
    `batch_size / num_processes` of them and feeds them as `grad_accum` micro-batches.
    """

    out_dir: Path  # checkpoints/, metrics.jsonl and summary.json go here
    steps: int = 1000  # optimizer steps
    batch_size: int = 32  # sequences per optimizer step, all processes together (global batch)
    grad_accum: int = 1  # micro-batches per step on each process (trades memory for time)
    lr: float = 3e-4  # peak learning rate, reached at the end of warmup
    weight_decay: float = 0.1  # AdamW decoupled decay; applied to tensors with >= 2 dims only
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW moments; 0.95 is the usual LM choice
    warmup_steps: int = 100  # linear warmup from lr/warmup_steps to lr
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    grad_clip: float | None = 1.0  # max global L2 norm of the gradient; None = no clipping
    # (regex, multiplier) pairs: a trainable parameter whose name matches a regex (re.search,
    # first match wins) trains at lr * multiplier, e.g. (("rotary|rope", 10.0),). A mapping
    # is accepted and kept in its order.
    lr_scale: tuple[tuple[str, float], ...] = ()
    seed: int = 0  # data order, and the python/numpy/torch RNGs (offset by process rank)
    bf16: bool = False  # bf16 autocast for the forward pass; weights and loss stay float32
    # shard parameters, gradients and optimizer state over the processes with FSDP2 (torch's
    # fully_shard, one decoder block at a time; positional parameters replicated); sharded
    # checkpoints. Off: data parallel, every process holds the whole model
    fsdp: bool = False
    checkpoint_interval: int = 500  # steps between checkpoints; the last step is always saved
    keep_last: int = 2  # checkpoints kept on disk; older ones are deleted
    save_frozen: bool = False  # also save frozen weights (otherwise they come from the model)
    log_interval: int = 10  # steps between metrics lines and progress-bar updates
    resume: bool = False  # continue from the latest checkpoint in out_dir if there is one
    overwrite: bool = False  # replace the checkpoints, metrics and summary already in out_dir

    def __post_init__(self) -> None:
        # Normalise the forms JSON and the command line produce (str paths, lists, dicts) so
        # that TrainConfig(**config.to_dict()) == config.
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        object.__setattr__(self, "betas", tuple(self.betas))
        pairs = self.lr_scale.items() if isinstance(self.lr_scale, Mapping) else self.lr_scale
        object.__setattr__(self, "lr_scale", tuple((str(p), float(m)) for p, m in pairs))

        for name in ("steps", "batch_size", "grad_accum", "checkpoint_interval", "keep_last"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, name, value, "an integer >= 1")
        _require(
            self.batch_size % self.grad_accum == 0,
            "batch_size",
            self.batch_size,
            f"a multiple of grad_accum={self.grad_accum}",
        )
        _require(
            isinstance(self.log_interval, int) and self.log_interval >= 1,
            "log_interval",
            self.log_interval,
            "an integer >= 1",
        )
        _require(
            isinstance(self.warmup_steps, int) and 0 <= self.warmup_steps <= self.steps,
            "warmup_steps",
            self.warmup_steps,
            f"an integer in [0, steps={self.steps}]",
        )
        _require(0 < self.lr <= 10, "lr", self.lr, "a finite number > 0 and <= 10")
        _require(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            "weight_decay",
            self.weight_decay,
            "a finite number >= 0",
        )
        _require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            self.betas,
            "two numbers in [0, 1)",
        )
        _require(
            0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]"
        )
        _require(
            self.grad_clip is None or (math.isfinite(self.grad_clip) and self.grad_clip > 0),
            "grad_clip",
            self.grad_clip,
            "None (no clipping) or a finite number > 0",
        )
        for pattern, multiplier in self.lr_scale:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(
                    f"TrainConfig.lr_scale pattern {pattern!r} is invalid: "
                    f"a Python regular expression is allowed ({err})"
                ) from None
            _require(
                math.isfinite(multiplier) and multiplier > 0,
                "lr_scale",
                self.lr_scale,
                f"multipliers must be finite and > 0 (got {multiplier} for {pattern!r})",
            )
        _require(
            isinstance(self.seed, int) and self.seed >= 0, "seed", self.seed, "an integer >= 0"
        )
        _require(isinstance(self.fsdp, bool), "fsdp", self.fsdp, "True or False")
        _require(
            not (self.resume and self.overwrite),
            "overwrite",
            self.overwrite,
            "False when resume=True (a run cannot both continue and replace its folder)",
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: plain str, int, float, bool, None and lists."""
        out = dataclasses.asdict(self)
        out["out_dir"] = str(self.out_dir)
        out["betas"] = list(self.betas)
        out["lr_scale"] = [list(pair) for pair in self.lr_scale]
        return out
