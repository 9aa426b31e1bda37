"""The four labs at the end of the long-context lecture, as tests against ropekit's code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ropekit.encodings import build, schedules


def _rotate_one(vector: np.ndarray, position: int, spec: str = "rope") -> np.ndarray:
    enc = build(
        spec + (":" if ":" not in spec else ",") + "pairing=interleaved",
        n_heads=1,
        head_dim=len(vector),
    )
    x = torch.tensor(vector, dtype=torch.float64)[None, None, None]
    return enc.rotate_k(x, torch.tensor([[position]]))[0, 0, 0].numpy()


def test_lab1_rope_encodes_relative_not_absolute_position():
    rng = np.random.default_rng(0)
    q0, k0 = rng.normal(size=16), rng.normal(size=16)
    scores = [
        float(_rotate_one(q0, base + 5) @ _rotate_one(k0, base + 8)) for base in (0, 100, 500)
    ]
    assert max(scores) - min(scores) < 1e-6
    other = float(_rotate_one(q0, 5) @ _rotate_one(k0, 20))
    assert abs(other - scores[0]) > 1e-3


def test_lab2_position_interpolation_bounds_the_rotation_angle():
    dim, l_train, l_new = 64, 512, 4096
    slow = schedules.rope(dim, 10000.0)[0][-1].item()
    max_angle_train = l_train * slow
    assert l_new * slow > 4 * max_angle_train
    pi_slow = schedules.linear(dim, 10000.0, l_new / l_train)[0][-1].item()
    assert l_new * pi_slow == pytest.approx(max_angle_train, abs=1e-9)
    positions = np.linspace(0, l_new, 200)
    assert np.mean(positions * slow > max_angle_train + 1e-9) > 0.8
    assert np.mean(positions * pi_slow > max_angle_train + 1e-9) < 1e-6


def test_lab3_ntk_preserves_high_frequency_resolution():
    dim, factor = 64, 4096 / 512
    rope = schedules.rope(dim, 10000.0)[0]
    pi = schedules.linear(dim, 10000.0, factor)[0]
    ntk = schedules.ntk(dim, 10000.0, factor)[0]
    err_pi = abs(pi[0] - rope[0]) / rope[0]
    err_ntk = abs(ntk[0] - rope[0]) / rope[0]
    assert err_ntk < 0.1 * err_pi
    assert 4096 * rope[-1] > 4 * 512 * rope[-1]
    assert 4096 * ntk[-1] < 0.5 * 4096 * rope[-1]


def test_lab4_alibi_extrapolates_while_a_learned_table_cannot():
    learned = build("learned:max_length=512", n_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="past the learned table"):
        learned.embed(torch.zeros(1, 500, 8), torch.arange(512, 1012)[None])
    alibi = build("alibi", n_heads=8, head_dim=8)
    far = torch.arange(5000)[None]
    row = alibi.score_bias(far[:, -1:], far)[0, 0, 0].flip(0)  # distance 0..4999
    assert torch.all(row[1:] < row[:-1])
    assert len(torch.unique(row)) == 5000
