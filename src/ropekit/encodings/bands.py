"""Banded attention: the attention of encodings that remap the query-key distance.

Shape legend: B batch · H query heads · K key/value heads · g = H/K query heads per key head ·
T query length · S key length · D head dim · R query rows in one block · N keys in one block.

ReRoPE, Self-Extend, DCA and STRING change the relative distance each query-key pair sees
(clip it, group it, chunk it, shift it). With RoPE the logit of query i and key j depends on
their positions only through P_q - P_k, so a remap is expressed by rotating queries and keys at
*other* positions; but which positions depends on the pair, not on i or j alone, so one
rotation of q and one of k cannot express it. Every such method is a small number of *bands*:

    band b: queries rotated at P_q^b(i), keys at P_k^b(j), covering the keys with
            lo_b(i) <= pos(j) < hi_b(i)          (bands partition the keys of each query)

    logit(i, j) = scale * <R(P_q^b(i)) q_i, R(P_k^b(j)) k_j>  for the band b that covers j
    out_i       = sum_j softmax_j(logit(i, .) + mask(i, .)) v_j

(ReRoPE: a near band d < w at true positions and a far band at clipped distance; Self-Extend:
neighbours and groups; DCA: intra-, successive- and inter-chunk; STRING: near and shifted.)
Plain RoPE is one band covering every key. ``banded_attention`` computes this (to round-off) with
one of two kernels, held together by tests (house style of ``rotary.py``):

- ``fused`` (default): ``bands_fused``: each band's keys for a block of query rows are at most
  a few contiguous *pieces*, each one call of PyTorch's fused attention kernel returning its
  log-sum-exp (the CPU's flash op, CUDA's memory-efficient op), merged by log-sum-exp (exact
  up to round-off), on CPU about the cost of one causal attention; on CUDA first
  ``bands_flex``: each band one FlexAttention call over a block mask of the tiles its keys
  reach, merged the same way (the pieces where FlexAttention cannot be compiled);
- ``reference``: block by block over query rows, per block and band the ordinary q k^T on the
  band's keys, the logits of each pair taken from the band that covers it, then one softmax
  over the block's row (the selected-logits form of an exact log-sum-exp merge). A block holds
  at most ``block_entries`` logits (by default as many as q has entries); with autograd each
  block is recomputed in the backward (``torch.utils.checkpoint``). It runs wherever the
  fused one cannot (another device, float64 on CUDA, packed documents), with one warning.

No (T, S) tensor per head ever exists in either. Keys are rotated once per band for the whole
sequence (once per distinct key positions: what a cache of unrotated keys needs anyway); a KV
cache keeps them rotated between calls (``RotatedKeys``), so a decoding step rotates only its
new keys.

Band membership is decided on the *true* key positions (those the KV cache keeps), the
masks of the caller (causal, documents, padding) are applied on top, so packed and padded
rows work as in ordinary attention. Positions may be fractional (Leaky ReRoPE's P / k):
rotations are formed in float64 from any real position.

Holds: Band, band_membership, RotatedKeys, banded_attention, KERNELS, BLOCK_ENTRIES.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.utils import checkpoint as activation_checkpoint

from . import bands_flex, bands_fused

KERNELS = ("fused", "reference")
_FALLBACKS: set[str] = set()  # reasons already warned about (once per process)

# The least logits per block of query rows (entries of one (B, H, R, N) tensor). By default a
# block may hold as many logits as the queries have entries (B * H * T * D, so about D query
# rows in self-attention): its extra memory, a few tensors of that size, is then of the order of
# the q, k, v the attention holds anyway, and every block is a matmul of enough rows to run at
# speed. A fixed budget made blocks of 3 rows at 16k tokens on SmolLM2 (9 heads), 4x slower per
# layer at 8k than blocks of 64 rows (measured: 25.8 s against 6.3 s, one thread).
BLOCK_ENTRIES = 1 << 19


@dataclasses.dataclass(frozen=True)
class Band:
    """One band of a distance-remapping attention (module docstring).

    ``q_positions`` (B|1, T) and ``k_positions`` (B|1, S): where queries and keys of this band
    are rotated (int64, or float64 for fractional positions). ``lo`` / ``hi`` (B|1, T) int64:
    the band covers, for query i, the keys whose true position p satisfies lo[i] <= p < hi[i];
    None means unbounded. ``q_scale`` (B|1, H|1, T, 1) or None: a factor on the queries (ReRoPE's
    log-n scaling) applied before rotating.
    """

    q_positions: Tensor
    k_positions: Tensor
    lo: Tensor | None = None
    hi: Tensor | None = None
    q_scale: Tensor | None = None


def band_membership(band: Band, key_positions: Tensor, start: int, stop: int) -> Tensor | None:
    """Which keys (B|1, 1, R, N) of query rows [start, stop) the band covers; None: all.

    key_positions (B|1, N): the true positions of the block's keys.
    """
    member = None
    keys = key_positions[:, None, None, :]  # (B|1, 1, 1, N)
    if band.lo is not None:
        member = keys >= band.lo[:, None, start:stop, None]  # (B|1, 1, R, N)
    if band.hi is not None:
        below = keys < band.hi[:, None, start:stop, None]
        member = below if member is None else member & below
    return member


class RotatedKeys:
    """Each band's rotated keys, kept beside a KV cache so that a decoding step rotates only
    the keys it adds (rotating every cached key per band and step costs about as much as the
    attention itself at 16k).

    One per cached layer. Each call passes all the layer's unrotated keys (B, K, S, D) and the
    distinct key positions of its bands (B|1, S); a slot's stored rows are reused where its
    stored positions equal the new ones' first rows (a guard: the cache owner, not this check,
    vouches for the keys). The owner calls ``truncate(n)`` when it drops keys past n (crop)
    and ``reset()`` when it changes keys it returned before (reorder, edits). ``follow``
    does that for a cache that replaces its key tensor on every change (transformers').
    Rows live in buffers with spare room, so an appended key costs its own rotation only.
    Not used for keys that need a gradient.
    """

    def __init__(self) -> None:
        self._slots: list[tuple[Tensor, Tensor, int]] = []  # (positions, buffer, rows held)
        self._source: tuple[weakref.ref, int, int, tuple[int, ...]] | None = None

    def __len__(self) -> int:
        return min((n for _, _, n in self._slots), default=0)

    def reset(self) -> None:
        self._slots, self._source = [], None

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` rows of every slot (the cache kept its first n keys)."""
        self._slots = [(p[..., :n], buf, min(held, n)) for p, buf, held in self._slots]

    def follow(self, keys: Tensor | None) -> None:
        """Before a call: keep only what is still true of ``keys``, the tensor the cache holds
        now (before this step's update). A view of the same storage that is the same tensor or
        a prefix of it, at the same version, is an unchanged cache (or a crop of it);
        anything else is a change: start again."""
        source = self._source
        if keys is None or keys.dim() != 4 or source is None:
            self.reset()
            return
        ref, ptr, version, stride = source
        base = ref()
        same = (
            base is not None
            and keys.data_ptr() == ptr
            and keys.stride() == stride
            and _version(keys) == version
            and keys.shape[:2] == base.shape[:2]
            and keys.shape[-2] <= base.shape[-2]
        )
        if not same:
            self.reset()
        elif keys.shape[-2] < base.shape[-2]:
            self.truncate(keys.shape[-2])

    def seen(self, keys: Tensor) -> None:
        """After the cache's update: ``keys`` is what it holds now (for ``follow``)."""
        self._source = (weakref.ref(keys), keys.data_ptr(), _version(keys), keys.stride())

    def rotate(
        self,
        k: Tensor,
        positions: Sequence[Tensor],
        rotate: Callable[[Tensor, Tensor, bool], Tensor],
    ) -> tuple[Tensor, ...]:
        """Each positions tensor's rotated keys (B, K, S, D), rotating only rows not held."""
        B, K, S, D = k.shape
        if len(self._slots) != len(positions):
            self._slots = []
        slots, out = [], []
        for i, pos in enumerate(positions):
            held, buffer, old = 0, None, self._slots[i] if self._slots else None
            if old is not None:
                old_pos, buffer, held = old
                held = min(held, S)
                fits = (
                    buffer.shape[:2] == (B, K) and buffer.shape[-1] == D
                    and buffer.dtype == k.dtype and buffer.device == k.device
                    and old_pos.shape[0] == pos.shape[0]
                )  # fmt: skip
                if not fits or not torch.equal(old_pos[..., :held], pos[..., :held]):
                    held, buffer = 0, None
            if buffer is None or buffer.shape[2] < S:
                grown = k.new_empty(B, K, S + max(S // 4, 256), D)  # spare room for appends
                if held:
                    grown[:, :, :held] = buffer[:, :, :held]
                buffer = grown
            if held < S:
                buffer[:, :, held:S] = rotate(k[:, :, held:], pos[:, held:], False)
            slots.append((pos, buffer, S))
            out.append(buffer[:, :, :S])  # (B, K, S, D)
        self._slots = slots
        return tuple(out)


def _version(t: Tensor) -> int | None:
    """A tensor's version counter; None for inference tensors, which keep none (in-place edits
    of those go unseen: transformers' caches replace their key tensor rather than edit it)."""
    return None if t.is_inference() else t._version


def _key_ranges(
    bands: Sequence[Band], key_positions: Tensor, rows: int, blocks: list[tuple[int, int, int]]
) -> list[list[tuple[int, int]]]:
    """Per block and band, the slice [a, b) of key indices that can hold the band's keys.

    Only when key positions never decrease along each row (no packed documents) can a position
    bound become an index bound (binary search); otherwise every band reads all keys of the
    block and membership alone selects. Bounds for every block are found at once and read back
    once (one device sync per call, not one per block)."""
    full = [[(0, n) for _ in bands] for _, _, n in blocks]
    S = key_positions.shape[-1]
    bounded = [b for band in bands for b in (band.lo, band.hi) if b is not None]
    if S < 2 or not bounded or not bool((key_positions[:, 1:] >= key_positions[:, :-1]).all()):
        return full
    n_blocks = len(blocks)
    padded = n_blocks * rows
    edges = []  # (2 * n_bands, n_blocks): first key index of each bound, -1 when unbounded
    for band in bands:
        for bound, lower in ((band.lo, True), (band.hi, False)):
            if bound is None:
                edges.append(torch.full((n_blocks,), -1, device=key_positions.device))
                continue
            # The loosest bound over each block's rows and over the batch: smallest lo, largest
            # hi (padding rows past T with values that never win).
            per_row = bound.amin(0) if lower else bound.amax(0)  # (T,)
            fill = torch.iinfo(torch.int64).max if lower else torch.iinfo(torch.int64).min
            per_row = torch.cat((per_row, per_row.new_full((padded - per_row.shape[0],), fill)))
            per_block = per_row.view(n_blocks, rows)
            per_block = per_block.amin(1) if lower else per_block.amax(1)  # (n_blocks,)
            # First key index at or above the bound in each batch row, then the loosest row.
            sorted_keys = key_positions.contiguous()
            wanted = per_block[None].expand(sorted_keys.shape[0], -1).contiguous()
            idx = torch.searchsorted(sorted_keys, wanted)
            edges.append(idx.amin(0) if lower else idx.amax(0))
    values = torch.stack(edges).tolist()  # one sync
    ranges = []
    for i, (_, _, n) in enumerate(blocks):
        row = []
        for j in range(len(bands)):
            lo_idx, hi_idx = values[2 * j][i], values[2 * j + 1][i]
            a = 0 if lo_idx < 0 else min(lo_idx, n)
            b = n if hi_idx < 0 else min(hi_idx, n)
            row.append((a, max(a, b)))
        ranges.append(row)
    return ranges


def _block(
    q: Tensor,
    keys: tuple[Tensor, ...],
    v: Tensor,
    q_positions: tuple[Tensor, ...],
    q_scales: tuple[Tensor | None, ...],
    members: tuple[Tensor | None, ...],
    ranges: tuple[tuple[int, int], ...],
    mask: Tensor | None,
    rotate: Callable[[Tensor, Tensor, bool], Tensor],
    scale: float,
    inplace: bool,
) -> Tensor:
    """Attention of one block of query rows q (B, H, R, D) over keys [0, N): (B, H, R, D).

    ``inplace`` (no autograd): the logits are selected, masked and normalised in their own
    buffer, so a block costs about two (B, H, R, N) buffers; with autograd the same steps run
    out of place (and are recomputed in the backward)."""
    B, H, R = q.shape[:3]
    K, N = v.shape[1], v.shape[2]
    g = H // K
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # softmax precision
    logits = q.new_full((B, K, g, R, N), float("-inf"), dtype=acc)
    for kb, qp, qs, member, (a, b) in zip(
        keys, q_positions, q_scales, members, ranges, strict=True
    ):
        if b <= a:
            continue
        qb = q if qs is None else q * qs.to(q.dtype)
        # The g query heads of a key head as g * R rows of one matmul: a broadcast over g would
        # copy the keys g times per block (most of the block's time at 8k on SmolLM2).
        qr = rotate(qb, qp, True).reshape(B, K, g * R, -1)  # (B, K, g R, D)
        part = (qr @ kb[:, :, a:b].transpose(-1, -2)).view(B, K, g, R, b - a).to(acc)
        window = logits[..., a:b]
        inside = None if member is None else member[..., a:b].unsqueeze(1)  # (B|1, 1, 1, R, n)
        if inplace:
            part.mul_(scale)
            if inside is None:
                window.copy_(part)
            else:
                # Bands are disjoint and the buffer starts at -inf: keep the maximum.
                torch.maximum(window, part.masked_fill_(~inside, float("-inf")), out=window)
        elif inside is None:
            window.copy_(part * scale)
        else:
            window.copy_(torch.where(inside, part * scale, window))
    logits = logits.flatten(1, 2)  # (B, H, R, N)
    if mask is not None:
        if mask.dtype == torch.bool:
            logits = (
                logits.masked_fill_(~mask, float("-inf"))
                if inplace
                else logits.masked_fill(~mask, float("-inf"))
            )
        else:
            logits = logits.add_(mask.to(acc)) if inplace else logits + mask.to(acc)
    # Softmax that leaves rows with no visible key at 0 instead of NaN (padding rows), so no
    # NaN reaches the values of later layers through a masked-out pad token.
    top = logits.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    tiny = torch.finfo(acc).tiny
    if inplace:
        weights = logits.sub_(top).exp_()
        weights = weights.div_(weights.sum(-1, keepdim=True).clamp_min_(tiny))
    else:
        weights = (logits - top).exp()
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(tiny)
    weights = weights.to(v.dtype).reshape(B, K, g * R, N)  # (B, K, g R, N), as the logits
    return (weights @ v).view(B, H, R, -1)  # (B, H, R, D)


def banded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bands: Sequence[Band],
    key_positions: Tensor,
    rotate: Callable[[Tensor, Tensor, bool], Tensor],
    *,
    scale: float | None = None,
    causal_offset: int | None = None,
    mask: Callable[[int, int, int], Tensor | None] | None = None,
    kernel: str = "fused",
    block_rows: int | None = None,
    block_entries: int | None = None,
    rotated_keys: RotatedKeys | None = None,
) -> Tensor:
    """Exact attention of unrotated q (B, H, T, D) over unrotated k, v (B, K, S, D) as bands.

    ``rotate(x, positions, query)`` rotates queries (B, H, T, D) (``query`` True) or keys
    (B, K, S, D) at positions (B|1, T) or (B|1, S), int or float (an encoding's
    ``rotate_band``). ``key_positions`` (B|1, S): the true positions of the
    keys (band membership). ``scale``: logit scale, default 1/sqrt(D). ``causal_offset``: query
    row r sees key indices <= r + causal_offset (a causal decoder: S - T); None: every key
    (masking left to ``mask``). ``mask(start, stop, n)``: the caller's mask for query rows
    [start, stop) and keys [0, n), broadcastable to (B, H, R, n), bool (True = visible) or
    float (added to the logits), or None.

    ``kernel``: ``fused`` (default; each band on a fused attention kernel, merged by
    log-sum-exp: ``bands_flex`` on CUDA where FlexAttention compiles, else ``bands_fused``) or
    ``reference`` (block by block in eager PyTorch, the oracle). Where the fused kernel cannot
    run (``bands_fused.supported``: another device, float64 on CUDA, packed documents) the
    reference runs instead, with one warning naming why. ``block_rows``: ``bands_fused``'s query
    rows per block (None: ``bands_fused.BLOCK_ROWS``; FlexAttention's tiles are
    ``bands_flex.TILE``).
    ``block_entries``: the reference's logits per block of query rows; None: the larger of
    ``BLOCK_ENTRIES`` and q's entries (comment at ``BLOCK_ENTRIES``). ``rotated_keys``: a KV
    cache's ``RotatedKeys``, so that keys rotated by an earlier call are not rotated again.
    Returns (B, H, T, D) in v's dtype.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not allowed; use one of {', '.join(KERNELS)}")
    _check_inputs(q, k, v, bands, key_positions)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if kernel == "fused":
        why = bands_fused.supported(q, key_positions)
        if why is None:
            slots, keys = _rotate_keys(k, bands, rotate, rotated_keys)
            args = (q, keys, v, bands, key_positions, rotate)
            common = {"slots": slots, "scale": scale, "causal_offset": causal_offset, "mask": mask}
            if bands_flex.supported(q) is None:  # CUDA, where it compiles
                try:
                    return bands_flex.flex_banded_attention(*args, **common)
                except bands_flex.Unavailable:
                    pass  # warned about once; the pieces need no compiler
            return bands_fused.fused_banded_attention(*args, **common, block_rows=block_rows)
        _fall_back(why)
    return _reference(
        q, k, v, bands, key_positions, rotate, scale, causal_offset, mask, block_entries,
        rotated_keys,
    )  # fmt: skip


def _fall_back(why: str) -> None:
    """Say once per reason that the reference kernel runs instead of the fused one."""
    if why not in _FALLBACKS:
        _FALLBACKS.add(why)
        warnings.warn(
            f"ropekit: banded attention runs on the reference kernel: {why}",
            RuntimeWarning,
            stacklevel=3,
        )


def _reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bands: Sequence[Band],
    key_positions: Tensor,
    rotate: Callable[[Tensor, Tensor, bool], Tensor],
    scale: float,
    causal_offset: int | None,
    mask: Callable[[int, int, int], Tensor | None] | None,
    block_entries: int | None,
    rotated_keys: RotatedKeys | None,
) -> Tensor:
    """The reference kernel (module docstring): blocks of query rows, each band's logits of
    the block selected into one buffer, one softmax."""
    B, H, T, D = q.shape
    S = k.shape[2]
    if block_entries is None:
        block_entries = max(BLOCK_ENTRIES, q.numel())
    slots, rotated = _rotate_keys(k, bands, rotate, rotated_keys)
    keys = tuple(rotated[slot] for slot in slots)
    rows, blocks = _query_blocks(B * H, T, S, causal_offset, block_entries)
    ranges = _key_ranges(bands, key_positions, rows, blocks)
    recompute = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, *(b.q_scale for b in bands if b.q_scale is not None))
    )
    out = []
    for (start, stop, n), block_ranges in zip(blocks, ranges, strict=True):
        if n == 0:  # a causal block that sees no key: its rows attend to nothing
            out.append(q.new_zeros(B, H, stop - start, D, dtype=v.dtype))
            continue
        block_mask = _block_mask(mask, causal_offset, start, stop, n, q.device)
        args = (
            q[:, :, start:stop],
            tuple(kb[:, :, :n] for kb in keys),
            v[:, :, :n],
            tuple(band.q_positions[:, start:stop] for band in bands),
            tuple(
                None if band.q_scale is None else band.q_scale[..., start:stop, :] for band in bands
            ),
            tuple(band_membership(band, key_positions[:, :n], start, stop) for band in bands),
            tuple(block_ranges),
            block_mask,
            rotate,
            scale,
            not recompute,
        )
        if recompute:
            out.append(activation_checkpoint.checkpoint(_block, *args, use_reentrant=False))
        else:
            out.append(_block(*args))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)  # (B, H, T, D)


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, bands: Sequence[Band], key_positions: Tensor
) -> None:
    """ValueError unless q is (B, H, T, D), k and v (B, K, S, D) with K dividing H (grouped
    queries), there is a band, and ``key_positions`` is (B|1, S), one column per key."""
    B, H = q.shape[:2]
    K, S = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape != k.shape or H % K:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be (B, H, T, D) "
            "and (B, K, S, D) with K dividing H"
        )
    if not bands:
        raise ValueError("banded_attention needs at least one band")
    if key_positions.dim() != 2 or key_positions.shape[-1] != S:
        raise ValueError(
            f"key_positions {tuple(key_positions.shape)} must be (B|1, S) with S = {S}"
        )


def _rotate_keys(
    k: Tensor,
    bands: Sequence[Band],
    rotate: Callable[[Tensor, Tensor, bool], Tensor],
    memo: RotatedKeys | None = None,
) -> tuple[tuple[int, ...], tuple[Tensor, ...]]:
    """(slot of each band, each slot's rotated keys (B, K, S, D)): R(P_k^b(j)) k_j for the
    whole sequence, once per distinct key positions tensor (by identity, not value): DCA's
    three bands and STRING's two share one slot, so they share the rotated keys too. With a
    ``memo`` (and no gradient to keys) only the keys it has not rotated before are rotated."""
    order: dict[int, int] = {}
    slots = tuple(order.setdefault(id(band.k_positions), len(order)) for band in bands)
    positions = list({id(b.k_positions): b.k_positions for b in bands}.values())
    if memo is not None and not (torch.is_grad_enabled() and k.requires_grad):
        return slots, memo.rotate(k, positions, rotate)
    return slots, tuple(rotate(k, p, False) for p in positions)  # each (B, K, S, D)


def _query_blocks(
    heads: int, T: int, S: int, causal_offset: int | None, block_entries: int
) -> tuple[int, list[tuple[int, int, int]]]:
    """(rows per block, [(start, stop, n)]): query rows [start, stop) and the keys [0, n) they
    can see, blocks of as many rows as keep ``heads`` (B * H) x rows x S logits within
    ``block_entries``. With ``causal_offset`` a block needs only the keys up to its last row's
    (a causal decoder's later keys are all masked), so n can be smaller than S, or 0."""
    rows = max(1, min(T, block_entries // max(1, heads * S)))
    blocks = []
    for start in range(0, T, rows):
        stop = min(T, start + rows)
        n = S if causal_offset is None else max(0, min(S, stop + causal_offset))
        blocks.append((start, stop, n))
    return rows, blocks


def _block_mask(
    mask: Callable[[int, int, int], Tensor | None] | None,
    causal_offset: int | None,
    start: int,
    stop: int,
    n: int,
    device: torch.device,
) -> Tensor | None:
    """The mask of query rows [start, stop) over keys [0, n): the caller's, with the causal
    one (key j visible to row r iff j <= r + causal_offset) folded in; None: every key."""
    block_mask = None if mask is None else mask(start, stop, n)
    if causal_offset is not None:
        causal = torch.ones(stop - start, n, dtype=torch.bool, device=device).tril(
            diagonal=start + causal_offset
        )  # (R, n): key j visible to row r iff j <= r + offset
        block_mask = causal if block_mask is None else _combine(block_mask, causal)
    return block_mask


def _combine(mask: Tensor, causal: Tensor) -> Tensor:
    """The caller's mask (bool or additive) with the causal one folded in."""
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, float("-inf"))
