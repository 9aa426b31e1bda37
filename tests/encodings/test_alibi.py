"""ALiBi: slopes as in the paper, a Toeplitz bias that falls with distance."""

from __future__ import annotations

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
