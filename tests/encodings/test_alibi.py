"""ALiBi: slopes as in the paper, a Toeplitz bias that falls with distance."""

from __future__ import annotations

import re

import pytest
import torch

from ropekit.encodings import build
from ropekit.encodings.alibi import alibi_slopes


def test_alibi_slopes_follow_the_paper():
    torch.testing.assert_close(
        alibi_slopes(8), torch.tensor([2.0 ** -(h + 1) for h in range(8)], dtype=torch.float64)
    )
    # 12 heads: the 8-head slopes, then every other slope of the 16-head sequence.
    sixteen = [2.0 ** (-(h + 1) / 2) for h in range(16)]
    expected = [2.0 ** -(h + 1) for h in range(8)] + sixteen[0::2][:4]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected, dtype=torch.float64))
    for n in (1, 3, 5, 6, 7, 9, 24, 40):
        slopes = alibi_slopes(n)
        assert slopes.shape == (n,) and len(set(slopes.tolist())) == n
        assert torch.all((slopes > 0) & (slopes < 1))


def test_alibi_bias_is_toeplitz_and_strictly_decreasing_with_distance():
    enc = build("alibi", n_heads=6, head_dim=8)
    pos = torch.arange(40)[None]
    bias = enc.score_bias(pos, pos)  # (1, 6, 40, 40)
    assert bias.shape == (1, 6, 40, 40)
    for h in range(6):
        b = bias[0, h]
        for offset in range(-39, 40):
            diag = torch.diagonal(b, offset)
            assert torch.all(diag == diag[0])
        row = b[39, :40].flip(0)  # distances 0, 1, 2, ... from the last query
        assert torch.all(row[1:] < row[:-1])
    # Offsets into a long document give the same biases (relative).
    shifted = enc.score_bias(pos + 100_000, pos + 100_000)
    assert torch.equal(shifted, bias)


def test_alibi_slopes_refuse_zero_heads():
    """There is no slope for no head: the error names the value and the bound."""
    with pytest.raises(ValueError, match=re.escape("n_heads=0 is not allowed; it must be >= 1")):
        alibi_slopes(0)


def test_alibi_slopes_are_not_saved_with_the_model():
    """The slopes follow from the number of heads: they are rebuilt, not read from a
    checkpoint, so the state dict holds nothing for ALiBi."""
    assert "slopes" not in build("alibi", n_heads=4, head_dim=8).state_dict()


# Positions spanning more than 2^24 (float32 stops holding every integer there), shifted by
# 0 or to negative values: queries at a and b, keys at the origin and close to the queries.
FAR = 2**24 + 1


@pytest.mark.parametrize("shift", [0, 1000, -FAR])
def test_alibi_bias_is_minus_slope_times_exact_distance(shift):
    """score bias(i, j) = -m_h |i - j| with |i - j| exact, for any integer positions: small
    distances stay exact even when the positions span past 2^24 or are negative."""
    enc = build("alibi", n_heads=4, head_dim=8)
    q = [FAR, FAR - 1, 5]
    k = [0, FAR - 4, 2, 9]
    bias = enc.score_bias(torch.tensor([q]) + shift, torch.tensor([k]) + shift)
    distance = torch.tensor([[abs(i - j) for j in k] for i in q], dtype=torch.float32)
    slopes = alibi_slopes(4).float()
    assert torch.equal(bias[0], distance[None] * -slopes[:, None, None])
