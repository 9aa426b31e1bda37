"""HARPE's fixed per-head bases: the stated rule in float64, each query head rotated exactly as
plain RoPE at its key/value head's base, one head = NTK-aware scaling. (The properties every
rotary encoding has run over ``harpe`` in test_properties.py through conftest.ROTARY_SPECS.)"""

from __future__ import annotations

import pytest
import torch

from ropekit.encodings import build

_TOL = {"rtol": 1e-12, "atol": 1e-12}


@pytest.mark.parametrize(
    ("n_kv_heads", "head_dim", "base", "s"), [(3, 64, 1e5, 4), (2, 16, 1e4, 8)]
)
def test_kv_head_k_rotates_at_the_ntk_base_of_stage_k(n_kv_heads, head_dim, base, s):
    enc = build(
        f"harpe:factor={s},base={base}",
        n_heads=3 * n_kv_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
    )
    d = head_dim
    f = torch.arange(0, d, 2, dtype=torch.float64) / d
    for k in range(n_kv_heads):
        b_k = base * (s ** ((k + 1) / n_kv_heads)) ** (d / (d - 2))
        torch.testing.assert_close(enc.inv_freq()[0][k], b_k**-f, rtol=1e-15, atol=0)
        assert enc.bases[k] == pytest.approx(b_k, rel=1e-14)


def test_each_query_head_rotates_as_plain_rope_at_its_kv_heads_base():
    enc = build("harpe:factor=4,pairing=interleaved", n_heads=6, n_kv_heads=2, head_dim=16)
    q = torch.randn(2, 6, 9, 16, dtype=torch.float64)
    k = torch.randn(2, 2, 9, 16, dtype=torch.float64)
    pos = torch.tensor([[0, 3, 8, 50, 99, 1000, 7, 2, 40_000]]).expand(2, -1)
    out_q, out_k = enc.rotate_q(q, pos), enc.rotate_k(k, pos)
    for kv, b in enumerate(enc.bases):
        rope = build(f"rope:base={b},pairing=interleaved", n_heads=3, n_kv_heads=1, head_dim=16)
        heads = slice(3 * kv, 3 * kv + 3)
        torch.testing.assert_close(out_q[:, heads], rope.rotate_q(q[:, heads], pos), **_TOL)
        torch.testing.assert_close(out_k[:, kv : kv + 1], rope.rotate_k(k[:, kv : kv + 1], pos))


def test_with_one_kv_head_harpe_is_ntk():
    harpe = build("harpe:factor=4", n_heads=4, n_kv_heads=1, head_dim=16)
    ntk = build("ntk:factor=4", n_heads=4, n_kv_heads=1, head_dim=16)
    torch.testing.assert_close(harpe.inv_freq()[0], ntk.inv_freq()[0], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [("harpe", "factor is required for HarpeConfig"), ("harpe:factor=0.5", "factor=0.5")],
)
def test_harpe_needs_a_factor_of_at_least_one(spec, message):
    with pytest.raises(ValueError, match=message):
        build(spec, n_heads=2, head_dim=16)
