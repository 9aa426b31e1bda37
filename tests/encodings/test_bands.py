"""Bands: which keys a band covers (lo inclusive, hi exclusive, None unbounded), and banded
attention of one band at the true positions equal to causal attention of rotated q and k, in
both kernels. (Distance remaps against their pairwise definition: test_remap.py; the fused
kernel's plan: test_bands_fused.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from ropekit.encodings import banded_attention, bands, build
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


# ----------------------------------------------------------------------------- RotatedKeys
def _shift(x, positions, query):
    """A stand-in rotation, cheap and position-dependent: keys + their position."""
    return x + positions[:, None, :, None].to(x.dtype)


def _recording(calls):
    def rotate(x, positions, query):
        calls.append((x.shape[2], query))
        return _shift(x, positions, query)

    return rotate


def _keys(B=1, K=2, S=5, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, K, S, D, generator=g, dtype=dtype)


# What changes between two calls over a cache of 5 keys at positions 0..4: the keys' dtype,
# head count, head dim or batch, or the positions they are rotated at.
CHANGES = {
    "dtype": (_keys(dtype=torch.float32), torch.arange(5)[None]),
    "heads": (_keys(K=1), torch.arange(5)[None]),
    "head_dim": (_keys(D=4), torch.arange(5)[None]),
    "batch": (_keys(B=2), torch.arange(5)[None].expand(2, -1)),
    "positions": (_keys(), torch.arange(5)[None] + 3),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_rotated_keys_equal_a_fresh_rotation_whatever_changed_since_the_last_call(change):
    """A slot is reused only for keys of the same layout at the same positions: after any
    other change every key is rotated again, so the result is the rotation of the keys given."""
    memo = bands.RotatedKeys()
    memo.rotate(_keys(), [torch.arange(5)[None]], _shift)
    k, pos = CHANGES[change]
    calls = []
    (got,) = memo.rotate(k, [pos], _recording(calls))
    expected = _shift(k, pos, False)
    assert got.dtype == k.dtype and got.shape == k.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert calls == [(5, False)]  # all five rotated again, as keys


@pytest.mark.parametrize(
    ("D", "lengths", "rotated"),
    [
        (300, [1, 300, 300], [1, 299]),  # past the first buffer's 1 + 256 spare rows
        (2, [1, 1100, 1101, 1101], [1, 1099, 1]),  # past 1024 keys: spare room S // 4
    ],
)
def test_a_growing_cache_rotates_only_its_new_keys(D, lengths, rotated):
    """Each call over a longer prefix of the same keys rotates only the keys it adds, even when
    the rows held move to a larger buffer; a repeated call rotates nothing; every result is
    the rotation of the whole prefix."""
    k = _keys(K=1, S=lengths[-1], D=D)
    pos = torch.arange(lengths[-1])[None]
    memo, calls = bands.RotatedKeys(), []
    for n in lengths:
        (got,) = memo.rotate(k[:, :, :n], [pos[:, :n]], _recording(calls))
        torch.testing.assert_close(got, _shift(k[:, :, :n], pos[:, :n], False), rtol=0, atol=0)
        assert len(memo) == n
    assert calls == [(n, False) for n in rotated]


def test_follow_starts_empty_and_forgets_everything_when_the_cache_is_gone():
    """A new memo follows any cache (nothing seen yet); a cache that holds no keys (None)
    drops every slot."""
    k = _keys()
    memo = bands.RotatedKeys()
    memo.follow(k)
    assert len(memo) == 0
    memo.rotate(k, [torch.arange(5)[None]], _shift)
    memo.seen(k)
    memo.follow(None)
    assert len(memo) == 0


@pytest.mark.parametrize("S", [1, 2, 5])
@pytest.mark.parametrize("inference", [False, True])
def test_follow_keeps_every_row_of_an_unchanged_cache(S, inference):
    """The same key tensor, unedited, keeps all its S rows (one key and two heads included),
    also for inference tensors, which have no version counter (transformers decodes under
    ``torch.inference_mode``)."""
    with torch.inference_mode(inference):
        k = _keys(K=2, S=S)
    memo = bands.RotatedKeys()
    memo.rotate(k, [torch.arange(S)[None]], _shift)
    memo.seen(k)
    memo.follow(k)
    assert len(memo) == S
    memo.follow(k[:, :, : S - 1])  # a crop keeps that many rows
    assert len(memo) == S - 1


def test_the_fallback_warns_once_per_reason_at_the_callers_line(monkeypatch):
    """Packed rows run on the reference kernel: one RuntimeWarning however often it happens,
    located at the caller of banded_attention, not at a line of bands.py (where the warning
    would name ropekit's own line instead of the one to change)."""
    monkeypatch.setattr(bands, "_FALLBACKS", set())
    enc = build("rope", **SHAPE)
    q, k, v = (torch.randn(1, h, 6, SHAPE["head_dim"]) for h in (4, 2, 2))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])  # two packed documents
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            banded_attention(q, k, v, enc.bands(positions, positions), positions, enc.rotate_band)
    assert [w.category for w in caught] == [RuntimeWarning]
    assert "reference kernel" in str(caught[0].message)
    assert caught[0].filename != bands.__file__
