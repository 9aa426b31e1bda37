"""The lr schedule's laws and the parameter groups (trainable only, multipliers, decay)."""

import itertools

import pytest
import torch
from torch import nn

from ropekit.train import TrainConfig, lr_factor
from ropekit.train.optim import build_optimizer, param_groups


def test_warmup_is_linear_then_cosine_falls_to_the_floor(tmp_path):
    config = TrainConfig(tmp_path, steps=100, warmup_steps=10, min_lr_ratio=0.1)
    factors = [lr_factor(s, config) for s in range(config.steps)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[10] == 1.0  # cosine starts at the peak
    assert all(a >= b for a, b in itertools.pairwise(factors[10:]))
    assert factors[-1] > 0.1
    assert lr_factor(config.steps, config) == pytest.approx(0.1)  # one past the last step
    # Halfway through the decay the cosine is at its midpoint.
    assert lr_factor(55, config) == pytest.approx(0.1 + 0.9 * 0.5)


def test_no_warmup_starts_at_the_peak(tmp_path):
    config = TrainConfig(tmp_path, steps=5, warmup_steps=0, min_lr_ratio=0.0)
    assert lr_factor(0, config) == 1.0


def test_scheduler_applies_lr_factor_to_every_group(tmp_path):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    config = TrainConfig(tmp_path, steps=20, warmup_steps=5, lr=1e-2, lr_scale={r"^1\.": 4.0})
    optimizer, scheduler = build_optimizer(model, config)
    assert {g["initial_lr"] for g in optimizer.param_groups} == {1e-2, 4e-2}
    for step in range(config.steps):
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(group["initial_lr"] * lr_factor(step, config))
        optimizer.step()
        scheduler.step()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.norm = nn.LayerNorm(4)  # 1-D weight and bias
        self.rotary = nn.Parameter(torch.zeros(2, 3))
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def lr_and_decay(groups, param):
    (group,) = [g for g in groups if any(p is param for p in g["params"])]
    return group["lr"], group["weight_decay"]


def test_groups_hold_trainable_parameters_only_with_their_lr_and_decay(tmp_path):
    model = Tiny()
    config = TrainConfig(tmp_path, lr=1e-3, weight_decay=0.1, lr_scale={"rot": 10.0})
    groups = param_groups(model, config)
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    assert lr_and_decay(groups, model.embed.weight) == (1e-3, 0.1)
    assert lr_and_decay(groups, model.norm.weight) == (1e-3, 0.0)
    assert lr_and_decay(groups, model.norm.bias) == (1e-3, 0.0)
    assert lr_and_decay(groups, model.rotary) == (pytest.approx(1e-2), 0.1)


def test_first_matching_pattern_wins(tmp_path):
    model = Tiny()
    config = TrainConfig(tmp_path, lr=1.0, lr_scale=(("rotary", 3.0), ("rot", 5.0)))
    assert lr_and_decay(param_groups(model, config), model.rotary)[0] == 3.0


def test_nothing_trainable_is_an_error(tmp_path):
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        param_groups(model, TrainConfig(tmp_path))
