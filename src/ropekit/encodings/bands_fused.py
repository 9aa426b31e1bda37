"""The fast path of banded attention: each band on a fused attention kernel, merged by
log-sum-exp.

Shape legend: B batch · H query heads · K key/value heads · T query length · S key length ·
D head dim · R query rows in one block · n keys in one piece · B' the batch the band bounds
broadcast to (1 or B).

``bands.py`` defines what is computed (every pair's logit from the one band that covers it,
one softmax per query row) and keeps the block-by-block eager kernel as the reference. This
module computes the same thing at the speed of ordinary attention:

1. *Key ranges.* With key positions that never decrease along a row (no packed documents),
   band b covers for query row r a contiguous range of key indices
   first_b(r) <= j < stop_b(r) (``searchsorted`` of its position bounds; the causal limit
   j <= r + causal_offset folded into stop).
2. *Blocks and pieces.* Query rows go in blocks of about ``BLOCK_ROWS`` (a new block also
   starts where a bound jumps by more than a block, e.g. at a DCA chunk boundary). Within a
   block a band's keys are at most three *pieces*: the range every row of the block sees
   (no mask at all), and on each side the few keys some rows see and others do not (a mask
   of the block's rows over those keys; its width is the bound's drift over the block, about
   R keys for a seam at a fixed distance). So each query-key pair is computed once, and
   twice only in the narrow pieces where a band boundary crosses the block.
3. *Fused calls.* Every piece is one call of a fused attention kernel that returns its
   outputs and the log-sum-exp of its logits, lse_p: on CPU PyTorch's flash-attention op
   (``_scaled_dot_product_flash_attention_for_cpu``; grouped queries are native to it), on
   CUDA the memory-efficient op (``_scaled_dot_product_efficient_attention``, the CUDA kernel
   that takes an additive mask and float32 as well as half precision; key/value heads are
   repeated for grouped queries, and its gradients summed back over each group).
4. *Exact merge.* With m = max_p lse_p: out = sum_p exp(lse_p - m) out_p / sum_p exp(lse_p - m)
   and lse = m + ln sum_p exp(lse_p - m), the merge FlashAttention uses across key blocks
   (Dao et al. 2022, sec. 3.1) and ring attention across devices. It is exact: the pieces
   partition each row's keys, so this is one softmax over the row.
5. *Backward* (``_FusedBands``): the gradient of one softmax over the row, piece by piece.
   For piece p, with P_p = exp(scale q k_p^T + mask_p - lse) (the row's final lse) and
   delta = rowsum(dO * O) (the merged output), dV_p = P_p^T dO and
   dS_p = P_p * (dO V_p^T - delta): exactly what the kernel's own backward computes when it
   is handed the merged output and lse (``..._backward``), so each piece's gradients
   are one backward call and sum into q, k and v. Nothing of size (T, S) is kept: only the
   rotated q and k, v, the output and its lse (what plain flash attention keeps).

Rows that see no key (padding) give zeros, as the reference does: the kernel returns lse 0
for a fully masked row, so such rows' lse is set to -inf before the merge (+inf in backward,
so their weights are exp(-inf) = 0 there too).

On CUDA, ``bands.banded_attention`` first takes ``bands_flex`` (each band one FlexAttention
call over the tiles it reaches: fewer launches, no logit of a skipped tile), and this module's
pieces where FlexAttention cannot be compiled.

Limits: the CPU op takes float64, float32, bfloat16 and float16, the CUDA op all but float64;
other devices have no kernel here; key ranges need non-decreasing key positions.
``bands.banded_attention`` checks ``supported`` and otherwise takes the reference kernel, with
one warning naming why.

Holds: BLOCK_ROWS, FINE_ROWS, supported, why_no_ranges, index_bounds, band_queries,
fused_banded_attention.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .positions import LastCall

# Query rows per block. PyTorch's CPU flash kernel splits queries into tiles of 256 rows once
# a call has >= 768 of them (64 below), and the narrow masked pieces cost about R / S of the
# work; measured here (one thread, 16k tokens, causal attention as blocks of R rows over their
# visible keys, against one causal call): R = 512 1.02-1.16x, R = 768 1.06-1.08x, R = 1024
# 1.06-1.30x (small and SmolLM2-shaped heads).
BLOCK_ROWS = 768
# Query rows per sub-block where a band boundary crosses a block: a boundary at a fixed
# distance (a seam, the causal diagonal) then costs masked pieces of about FINE_ROWS^2 pairs
# per sub-block instead of BLOCK_ROWS^2 per block.
FINE_ROWS = 64

# The dtypes each device's kernel takes (module docstring, 3).
_DTYPES = {
    "cpu": (torch.float64, torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.float32, torch.bfloat16, torch.float16),
}
_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_cuda_efficient = torch.ops.aten._scaled_dot_product_efficient_attention
_cuda_efficient_backward = torch.ops.aten._scaled_dot_product_efficient_attention_backward
# The CUDA op reads its bias with a row stride that must be a multiple of 16 elements (what
# F.scaled_dot_product_attention pads masks to) and pads its lse rows to a multiple of 32.
_BIAS_ALIGN, _LSE_ALIGN = 16, 32


def supported(q: Tensor, key_positions: Tensor) -> str | None:
    """None when the fused path can compute this call; else why not (one short phrase)."""
    device = q.device.type
    if device not in _DTYPES:
        return f"the fused band kernel runs on CPU and CUDA only (tensors on {device})"
    if q.dtype not in _DTYPES[device]:
        return f"the fused band kernel on {device.upper()} does not take {q.dtype}"
    return why_no_ranges(key_positions)


def why_no_ranges(key_positions: Tensor) -> str | None:
    """None when every band's keys are one index range per query row (key positions that
    never decrease along a row); else why not."""
    S = key_positions.shape[-1]
    if S > 1 and not bool((key_positions[:, 1:] >= key_positions[:, :-1]).all()):
        return "key positions decrease along a row (packed documents): no key ranges"
    return None


# What selects the keys of a piece (module docstring, 2): nothing (every row sees every key),
# the band's per-row bounds as a mask, or a triangle of a square piece on the kernel's own
# causal path (row i sees keys j <= i) or, with rows and keys reversed, j >= i.
FULL, MASKED, CAUSAL, ANTICAUSAL = "full", "masked", "causal", "anticausal"


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Query rows [row_start, row_stop) of band ``band`` over keys [start, stop), selected as
    ``kind`` says."""

    band: int
    row_start: int
    row_stop: int
    start: int
    stop: int
    kind: str


@dataclasses.dataclass(frozen=True)
class _Block:
    """Query rows [start, stop) and the pieces they attend to (merged together)."""

    start: int
    stop: int
    pieces: tuple[_Piece, ...]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a call computes, shared by its forward and backward: the blocks, each band's
    per-row key index bounds (n_bands, B', T), the caller's mask and the logit scale."""

    blocks: tuple[_Block, ...]
    first: Tensor
    stop: Tensor
    mask: Callable[[int, int, int], Tensor | None] | None
    scale: float
    slots: tuple[int, ...]  # band -> index of its rotated keys (bands sharing key positions)


def index_bounds(
    bands: Sequence[Any], key_positions: Tensor, T: int, causal_offset: int | None
) -> tuple[Tensor, Tensor]:
    """first, stop (n_bands, B', T) int64: band b covers key indices first <= j < stop of query
    row r (its position bounds found by binary search in the sorted key positions; the causal
    limit j <= r + causal_offset folded into stop)."""
    S = key_positions.shape[-1]
    bounds = [t for band in bands for t in (band.lo, band.hi) if t is not None]
    batch = max([key_positions.shape[0], *(t.shape[0] for t in bounds)])
    keys = key_positions.expand(batch, S).contiguous()
    device = key_positions.device
    limit = torch.full((T,), S, dtype=torch.long, device=device)
    if causal_offset is not None:
        limit = (torch.arange(T, device=device) + causal_offset + 1).clamp_(0, S)  # (T,)

    def search(bound: Tensor | None, default: Tensor) -> Tensor:
        if bound is None:
            return default.expand(batch, T)
        wanted = bound.to(keys.dtype).expand(batch, T).contiguous()
        return torch.searchsorted(keys, wanted)  # (B', T): first index with position >= bound

    zero = torch.zeros((), dtype=torch.long, device=device)
    first = torch.stack([search(band.lo, zero) for band in bands])  # (n_bands, B', T)
    stop = torch.stack([torch.minimum(search(band.hi, limit), limit) for band in bands])
    return first, stop


def _spans(jumps: list[int], T: int, rows: int) -> list[tuple[int, int]]:
    """Row spans of about ``rows`` rows, a new one at each row in ``jumps``."""
    spans = []
    for a, b in itertools.pairwise([0, *jumps, T]):
        n = max(1, math.ceil((b - a) / rows))
        edges = [a + (b - a) * i // n for i in range(n + 1)]
        spans += list(itertools.pairwise(edges))
    return spans


class _Bounds:
    """The bands' per-row key bounds reduced over the batch, on the host, to plan with.

    For band b and rows [s, e): the lowest and highest first, the lowest and highest stop, and
    whether first (and stop) advance by exactly one key per row in every batch row there (a
    boundary at a fixed distance: a seam, the causal diagonal)."""

    def __init__(self, first: Tensor, stop: Tensor) -> None:
        # planning reads these row by row in Python: on the host, whatever the inputs' device
        self.lows = torch.stack([first.amin(1), stop.amin(1)]).cpu().numpy()  # (2, n_bands, T)
        self.highs = torch.stack([first.amax(1), stop.amax(1)]).cpu().numpy()
        steps = torch.stack([first.diff(), stop.diff()])  # (2, n_bands, B', T - 1)
        self.unit = (steps == 1).all(2).cpu().numpy()  # (2, n_bands, T - 1)

    def jumps(self, keys: int) -> list[int]:
        """Rows where some bound moves by more than ``keys`` keys from the row before."""
        lows, highs = torch.from_numpy(self.lows), torch.from_numpy(self.highs)
        drift = torch.cat([lows.diff(), highs.diff()]).abs() > keys  # (4, n_bands, T - 1)
        return (torch.nonzero(drift.flatten(0, 1).any(0)).flatten() + 1).tolist()

    def __call__(self, band: int, s: int, e: int) -> tuple[int, int, int, int, bool, bool]:
        lows, highs, unit = self.lows[:, band, s:e], self.highs[:, band, s:e], self.unit
        return (
            int(lows[0].min()), int(highs[0].max()), int(lows[1].min()), int(highs[1].max()),
            bool(unit[0, band, s : e - 1].all()), bool(unit[1, band, s : e - 1].all()),
        )  # fmt: skip


def _cover(
    bounds: _Bounds, band: int, s: int, e: int, window: tuple[int, int], fine: int
) -> list[_Piece]:
    """The pieces of band ``band`` for rows [s, e) over the keys in ``window`` (module
    docstring, 2): the keys every row sees as one unmasked piece; on either side, where a
    band boundary crosses the rows, one triangle on the kernel's causal path when the
    boundary advances one key per row (a seam, the causal diagonal), else the same split again
    on sub-blocks, down to masked pieces of at most ``fine`` rows."""
    a_lo, a_hi, z_lo, z_hi, a_unit, z_unit = bounds(band, s, e)
    lo, hi = max(a_lo, window[0]), min(z_hi, window[1])
    if hi <= lo:
        return []  # no row has a key of this band in the window
    n_rows = e - s
    inner = (max(a_hi, lo), min(z_lo, hi))  # keys seen by every row
    if inner[0] >= inner[1]:
        if n_rows <= fine:
            return [_Piece(band, s, e, lo, hi, MASKED)]
        # A band narrower than the rows (ReRoPE's near band in long blocks): sub-blocks about
        # as tall as it is wide have an unmasked middle and two triangles each.
        width = z_lo - a_lo if a_unit and z_unit else 0
        return _split(bounds, band, s, e, (lo, hi), fine, min(max(fine, width), n_rows - 1))
    pieces = [_Piece(band, s, e, *inner, FULL)]
    # Left: row s + i sees keys [a_lo + i, a_hi) (upper triangle); right: [z_lo, z_lo + i)
    # (strictly lower): squares of R - 1 rows and keys, the kernel's own causal path.
    if lo < inner[0]:
        if a_unit and (lo, inner[0]) == (a_lo, a_hi) and a_hi - a_lo == n_rows - 1:
            pieces.append(_Piece(band, s, e - 1, a_lo, a_hi, ANTICAUSAL))
        else:
            pieces += _split(bounds, band, s, e, (lo, inner[0]), fine, fine)
    if inner[1] < hi:
        if z_unit and (inner[1], hi) == (z_lo, z_hi) and z_hi - z_lo == n_rows - 1:
            pieces.append(_Piece(band, s + 1, e, z_lo, z_hi, CAUSAL))
        else:
            pieces += _split(bounds, band, s, e, (inner[1], hi), fine, fine)
    return pieces


def _split(
    bounds: _Bounds, band: int, s: int, e: int, window: tuple[int, int], fine: int, rows: int
) -> list[_Piece]:
    """``_cover`` of sub-blocks of about ``rows`` rows (at most e - s - 1: a real split)."""
    if e - s <= fine:
        return [_Piece(band, s, e, *window, MASKED)]
    rows = max(1, min(rows, e - s - 1))
    return [
        piece
        for a, b in _spans([], e - s, rows)
        for piece in _cover(bounds, band, s + a, s + b, window, fine)
    ]


def _blocks(first: Tensor, stop: Tensor, rows: int, fine: int) -> tuple[_Block, ...]:
    """Blocks of about ``rows`` query rows and each band's pieces in them (``_cover``). A
    bound that jumps by more than ``fine`` keys from one row to the next (a DCA chunk
    boundary, llama.cpp's grouped blocks) starts a block, so that no block straddles it."""
    T = first.shape[-1]
    bounds = _Bounds(first, stop)
    spans = _spans(bounds.jumps(fine) if T > 1 else [], T, rows)
    window = (0, torch.iinfo(torch.int64).max)
    return tuple(
        _Block(s, e, tuple(p for band in range(first.shape[0]) for p in _cover(
            bounds, band, s, e, window, fine)))
        for s, e in spans
    )  # fmt: skip


def _piece_mask(plan: _Plan, piece: _Piece, dtype: torch.dtype) -> Tensor | None:
    """The additive mask (B'|B, 1|H, R, n) of one piece in ``dtype`` (the kernel wants the
    queries' dtype): the band's bounds where the piece is masked, and the caller's mask."""
    s, e, a, z = piece.row_start, piece.row_stop, piece.start, piece.stop
    visible = None
    device = plan.first.device
    if piece.kind == MASKED:
        j = torch.arange(a, z, device=device)  # (n,)
        first = plan.first[piece.band, :, s:e, None]  # (B', R, 1)
        stop = plan.stop[piece.band, :, s:e, None]
        visible = ((j >= first) & (j < stop))[:, None]  # (B', 1, R, n)
    elif piece.kind in (CAUSAL, ANTICAUSAL):  # with a caller's mask: the triangle as a mask
        square = torch.ones(e - s, z - a, dtype=torch.bool, device=device)
        visible = square.tril() if piece.kind == CAUSAL else square.triu()  # (R, n)
    caller = None if plan.mask is None else plan.mask(s, e, z)
    if caller is not None:
        caller = caller[..., a:z]
        if caller.dtype == torch.bool:
            visible = caller if visible is None else visible & caller
            caller = None
    if visible is None and caller is None:
        return None
    additive = torch.zeros((), dtype=dtype, device=plan.first.device)
    if visible is not None:
        additive = additive.masked_fill(~visible, float("-inf"))
    if caller is not None:
        additive = additive + caller.to(dtype)
    return additive


def _seen(mask: Tensor | None) -> Tensor | None:
    """Which rows (B'|B, 1|H, R) of a piece see at least one key; None: all of them."""
    return None if mask is None else (mask > float("-inf")).any(-1)


def _forward(
    plan: _Plan, queries: Sequence[Tensor], keys: Sequence[Tensor], v: Tensor
) -> tuple[Tensor, Tensor]:
    """out (B, H, T, D) in v's dtype and its lse (B, H, T) (float32; float64 for float64)."""
    B, H, T, D = queries[0].shape
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    out = v.new_zeros(B, H, T, D)
    lse = torch.full((B, H, T), float("-inf"), dtype=acc, device=v.device)
    for block in plan.blocks:
        parts = []
        for piece in block.pieces:
            s, e, a, z = piece.row_start, piece.row_stop, piece.start, piece.stop
            q, k = queries[piece.band], keys[plan.slots[piece.band]]
            o, m = _attend(plan, piece, q[:, :, s:e], k[:, :, a:z], v[:, :, a:z])
            parts.append((s - block.start, e - block.start, o, m.to(acc)))
        if parts:
            o, m = _merge(parts, block.stop - block.start)
            out[:, :, block.start : block.stop] = o
            lse[:, :, block.start : block.stop] = m
    return out, lse


def _triangle(plan: _Plan, piece: _Piece) -> tuple[bool, bool]:
    """(on the kernel's causal path, with rows and keys reversed) for this piece."""
    fast = piece.kind in (CAUSAL, ANTICAUSAL) and plan.mask is None
    return fast, fast and piece.kind == ANTICAUSAL


def _attend(plan: _Plan, piece: _Piece, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """One piece on the kernel: out (B, H, R, D) and lse (B, H, R); rows that see no key get
    out 0 and lse -inf, whatever the kernel returns there. An upper triangle (j >= i) is the
    causal one of the reversed rows and keys."""
    causal, flip = _triangle(plan, piece)
    if causal:
        if flip:
            q, k, v = q.flip(2), k.flip(2), v.flip(2)
        o, m = _kernel(q, k, v, None, True, plan.scale)
        return (o.flip(2), m.flip(-1)) if flip else (o, m)
    mask = _piece_mask(plan, piece, q.dtype)
    o, m = _kernel(q, k, v, mask, False, plan.scale)
    seen = _seen(mask)
    if seen is not None:
        o = o.masked_fill(~seen[..., None], 0.0)
        m = m.masked_fill(~seen, float("-inf"))  # the CPU kernel's lse is 0 there
    return o, m


def _attend_backward(
    plan: _Plan, piece: _Piece, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The kernel's backward of one piece given the block's merged out and lse (module
    docstring, 5): (dq, dk, dv) of the piece's rows and keys."""
    causal, flip = _triangle(plan, piece)
    mask = None if causal else _piece_mask(plan, piece, q.dtype)
    if flip:
        grad, q, k, v, out, lse = (t.flip(-2) for t in (grad, q, k, v, out, lse[..., None]))
        lse = lse[..., 0]
    gq, gk, gv = _kernel_backward(grad, q, k, v, out, lse, mask, causal, plan.scale)
    return (gq.flip(2), gk.flip(2), gv.flip(2)) if flip else (gq, gk, gv)


def _kernel(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """One fused attention call on the inputs' device: queries (B, H, R, D) over keys and
    values (B, K, n, D), the additive ``mask`` broadcastable to (B, H, R, n) or None, row i
    seeing keys j <= i only where ``causal``. Returns out (B, H, R, D) and lse (B, H, R)."""
    if q.device.type != "cuda":  # pragma: no mutate (CUDA only, see below)
        return _cpu_flash(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    # pragma: no mutate block (CUDA only: `make mutation` has no GPU; `make cuda-check` tests it)
    k, v, bias = _cuda_inputs(q, k, v, mask)
    out, lse, _, _ = _cuda_efficient(q, k, v, bias, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]]


def _kernel_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    mask: Tensor | None, causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The kernel's backward of ``_kernel`` given out and lse (B, H, R): (dq, dk, dv) shaped
    as q, k and v (dk and dv in float32 where CUDA sums them over grouped queries)."""
    if q.device.type != "cuda":  # pragma: no mutate (CUDA only, see below)
        return _cpu_flash_backward(
            grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
    # pragma: no mutate block (CUDA only: `make mutation` has no GPU; `make cuda-check` tests it)
    B, K, n, D = k.shape
    group = q.shape[1] // K
    k, v, bias = _cuda_inputs(q, k, v, mask)
    lse = F.pad(lse, (0, -lse.shape[-1] % _LSE_ALIGN), value=float("inf")).contiguous()
    # out laid out as the op's forward writes it, (B, R, H, D) in memory: its half-precision
    # backward reads out so (measured on an H200: a (B, H, R, D)-contiguous out gave dq and dk
    # off by 1e-1 to 1e34 RMS in bfloat16 and float16; float32 took either)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    unused = torch.empty((), dtype=torch.long)  # the dropout seed and offset (no dropout)
    gq, gk, gv, _ = _cuda_efficient_backward(
        grad, q, k, v, bias, out, lse, unused, unused, 0.0, [True, True, True, False], causal,
        scale=scale,
    )  # fmt: skip
    if group > 1:  # a key/value head's gradient: the sum over the query heads it served,
        # in float32 (the accumulation dtype of the caller's sums, module docstring, 5)
        gk, gv = (g.view(B, K, group, n, D).sum(2, dtype=torch.float32) for g in (gk, gv))
    return gq, gk, gv


def _cuda_inputs(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """k and v with one head per query head, and the mask as the CUDA op's bias: expanded to
    (B, H, R, n) on a row stride aligned to ``_BIAS_ALIGN`` elements."""
    B, H, R, _ = q.shape
    group = H // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if mask is None:
        return k, v, None
    n = k.shape[2]
    bias = F.pad(mask, (0, -n % _BIAS_ALIGN))[..., :n]
    return k, v, bias.expand(B, H, R, n)


def _merge(parts: Sequence[tuple[int, int, Tensor, Tensor]], R: int) -> tuple[Tensor, Tensor]:
    """One softmax over the union of the pieces' keys for each of a block's R rows, from each
    piece's rows [a, b), out (B, H, b - a, D) and lse (B, H, b - a)."""
    if len(parts) == 1 and parts[0][:2] == (0, R):
        return parts[0][2], parts[0][3]
    _, _, o0, m0 = parts[0]
    top = m0.new_full((*m0.shape[:2], R), float("-inf"))  # (B, H, R)
    for a, b, _, m in parts:
        torch.maximum(top[..., a:b], m, out=top[..., a:b])
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows that see nothing
    total = torch.zeros_like(top)
    merged = m0.new_zeros((*m0.shape[:2], R, o0.shape[-1]))  # (B, H, R, D)
    for a, b, o, m in parts:
        w = (m - top[..., a:b]).exp_()  # exp(-inf) = 0 for pieces a row does not see
        total[..., a:b] += w
        merged[..., a:b, :].addcmul_(w[..., None], o.to(w.dtype))
    out = merged / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return out.to(o0.dtype), top + total.log()


class _FusedBands(torch.autograd.Function):
    """Banded attention with its backward on the kernel's own backward (module docstring, 5).
    Inputs: the plan, v, then each band's rotated queries and each slot's rotated keys."""

    @staticmethod
    def forward(ctx, plan: _Plan, n_bands: int, v: Tensor, *tensors: Tensor) -> Tensor:
        queries, keys = tensors[:n_bands], tensors[n_bands:]
        out, lse = _forward(plan, queries, keys, v)
        ctx.plan, ctx.n_bands = plan, n_bands
        ctx.save_for_backward(v, out, lse, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        plan, n_bands = ctx.plan, ctx.n_bands
        v, out, lse, *tensors = ctx.saved_tensors
        queries, keys = tensors[:n_bands], tensors[n_bands:]
        acc = torch.float64 if v.dtype == torch.float64 else torch.float32
        dq = [torch.zeros_like(t, dtype=acc) for t in queries]
        dk = [torch.zeros_like(t, dtype=acc) for t in keys]
        dv = torch.zeros_like(v, dtype=acc)
        # A row that sees no key has lse -inf; +inf makes its P = exp(s - lse) zero.
        lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
        grad = grad.contiguous()
        for block in plan.blocks:
            for piece in block.pieces:
                s, e, a, z = piece.row_start, piece.row_stop, piece.start, piece.stop
                slot = plan.slots[piece.band]
                gq, gk, gv = _attend_backward(
                    plan, piece, grad[:, :, s:e], queries[piece.band][:, :, s:e],
                    keys[slot][:, :, a:z], v[:, :, a:z], out[:, :, s:e], lse[:, :, s:e],
                )  # fmt: skip
                dq[piece.band][:, :, s:e] += gq
                dk[slot][:, :, a:z] += gk
                dv[:, :, a:z] += gv
        grads = [g.to(t.dtype) for g, t in zip([*dq, *dk], tensors, strict=True)]
        return None, None, dv.to(v.dtype), *grads


# The last call's layout (``LastCall``): planned once per forward, not once per layer.
_last_layout = LastCall()


def _layout(
    bands: Sequence[Any], key_positions: Tensor, T: int, causal_offset: int | None, rows: int
) -> tuple[Tensor, Tensor, tuple[_Block, ...]]:
    """(first, stop, blocks) of a call, reused when the bands are the very same objects as
    the last call's and the key positions the same tensor at the same version."""
    key = (T, causal_offset, rows, FINE_ROWS)
    layout = _last_layout.get(key, bands, key_positions)
    if layout is None:
        first, stop = index_bounds(bands, key_positions, T, causal_offset)
        layout = _last_layout.put(key, bands, key_positions, (first, stop, _blocks(
            first, stop, rows, FINE_ROWS)))  # fmt: skip
    return layout


def band_queries(
    q: Tensor, bands: Sequence[Any], rotate: Callable[[Tensor, Tensor, bool], Tensor]
) -> list[Tensor]:
    """Each band's queries (B, H, T, D): q times the band's factor, rotated at its positions."""
    return [
        rotate(q if band.q_scale is None else q * band.q_scale.to(q.dtype), band.q_positions, True)
        for band in bands
    ]


def fused_banded_attention(
    q: Tensor,
    keys: Sequence[Tensor],
    v: Tensor,
    bands: Sequence[Any],
    key_positions: Tensor,
    rotate: Callable[[Tensor, Tensor, bool], Tensor],
    *,
    slots: Sequence[int],
    scale: float,
    causal_offset: int | None,
    mask: Callable[[int, int, int], Tensor | None] | None,
    block_rows: int | None = None,
) -> Tensor:
    """Banded attention of unrotated q (B, H, T, D) over each slot's rotated keys
    (B, K, S, D) and v (B, K, S, D): (B, H, T, D) in v's dtype. ``slots[b]``: which of
    ``keys`` band b reads; ``block_rows``: query rows per block (None: ``BLOCK_ROWS``).
    Arguments otherwise as ``bands.banded_attention`` (``bands`` are its ``Band`` records,
    typed ``Any`` here because ``bands`` imports this module)."""
    T = q.shape[2]
    rows = BLOCK_ROWS if block_rows is None else block_rows
    if rows < 1:
        raise ValueError(f"block_rows={block_rows} is not allowed; it must be >= 1")
    if T == 0 or v.shape[2] == 0:
        return v.new_zeros(*q.shape[:3], v.shape[-1])
    first, stop, blocks = _layout(bands, key_positions, T, causal_offset, rows)
    plan = _Plan(blocks, first, stop, mask, scale, tuple(slots))
    queries = band_queries(q, bands, rotate)
    tensors = (*queries, *keys)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (v, *tensors)):
        return _FusedBands.apply(plan, len(bands), v, *tensors)
    return _forward(plan, queries, keys, v)[0]
