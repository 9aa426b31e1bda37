"""The absolute encodings: the sinusoidal table of Vaswani et al. added to token states, and a
learned table that refuses positions past its last row."""

from __future__ import annotations

import math

import pytest
import torch

from ropekit.encodings import build


def test_sinusoidal_adds_the_vaswani_table():
    enc = build("sinusoidal:scale=1", n_heads=2, head_dim=4)
    h = torch.zeros(1, 3, 8)
    out = enc.embed(h, torch.tensor([[0, 1, 7]]))
    assert torch.allclose(out[0, 0], torch.tensor([0.0, 1.0] * 4))
    p, i = 7, 1
    assert math.isclose(out[0, 2, 2 * i].item(), math.sin(p / 10000 ** (2 * i / 8)), rel_tol=1e-6)
    assert math.isclose(
        out[0, 2, 2 * i + 1].item(), math.cos(p / 10000 ** (2 * i / 8)), rel_tol=1e-6
    )


def test_learned_table_errors_past_its_last_row():
    enc = build("learned:max_length=16", n_heads=2, head_dim=4)
    h = torch.zeros(1, 3, 8)
    assert enc.embed(h, torch.tensor([[0, 5, 15]])).shape == (1, 3, 8)
    with pytest.raises(ValueError, match="past the learned table of 16 rows"):
        enc.embed(h, torch.tensor([[14, 15, 16]]))
