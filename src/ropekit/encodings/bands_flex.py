"""The CUDA path of banded attention: each band one FlexAttention call over the key tiles it
reaches, merged by log-sum-exp.

Shape legend: as ``bands_fused`` · M query rows and N keys per tile (``TILE``) · nM, nN the
query and key tiles.

``bands_fused`` computes banded attention as pieces, each one call of a fused kernel. That is
the speed of ordinary attention on a CPU, not on a GPU: there every call is a launch however
small its piece, and the one CUDA kernel that takes a mask computes every logit of a masked
piece; on an H200 the pieces took 2-5x plain RoPE's forward (docs/decisions.md). FlexAttention
(Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized Attention
Kernels") computes one attention over a *block mask*: tiles it marks empty are skipped, tiles
it marks full are computed without evaluating the mask. So each band is one call that
computes the tiles its keys reach:

1. *Key ranges*, as ``bands_fused`` (1): band b covers key indices first_b(r) <= j < stop_b(r)
   of query row r, the causal limit folded in (``bands_fused.index_bounds``).
2. *The block mask, from the ranges* (``tiles``), with no (T, S) evaluation: query tile t and
   key tile u are *full* for band b when every row of t covers every key of u, *partial* when
   some row covers some key of u, else empty. The mask function (``mask_mod``) is the range
   test itself, applied on partial tiles. Every pair is thus computed by the one band that
   covers it, plus the uncovered pairs of the partial tiles where a band boundary crosses a
   tile: about one causal attention in all, plus one tile per boundary and tile row.
3. *Exact merge*, as ``bands_fused`` (4): with each call's out_b and lse_b and m = max_b lse_b,
   out = sum_b exp(lse_b - m) out_b / sum_b exp(lse_b - m). The result does not depend on m,
   so m is held constant for autograd, and the gradient flows exactly through out_b and lse_b
   into FlexAttention's own backward.
4. *The caller's mask*: a boolean one joins the range test, an additive one is the score
   modification (``score_mod``, added to the logits); either makes every reached tile partial
   (the mask must be read there).

Rows that see no key: FlexAttention gives them out 0 and lse -inf; the merge keeps the zeros.

On CUDA the call is compiled (``torch.compile`` of ``flex_attention``: its Triton kernels).
Anywhere else ``flex_attention`` runs eagerly, as PyTorch's reference that evaluates the mask
on every pair and skips no tile; the CPU tests use it to hold the mask functions and the merge
to the definitions, and hold ``tiles`` to a brute-force count of each tile's pairs.

Limits: float32, bfloat16 and float16 on CUDA; key ranges need non-decreasing key positions
(as ``bands_fused``). ``bands.banded_attention`` checks ``supported`` and otherwise takes
``bands_fused``'s pieces (which run on CUDA too, without a compiler) or the reference kernel,
with one warning naming why; a compile failure (``Unavailable``) is warned about once and sends
the rest of the process to the pieces.

Holds: TILE, Unavailable, supported, padded, tiles, flex_banded_attention.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import flex_attention as flex

from . import bands_fused
from .positions import LastCall

# Query rows and keys per tile of the block masks: FlexAttention's default block size (its
# CUDA kernels take tiles of this size or a divisor of it).
TILE = 128
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Unavailable(RuntimeError):
    """FlexAttention could not be compiled here (``bands.banded_attention`` then takes
    ``bands_fused``'s pieces, which need no compiler)."""


# Why FlexAttention failed to compile in this process (None: it has not), so that a failure is
# warned about once and not retried on every call.
_failure: list[str] = []


def supported(q: Tensor) -> str | None:
    """None when this path can compute a call on these queries; else why not (one short
    phrase). The key ranges are ``bands_fused.supported``'s to check, which
    ``bands.banded_attention`` asks first."""
    if q.device.type != "cuda":
        return f"the FlexAttention band kernel runs on CUDA only (tensors on {q.device.type})"
    if q.dtype not in _DTYPES:
        return f"the FlexAttention band kernel does not take {q.dtype}"
    if _failure:
        return f"FlexAttention failed to compile here ({_failure[0]})"
    return None


def padded(n: int) -> int:
    """The length n rows or keys are padded to for the kernel: a power of two of at least one
    tile. The kernel is compiled for static shapes (with dynamic ones PyTorch 2.11 found no
    kernel configuration for FlexAttention on an H200), so a cache growing by one key per
    decoding step recompiles once per doubling, not once per token; the padding costs no
    arithmetic, since padded tiles are in no block mask."""
    return max(TILE, 1 << (n - 1).bit_length())


def tiles(
    first: Tensor, stop: Tensor, rows: int, keys: int, tile: int = TILE
) -> tuple[Tensor, Tensor]:
    """(partial, full) bool (n_bands, B', rows / tile, keys / tile): which key tiles of ``tile``
    keys each query tile of ``tile`` rows reaches in part or wholly (module docstring, 2), from
    the key index bounds (n_bands, B', T) of the T <= ``rows`` real rows. Padded keys (past
    every stop) are covered by no row, so a tile holding one is never full; padded rows are
    no row's concern (their outputs are dropped). A row with no keys makes no tile full.

    Memory O(T + tiles), never O(T x key tiles) (a (T, S / tile) test is 400 MB per band at
    128k): row r reaches key tiles floor(first_r / tile) <= u < ceil(stop_r / tile), so each
    query tile's reached tiles are a union of intervals, counted exactly by a difference array
    (+1 where a row's interval starts, -1 past its end, summed along the key tiles). A tile is
    full iff every row covers it, iff the tile lies in [max first, min stop) over the query
    tile's real rows: a row without keys (first >= stop) makes that interval empty."""
    T = first.shape[-1]
    n_bands, batch = first.shape[:2]
    nM, nN = rows // tile, keys // tile
    seen = first < stop
    # reached: each real row with keys adds +1 at its first key tile and -1 past its last
    begin = torch.where(seen, first.div(tile, rounding_mode="floor"), 0)
    end = torch.where(seen, -(-stop // tile), 0)  # ceil; a row without keys adds +1 - 1 at 0
    row_tile = torch.arange(T, device=first.device).div(tile, rounding_mode="floor") * (nN + 1)
    steps = first.new_zeros(n_bands, batch, nM * (nN + 1))
    steps.scatter_add_(-1, row_tile + begin, torch.ones_like(begin))
    steps.scatter_add_(-1, row_tile + end, -torch.ones_like(end))
    reached = steps.view(n_bands, batch, nM, nN + 1).cumsum(-1)[..., :nN] > 0
    # full: padded rows take the widest range [0, keys), which constrains no max or min
    lo = F.pad(first, (0, rows - T)).view(n_bands, batch, nM, tile).amax(-1, keepdim=True)
    hi = F.pad(stop, (0, rows - T), value=keys).view(n_bands, batch, nM, tile).amin(-1, True)
    start = torch.arange(0, keys, tile, device=first.device)  # (nN,) each key tile's first key
    real = torch.arange(0, rows, tile, device=first.device) < T  # (nM,) tiles with a real row
    full = (lo <= start) & (hi >= start + tile) & real[:, None]
    return reached & ~full, full


def _block_mask(
    partial: Tensor, full: Tensor, mask_mod: Callable, backward: bool
) -> flex.BlockMask:
    """The BlockMask of one band from its tiles (B', nM, nN): the reached tiles' indices first
    in each row of tiles, their counts, one head broadcast over all; with the transposed lists
    the backward needs where ``backward``."""

    def listed(reach: Tensor) -> tuple[Tensor, Tensor]:
        counts = reach.sum(-1, dtype=torch.int32)[:, None]  # (B', 1, nM)
        order = reach.to(torch.int8).argsort(dim=-1, descending=True, stable=True)
        return counts, order.to(torch.int32)[:, None]  # (B', 1, nM, nN)

    rows, keys = partial.shape[-2] * TILE, partial.shape[-1] * TILE
    return flex.BlockMask.from_kv_blocks(
        *listed(partial), *listed(full), BLOCK_SIZE=TILE, mask_mod=mask_mod,
        seq_lengths=(rows, keys), compute_q_blocks=backward,
    )  # fmt: skip


def _index(t: Tensor) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """t (B|1, H|1, T, S) read at (batch, head, row, key), broadcast where its size is 1, and
    at the last row and key for padded ones (which the range test masks anyway)."""
    by_batch, by_head = int(t.shape[0] > 1), int(t.shape[1] > 1)
    T, S = t.shape[-2] - 1, t.shape[-1] - 1
    return lambda b, h, r, j: t[b * by_batch, h * by_head, r.clamp(max=T), j.clamp(max=S)]


def _mods(first: Tensor, stop: Tensor, caller: Tensor | None) -> tuple[Callable, Callable | None]:
    """(mask_mod, score_mod) of one band: keys first[r] <= j < stop[r] of row r (first, stop
    (B', padded rows), empty ranges for padded rows), and the caller's mask (B|1, H|1, T, S),
    boolean in mask_mod, additive in score_mod (None without one)."""
    by_batch = int(first.shape[0] > 1)
    in_band = lambda b, h, r, j: (j >= first[b * by_batch, r]) & (j < stop[b * by_batch, r])  # noqa: E731
    if caller is None:
        return in_band, None
    read = _index(caller)
    if caller.dtype == torch.bool:
        return (lambda b, h, r, j: in_band(b, h, r, j) & read(b, h, r, j)), None
    return in_band, lambda score, b, h, r, j: score + read(b, h, r, j)


def _caller_mask(
    mask: Callable[[int, int, int], Tensor | None] | None, T: int, S: int, dtype: torch.dtype
) -> Tensor | None:
    """The caller's mask of every row over every key as (B|1, H|1, T, S): boolean, or additive
    in the logits' dtype (float32 for half precision: FlexAttention scores in float32)."""
    caller = None if mask is None else mask(0, T, S)
    if caller is None:
        return None
    caller = caller.expand(*caller.shape[:-2], T, S)
    while caller.dim() < 4:
        caller = caller[None]
    if caller.dtype == torch.bool:
        return caller
    return caller.to(torch.float64 if dtype == torch.float64 else torch.float32)


def _flex_call(q: Tensor, k: Tensor, v: Tensor, block_mask, score_mod, scale: float, gqa: bool):
    """FlexAttention with its lse: what each compiled variant wraps (``_compiled``)."""
    return flex.flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa,
        return_aux=flex.AuxRequest(lse=True),
    )  # fmt: skip


# One compiled FlexAttention per (dtype, the caller's mask kind, grouped heads): each wraps its
# own copy of _flex_call's code object, so that every variant has dynamo's whole recompile
# budget for its shapes (a prefill, then decoding steps over a growing cache) instead of all
# variants sharing one (``rotary._kernel`` does the same).
_variants: dict[tuple, Callable[..., Any]] = {}


def _compiled(key: tuple) -> Callable[..., Any]:
    # pragma: no mutate block (CUDA only: `make mutation` has no GPU; `make cuda-check` tests it)
    if key not in _variants:
        code = _flex_call.__code__.replace(co_name=f"_flex_call_{len(_variants)}")
        fn = types.FunctionType(code, _flex_call.__globals__, code.co_name)
        _variants[key] = torch.compile(fn, dynamic=False)  # static shapes (``padded``)
    return _variants[key]


def _use_compiled(q: Tensor) -> bool:
    """Whether a call takes the compiled kernel: on CUDA, outside a caller's own compiled
    graph (whose compiler then lowers FlexAttention itself)."""
    return q.device.type == "cuda" and not torch.compiler.is_compiling()  # pragma: no mutate (CUDA)


def _attend(q: Tensor, k: Tensor, v: Tensor, block_mask, score_mod, scale: float):
    """One band's call: out (B, H, T, D) and lse (B, H, T) (float32). Compiled on CUDA; the
    eager reference elsewhere. A compile failure is recorded, warned about once, and raised
    as ``Unavailable``."""
    gqa = q.shape[1] != k.shape[1]
    if not _use_compiled(q):
        out, aux = _flex_call(q, k, v, block_mask, score_mod, scale, gqa)
        return out, aux.lse
    try:
        attend = _compiled((q.dtype, score_mod is not None, gqa))  # pragma: no mutate (CUDA)
        out, aux = attend(q, k, v, block_mask, score_mod, scale, gqa)  # pragma: no mutate (CUDA)
    except Exception as e:  # any compiler failure means: the pieces that need no compiler
        _failure[:] = [f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"]
        warnings.warn(
            f"ropekit: FlexAttention failed to compile ({_failure[0]}); banded attention runs "
            "on the fused kernel's pieces instead for the rest of the process",
            RuntimeWarning,
            stacklevel=2,
        )
        raise Unavailable(_failure[0]) from e
    return out, aux.lse


def _merge(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> Tensor:
    """One softmax over the union of the bands' keys (module docstring, 3): (B, H, T, D) in
    float32 (float64 for float64) from each band's out (B, H, T, D) and lse (B, H, T)."""
    if len(outs) == 1:
        return outs[0]
    lse = torch.stack(lses)  # (n_bands, B, H, T)
    top = lse.detach().amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows that see nothing
    w = (lse - top).exp()  # exp(-inf) = 0 for a band a row does not reach
    total = w.sum(0).clamp_min(torch.finfo(w.dtype).tiny)
    merged = sum(wb[..., None] * o.to(w.dtype) for wb, o in zip(w, outs, strict=True))
    return merged / total[..., None]


def flex_banded_attention(
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
) -> Tensor:
    """Banded attention of unrotated q (B, H, T, D) over each slot's rotated keys
    (B, K, S, D) and v (B, K, S, D): (B, H, T, D) in v's dtype. Arguments as
    ``bands_fused.fused_banded_attention`` (``bands`` are ``bands.Band`` records)."""
    T, S = q.shape[2], v.shape[2]
    if T == 0 or S == 0:
        return v.new_zeros(*q.shape[:3], v.shape[-1])
    caller = _caller_mask(mask, T, S, q.dtype)
    queries = bands_fused.band_queries(q, bands, rotate)  # each (B, H, T, D)
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (v, *queries, *keys))
    block_masks = _layout(bands, key_positions, T, causal_offset, caller, backward)
    rows, n = padded(T), padded(S)
    keys = [F.pad(k, (0, 0, 0, n - S)) for k in keys]
    v_in = F.pad(v, (0, 0, 0, n - S))
    outs, lses = [], []  # lse in float32, float64 for float64 inputs (FlexAttention's own)
    for query, slot, (block_mask, score_mod) in zip(queries, slots, block_masks, strict=True):
        query = F.pad(query, (0, 0, 0, rows - T))
        out, lse = _attend(query, keys[slot], v_in, block_mask, score_mod, scale)
        outs.append(out[:, :, :T])
        lses.append(lse[:, :, :T])
    return _merge(outs, lses).to(v.dtype)


# The last call's block masks (``LastCall``): made once per forward, not once per layer. Not
# with a caller's mask: each layer reads its own.
_last_layout = LastCall()


def _layout(
    bands: Sequence[Any],
    key_positions: Tensor,
    T: int,
    causal_offset: int | None,
    caller: Tensor | None,
    backward: bool,
) -> list[tuple[flex.BlockMask, Callable | None]]:
    """Each band's (block mask, score_mod) over the padded rows and keys, reused when the
    bands are the very same objects as the last call's and the key positions the same tensor
    at the same version, and there is no caller's mask."""
    key = (T, causal_offset, backward)
    if caller is None:
        masks = _last_layout.get(key, bands, key_positions)
        if masks is not None:
            return masks
    S = key_positions.shape[-1]
    rows, keys = padded(T), padded(S)
    first, stop = bands_fused.index_bounds(bands, key_positions, T, causal_offset)
    partial, full = tiles(first, stop, rows, keys)
    if caller is not None:  # the caller's mask is read on every reached tile
        partial, full = partial | full, torch.zeros_like(full)
    first, stop = (F.pad(t, (0, rows - T)) for t in (first, stop))  # padded rows: no keys
    masks = []
    for b in range(len(bands)):
        mask_mod, score_mod = _mods(first[b], stop[b], caller)
        masks.append((_block_mask(partial[b], full[b], mask_mod, backward), score_mod))
    return masks if caller is not None else _last_layout.put(key, bands, key_positions, masks)
