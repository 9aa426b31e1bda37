"""Bands: which keys a band covers (lo inclusive, hi exclusive, None unbounded), and banded
attention of one band at the true positions equal to causal attention of rotated q and k, in
both kernels. (Distance remaps against their pairwise definition: test_remap.py; the fused
kernel's plan: test_bands_fused.py.)"""

from __future__ import annotations

import math
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


# ----------------------------------------------------------------------------- the definition
def pairwise_attention(q, k, v, band_list, key_positions, rotate, scale, visible):
    """The module docstring's definition with full (T, S) matrices: each pair's logit from
    the band that covers it, scale * <R(P_q^b(i)) s_b(i) q_i, R(P_k^b(j)) k_j>; ``visible``
    (B|1, 1, T, S) bool or additive; softmax over the visible keys (none: a row of zeros)."""
    H, K = q.shape[1], k.shape[1]
    logits = None
    for band in band_list:
        qb = q if band.q_scale is None else q * band.q_scale
        qr = rotate(qb, band.q_positions, True).double()
        kr = rotate(k, band.k_positions, False).double().repeat_interleave(H // K, dim=1)
        part = qr @ kr.transpose(-1, -2) * scale  # (B, H, T, S)
        member = band_membership(band, key_positions, 0, q.shape[2])
        inside = torch.ones_like(part, dtype=torch.bool) if member is None else member
        logits = torch.where(inside, part, -math.inf if logits is None else logits)
    if visible.dtype == torch.bool:
        logits = logits.masked_fill(~visible, -math.inf)
    else:
        logits = logits + visible.double()
    weights = logits.softmax(-1).nan_to_num(0.0)  # rows that see no key: zeros
    return weights @ v.double().repeat_interleave(H // K, dim=1)


T12 = 12
P12 = torch.arange(T12)[None] + 3  # (1, T): key and query positions


def _three_bands():
    """Far (listed first, empty for the first rows: a band that covers no key of a block must
    not stop the others), middle (fractional query positions) and near, partitioning the keys
    of every query; the far band scales its queries (float64, as the remaps' scales are: the
    kernel casts them to the queries' dtype)."""
    p = P12
    scale = (1 + 0.05 * torch.arange(T12, dtype=torch.float64))[None, None, :, None]
    return [
        Band(p // 2, p // 3, hi=p - 6, q_scale=scale),
        Band(p.double() + 0.5, p.double(), lo=p - 6, hi=p - 2),
        Band(p, p, lo=p - 2),
    ]


def _query_heavy(enc):
    """A band rotation that treats queries and keys differently (a temperature on queries),
    as AdaRoPE's does: the kernel must say which it is rotating."""

    def rotate(x, positions, query):
        out = enc.rotate_band(x, positions, query)
        return out * 1.5 if query else out

    return rotate


PADDED = torch.ones(T12, T12, dtype=torch.bool)
PADDED[:, 2] = False  # a padding key
MASKS = {
    "causal": lambda: (0, None, torch.ones(T12, T12, dtype=torch.bool).tril()),
    # the caller's mask on top of the causal offset: it is asked for each block's keys only
    "causal and padding": lambda: (
        0,
        PADDED,
        PADDED & torch.ones(T12, T12, dtype=torch.bool).tril(),
    ),
    "bool": lambda: (
        None,
        *[torch.rand(T12, T12, generator=torch.Generator().manual_seed(3)) > 0.3] * 2,
    ),
    "additive": lambda: (
        None,
        *[
            torch.randn(T12, T12, generator=torch.Generator().manual_seed(4)).tril()
            + torch.full((T12, T12), -math.inf).triu(1)
        ]
        * 2,
    ),
}
TOLERANCE = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.bfloat16: {"rtol": 0, "atol": 5e-2},
}


@pytest.mark.parametrize("dtype", sorted(TOLERANCE, key=str), ids=str)
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("block_entries", [48, 240])  # blocks of 1 and of 5 query rows
def test_the_reference_kernel_equals_the_pairwise_definition(dtype, mask, grad, block_entries):
    """Three bands (one empty for the first rows, fractional positions, a query scale), a
    rotation that tells queries from keys, causal / boolean / additive masks, blocks of 1 and
    5 rows (the last one short), with and without autograd (in place or recomputed), in
    float64, float32 and bfloat16; one query row has logits of about 100, which a softmax not
    taken row by row from each row's maximum would underflow or overflow."""
    enc = build("rerope:window=4", n_heads=4, n_kv_heads=2, head_dim=8, n_layers=1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, T12, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    if dtype != torch.bfloat16:
        q[:, :, 7] *= 30  # the hot row
    q, k, v = (t.to(dtype).requires_grad_(grad) for t in (q, k, v))
    offset, given, visible = MASKS[mask]()
    band_list, rotate = _three_bands(), _query_heavy(enc)
    got = banded_attention(
        q, k, v, band_list, P12, rotate, kernel="reference", causal_offset=offset,
        mask=None if given is None else (lambda a, b, n: given[a:b, :n]),
        block_entries=block_entries,
    )  # fmt: skip
    expected = pairwise_attention(
        q.detach().double(), k.detach().double(), v.detach().double(),
        _three_bands(), P12, rotate, 8**-0.5, visible,
    )  # fmt: skip
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, **TOLERANCE[dtype])
    if grad:
        got.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("grad", [False, True])
def test_one_unbounded_band_with_autograd_and_rows_that_see_no_key(grad):
    """More queries than keys with a causal offset of -2: the first two rows see no key and
    give zeros (blocks of one row, 16 logits), the others attend as one band of rotated q and k; the
    result is in v's dtype."""
    enc = build("rope", n_heads=4, n_kv_heads=2, head_dim=8, n_layers=1)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=grad)
    k, v = (torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    q_pos, k_pos = torch.arange(6)[None], torch.arange(4)[None]
    got = banded_attention(
        q, k, v, [Band(q_pos, k_pos)], k_pos, enc.rotate_band, kernel="reference",
        causal_offset=-2, block_entries=16,
    )  # fmt: skip
    visible = torch.ones(6, 4, dtype=torch.bool).tril(-2)
    expected = pairwise_attention(
        q.detach(), k, v, [Band(q_pos, k_pos)], k_pos, enc.rotate_band, 8**-0.5, visible
    )
    assert got.shape == (1, 4, 6, 8) and not got[:, :, :2].any()
    torch.testing.assert_close(got.detach(), expected, rtol=1e-10, atol=1e-10)
    # the result is in v's dtype, the rows that see no key included
    single = banded_attention(
        q.detach(), k, v.float(), [Band(q_pos, k_pos)], k_pos, enc.rotate_band,
        kernel="reference", causal_offset=-2, block_entries=16,
    )  # fmt: skip
    assert single.dtype == torch.float32
    torch.testing.assert_close(single, expected.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["reference", "fused"])
def test_both_kernels_keep_rotated_keys_for_the_next_call(kernel):
    """With a KV cache's RotatedKeys each call rotates only the keys it has not seen; the
    decoding query (causal offset S - 1) attends to every cached key."""
    enc = build("rerope:window=3", **SHAPE)
    calls = []

    def counting(x, positions, query):
        if not query:
            calls.append(x.shape[2])
        return enc.rotate_band(x, positions, query)

    q, k, v = (torch.randn(1, h, 9, SHAPE["head_dim"], dtype=torch.float64) for h in (4, 2, 2))
    pos = torch.arange(9)[None]
    memo = bands.RotatedKeys()
    for stop in (8, 9):
        band_list = enc.bands(pos[:, stop - 1 : stop], pos[:, :stop])
        got = banded_attention(
            q[:, :, stop - 1 : stop], k[:, :, :stop], v[:, :, :stop], band_list, pos[:, :stop],
            counting, causal_offset=stop - 1, rotated_keys=memo, kernel=kernel,
        )  # fmt: skip
        expected = pairwise_attention(
            q[:, :, stop - 1 : stop], k[:, :, :stop], v[:, :, :stop], band_list, pos[:, :stop],
            enc.rotate_band, SHAPE["head_dim"] ** -0.5, torch.ones(1, stop, dtype=torch.bool),
        )  # fmt: skip
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)  # the new query
    assert calls == [8, 8, 1, 1]  # two bands: all 8 keys, then only the new one, per slot


# ----------------------------------------------------------------------------- key ranges
def _hull(band, key_positions, start, stop, n):
    """The smallest index interval [a, b) holding every key in [0, n) that the band covers
    for some query row in [start, stop) (None when it covers none)."""
    member = band_membership(band, key_positions[:, :n], start, stop)
    covered = torch.ones(n, dtype=torch.bool) if member is None else member.any(0).any(0).any(0)
    idx = covered.nonzero().flatten().tolist()
    return (idx[0], idx[-1] + 1) if idx else None


def _remap(spec):
    enc = build(spec, **SHAPE, original_length=8)
    return lambda p: enc.bands(p, p)


KEY_RANGE_CASES = {
    "rerope": (_remap("rerope:window=3"), torch.arange(10)[None] + 2, 4),  # last block padded
    "leaky rerope": (_remap("rerope:window=3,leaky=2"), torch.arange(10)[None] + 2, 3),
    "dca": (_remap("dca:chunk_size=5,local_size=2,scale=none"), torch.arange(14)[None], 4),
    "string": (_remap("string:shift=4,window=2,scale=none"), torch.arange(10)[None] + 3, 3),
    # a repeated position (positions that never decrease may repeat)
    "self-extend": (
        _remap("self-extend:group=2,window=3"),
        torch.tensor([[0, 1, 2, 2, 3, 4, 5, 6, 7]]),
        2,
    ),
    "two keys": (_remap("rerope:window=1"), torch.arange(2)[None], 1),
    # every band bounded on both sides
    "windows": (
        lambda p: [Band(p, p, lo=p - 2, hi=p + 1), Band(p, p, lo=p - 9, hi=p - 2)],
        torch.arange(12)[None],
        4,
    ),
}


@pytest.mark.parametrize("case", sorted(KEY_RANGE_CASES))
def test_key_ranges_are_the_index_span_of_each_bands_keys(case):
    """Where key positions never decrease, each block reads, per band, exactly the index span
    of the keys the band covers for its rows (an empty range where it covers none); one
    batch row (over a batch the bounds are the loosest of its rows')."""
    make, positions, rows = KEY_RANGE_CASES[case]
    band_list = make(positions)
    T = positions.shape[-1]
    blocks = [(s, min(T, s + rows), min(T, s + rows)) for s in range(0, T, rows)]
    got = bands._key_ranges(band_list, positions, rows, blocks)
    for (start, stop, n), ranges in zip(blocks, got, strict=True):
        for band, (a, b) in zip(band_list, ranges, strict=True):
            hull = _hull(band, positions, start, stop, n)
            assert (a, b) == hull if hull else b <= a, (case, start, (a, b), hull)


def test_key_ranges_of_packed_rows_are_every_key():
    """Positions that restart (packed documents) cannot be searched: every band reads every
    key of the block, and membership alone selects."""
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    band_list = build("rerope:window=2", **SHAPE).bands(positions, positions)
    blocks = [(0, 4, 4), (4, 8, 8)]
    got = bands._key_ranges(band_list, positions, 4, blocks)
    assert got == [[(0, 4), (0, 4)], [(0, 8), (0, 8)]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_reference_kernel_runs_on_the_device_of_its_inputs():
    """Every tensor the reference kernel makes (key-range edges, causal masks) lives on the
    inputs' device: on CUDA it gives what it gives on the CPU."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 10, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    pos = torch.arange(10)[None]
    results = []
    for device in ("cpu", "cuda"):
        enc = build("rerope:window=3", **SHAPE).double().to(device)
        p = pos.to(device)
        out = banded_attention(
            q.to(device), k.to(device), v.to(device), enc.bands(p, p), p, enc.rotate_band,
            kernel="reference", causal_offset=0, block_entries=64,
        )  # fmt: skip
        results.append(out.cpu())
    torch.testing.assert_close(results[1], results[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kernel", ["reference", "fused"])
def test_a_given_logit_scale_replaces_one_over_the_square_root_of_d(kernel):
    enc = build("rerope:window=3", n_heads=4, n_kv_heads=2, head_dim=8, n_layers=1)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 9, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    pos = torch.arange(9)[None]
    band_list = enc.bands(pos, pos)
    got = banded_attention(q, k, v, band_list, pos, enc.rotate_band, scale=0.7, causal_offset=0,
                           kernel=kernel)  # fmt: skip
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    expected = pairwise_attention(q, k, v, band_list, pos, enc.rotate_band, 0.7, causal)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("k_shape", "v_shape"),
    [
        ((1, 2, 6, 8), (1, 2, 5, 8)),  # v is not k's shape
        ((2, 2, 6, 8), (2, 2, 6, 8)),  # another batch
        ((1, 3, 6, 8), (1, 3, 6, 8)),  # 3 key heads do not divide 4 query heads
    ],
)
def test_bad_shapes_and_kernels_are_refused_naming_them(k_shape, v_shape):
    q = torch.zeros(1, 4, 6, 8)
    k, v = torch.zeros(k_shape), torch.zeros(v_shape)
    pos = torch.arange(6)[None]
    band_list = [Band(pos, pos)]
    rotate = build("rope", **SHAPE).rotate_band
    with pytest.raises(ValueError) as info:
        banded_attention(q, k, v, band_list, pos, rotate)
    assert str(info.value) == (
        f"q (1, 4, 6, 8), k {k_shape}, v {v_shape} must be (B, H, T, D) and (B, K, S, D) "
        "with K dividing H"
    )
    with pytest.raises(ValueError, match="kernel='flash' is not allowed; use one of fused, ref"):
        banded_attention(q, q[:, :2], q[:, :2], band_list, pos, rotate, kernel="flash")


def test_no_bands_and_key_positions_not_of_shape_b_s_are_refused_by_their_whole_message():
    q, k = torch.zeros(1, 4, 6, 8), torch.zeros(1, 2, 6, 8)
    pos = torch.arange(6)[None]
    rotate = build("rope", **SHAPE).rotate_band
    with pytest.raises(ValueError) as info:
        banded_attention(q, k, k, [], pos, rotate)
    assert str(info.value) == "banded_attention needs at least one band"
    for kernel in ("fused", "reference"):
        for key_positions in (pos[:, :5], pos[0], pos[None]):
            with pytest.raises(ValueError) as info:
                banded_attention(q, k, k, [Band(pos, pos)], key_positions, rotate, kernel=kernel)
            assert str(info.value) == (
                f"key_positions {tuple(key_positions.shape)} must be (B|1, S) with S = 6"
            )


@pytest.mark.parametrize("kernel", ["fused", "reference"])
def test_rotate_is_told_query_true_for_queries_and_false_for_keys(kernel):
    """``rotate(x, positions, query)`` gets the bool its signature names: True with the
    queries (H heads), False with the keys (K heads), never another falsy value."""
    calls = []

    def rotate(x, positions, query):
        calls.append((x.shape[1], query))
        return _shift(x, positions, query)

    q, k = torch.randn(1, 4, 6, 8, dtype=torch.float64), _keys(S=6)
    pos = torch.arange(6)[None]
    banded_attention(q, k, k, [Band(pos, pos)], pos, rotate, causal_offset=0, kernel=kernel)
    assert {heads for heads, _ in calls} == {4, 2}
    assert all(query is (heads == 4) for heads, query in calls), calls
