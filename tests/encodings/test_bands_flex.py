"""The CUDA band kernel (``encodings/bands_flex.py``). On any machine: its tiles against a
brute-force count of each tile's pairs, its mask functions and merge against the reference
kernel in float64 (FlexAttention's eager reference forward), and its merge's gradients through
a dense definition of what each FlexAttention call computes. On CUDA (``make cuda-check``):
forward and backward within plain RoPE's own error in float32 and half precision, masks,
cached decoding, the float64 fallback, and a decoder's training step and decoding."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from ropekit.encodings import bands, bands_flex, bands_fused
from ropekit.encodings.positions import LastCall

from .conftest import output_and_grads
from .test_bands_fused import LONG, TOL64, _attend, _enc, _qkv, _rows_of, left_padded

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")


def _flex(enc, q, k, v, key_positions, mask=None):
    """bands_flex on any device (the dispatch sends only CUDA tensors to it)."""
    T, S = q.shape[2], k.shape[2]
    band_list = enc.bands(key_positions[:, S - T :], key_positions)
    slots, keys = bands._rotate_keys(k, band_list, enc.rotate_band)
    return bands_flex.flex_banded_attention(
        q, keys, v, band_list, key_positions, enc.rotate_band, slots=slots,
        scale=q.shape[-1] ** -0.5, causal_offset=S - T, mask=mask,
    )  # fmt: skip


# ----------------------------------------------------------------------------- the tiles
def _tile_counts(first, stop, rows, keys, tile):
    """Per band, batch row and (query tile, key tile) of the padded grid: the pairs the band
    covers, and the pairs of real rows the tile has (padded keys count: no band covers them)."""
    n_bands, batch = first.shape[:2]
    j = torch.arange(keys)
    member = (j >= first[..., None]) & (j < stop[..., None])  # (n_bands, B', T, keys)
    nM, nN = rows // tile, keys // tile
    covered = torch.zeros(n_bands, batch, nM, nN, dtype=torch.long)
    size = torch.zeros(nM, nN, dtype=torch.long)
    for t in range(nM):
        for u in range(nN):
            cell = member[..., t * tile : (t + 1) * tile, u * tile : (u + 1) * tile]
            covered[..., t, u] = cell.sum((-1, -2))
            size[t, u] = cell.shape[-1] * cell.shape[-2]
    return covered, size


@pytest.mark.parametrize("spec", LONG)
@pytest.mark.parametrize(("T", "tile"), [(200, 16), (131, 8), (64, 128)])
def test_tiles_are_full_exactly_where_every_pair_is_covered_and_partial_where_some_is(
    spec, T, tile
):
    """Against a brute-force count of each tile's pairs over the padded grid: full iff the
    band covers every pair of the tile's real rows (a padded key is never covered), partial
    iff some but not every pair; offset batch rows, and a prefix whose query rows start past
    the first key (the causal limit cuts tiles on the diagonal)."""
    enc = _enc(spec)
    positions = torch.arange(T)[None] + torch.tensor([[0], [13]])
    for n in (T, T // 3):  # a whole sequence, then its last rows as queries
        band_list = enc.bands(positions[:, T - n :], positions)
        first, stop = bands_fused.index_bounds(band_list, positions, n, T - n)
        rows, keys = -(-n // tile) * tile + tile, -(-T // tile) * tile + tile  # a spare tile
        partial, full = bands_flex.tiles(first, stop, rows, keys, tile)
        covered, size = _tile_counts(first, stop, rows, keys, tile)
        assert torch.equal(full, (covered == size) & (size > 0))
        assert torch.equal(partial, (covered > 0) & (covered < size))


@pytest.mark.parametrize("seed", range(6))
def test_tiles_of_arbitrary_ranges_match_the_count_even_where_a_tile_row_leaves_gaps(seed):
    """Random bounds, not a remap's: rows of one query tile far apart, empty rows, ranges
    ending mid-tile. A tile between two rows' ranges is reached by neither (the difference
    array counts a union of intervals, not its hull). T ends mid-tile, or on a tile's edge with
    a whole tile of padded rows after it."""
    g = torch.Generator().manual_seed(seed)
    T, tile, keys = 36 + seed % 2, 4, 48
    first = torch.randint(0, keys, (2, 3, T), generator=g)
    stop = (first + torch.randint(-3, 14, (2, 3, T), generator=g)).clamp(0, keys - 5)
    partial, full = bands_flex.tiles(first, stop, 40, keys, tile)
    covered, size = _tile_counts(first, stop, 40, keys, tile)
    assert torch.equal(full, (covered == size) & (size > 0))
    assert torch.equal(partial, (covered > 0) & (covered < size))


def test_a_tile_between_two_rows_ranges_is_not_reached():
    first, stop = torch.tensor([[[0, 6]]]), torch.tensor([[[2, 8]]])  # one tile of rows
    partial, full = bands_flex.tiles(first, stop, 2, 8, tile=2)
    assert partial.tolist() == [[[[True, False, False, True]]]] and not full.any()


def test_tiles_of_rows_without_keys_are_never_full_and_a_padded_row_is_no_rows_concern():
    """A row with first >= stop sees nothing: it makes no tile full and reaches none; padded
    rows (past T) neither reach a tile nor keep one from being full."""
    first = torch.tensor([[[0, 0, 5, 5, 0]]])  # (1 band, 1 batch row, T = 5)
    stop = torch.tensor([[[4, 4, 5, 2, 2]]])  # rows 2 and 3: no keys
    partial, full = bands_flex.tiles(first, stop, 6, 6, tile=2)
    assert full.tolist() == [[[[True, True, False], [False, False, False], [True, False, False]]]]
    assert not partial.any()


def test_padded_lengths_are_powers_of_two_of_at_least_one_tile():
    assert [bands_flex.padded(n) for n in (1, 128, 129, 300, 16384, 16385)] == [
        128, 128, 256, 512, 16384, 32768,
    ]  # fmt: skip


def test_the_block_mask_lists_the_partial_and_full_tiles_of_each_row_of_tiles():
    partial = torch.tensor([[[True, False, True], [False, False, False]]])  # (B', nM, nN)
    full = torch.tensor([[[False, True, False], [True, True, False]]])
    block_mask = bands_flex._block_mask(partial, full, lambda b, h, r, j: j >= 0, True)
    for t in (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
              block_mask.full_kv_indices):  # fmt: skip
        assert t.dtype == torch.int32  # what FlexAttention's kernels index with
    assert block_mask.kv_num_blocks.tolist() == [[[2, 0]]]
    assert block_mask.full_kv_num_blocks.tolist() == [[[1, 2]]]
    assert block_mask.kv_indices[0, 0, 0, :2].tolist() == [0, 2]
    assert block_mask.full_kv_indices[0, 0, 0, :1].tolist() == [1]
    assert block_mask.full_kv_indices[0, 0, 1, :2].tolist() == [0, 1]
    assert block_mask.seq_lengths == (256, 384)
    assert block_mask.q_num_blocks is not None  # the backward's lists
    assert bands_flex._block_mask(partial, full, lambda *a: True, False).q_num_blocks is None


# ----------------------------------------------------------------------------- the values
@pytest.mark.parametrize("spec", LONG)
def test_flex_equals_the_reference_kernel_in_float64(spec):
    """The mask functions and the merge, through FlexAttention's eager reference (which
    evaluates the mask on every pair): offset rows, a whole sequence and its last rows."""
    T = 200
    q, k, v = _qkv(T, T, seed=1)
    positions = torch.arange(T)[None] + torch.tensor([[0], [13]])
    enc = _enc(spec)
    for rows in (T, 37, 1):
        got = _flex(enc, q[:, :, T - rows :], k, v, positions)
        expected = _attend(enc, q[:, :, T - rows :], k, v, positions, "reference")
        torch.testing.assert_close(got, expected, **TOL64)


def test_callers_boolean_and_additive_masks_agree_with_the_reference():
    """transformers' masks with left padding: the boolean joins the range test, the additive
    one is added to the logits; rows that see nothing give zeros."""
    enc = _enc("string:shift=30,window=4")
    q, k, v, positions, keep, allowed = left_padded()
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -1e30)
    rows = keep[:, None, :, None]
    for full in (allowed, additive, allowed[0, 0]):
        mask = _rows_of(full)
        got = _flex(enc, q, k, v, positions, mask)
        expected = _attend(enc, q, k, v, positions, "reference", None, mask)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got * rows, expected * rows, **TOL64)
    assert not _flex(enc, q, k, v, positions, _rows_of(allowed))[1, :, :17].any()


def _dense_attend(q, k, v, block_mask, score_mod, scale):
    """What one FlexAttention call computes, written densely (differentiable on any device):
    the mask function on every pair, the score modification on every logit; rows with no key
    give out 0 and lse -inf."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    k, v = (t.repeat_interleave(H // k.shape[1], 1) for t in (k, v))
    b, h = torch.arange(B)[:, None, None, None], torch.arange(H)[None, :, None, None]
    r, j = torch.arange(T)[None, None, :, None], torch.arange(S)[None, None, None, :]
    scores = scale * q @ k.transpose(-1, -2)
    if score_mod is not None:
        scores = score_mod(scores, b, h, r, j)
    scores = scores.masked_fill(~block_mask.mask_mod(b, h, r, j), float("-inf"))
    top = scores.detach().amax(-1, keepdim=True)
    e = (scores - torch.where(torch.isfinite(top), top, 0)).exp()
    total = e.sum(-1).clamp_min(torch.finfo(e.dtype).tiny)
    lse = torch.where(e.sum(-1) > 0, top[..., 0] + total.log(), float("-inf"))
    return (e / total[..., None]) @ v, lse


@pytest.mark.parametrize("spec", LONG)
def test_the_merge_passes_exact_gradients_through_each_bands_out_and_lse(spec, monkeypatch):
    """With each call written densely, output and q/k/v gradients equal the reference
    kernel's in float64: the merge's reference point is held constant for autograd, and the
    gradient of each band's lse carries the rest (module docstring, 3)."""
    monkeypatch.setattr(bands_flex, "_attend", _dense_attend)
    T = 90
    q, k, v = _qkv(T, T, seed=2)
    positions = torch.arange(T)[None] + torch.tensor([[0], [5]])
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    enc = _enc(spec)
    got = output_and_grads(lambda *a: _flex(enc, *a, positions), q, k, v, w)
    expected = output_and_grads(lambda *a: _attend(enc, *a, positions, "reference"), q, k, v, w)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **TOL64)


def test_rows_no_band_reaches_merge_to_zeros_with_zero_gradients():
    outs = [torch.randn(1, 1, 3, 2, requires_grad=True) for _ in range(2)]
    lses = [torch.tensor([[[0.5, float("-inf"), 1.0]]]), torch.full((1, 1, 3), float("-inf"))]
    lses = [t.requires_grad_() for t in lses]
    merged = bands_flex._merge(outs, lses)
    assert torch.equal(merged[0, 0, 1], torch.zeros(2))
    torch.testing.assert_close(merged[0, 0, 0], outs[0][0, 0, 0])
    merged.sum().backward()
    for t in (*outs, *lses):
        assert torch.isfinite(t.grad).all()
    assert not outs[1].grad.any() and not outs[0].grad[0, 0, 1].any()


def test_a_compile_failure_is_named_by_its_first_line_cut_at_160_characters(monkeypatch):
    def fail(*args):
        raise ValueError("x" * 300 + "\nsecond line")

    monkeypatch.setattr(bands_flex, "_failure", [])
    monkeypatch.setattr(bands_flex, "_compiled", lambda key: fail)
    monkeypatch.setattr(bands_flex, "_use_compiled", lambda q: True)
    q, k, v = _qkv(8, 8, seed=5)
    with pytest.raises(bands_flex.Unavailable), pytest.warns(RuntimeWarning):
        _flex(_enc("dca"), q, k, v, torch.arange(8)[None])
    assert bands_flex._failure == ["ValueError: " + "x" * 160]


def test_supported_names_what_the_flex_kernel_cannot_take(monkeypatch):
    """Its device, its dtypes, and a compile failure earlier in the process (queries stood in
    by what ``supported`` reads of them: no GPU here)."""
    assert bands_flex.supported(torch.zeros(1, 1, 4, 16)) == (
        "the FlexAttention band kernel runs on CUDA only (tensors on cpu)"
    )
    on_cuda = lambda dtype: types.SimpleNamespace(device=torch.device("cuda"), dtype=dtype)  # noqa: E731
    assert bands_flex.supported(on_cuda(torch.bfloat16)) is None
    assert bands_flex.supported(on_cuda(torch.float64)) == (
        "the FlexAttention band kernel does not take torch.float64"
    )
    monkeypatch.setattr(bands_flex, "_failure", ["InductorError: no kernel"])
    assert bands_flex.supported(on_cuda(torch.float32)) == (
        "FlexAttention failed to compile here (InductorError: no kernel)"
    )


def test_a_compile_failure_warns_once_and_sends_the_process_to_the_pieces(monkeypatch):
    """Where FlexAttention does not compile, the call and every later one take the fused
    kernel's pieces (here the CPU's), with one warning naming the failure."""

    def broken(key):
        def fail(*args):
            raise RuntimeError("NoValidChoicesError: No choices to select\nmore lines")

        return fail

    monkeypatch.setattr(bands_flex, "_failure", [])
    monkeypatch.setattr(bands_flex, "_compiled", broken)
    monkeypatch.setattr(bands_flex, "_use_compiled", lambda q: True)
    monkeypatch.setattr(bands_flex, "supported", lambda q: (bands_flex._failure or [None])[0])
    enc = _enc("rerope:window=16,leaky=4")
    q, k, v = _qkv(50, 50, seed=5)
    positions = torch.arange(50)[None]
    expected = _attend(enc, q, k, v, positions, "reference")
    warning = (
        r"ropekit: FlexAttention failed to compile \(RuntimeError: NoValidChoicesError: No "
        r"choices to select\); banded attention runs on the fused kernel's pieces instead for "
        r"the rest of the process$"
    )
    with pytest.warns(RuntimeWarning, match=warning) as record:
        first = _attend(enc, q, k, v, positions, "fused")
        again = _attend(enc, q, k, v, positions, "fused")
    assert len([w for w in record if "FlexAttention" in str(w.message)]) == 1
    assert bands_flex._failure == ["RuntimeError: NoValidChoicesError: No choices to select"]
    torch.testing.assert_close(first, expected, **TOL64)
    torch.testing.assert_close(again, expected, **TOL64)
    monkeypatch.setattr(bands_flex, "_failure", [])
    unavailable = r"^RuntimeError: NoValidChoicesError: No "
    with pytest.raises(bands_flex.Unavailable, match=unavailable), pytest.warns(RuntimeWarning):
        _flex(enc, q, k, v, positions)


def test_the_cpu_never_takes_the_flex_kernel(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the flex kernel ran on CPU")

    monkeypatch.setattr(bands_flex, "flex_banded_attention", refuse)
    q, k, v = _qkv(20, 20, seed=3)
    _attend(_enc("dca"), q, k, v, torch.arange(20)[None], "fused")


def test_one_band_over_every_key_is_causal_attention():
    """Plain RoPE as one band (no rotation here): FlexAttention's one call, no merge."""
    q, k, v = _qkv(30, 30, seed=8)
    positions = torch.arange(30)[None]
    band = bands.Band(positions, positions)
    got = bands_flex.flex_banded_attention(
        q, [k], v, [band], positions, lambda x, p, query: x, slots=[0], scale=0.25,
        causal_offset=0, mask=None,
    )  # fmt: skip
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got, expected, **TOL64)


def _call(enc, q, k, v, positions, scale=None, mask=None):
    """flex and the reference kernel on the same call (q the last rows of the keys')."""
    T, S = q.shape[2], k.shape[2]
    band_list = enc.bands(positions[:, S - T :], positions)
    slots, keys = bands._rotate_keys(k, band_list, enc.rotate_band)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    got = bands_flex.flex_banded_attention(
        q, keys, v, band_list, positions, enc.rotate_band, slots=slots, scale=scale,
        causal_offset=S - T, mask=mask,
    )  # fmt: skip
    expected = bands.banded_attention(
        q, k, v, band_list, positions, enc.rotate_band, scale=scale, causal_offset=S - T,
        mask=mask, kernel="reference",
    )  # fmt: skip
    return got, expected


@pytest.mark.parametrize("spec", ["dca", "rerope:window=16,leaky=4"])
def test_a_batch_sharing_its_key_positions_and_a_logit_scale_of_its_own(spec):
    """Two batch rows over one row of positions (the bands' bounds then have one row), and a
    logit scale other than 1/sqrt(D)."""
    q, k, v = _qkv(90, 90, seed=9)
    got, expected = _call(_enc(spec), q, k, v, torch.arange(90)[None], scale=0.3)
    torch.testing.assert_close(got, expected, **TOL64)


@pytest.mark.parametrize(("H", "K"), [(4, 2), (128, 8), (2, 2)])
def test_grouped_heads_over_as_many_keys_as_query_heads(H, K):
    """H query heads over K key heads and H keys (128 of them: as many as the padded keys):
    the grouping is read from the heads."""
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, n, H, 16, generator=g, dtype=torch.float64) for n in (H, K, K))
    got, expected = _call(_enc("string:window=2"), q, k, v, torch.arange(H)[None])
    torch.testing.assert_close(got, expected, **TOL64)


def test_a_callers_mask_of_its_own_per_head_is_read_per_head():
    """A mask that differs between two heads (transformers' masks are per batch row; a
    caller's may be per head): each head reads its own."""
    g = torch.Generator().manual_seed(16)
    q, k, v = (torch.randn(2, n, 40, 16, generator=g, dtype=torch.float64) for n in (2, 1, 1))
    bias = torch.randn(2, 2, 40, 40, generator=g, dtype=torch.float64)
    got, expected = _call(_enc("dca"), q, k, v, torch.arange(40)[None], mask=_rows_of(bias))
    torch.testing.assert_close(got, expected, **TOL64)


@pytest.mark.parametrize(("T", "S"), [(0, 5), (3, 0), (0, 0), (1, 1)])
def test_no_queries_or_no_keys_give_zeros_of_the_output_shape_and_one_key_its_value(T, S):
    enc = _enc("dca")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, T, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, S, 8 + 8 * i, generator=g, dtype=torch.float64) for i in (1, 0))
    k = k[..., :16]
    positions = torch.arange(S)[None]
    band_list = enc.bands(positions[:, S - T :] if T <= S else torch.arange(T)[None], positions)
    got = bands_flex.flex_banded_attention(
        q, [k] * 3, v, band_list, positions, enc.rotate_band, slots=[0, 0, 0], scale=0.25,
        causal_offset=S - T, mask=None,
    )  # fmt: skip
    assert got.shape == (2, 4, T, 8) and got.dtype == v.dtype
    if T and S:  # one query over one key: that key's value
        torch.testing.assert_close(got, v.repeat_interleave(2, 1), **TOL64)
    else:
        assert not got.any()


def test_merge_is_one_softmax_over_the_bands_at_large_and_very_different_lse():
    """Rows whose lse lie thousands of nats apart, each merged on its own scale."""
    g = torch.Generator().manual_seed(1)
    outs = [torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    lses = [torch.tensor([[[0.0, 900.0, -2000.0]] * 2], dtype=torch.float64) + i for i in range(3)]
    merged = bands_flex._merge(outs, lses)
    w = torch.stack(lses).softmax(0)  # (3, 1, 2, 3)
    expected = sum(wb[..., None] * o for wb, o in zip(w, outs, strict=True))
    torch.testing.assert_close(merged, expected, **TOL64)


def _rows_strictly(full: torch.Tensor):
    """A caller's mask function over a full mask that takes integer rows and keys only (what
    transformers' and the decoder's masks are sliced with)."""

    def mask(start, stop, n):
        assert all(isinstance(i, int) for i in (start, stop, n)), (start, stop, n)
        return full[..., start:stop, :n]

    return mask


@pytest.mark.parametrize("rows", [120, 33])
def test_callers_additive_mask_values_are_added_exactly_also_on_a_cache(rows):
    """An additive mask of arbitrary float64 values (an ALiBi-like bias) added to the logits
    as they are, with fewer query rows than keys (decoding over a cache: rows and keys of
    the mask read where they are)."""
    enc = _enc("rerope:window=9,leaky=2.5,logn=true")
    S = 120
    q, k, v = _qkv(rows, S, seed=12)
    g = torch.Generator().manual_seed(13)
    bias = torch.randn(2, 1, rows, S, generator=g, dtype=torch.float64) * 3
    got, expected = _call(enc, q, k, v, torch.arange(S)[None], mask=_rows_strictly(bias))
    torch.testing.assert_close(got, expected, **TOL64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_stays_in_its_dtype_through_the_calls_and_the_output(dtype, monkeypatch):
    """Queries, keys and values reach FlexAttention in the inputs' dtype (the logit scale and
    an additive mask in float32: what its scores are computed in), and the output comes back
    in it, close to the float64 reference."""
    seen = []
    attend = bands_flex._attend

    def spy(q, k, v, block_mask, score_mod, scale):
        seen.append((q.dtype, k.dtype, v.dtype))
        if score_mod is not None:
            zero = torch.zeros((), dtype=torch.float32)
            index = torch.zeros((), dtype=torch.long)
            seen.append(score_mod(zero, index, index, index, index).dtype)
        return attend(q, k, v, block_mask, score_mod, scale)

    monkeypatch.setattr(bands_flex, "_attend", spy)
    enc = _enc("rerope:window=9,leaky=2.5,logn=true")
    T = 64
    q, k, v = _qkv(T, T, seed=14)
    bias = torch.zeros(2, 1, T, T, dtype=torch.float64)
    positions = torch.arange(T)[None]
    exact = _attend(enc, q, k, v, positions, "reference", None, _rows_of(bias))
    low = [t.to(dtype) for t in (q, k, v)]
    got, _ = _call(_enc("rerope:window=9,leaky=2.5,logn=true", dtype), *low, positions,
                   mask=_rows_of(bias))  # fmt: skip
    assert got.dtype == dtype
    assert set(seen) == {(dtype, dtype, dtype), torch.float32}
    tol = 2e-6 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol)


def _masks(layout):
    """What a layout's block masks say: per band (partial counts, full counts, lengths,
    whether the backward's lists are there, whether a score modification is)."""
    return [
        (bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist(), bm.seq_lengths,
         bm.q_num_blocks is not None, score_mod is not None)
        for bm, score_mod in layout
    ]  # fmt: skip


def test_the_layout_is_reused_only_for_the_same_bands_positions_and_call(monkeypatch):
    """Block masks are made once per forward: a call with the very same bands objects, key
    positions (same version), query rows, causal offset and backward gets the last call's
    back; any other call (another caller's mask included) gets its own, made afresh."""
    monkeypatch.setattr(bands_flex, "_last_layout", LastCall())
    T = 300
    pos = torch.arange(T)[None]
    narrow, wide = (
        _enc("rerope:window=4").bands(pos, pos),
        _enc("rerope:window=200").bands(pos, pos),
    )
    layout = bands_flex._layout(narrow, pos, T, 0, None, False)
    fresh = _masks(layout)
    assert bands_flex._layout(narrow, pos, T, 0, None, False) is layout
    partial, full = bands_flex.tiles(*bands_fused.index_bounds(narrow, pos, T, 0), 512, 512)
    assert fresh == [
        (p.sum(-1, dtype=torch.int32)[:, None].tolist(), f.sum(-1)[:, None].tolist(),
         (512, 512), False, False)
        for p, f in zip(partial, full, strict=True)
    ]  # fmt: skip
    assert any(f.any() for f in full)  # full tiles: the mask is skipped there
    others = [
        bands_flex._layout(wide, pos, T, 0, None, False),  # other bands, same positions
        bands_flex._layout(narrow, pos, T, 0, None, True),  # a backward: its lists too
        bands_flex._layout(narrow[:1], pos, T, 0, None, False),  # fewer bands
    ]
    assert all(other is not layout for other in others)
    assert _masks(others[1]) == [(*m[:3], True, False) for m in fresh]
    assert _masks(others[2]) == fresh[:1]
    again = bands_flex._layout(narrow, pos, T, 0, None, False)
    assert again is not layout and _masks(again) == fresh  # planned afresh, the same
    pos.add_(0)  # a new version of the same tensor
    assert bands_flex._layout(narrow, pos, T, 0, None, False) is not again
    caller = torch.ones(1, 1, T, T, dtype=torch.bool)
    with_mask = bands_flex._layout(narrow, pos, T, 0, caller, False)
    reached = [(m[0][0][0][i] + m[1][0][0][i]) for m in fresh for i in range(4)]
    assert [m[0][0][0][i] for m in _masks(with_mask) for i in range(4)] == reached
    assert not any(v for m in _masks(with_mask) for v in m[1][0][0])  # nothing full
    assert bands_flex._layout(narrow, pos, T, 0, caller, False) is not with_mask
    without = bands_flex._layout(narrow, pos, T, 0, None, False)
    assert without is not with_mask and _masks(without) == fresh  # no caller's mask kept


def test_a_forward_with_gradients_makes_the_backwards_lists_and_one_without_does_not(
    monkeypatch,
):
    monkeypatch.setattr(bands_flex, "_last_layout", LastCall())
    monkeypatch.setattr(bands_flex, "_attend", _dense_attend)  # eager FlexAttention: no backward
    enc = _enc("dca")
    q, k, v = _qkv(40, 40, seed=15)
    positions = torch.arange(40)[None]
    with torch.no_grad():
        _flex(enc, q, k, v, positions)
    assert all(bm.q_num_blocks is None for bm, _ in bands_flex._last_layout._entry[3])
    _flex(enc, q, k, v, positions)  # grad mode on, nothing requires a gradient
    assert all(bm.q_num_blocks is None for bm, _ in bands_flex._last_layout._entry[3])
    _flex(enc, q, k, v.requires_grad_(), positions)
    assert all(bm.q_num_blocks is not None for bm, _ in bands_flex._last_layout._entry[3])
