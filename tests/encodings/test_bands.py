"""Bands: which keys a band covers (lo inclusive, hi exclusive, None unbounded), and banded
attention of one band at the true positions equal to causal attention of rotated q and k, in
both kernels. (Distance remaps against their pairwise definition: test_remap.py; the fused
kernel's plan: test_bands_fused.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ropekit.encodings import banded_attention, build
from ropekit.encodings.bands import Band, band_membership

from .conftest import SHAPE


def test_a_band_covers_keys_from_lo_inclusive_to_hi_exclusive():
    positions = torch.arange(6)[None]  # (1, 6)
    lo = torch.tensor([[0, 2, 2]])  # (1, T=3)
    hi = torch.tensor([[1, 4, 6]])
    member = band_membership(Band(positions[:, :3], positions, lo, hi), positions, 0, 3)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(member, expected[None, None])  # (B, 1, R, N)
    rows = band_membership(Band(positions[:, :3], positions, lo, hi), positions, 1, 3)
    assert torch.equal(rows, expected[None, None, 1:])
    only_lo = band_membership(Band(positions[:, :3], positions, lo=lo), positions, 0, 3)
    assert torch.equal(only_lo, (positions[:, None, :] >= lo[..., None])[:, None])
    assert band_membership(Band(positions[:, :3], positions), positions, 0, 3) is None


@pytest.mark.parametrize("kernel", ["reference", "fused"])
def test_one_band_at_the_true_positions_is_causal_attention_of_rotated_q_and_k(kernel):
    enc = build("rope", **SHAPE)
    g = torch.Generator().manual_seed(0)
    B, T, D = 2, 11, SHAPE["head_dim"]
    q = torch.randn(B, SHAPE["n_heads"], T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, SHAPE["n_kv_heads"], T, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, SHAPE["n_kv_heads"], T, D, generator=g, dtype=torch.float64)
    positions = torch.arange(T)[None]
    got = banded_attention(
        q, k, v, enc.bands(positions, positions), positions, enc.rotate_band,
        causal_offset=0, kernel=kernel,
    )  # fmt: skip
    groups = SHAPE["n_heads"] // SHAPE["n_kv_heads"]
    rk = enc.rotate_k(k, positions).repeat_interleave(groups, dim=1)
    expected = F.scaled_dot_product_attention(
        enc.rotate_q(q, positions), rk, v.repeat_interleave(groups, dim=1), is_causal=True
    )
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
