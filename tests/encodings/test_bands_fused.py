"""The fused band kernel (``encodings/bands_fused.py``) held to the reference kernel and to the
pairwise definitions: its plan covers every visible pair exactly once and computes little
more than that; forward and backward equal the reference in float64 to round-off and in
float32 within plain RoPE's own float32 error; cached decoding (token by token, chunked, with
the rotated-key memo), padding masks, offset batches, and the fallback for packed rows."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from ropekit.encodings import banded_attention, bands, bands_fused, build
from ropekit.encodings.positions import LastCall

from .conftest import output_and_grads
from .test_remap import CASES, SHAPE, brute_force

TOL64 = {"rtol": 1e-10, "atol": 1e-10}
# Remaps with their defaults at L0 = 64, so that a few hundred tokens cross every band boundary
# many times (windows, groups, chunks and shifts of 8-64 tokens).
LONG = [
    "rerope:window=16",
    "rerope:window=16,leaky=4",
    "rerope:window=9,leaky=2.5,logn=true",
    "self-extend:group=4,window=16",
    "self-extend:group=4,window=16,mode=llama.cpp",
    "dca",
    "dca:chunk_size=40,local_size=8",
    "string:window=8",
    "string:shift=30,window=4,init=yarn,factor=2",
]
L0 = 64


def _enc(spec: str, dtype=torch.float64):
    return build(spec, **SHAPE, original_length=L0).to(dtype)


def _qkv(T: int, S: int, B: int = 2, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    H, K, D = SHAPE["n_heads"], SHAPE["n_kv_heads"], SHAPE["head_dim"]
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, K, S, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, K, S, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _attend(enc, q, k, v, key_positions, kernel, rows=None, mask=None, memo=None):
    T, S = q.shape[2], k.shape[2]
    q_pos = key_positions[:, S - T :]
    return banded_attention(
        q, k, v, enc.bands(q_pos, key_positions), key_positions, enc.rotate_band,
        causal_offset=S - T, mask=mask, kernel=kernel, block_rows=rows, rotated_keys=memo,
    )  # fmt: skip


# ----------------------------------------------------------------------------- the plan
def _coverage(enc, q_pos, k_pos, rows, fine, monkeypatch):
    """Per band, how often the plan computes each (batch row, query, key) pair, and the
    pairs it computes in all (a triangle counts its half, as the causal kernel skips the
    rest), beside the band's true membership."""
    monkeypatch.setattr(bands_fused, "FINE_ROWS", fine)
    band_list = enc.bands(q_pos, k_pos)
    T, S = q_pos.shape[-1], k_pos.shape[-1]
    first, stop = bands_fused.index_bounds(band_list, k_pos, T, S - T)
    return _count(first, stop, S, rows, fine)


KINDS = (bands_fused.FULL, bands_fused.MASKED, bands_fused.CAUSAL, bands_fused.ANTICAUSAL)


def _count(first, stop, S, rows, fine):
    """``_coverage`` for given key index bounds (n_bands, B', T) over S keys: every piece has
    rows, keys and one of the four kinds."""
    T = first.shape[-1]
    blocks = bands_fused._blocks(first, stop, rows, fine)
    batch = first.shape[1]
    count = torch.zeros(first.shape[0], batch, T, S, dtype=torch.long)
    computed = 0
    j = torch.arange(S)
    for block in blocks:
        for p in block.pieces:
            assert block.start <= p.row_start < p.row_stop <= block.stop
            assert 0 <= p.start < p.stop <= S and p.kind in KINDS, p
            r0, r1, a, z = p.row_start, p.row_stop, p.start, p.stop
            cell = torch.ones(r1 - r0, z - a, dtype=torch.long)
            if p.kind == bands_fused.MASKED:
                lo = first[p.band, :, r0:r1, None]
                hi = stop[p.band, :, r0:r1, None]
                cell = ((j[a:z] >= lo) & (j[a:z] < hi)).long()  # (B', R, n)
            elif p.kind == bands_fused.CAUSAL:
                assert r1 - r0 == z - a
                cell = cell.tril()
            elif p.kind == bands_fused.ANTICAUSAL:
                assert r1 - r0 == z - a
                cell = cell.triu()
            count[p.band, :, r0:r1, a:z] += cell
            n = (r1 - r0) * (z - a)
            computed += n // 2 if p.kind in (bands_fused.CAUSAL, bands_fused.ANTICAUSAL) else n
    member = (j >= first[..., None]) & (j < stop[..., None])  # (n_bands, B', T, S)
    return count, member, computed, blocks


@pytest.mark.parametrize("spec", LONG)
@pytest.mark.parametrize(("rows", "fine"), [(16, 4), (50, 8), (768, 64)])
def test_the_plan_computes_every_visible_pair_of_each_band_exactly_once(
    spec, rows, fine, monkeypatch
):
    enc = _enc(spec)
    S = 300
    for k_pos in (torch.arange(S)[None], torch.arange(S)[None] + torch.tensor([[0], [7]])):
        count, member, _, _ = _coverage(enc, k_pos, k_pos, rows, fine, monkeypatch)
        assert torch.equal(count, member.long()), spec
    # A cached chunk: 40 new queries over 300 keys.
    k_pos = torch.arange(S)[None]
    count, member, _, _ = _coverage(enc, k_pos[:, -40:], k_pos, rows, fine, monkeypatch)
    assert torch.equal(count, member.long())


@pytest.mark.parametrize(
    "spec",
    [
        "rerope", "rerope:leaky=4", "rerope:window=300,leaky=2.5,logn=true", "self-extend",
        "self-extend:mode=llama.cpp", "dca", "string", "string:init=yarn,factor=2",
    ],
)  # fmt: skip
def test_the_plan_computes_little_more_than_the_visible_pairs(spec, monkeypatch):
    """Each pair lies in one band, so the work is one causal attention's plus the narrow
    pieces where a band boundary crosses a block: at most 5% more pairs at 4096 tokens with
    the default block sizes; and at most 5% of them in calls of fewer than 192 query rows
    (where PyTorch's CPU kernel takes small tiles)."""
    enc = build(spec, **SHAPE, original_length=2048)  # the authors' defaults at L0 = 2048
    pos = torch.arange(4096)[None]
    _, member, computed, blocks = _coverage(
        enc, pos, pos, bands_fused.BLOCK_ROWS, bands_fused.FINE_ROWS, monkeypatch
    )
    visible = int(member.sum())
    assert computed <= 1.05 * visible, (computed / visible, spec)
    small = sum(
        (p.row_stop - p.row_start) * (p.stop - p.start)
        for b in blocks
        for p in b.pieces
        if p.row_stop - p.row_start < 192
    )
    assert small <= 0.05 * visible, (small / visible, spec)


def test_a_jump_in_a_bound_starts_a_block(monkeypatch):
    """DCA's chunk starts jump by the chunk length: no block straddles one, so no masked piece
    is as wide as a chunk."""
    enc = _enc("dca:chunk_size=100,local_size=20")  # chunks of 80
    pos = torch.arange(400)[None]
    _, _, _, blocks = _coverage(enc, pos, pos, 64, 8, monkeypatch)
    assert {80, 160, 240, 320} <= {b.start for b in blocks}
    assert not [p for b in blocks for p in b.pieces if p.kind == bands_fused.MASKED]


def test_index_bounds_count_the_keys_before_each_bound_and_the_causal_limit():
    """first_b(r) is the number of keys before the band's lo (none for no lo), stop_b(r) the
    number before its hi (all for no hi) and at most the r + causal_offset + 1 keys the row may
    see (0 to S of them): key indices, int64, whose range is the band's brute-force membership;
    batch rows with their own positions and bounds, offsets that hide every key from early rows
    and that leave late rows past the last key."""
    S, T = 12, 6
    pos = torch.tensor([[0, 1, 1, 2, 4, 5, 5, 5, 7, 8, 9, 11], [*range(3, 15)]])  # (2, S)
    g = torch.Generator().manual_seed(1)
    lo = torch.randint(-2, 14, (2, T), generator=g)
    hi = lo + torch.randint(0, 8, (2, T), generator=g)
    dummy = torch.zeros(1, 1)
    band_list = [
        bands.Band(dummy, dummy, lo, hi),
        bands.Band(dummy, dummy, None, hi[:1]),
        bands.Band(dummy, dummy, lo[1:], None),
        bands.Band(dummy, dummy, None, None),
    ]
    j = torch.arange(S)
    for offset in (None, -4, 0, S - T, S - T + 3):
        first, stop = bands_fused.index_bounds(band_list, pos, T, offset)
        assert first.shape == stop.shape == (4, 2, T)
        assert first.dtype == stop.dtype == torch.long
        for b, band in enumerate(band_list):
            for i, r in itertools.product(range(2), range(T)):
                k = pos[i]
                low = None if band.lo is None else band.lo[min(i, band.lo.shape[0] - 1), r]
                high = None if band.hi is None else band.hi[min(i, band.hi.shape[0] - 1), r]
                want_first = 0 if low is None else int((k < low).sum())
                want_stop = S if high is None else int((k < high).sum())
                if offset is not None:
                    want_stop = min(want_stop, sum(1 for jj in range(S) if jj <= r + offset))
                assert (int(first[b, i, r]), int(stop[b, i, r])) == (want_first, want_stop)
                member = (j <= r + offset) if offset is not None else torch.ones(S, dtype=bool)
                member &= (k >= low) if low is not None else True
                member &= (k < high) if high is not None else True
                assert torch.equal((j >= first[b, i, r]) & (j < stop[b, i, r]), member)


def test_the_plan_covers_bounds_that_differ_between_batch_rows_exactly_once():
    """Boundaries advancing one key per row in each batch row, but from different keys: the
    block's extremes then span more than its rows, so no triangle fits them, and the plan still
    computes every pair once (with no empty piece)."""
    T, S, B = 40, 60, 2
    r = torch.arange(T)
    c = torch.tensor([[0], [3]])
    first = torch.stack([r + c, torch.zeros(B, T, dtype=torch.long), r + c])
    stop = torch.stack([torch.full((B, T), S), r + 1 + c, r + 5 + c])
    for rows, fine in ((16, 4), (40, 64), (7, 1)):
        count, member, _, _ = _count(first, stop, S, rows, fine)
        assert torch.equal(count, member.long()), (rows, fine)


def test_a_band_without_keys_or_without_common_keys_gets_no_empty_piece():
    """A band that covers no key of some block gets no piece there; one whose rows share no key
    (first of the last row = stop of the first) is covered without an empty middle piece."""
    first = torch.tensor([[[5, 5, 5, 5]], [[0, 1, 2, 3]]])
    stop = torch.tensor([[[5, 5, 5, 5]], [[3, 4, 5, 6]]])
    for rows, fine in ((4, 8), (4, 2), (2, 1)):
        count, member, _, blocks = _count(first, stop, 8, rows, fine)
        assert torch.equal(count, member.long())
        assert not [p for b in blocks for p in b.pieces if p.band == 0]


def test_a_jump_between_the_first_two_rows_starts_a_block():
    first = torch.tensor([[[0, 50]]])
    stop = torch.tensor([[[10, 60]]])
    blocks = bands_fused._blocks(first, stop, 768, 8)
    assert [(b.start, b.stop) for b in blocks] == [(0, 1), (1, 2)]


def test_bounds_report_one_key_per_row_from_the_rows_asked_only():
    """``_Bounds(band, s, e)`` says whether first (stop) advance by one key per row over rows
    [s, e) alone: the rows after e do not count."""
    first = torch.tensor([[[0, 1, 2, 3, 3, 3]]])
    bounds = bands_fused._Bounds(first, first + 1)
    assert bounds(0, 0, 4) == (0, 3, 1, 4, True, True)
    assert bounds(0, 0, 5) == (0, 3, 1, 4, False, False)
    assert bounds(0, 3, 6)[4:] == (False, False)


# ----------------------------------------------------------------------------- equal results
@pytest.mark.parametrize(("spec", "remap", "q_scale"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize(("rows", "fine"), [(1, 1), (3, 2), (7, 3), (768, 64)])
def test_fused_equals_the_pairwise_definition_forward_and_backward(
    spec, remap, q_scale, rows, fine, monkeypatch
):
    monkeypatch.setattr(bands_fused, "FINE_ROWS", fine)
    enc = build(spec, **SHAPE).double()
    T = 40
    q, k, v = _qkv(T, T)
    positions = torch.arange(T)[None] + torch.tensor([[0], [5]])
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    grads = []
    for fn in (
        lambda *a: _attend(enc, *a, positions, "fused", rows),
        lambda *a: brute_force(enc, *a, positions, remap, q_scale=q_scale),
    ):
        grads.append(output_and_grads(fn, q, k, v, w))
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected, **TOL64)


@pytest.mark.parametrize("spec", LONG)
def test_fused_equals_the_reference_on_long_offset_rows_forward_and_backward(spec, monkeypatch):
    monkeypatch.setattr(bands_fused, "FINE_ROWS", 8)
    enc = _enc(spec)
    T = 260
    q, k, v = _qkv(T, T, seed=1)
    positions = torch.arange(T)[None] + torch.tensor([[0], [13]])
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    results = []
    for kernel, rows in (("fused", 48), ("fused", None), ("reference", None)):
        attend = lambda *a, kernel=kernel, rows=rows: _attend(enc, *a, positions, kernel, rows)  # noqa: E731
        results.append(output_and_grads(attend, q, k, v, w))
    for fused in results[:2]:
        for got, expected in zip(fused, results[2], strict=True):
            torch.testing.assert_close(got, expected, **TOL64)


def test_fused_passes_gradcheck_in_float64():
    """Fast mode (random projections of the Jacobian) with tolerances 1000x tighter than
    gradcheck's defaults: a key gradient off by 0.1% fails it, which the default slow mode
    (rtol 1e-3) let through, at 1/30 of the slow mode's time."""
    enc = _enc("rerope:window=5,leaky=2,logn=true")
    T = 12
    q, k, v = (t.requires_grad_() for t in _qkv(T, T, B=1, seed=3))
    positions = torch.arange(T)[None]
    assert torch.autograd.gradcheck(
        lambda q, k, v: _attend(enc, q, k, v, positions, "fused", 5),
        (q, k, v),
        fast_mode=True,
        rtol=1e-6,
        atol=1e-8,
    )


@pytest.mark.parametrize("spec", ["rerope:window=16,leaky=4", "dca", "string:window=8"])
def test_float32_error_is_within_plain_ropes_own(spec):
    """Fused float32 against the float64 reference, next to plain RoPE through PyTorch's
    attention in float32 against float64 on the same inputs: the same size of error."""
    enc64, enc32 = _enc(spec), _enc(spec, torch.float32)
    rope64, rope32 = _enc("rope"), _enc("rope", torch.float32)
    T = 300
    q, k, v = _qkv(T, T, seed=4)
    positions = torch.arange(T)[None]
    exact = _attend(enc64, q, k, v, positions, "reference")
    got = _attend(enc32, q.float(), k.float(), v.float(), positions, "fused", 64)
    plain = {
        dtype: F.scaled_dot_product_attention(
            rope.rotate_q(q.to(dtype), positions), rope.rotate_k(k.to(dtype), positions),
            v.to(dtype), is_causal=True, enable_gqa=True,
        )
        for dtype, rope in ((torch.float64, rope64), (torch.float32, rope32))
    }  # fmt: skip
    rope_error = (plain[torch.float32].double() - plain[torch.float64]).abs().max()
    assert (got.double() - exact).abs().max() <= 4 * rope_error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_fused_and_stays_close(dtype):
    enc = _enc("self-extend:group=4,window=16")
    T = 200
    q, k, v = _qkv(T, T, seed=5)
    positions = torch.arange(T)[None]
    exact = _attend(enc, q, k, v, positions, "reference")
    low = _attend(enc.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), positions, "fused", 32)
    assert low.dtype == dtype
    assert (low.double() - exact).abs().max() < 0.05


def _grads(fn, q, k, v, w, dtype):
    """fn's gradients of sum(out * w) with respect to q, k and v given in ``dtype``, as float64."""
    leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
    (fn(*leaves) * w.to(dtype)).sum().backward()
    return [t.grad.double() for t in leaves]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_accumulate_in_float32(dtype):
    """A key's gradients sum one piece per block of query rows (67 blocks of 3 here): summed
    in float32, their RMS errors against float64 stay within 1.2x plain RoPE's own through
    PyTorch's attention in the same precision (0.8-1.05x measured over seeds); summed in half
    precision they are 1.35-1.45x (keys) and more (values)."""
    enc = _enc("self-extend:group=4,window=16")
    T = 200
    q, k, v = _qkv(T, T, B=1, seed=1)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    positions = torch.arange(T)[None]
    # float64 fused: the reference to 1e-10 (the tests above), without its slow first backward
    exact = _grads(lambda *a: _attend(enc, *a, positions, "fused"), q, k, v, w, torch.float64)
    low = _grads(lambda *a: _attend(enc.to(dtype), *a, positions, "fused", 3), q, k, v, w, dtype)
    rope = {d: _enc("rope", d) for d in (dtype, torch.float64)}

    def plain(q, k, v):
        r = rope[q.dtype]
        q, k = r.rotate_q(q, positions), r.rotate_k(k, positions)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    own = [_grads(plain, q, k, v, w, d) for d in (dtype, torch.float64)]

    def rms(a, b):
        return (a - b).pow(2).mean().sqrt()

    for i, name in ((1, "keys"), (2, "values")):
        assert rms(low[i], exact[i]) <= 1.2 * rms(own[0][i], own[1][i]), name


def test_a_logit_scale_other_than_the_default_is_used_forward_and_backward():
    """``scale`` s on the logits, s <q, k>, is the pairwise definition (1/sqrt(D) <q', k>) on
    queries q' = q s sqrt(D); the gradients follow through the same product."""
    spec, remap, _ = CASES[1]
    enc = build(spec, **SHAPE).double()
    T, s = 24, 0.3
    q, k, v = _qkv(T, T, B=1, seed=6)
    positions = torch.arange(T)[None]
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    c = s * math.sqrt(SHAPE["head_dim"])
    results = []
    for fn in (
        lambda q, k, v: banded_attention(
            q, k, v, enc.bands(positions, positions), positions, enc.rotate_band, scale=s,
            causal_offset=0, kernel="fused", block_rows=5,
        ),
        lambda q, k, v: brute_force(enc, q * c, k, v, positions, remap),
    ):  # fmt: skip
        results.append(output_and_grads(fn, q, k, v, w))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, **TOL64)


def left_padded(T: int = 120, pad: int = 17):
    """A batch of two rows of T tokens, the second left-padded by ``pad``: q, k, v (float64),
    its positions (padding at 0), which keys are real (B, S), and transformers' boolean
    causal mask over them (B, 1, T, S)."""
    q, k, v = _qkv(T, T, seed=6)
    positions = (torch.arange(T)[None] - torch.tensor([[0], [pad]])).clamp(min=0)
    keep = torch.ones(2, T, dtype=torch.bool)
    keep[1, :pad] = False
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
    return q, k, v, positions, keep, allowed


def _rows_of(full: torch.Tensor):
    """A caller's mask function over a full (B, 1, T, S) mask."""
    return lambda start, stop, n: full[..., start:stop, :n]


def test_caller_masks_padding_and_additive_agree_with_the_reference():
    """transformers' masks on top of the bands: sdpa's boolean one with left padding (rows
    that see nothing give zeros, not NaN), eager's additive one; forward and backward."""
    enc = _enc("string:shift=30,window=4")
    q, k, v, positions, keep, allowed = left_padded()
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(
        ~allowed, torch.finfo(torch.float64).min
    )
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for full in (allowed, additive):
        mask = _rows_of(full)
        results = []
        for kernel in ("fused", "reference"):
            attend = lambda *a, kernel=kernel, m=mask: _attend(enc, *a, positions, kernel, 32, m)  # noqa: E731
            results.append(output_and_grads(attend, q, k, v, w * keep[:, None, :, None]))
        (out_f, *g_f), (out_r, *g_r) = results
        assert torch.isfinite(out_f).all()
        rows = keep[:, None, :, None]
        torch.testing.assert_close(out_f * rows, out_r * rows, **TOL64)
        for a, b in zip(g_f, g_r, strict=True):
            torch.testing.assert_close(a, b, **TOL64)
    zeros = _attend(enc, q, k, v, positions, "fused", 32, lambda a, b, n: allowed[..., a:b, :n])
    assert not zeros[1, :, :17].any()


# ----------------------------------------------------------------------------- decoding
def _decode(enc, q, k, v, positions, schedules, kernel):
    """Cached decoding with the rotated-key memo after a prefill of 70 tokens, in each
    schedule of step sizes: per step (start, stop, its rows on the fused kernel, the same rows
    of one call over the prefix it has seen on ``kernel``)."""
    rows = None if kernel == "reference" else 32
    for steps in schedules:
        memo, start = bands.RotatedKeys(), 70
        _attend(enc, q[:, :, :start], k[:, :, :start], v[:, :, :start], positions[:, :start],
                "fused", 32, memo=memo)  # fmt: skip
        for n in steps:
            stop = start + n
            got = _attend(enc, q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop],
                          positions[:, :stop], "fused", 32, memo=memo)  # fmt: skip
            prefix = _attend(enc, q[:, :, :stop], k[:, :, :stop], v[:, :, :stop],
                             positions[:, :stop], kernel, rows)  # fmt: skip
            yield start, stop, got, prefix[:, :, start:]
            start = stop


@pytest.mark.parametrize("spec", LONG)
def test_cached_decoding_with_rotated_keys_equals_one_call_over_each_prefix(spec):
    """Token by token and in chunks over a growing cache, with the rotated-key memo the KV
    caches keep: each step equals the last rows of one call over the prefix it has seen (for
    a static remap the rows of one call over the whole sequence too; the length-following
    ones, DCA's scale and STRING's shift, follow the prefix's length)."""
    enc = _enc(spec)
    T = 150
    q, k, v = _qkv(T, T, seed=7)
    positions = torch.arange(T)[None] + torch.tensor([[0], [3]])
    whole = _attend(enc, q, k, v, positions, "fused", 32)
    schedules = ([1] * 20, [37, 1, 1, 50, 2])
    for start, stop, got, prefix in _decode(enc, q, k, v, positions, schedules, "reference"):
        torch.testing.assert_close(got, prefix, **TOL64)
        if not enc.dynamic:
            torch.testing.assert_close(got, whole[:, :, start:stop], **TOL64)
    assert enc.dynamic == (spec in ("dca", "dca:chunk_size=40,local_size=8", "string:window=8"))


def test_rotated_keys_rotate_only_new_keys_and_forget_what_changed():
    enc = _enc("rerope:window=16,leaky=4")
    calls = []

    def counting(x, positions, query):
        if not query:
            calls.append(x.shape[2])
        return enc.rotate_band(x, positions, query)

    q, k, v = _qkv(60, 60, B=1, seed=8)
    pos = torch.arange(60)[None]
    memo = bands.RotatedKeys()

    def step(stop):
        return banded_attention(
            q[:, :, stop - 1 : stop], k[:, :, :stop], v[:, :, :stop],
            enc.bands(pos[:, stop - 1 : stop], pos[:, :stop]), pos[:, :stop], counting,
            causal_offset=stop - 1, rotated_keys=memo,
        )  # fmt: skip

    step(50)
    assert calls == [50, 50]  # two bands, two key positions
    calls.clear()
    step(51)
    assert calls == [1, 1]  # only the new key, per slot
    memo.truncate(40)  # a crop to 40 keys, refilled with other keys at the same positions
    calls.clear()
    k[:, :, 40:] += 1
    got = step(45)
    assert calls == [5, 5]
    expected = banded_attention(
        q[:, :, 44:45], k[:, :, :45], v[:, :, :45], enc.bands(pos[:, 44:45], pos[:, :45]),
        pos[:, :45], enc.rotate_band, causal_offset=44,
    )  # fmt: skip
    torch.testing.assert_close(got, expected, **TOL64)


def test_follow_keeps_prefix_views_and_drops_anything_else():
    """transformers replaces a layer's key tensor on every change: a prefix view of the one
    seen (crop) keeps that many rows; another tensor (reorder) or an in-place edit starts over."""
    enc = _enc("string:window=8")
    k = torch.randn(1, 2, 30, 16, dtype=torch.float64)
    pos = torch.arange(30)[None]
    memo = bands.RotatedKeys()
    memo.rotate(k, [pos], enc.rotate_band)
    memo.seen(k)
    memo.follow(k[:, :, :20])
    assert len(memo) == 20
    memo.seen(k)
    memo.follow(k.index_select(0, torch.tensor([0])))
    assert len(memo) == 0
    memo.rotate(k, [pos], enc.rotate_band)
    memo.seen(k)
    k.mul_(2)
    memo.follow(k)
    assert len(memo) == 0


# ----------------------------------------------------------------------------- fallback
def test_packed_rows_fall_back_to_the_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(bands, "_FALLBACKS", set())
    enc = _enc("self-extend:group=2,window=5")
    q, k, v = _qkv(40, 40, B=1, seed=9)
    positions = torch.cat((torch.arange(25), torch.arange(15)))[None]
    with pytest.warns(RuntimeWarning, match="reference kernel: key positions decrease"):
        got = banded_attention(q, k, v, enc.bands(positions, positions), positions,
                               enc.rotate_band, causal_offset=0)  # fmt: skip
    expected = banded_attention(q, k, v, enc.bands(positions, positions), positions,
                                enc.rotate_band, causal_offset=0, kernel="reference")  # fmt: skip
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_supported_names_what_the_fused_kernel_cannot_take():
    pos = torch.arange(4)[None]
    assert bands_fused.supported(torch.zeros(1, 2, 4, 8), pos) is None
    assert bands_fused.supported(torch.zeros(1, 2, 4, 8, dtype=torch.float16), pos) is None
    assert bands_fused.supported(torch.zeros(1, 2, 4, 8, device="meta"), pos) == (
        "the fused band kernel runs on CPU and CUDA only (tensors on meta)"
    )
    assert bands_fused.supported(torch.zeros(1, 2, 4, 8, dtype=torch.int32), pos) == (
        "the fused band kernel on CPU does not take torch.int32"
    )
    q = torch.zeros(1, 2, 3, 8)
    assert bands_fused.supported(q, torch.tensor([[0, 0, 1]])) is None  # repeats: no decrease
    packed = "key positions decrease along a row (packed documents): no key ranges"
    assert bands_fused.supported(q[:, :, :2], torch.tensor([[1, 0]])) == packed


def test_a_bad_kernel_name_is_refused():
    enc = _enc("string:window=8")
    q, k, v = _qkv(4, 4, B=1)
    pos = torch.arange(4)[None]
    with pytest.raises(ValueError, match="kernel='flash' is not allowed; use one of fused"):
        banded_attention(q, k, v, enc.bands(pos, pos), pos, enc.rotate_band, kernel="flash")
    assert math.isfinite(float(_attend(enc, q, k, v, pos, "fused").sum()))


# ----------------------------------------------------------------------------- the helpers
def test_a_jump_is_a_bound_moving_by_more_than_the_given_keys():
    """``_Bounds.jumps(keys)``: the rows where some bound moves by more than ``keys`` keys
    from the row before; a move of exactly ``keys`` is no jump."""
    first = torch.tensor([[[0, 0, 4, 4, 9, 9]]])  # (1 band, B' = 1, T = 6): moves 4 and 5
    stop = torch.tensor([[[1, 2, 3, 4, 5, 6]]])
    assert bands_fused._Bounds(first, stop).jumps(4) == [4]
    assert bands_fused._Bounds(first, stop).jumps(3) == [2, 4]


def _sub_blocks(monkeypatch, s, e, fine, rows):
    """What ``_split`` returns, and the rows [s', e') of the sub-blocks it hands to _cover."""
    calls = []
    monkeypatch.setattr(
        bands_fused, "_cover", lambda bounds, band, s, e, window, fine: calls.append((s, e)) or []
    )
    return bands_fused._split(None, 0, s, e, (3, 9), fine, rows), calls


def test_split_masks_rows_no_taller_than_fine_and_else_splits_them_for_real(monkeypatch):
    """Rows [s, e) with e - s <= fine are one masked piece over the window; taller ones go to
    _cover in sub-blocks of about ``rows`` rows, at most e - s - 1 (a real split, not the
    rows again) and at least one."""
    pieces, calls = _sub_blocks(monkeypatch, 10, 14, 4, 2)  # 4 rows, fine = 4
    assert pieces == [bands_fused._Piece(0, 10, 14, 3, 9, bands_fused.MASKED)] and not calls
    for rows, expected in ((100, [(10, 11), (11, 13)]), (2, [(10, 11), (11, 13)])):
        assert _sub_blocks(monkeypatch, 10, 13, 1, rows)[1] == expected, rows
    assert _sub_blocks(monkeypatch, 10, 13, 1, 1)[1] == [(10, 11), (11, 12), (12, 13)]
    assert _sub_blocks(monkeypatch, 10, 13, 1, 0)[1] == [(10, 11), (11, 12), (12, 13)]


def test_only_an_unmasked_triangle_takes_the_kernels_causal_path():
    """A causal or anticausal piece runs on the kernel's causal path (anticausal with rows
    and keys reversed) unless the caller has a mask, which it then carries as a mask;
    other pieces never do."""
    plain = bands_fused._Plan((), torch.zeros(0), torch.zeros(0), None, 1.0, ())
    masked = dataclasses.replace(plain, mask=lambda s, e, n: None)
    kinds = (bands_fused.FULL, bands_fused.MASKED, bands_fused.CAUSAL, bands_fused.ANTICAUSAL)
    got = {
        (kind, plan.mask is None): bands_fused._triangle(
            plan, bands_fused._Piece(0, 0, 4, 0, 3, kind)
        )
        for kind in kinds
        for plan in (plain, masked)
    }
    assert got == {
        (bands_fused.FULL, True): (False, False),
        (bands_fused.MASKED, True): (False, False),
        (bands_fused.CAUSAL, True): (True, False),
        (bands_fused.ANTICAUSAL, True): (True, True),
        **{(kind, False): (False, False) for kind in kinds},
    }


def _piece_of(logits, v, rows, keys):
    """A piece's (row start, row stop, out, lse) from its logits, by plain softmax."""
    x = logits[:, :, rows[0] : rows[1], keys[0] : keys[1]]
    return (*rows, x.softmax(-1) @ v[:, :, keys[0] : keys[1]], x.logsumexp(-1))


def test_merge_is_one_softmax_over_the_union_of_the_pieces_even_at_large_logits():
    """Pieces over disjoint keys (some rows seeing only some of them), logits near +-1000
    where exp over- or underflows unless shifted by the row's largest lse: the merge equals
    one softmax (and logsumexp) per row over the keys its pieces cover."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 2, 4, 7, generator=g, dtype=torch.float64)
    logits = logits + torch.tensor([1000.0, -1000.0], dtype=torch.float64)[:, None, None]
    v = torch.randn(1, 2, 7, 3, generator=g, dtype=torch.float64)
    parts = [
        _piece_of(logits, v, (0, 4), (0, 3)),
        _piece_of(logits, v, (1, 3), (3, 5)),  # rows 0 and 3 do not see keys 3 and 4
        _piece_of(logits, v, (2, 4), (5, 7)),
    ]
    seen = torch.zeros(4, 7, dtype=torch.bool)
    seen[:, :3] = seen[1:3, 3:5] = seen[2:, 5:] = True
    x = logits.masked_fill(~seen, float("-inf"))
    out, lse = bands_fused._merge(parts, 4)
    torch.testing.assert_close(out, x.softmax(-1) @ v, **TOL64)
    torch.testing.assert_close(lse, x.logsumexp(-1), **TOL64)


def test_merge_gives_zeros_and_lse_minus_inf_to_rows_no_piece_covers():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 2, 4, 5, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 5, 3, generator=g, dtype=torch.float64)
    a, b, o, m = _piece_of(logits, v, (1, 3), (0, 5))
    out, lse = bands_fused._merge([(a, b, o, m)], 4)
    torch.testing.assert_close(out[:, :, 1:3], o, **TOL64)
    torch.testing.assert_close(lse[:, :, 1:3], m, **TOL64)
    assert not out[:, :, [0, 3]].any()
    assert bool((lse[:, :, [0, 3]] == float("-inf")).all())


def test_merge_passes_a_lone_piece_over_the_whole_block_through_without_buffers():
    """One piece covering all of a block's rows is already the softmax over the row: its out
    and lse are returned as they are, no merge buffers allocated."""
    o, m = torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4)
    out, lse = bands_fused._merge([(0, 4, o, m)], 4)
    assert out is o and lse is m


def test_the_layout_is_reused_only_for_the_same_bands_positions_and_block_rows(monkeypatch):
    """``_layout`` plans once per forward: a call with the very same bands objects, key
    positions (at the same version), query count, causal offset and block rows gets the last
    call's layout back; any other call is planned afresh."""
    monkeypatch.setattr(bands_fused, "_last_layout", LastCall())
    pos = torch.arange(40)[None]
    narrow, wide = _enc("rerope:window=4").bands(pos, pos), _enc("rerope:window=16").bands(pos, pos)

    def fresh(band_list, rows):
        first, stop = bands_fused.index_bounds(band_list, pos, 40, 0)
        return first, stop, bands_fused._blocks(first, stop, rows, bands_fused.FINE_ROWS)

    def check(got, band_list, rows):
        for a, b in zip(got, fresh(band_list, rows), strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, rows

    layout = bands_fused._layout(narrow, pos, 40, 0, 8)
    check(layout, narrow, 8)
    assert bands_fused._layout(narrow, pos, 40, 0, 8) is layout
    check(bands_fused._layout(narrow, pos, 40, 0, 16), narrow, 16)  # other block rows
    check(bands_fused._layout(wide, pos, 40, 0, 16), wide, 16)  # other bands, same positions
    check(bands_fused._layout(narrow, pos, 40, 0, 16), narrow, 16)  # back again


def test_block_rows_below_one_are_refused_by_their_whole_message():
    enc = _enc("rope")
    q, k, v = _qkv(4, 4, B=1)
    pos = torch.arange(4)[None]
    for rows in (0, -3):
        with pytest.raises(ValueError) as info:
            _attend(enc, q, k, v, pos, "fused", rows)
        assert str(info.value) == f"block_rows={rows} is not allowed; it must be >= 1"


def test_a_single_key_is_each_rows_whole_attention():
    """With one key and no causal limit every row's softmax is 1 on it: the output is that
    key's value, in every query head of its group."""
    enc = _enc("rerope:window=4")
    q, k, v = _qkv(5, 1)
    pos, q_pos = torch.arange(1)[None], torch.arange(5)[None]
    out = banded_attention(q, k, v, enc.bands(q_pos, pos), pos, enc.rotate_band, kernel="fused")
    group = SHAPE["n_heads"] // SHAPE["n_kv_heads"]
    expected = v.repeat_interleave(group, dim=1).expand_as(out)
    torch.testing.assert_close(out, expected, **TOL64)


@pytest.mark.parametrize("causal_offset", [None, 0])
def test_no_keys_give_zeros_that_keep_no_graph_as_the_reference(causal_offset):
    """Over zero keys every row sees nothing: zeros, as the reference kernel gives, and like
    its zeros they depend on no input, so no graph (and nothing saved for a backward) is kept
    even when the inputs require gradients."""
    enc = _enc("rerope:window=4")
    q, k, v = (t.requires_grad_() for t in _qkv(4, 0))
    pos, q_pos = torch.arange(0)[None], torch.arange(4)[None]
    for kernel in ("fused", "reference"):
        out = banded_attention(
            q, k, v, enc.bands(q_pos, pos), pos, enc.rotate_band, causal_offset=causal_offset,
            kernel=kernel,
        )  # fmt: skip
        assert out.shape == q.shape and not out.any(), kernel
        assert out.grad_fn is None and not out.requires_grad, kernel


def test_rows_the_callers_mask_hides_from_every_key_give_zeros_in_a_one_piece_block():
    """Without a causal limit one band over every key is one piece per block, its kernel
    output returned as it is: rows that the caller's mask hides from every key (padding
    queries) are still zeros there, and the other rows equal the reference."""
    enc = _enc("rope")
    q, k, v = _qkv(6, 6)
    pos = torch.arange(6)[None]
    allowed = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    allowed[0, :, 2] = allowed[1, :, 0] = False

    def mask(start, stop, n):
        return allowed[..., start:stop, :n]

    out = {
        kernel: banded_attention(
            q, k, v, enc.bands(pos, pos), pos, enc.rotate_band, mask=mask, kernel=kernel
        )
        for kernel in ("fused", "reference")
    }
    assert not out["fused"][0, :, 2].any() and not out["fused"][1, :, 0].any()
    torch.testing.assert_close(out["fused"], out["reference"], **TOL64)


def test_a_callers_mask_of_n_key_columns_and_of_another_float_dtype_is_used():
    """``mask(start, stop, n)`` is asked for keys [0, n) (a mask built from n works) and may
    be additive in float64 over float32 inputs: the result is the reference's."""
    enc = _enc("string:window=8", torch.float32)
    q, k, v = (t.float() for t in _qkv(50, 50, seed=2))
    pos = torch.arange(50)[None]

    def mask(start, stop, n):
        hidden = (torch.arange(start, stop)[:, None] + torch.arange(n)) % 3 == 0
        return torch.zeros(stop - start, n, dtype=torch.float64).masked_fill(hidden, -2.0)

    out = [_attend(enc, q, k, v, pos, kernel, 8, mask) for kernel in ("fused", "reference")]
    assert out[0].dtype == torch.float32
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H", [6, 4, 2])
@pytest.mark.parametrize("n", [16, 21])
def test_the_cuda_inputs_repeat_key_heads_in_order_and_align_the_mask(n, H):
    """What the CUDA op is handed (checked on any device): query head h reads key/value head
    h // (H / K) (groups of 3, of 2, and of 1), and the mask is the piece's mask expanded to
    (B, H, R, n) on a row stride that is a multiple of 16 elements."""
    B, K, R, D = 2, 2, 5, 8
    q = torch.randn(B, H, R, D)
    k, v = torch.randn(B, K, n, D), torch.randn(B, K, n, D)
    mask = torch.randn(B, 1, R, n)
    k2, v2, bias = bands_fused._cuda_inputs(q, k, v, mask)
    assert k2.shape == v2.shape == (B, H, n, D)
    for h in range(H):
        g = H // K
        assert torch.equal(k2[:, h], k[:, h // g]) and torch.equal(v2[:, h], v[:, h // g])
    assert bias.shape == (B, H, R, n) and bias.stride(-2) % 16 == 0 and bias.stride(-1) == 1
    assert torch.equal(bias, mask.expand(B, H, R, n))
    assert bands_fused._cuda_inputs(q, k, v, None)[2] is None
