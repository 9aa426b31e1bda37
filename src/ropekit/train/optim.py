"""Optimizer and learning-rate schedule.

Holds:
    lr_factor         the schedule as a pure function: linear warmup, then cosine to a floor.
    param_groups      AdamW groups over the trainable parameters only, with lr multipliers.
    build_optimizer   AdamW and its LambdaLR scheduler for a model and a TrainConfig.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from ropekit.train.config import TrainConfig


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based).

    Warmup rises linearly to 1 at step `warmup_steps - 1` (the first step already moves, at
    lr / warmup_steps); then a half cosine falls towards `min_lr_ratio`, which it would reach
    at step `steps`, one past the last.
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def param_groups(model: nn.Module, config: TrainConfig) -> list[dict[str, Any]]:
    """AdamW parameter groups holding every parameter with requires_grad=True and no other.

    Frozen parameters never reach the optimizer, so it keeps no state for them (context
    extension freezes a backbone hundreds of times larger than what it trains). A parameter's
    lr is `config.lr` times the multiplier of the first `config.lr_scale` regex its name
    matches (1 if none). Weight decay applies only to tensors with two or more dims: decaying
    gains and biases towards zero fights normalisation rather than regularising.
    """
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        multiplier = next((m for p, m in config.lr_scale if re.search(p, name)), 1.0)
        decay = config.weight_decay if param.ndim >= 2 else 0.0
        groups.setdefault((multiplier, decay), []).append(param)
    if not groups:
        raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
    return [
        {"params": params, "lr": config.lr * multiplier, "weight_decay": decay}
        for (multiplier, decay), params in groups.items()
    ]


def build_optimizer(model: nn.Module, config: TrainConfig) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW over `param_groups(model, config)` and the scheduler that applies `lr_factor`."""
    optimizer = torch.optim.AdamW(param_groups(model, config), lr=config.lr, betas=config.betas)
    scheduler = LambdaLR(optimizer, lambda step: lr_factor(step, config))
    return optimizer, scheduler
