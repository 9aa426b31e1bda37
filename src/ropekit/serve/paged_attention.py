"""A distance remap's attention over a paged KV cache (vLLM's layout), in plain torch: what
ropekit's vLLM plugin runs for ReRoPE, Leaky ReRoPE, Self-Extend, DCA and STRING.

Shape legend: N tokens of one engine step (every request's new tokens, one after another) ·
H query heads · K key/value heads · D head dim · P cache blocks · b tokens per block ·
T one request's new tokens · S its keys (cached + new).

A paged cache holds each request's keys and values in blocks of b tokens; request r's token
j (position j: decoders without padding or sliding windows) is in block
``block_table[r, j // b]`` at offset ``j % b``. One engine step attends, for each request,
its T new queries (positions S - T .. S - 1: a whole prompt, a chunk of one whose earlier
chunks are cached, or one decoded token) to its S keys:

    key_cache, value_cache (P, K, b, D)  -> gather blocks block_table[r, :ceil(S/b)]
                                            -> keys (1, K, S, D), values (1, K, S, D)
    query rows [start, start + T) of (N, H, D) -> (1, H, T, D)
    each band's keys from the held ones (below), then its fused banded attention
    (``bands_fused.fused_banded_attention``, what ``banded_attention`` runs on CPU) (1, H, T, D)

Every band rotates a key at a position that depends on that key's own position only
(ReRoPE's far band at 0, Leaky ReRoPE's at j / k, Self-Extend's at floor(j / G), DCA's at
j mod c, STRING's and every near band at j: ``encodings.remap``), and RoPE's rotations compose,
R(a) R(b) = R(a + b). So the cache holds each key rotated as the band that reaches back to the
first key reads it (``held_band``: the far band, DCA's and STRING's only key rotation), in the
slots and dtype of an engine's rotated keys, so a remap costs no cache memory beyond stock
serving; another band's keys are the held ones turned on by R(P_k^b(j) - P_k^held(j)), and
only over the keys that band covers at this step (a decoding step: ReRoPE's w, Self-Extend's
W keys; a prompt: its new tokens and the window before them), not every cached key (what an
unrotated cache needs: O(S) per band, layer and step, the plugin's decoding's largest cost
before). An encoding whose rotations do not compose (a rotation with an attention factor,
YaRN's mscale: R'(a) R'(b) = m^2 R(a + b)) keeps its keys unrotated (``rotations_compose``).
A prompt's step reads its request's keys and values back in one copy each (``gather_paged``);
a decoded token's step (``_decoding_step``) reads them where the cache holds them, each key and
value once, as vLLM's own decoding kernel does: on the CPU in float32 and float64 in one
compiled pass (``serve.paged_kernels``, numba: the bands' queries and a window's turned keys
rotated in it from the encoding's tables, the softmax online), elsewhere (bfloat16, another
device, no numba) in torch (``_torch_decoding_step``: batched products over views of the
request's blocks; only the few keys another band turns are copied).

Every function here is engine-independent (torch, numba and ropekit.encodings only), so the
main test suite checks it against ``banded_attention`` over contiguous keys without vLLM
(``tests/serve/test_paged_attention.py``).

Holds: Step, steps, write_paged, gather_paged, held_band, rotate_for_cache, rotations_compose,
paged_banded_attention, StepPositions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ropekit.encodings import bands_fused
from ropekit.encodings.positions import LastCall
from ropekit.encodings.rotary import PAIRINGS


@dataclasses.dataclass(frozen=True)
class Step:
    """One request's part of an engine step: its new tokens are rows [start, stop) of the
    step's queries; it has ``length`` keys (cached + new), the new ones last."""

    request: int  # its row of the block table
    start: int
    stop: int
    length: int

    @property
    def first_position(self) -> int:
        """The position of its first new token (the keys before it are cached)."""
        return self.length - (self.stop - self.start)


def steps(query_start_loc: Tensor, seq_lens: Tensor, num_tokens: int) -> list[Step]:
    """The requests of one step from vLLM's metadata: ``query_start_loc`` (R + 1,) the first
    query row of each request (and the end), ``seq_lens`` (R,) each request's keys after this
    step; rows at or past ``num_tokens`` are padding. ValueError where a request has more new
    tokens than keys (metadata that is not a causal decoder's)."""
    starts = [int(x) for x in query_start_loc.tolist()]
    lengths = [int(x) for x in seq_lens.tolist()]
    out = []
    for r in range(min(len(starts) - 1, len(lengths))):
        start, stop = starts[r], min(starts[r + 1], num_tokens)
        if stop <= start:
            continue
        if stop - start > lengths[r]:
            raise ValueError(
                f"request {r} has {stop - start} new tokens but {lengths[r]} keys in all; "
                "a causal decoder's keys include its new tokens"
            )
        out.append(Step(r, start, stop, lengths[r]))
    return out


def write_paged(
    key_cache: Tensor, value_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor
) -> None:
    """Store each token's key and value (N, K, D) at its slot (N,) of the caches (P, K, b, D):
    slot s is block s // b, offset s % b; slots < 0 (padding) are skipped. One compiled loop
    where the caches are ``_cache_arrays`` and nothing records gradients (``paged_kernels.
    write_rows``: a decoding step's write was 10 torch calls a layer), else torch's indexing."""
    b = key_cache.shape[2]
    n = min(slot_mapping.shape[0], key.shape[0])
    arrays = None if torch.is_grad_enabled() else _cache_arrays(key_cache, value_cache)
    if arrays is not None and slot_mapping.device.type == "cpu":
        keys, key_row, values, value_row = arrays
        _kernels().write_rows(
            keys.numpy(), key_row, values.numpy(), value_row, b, slot_mapping[:n].numpy(),
            key[:n].to(keys.dtype).contiguous().numpy(),
            value[:n].to(values.dtype).contiguous().numpy(),
        )  # fmt: skip
        return
    slots, key, value = slot_mapping[:n].long(), key[:n], value[:n]
    if bool((slots < 0).any()):  # (three selections less per layer where there is none)
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    blocks, offsets = torch.div(slots, b, rounding_mode="floor"), slots % b
    # Advanced indices on dims 0 and 2 around a slice: the indexed view is (n, K, D).
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)


def gather_paged(cache: Tensor, blocks: Tensor, length: int) -> Tensor:
    """A request's first ``length`` cached rows, (1, K, S, D), from the cache (P, K, b, D)
    and its block ids ``blocks`` (>= ceil(S / b) of them, in token order): a copy (never a
    view of the cache) in token order, made from the blocks where the cache holds them when
    their ids are consecutive (``_blocks``). (Advanced indexing took 2x as long here, and
    ``index_select`` on the transposed cache copies the whole cache first.)"""
    _, K, b, D = cache.shape
    n_blocks = -(-length // b)
    if blocks.shape[0] < n_blocks:
        raise ValueError(
            f"{length} keys need {n_blocks} blocks of {b}; the table has {blocks.shape[0]}"
        )
    rows = cache.new_empty(K, n_blocks, b, D)
    rows.copy_(_blocks(cache, _block_ids(blocks, n_blocks)).transpose(0, 1))
    return rows.view(K, n_blocks * b, D)[None, :, :length]  # (1, K, S, D): token order


def _blocks(cache: Tensor, blocks: Tensor | slice) -> Tensor:
    """A request's blocks (n, K, b, D) as the cache holds them, from ``_block_ids``: a view
    where their ids are consecutive, else one copy."""
    return cache[blocks] if isinstance(blocks, slice) else cache.index_select(0, blocks)


def _block_ids(blocks: Tensor, n: int) -> Tensor | slice:
    """A request's first ``n`` block ids: a slice where they are consecutive (vLLM hands out a
    lone request's blocks in order), else the ids."""
    runs = _block_runs(blocks, n)
    return runs[0][2] if runs is not None and len(runs) == 1 else blocks[:n].long()


def _block_runs(blocks: Tensor, n: int) -> list[tuple[int, int, slice]] | None:
    """A request's first ``n`` blocks as runs of consecutive ids: (lo, hi, the cache's blocks
    of table entries [lo, hi)); None for more than ``MAX_RUNS`` runs. (Read on the host, once
    for both caches: a test on the tensor took four ops per cache and layer.)"""
    ids = blocks[:n].tolist()
    starts = [0, *(i for i in range(1, n) if ids[i] != ids[i - 1] + 1)]
    if len(starts) > MAX_RUNS:
        return None
    return [
        (lo, hi, slice(ids[lo], ids[lo] + hi - lo))
        for lo, hi in zip(starts, [*starts[1:], n], strict=True)
    ]


# A decoded token's step reads a request's blocks where the cache holds them as long as they
# form at most this many runs of consecutive ids (one batched product per run and band piece);
# past it, one copy of keys and values in block order is cheaper than the products' calls.
MAX_RUNS = 16


@dataclasses.dataclass(frozen=True)
class _Run:
    """Blocks [lo, hi) of a request's table as ``keys`` and ``values`` (hi - lo, K, b, D):
    views of the cache where their ids are consecutive, else copies."""

    lo: int
    hi: int
    keys: Tensor
    values: Tensor


def _runs(key_cache: Tensor, value_cache: Tensor, blocks: Tensor, n: int) -> list[_Run]:
    """A request's first ``n`` blocks as runs of consecutive ids, each read where the cache
    holds it (a cache that has recycled blocks hands a request several runs); more than
    ``MAX_RUNS`` of them as one copy each of keys and values."""
    runs = _block_runs(blocks, n)
    if runs is None:
        index = blocks[:n].long()
        return [_Run(0, n, key_cache.index_select(0, index), value_cache.index_select(0, index))]
    return [_Run(lo, hi, key_cache[where], value_cache[where]) for lo, hi, where in runs]


def _overlaps(runs: Sequence[_Run], lo: int, hi: int):
    """(a, c, run) for each run's part of blocks [a, c) within [lo, hi)."""
    for run in runs:
        a, c = max(lo, run.lo), min(hi, run.hi)
        if c > a:
            yield a, c, run


@dataclasses.dataclass(frozen=True)
class _BandKeys:
    """The keys one band of a decoded token covers, as ``pieces`` (lo, hi, r0, r1): rows
    [r0, r1) of blocks [lo, hi) (the blocks its range fills, and the rows of a block it shares
    with another band or that ends at the last key); ``turn`` (hi - lo, b) over the rows of the
    blocks [lo, hi) that hold them: the turn from the held rotation to the band's own (rows past
    the last key: 0), None where the band reads its keys as the cache holds them."""

    lo: int
    hi: int
    pieces: tuple[tuple[int, int, int, int], ...]
    turn: Tensor | None


@dataclasses.dataclass(frozen=True)
class _DecodingLayout:
    """A decoded token's bands, the same in every layer of a step (``_decoding_layout``): the
    query's factor per band (n_bands, H|1, 1, 1) (its ``q_scale`` times the attention's scale)
    and position per band (n_bands, 1), so that one rotation makes every band's query; each
    band's keys (``_BandKeys``), None for a band that covers none; and the segments the
    compiled step reads (``paged_kernels.attend``): the bands' key ranges [starts, stops)
    in key order, each one's band, and where a segment's keys are turned, its first row in
    ``turns`` (else -1), int64 arrays; ``turns`` (1, N_t): the turn of every turned key, the
    segments one after another."""

    q_factors: Tensor
    q_positions: Tensor
    keys: tuple[_BandKeys | None, ...]
    starts: np.ndarray
    stops: np.ndarray
    bands: np.ndarray
    turned_at: np.ndarray
    turns: Tensor


_last_decoding = LastCall()


def _pieces(a: int, c: int, b: int) -> tuple[tuple[int, int, int, int], ...]:
    """Keys [a, c) as rows of blocks of b: (lo, hi, r0, r1), rows [r0, r1) of blocks [lo, hi)."""
    lo, hi = -(-a // b), c // b  # the blocks wholly inside
    if hi < lo:  # within one block
        return ((a // b, a // b + 1, a % b, c - a // b * b),)
    pieces = [(lo - 1, lo, a % b, b)] if a % b else []
    pieces += [(lo, hi, 0, b)] if hi > lo else []
    return (*pieces, *([(hi, hi + 1, 0, c % b)] if c % b else []))


def _decoding_layout(
    bands: Sequence[Any], k_pos: Tensor, held: Tensor, block: int, scale: float
) -> _DecodingLayout:
    """The ``_DecodingLayout`` of a decoded token over keys at ``k_pos`` (1, S) held rotated
    at ``held``, in blocks of ``block`` rows; kept for the next call with the very same bands
    and key positions (the step's other layers: ``LastCall``), whose rotations then find their
    tables in the encoding's cache (the same position tensors)."""
    key = (block, scale)
    layout = _last_decoding.get(key, bands, k_pos)
    if layout is not None:
        return layout
    length = k_pos.shape[-1]
    first, stop = bands_fused.index_bounds(bands, k_pos, 1, length - 1)  # (n_bands, 1, 1)
    firsts, stops = first.flatten().tolist(), stop.flatten().tolist()
    parts = []
    for band, a, c in zip(bands, firsts, stops, strict=True):
        lo, hi = a // block, -(-c // block)
        turn = None
        if band.k_positions is not held:
            rows = slice(lo * block, min(hi * block, length))
            turn = band.k_positions[:, rows] - held[:, rows]
            turn = F.pad(turn, (0, (hi - lo) * block - turn.shape[1])).view(hi - lo, block)
        parts.append(_BandKeys(lo, hi, _pieces(a, c, block), turn) if c > a else None)
    factors = torch.cat([
        (band.q_scale.double() if band.q_scale is not None else k_pos.new_ones((1, 1, 1, 1),
            dtype=torch.float64)).expand(1, -1, 1, 1) * scale
        for band in bands
    ])  # fmt: skip
    positions = torch.cat([band.q_positions.double() for band in bands])  # (n_bands, 1)
    segments = sorted(
        (a, c, i) for i, (a, c) in enumerate(zip(firsts, stops, strict=True)) if c > a
    )
    turned_at, turns, n_turned = [], [], 0
    for a, c, i in segments:
        part = parts[i]
        turned_at.append(-1 if part.turn is None else n_turned)
        if part.turn is not None:  # the turns of keys [a, c), from its blocks' rows
            turns.append(part.turn.flatten()[a - part.lo * block : c - part.lo * block])
            n_turned += c - a
    layout = _DecodingLayout(
        factors, positions, tuple(parts),
        *np.array([s[:3] for s in segments], dtype=np.int64).reshape(-1, 3).T.copy(),
        np.array(turned_at, dtype=np.int64),
        torch.cat(turns)[None] if turns else k_pos.new_zeros((1, 0), dtype=torch.float64),
    )  # fmt: skip
    return _last_decoding.put(key, bands, k_pos, layout)


@torch.no_grad()  # serving only: autograd refuses the products written into the table (out=)
def _torch_decoding_step(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    blocks: Tensor,
    length: int,
    bands: Sequence[Any],
    k_pos: Tensor,
    held: Tensor,
    rotate: Any,
    scale: float,
) -> Tensor:
    """One decoded token's banded attention (1, H, 1, D) over keys held rotated (module
    docstring), reading the cache where it holds the keys and values: the request's blocks run
    by run of consecutive ids (``_runs``), no copy into token order. Each band's logits come
    from batched products of its query with the blocks that hold its keys (blocks x kv heads as
    one batch, the query heads of each kv head as rows: views of the cache), on the rows of its
    own keys only (``_BandKeys.pieces``: rows a block shares with another band, or past the
    last key, are left to the other band or unread), into one (blocks, K, g, b) table; a band
    that reads its keys other than the cache holds them (a window) turns a copy of its few
    blocks first. One softmax over the row (exact: each key's logit from the one band covering
    it), and the values summed block by block where the cache holds them. Every band's query
    comes from one rotation. What serves a decoded token where the compiled pass does not run
    (``_decoding_step``): through 30 layers' caches it took 1.32-1.75x vLLM's own decoding
    kernel, the compiled pass 0.99-1.49x in the same runs (``benchmarks/vllm_decoding.py``;
    the engine's record: docs/serving)."""
    _, K, b, D = key_cache.shape
    H = q.shape[1]
    g = H // K
    layout = _decoding_layout(bands, k_pos, held, b, scale)
    n, tail = divmod(length, b)
    runs = _runs(key_cache, value_cache, blocks, n + (tail > 0))
    queries = rotate(q.expand(len(bands), H, 1, D) * layout.q_factors.to(q.dtype),
                     layout.q_positions, True)  # (n_bands, H, 1, D)  # fmt: skip
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    logits = q.new_full((n + (tail > 0), K, g, b), float("-inf"), dtype=acc)  # unwritten: 0
    for query, part in zip(queries.view(-1, 1, K, g, D), layout.keys, strict=True):
        if part is None:
            continue
        turned = None
        if part.turn is not None:  # a copy of its few blocks, turned (rows of no piece: unread)
            blocks_of = [
                r.keys[a - r.lo : c - r.lo] for a, c, r in _overlaps(runs, part.lo, part.hi)
            ]
            source = blocks_of[0] if len(blocks_of) == 1 else torch.cat(blocks_of)
            turned = _Run(part.lo, part.hi, rotate(source, part.turn, False), None)
        for lo, hi, r0, r1 in part.pieces:
            for a, c, run in _overlaps([turned] if turned else runs, lo, hi):
                # (m K, g, D) @ (m K, D, r): blocks x kv heads as one batch, views of the cache
                keys_t = run.keys[a - run.lo : c - run.lo, :, r0:r1].flatten(0, 1).transpose(1, 2)
                query_rows = query.expand(c - a, K, g, D).flatten(0, 1)
                if r1 - r0 == b and logits.dtype == q.dtype:  # whole blocks, no copy: the
                    # products written where the table holds them (bf16/fp16: cast on copy)
                    torch.bmm(query_rows, keys_t, out=logits[a:c].view(-1, g, b))
                else:
                    scores = torch.bmm(query_rows, keys_t)
                    logits[a:c, :, :, r0:r1] = scores.view(c - a, K, g, r1 - r0)
    # One softmax over the row, normalised after the values: exp(l - max) V / sum exp(l - max)
    weights = logits.sub_(logits.amax((0, 3), keepdim=True)).exp_()  # (n', K, g, b), in place
    total = weights.sum((0, 3))[..., None]  # (K, g, 1)
    weights = weights.to(q.dtype)
    out = None
    for a, c, run in _overlaps(runs, 0, n):
        part = torch.bmm(
            weights[a:c].flatten(0, 1), run.values[a - run.lo : c - run.lo].flatten(0, 1)
        )
        part = part.view(c - a, K, g, D).sum(0)
        out = part if out is None else out + part
    if out is None:
        out = q.new_zeros(K, g, D)
    if tail:  # the last block's rows past the last key may hold anything: not read
        run = runs[-1]
        out = out + weights[n, :, :, :tail] @ run.values[n - run.lo, :, :tail]
    out = out / total.to(out.dtype)
    return out.reshape(1, H, 1, D)


@torch.no_grad()  # serving only; learned frequencies' tables leave autograd for numpy
def _decoding_step(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    blocks: Tensor,
    length: int,
    bands: Sequence[Any],
    k_pos: Tensor,
    held: Tensor,
    encoding: Any,
    layer: int,
    scale: float,
) -> Tensor:
    """One decoded token's banded attention (1, H, 1, D) over keys held rotated: one call of
    ``paged_kernels.attend`` where the compiled pass runs (``_kernel_arrays``: numba, the CPU,
    float32 or float64, vLLM's cache layout or contiguous caches; and an encoding whose
    rotation is tables, ``band_tables``), which also rotates every band's query and turns a
    window's keys by those tables (made once per step for a schedule whose tables do not depend
    on the layer: the same positions tensors every layer); else the torch step
    (``_torch_decoding_step``). Both are held to ``banded_attention`` in float64
    (tests/serve/test_paged_attention.py)."""
    b, D = key_cache.shape[2:]
    H = q.shape[1]
    arrays = _kernel_arrays(q, key_cache, value_cache, blocks, encoding)
    layout = _decoding_layout(bands, k_pos, held, b, scale)
    q_tables = None
    if arrays is not None:
        q_tables = encoding.band_tables(layout.q_positions, True, layer, q.dtype)
    if q_tables is None:
        rotate = functools.partial(encoding.rotate_band, layer=layer)
        return _torch_decoding_step(
            q, key_cache, value_cache, blocks, length, bands, k_pos, held, rotate, scale
        )
    t_cos, t_sin = encoding.band_tables(layout.turns, False, layer, q.dtype)  # (1, K|1, N_t, F)
    q_cos, q_sin = q_tables  # (n_bands, H|1, 1, F)
    keys, key_row, values, value_row = arrays
    out = q.new_empty(H, D, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    _kernels().attend(
        q[0, :, 0].contiguous().numpy(), layout.q_factors[:, :, 0, 0].numpy(),
        q_cos[:, :, 0].numpy(), q_sin[:, :, 0].numpy(), keys.numpy(), key_row, values.numpy(),
        value_row, b, blocks[: -(-length // b)].numpy(), layout.starts, layout.stops,
        layout.bands, layout.turned_at, t_cos[0].numpy(), t_sin[0].numpy(),
        encoding.pairing == "interleaved", out.numpy(),
    )  # fmt: skip
    return out.to(q.dtype).view(1, H, 1, D)


# What the compiled loops read (numba has no bfloat16 or float16).
_COMPILED_DTYPES = (torch.float32, torch.float64)


@functools.cache
def _kernels() -> Any:
    """The module ``paged_kernels``, or None where numba is not installed (vLLM's environment
    has it: vLLM requires it)."""
    try:
        from ropekit.serve import paged_kernels
    except ImportError:
        return None
    return paged_kernels


def _kernel_arrays(
    q: Tensor, key_cache: Tensor, value_cache: Tensor, blocks: Tensor, encoding: Any
) -> tuple[Tensor, int, Tensor, int] | None:
    """The caches as ``paged_kernels.attend`` reads them (``_cache_arrays``), or None where
    the compiled step does not run: not those caches, a query of another dtype or device, or
    an encoding without a pairing the kernel knows."""
    if q.dtype != key_cache.dtype or blocks.device.type != "cpu" or not _pairs_known(encoding):
        return None
    return _cache_arrays(key_cache, value_cache)


def _pairs_known(encoding: Any) -> bool:
    """Whether the compiled loops know the encoding's pairing (``paged_kernels._rotate_row``:
    every pairing ``rotary.rotate`` has)."""
    return getattr(encoding, "pairing", None) in PAIRINGS


def _cache_arrays(key_cache: Tensor, value_cache: Tensor) -> tuple[Tensor, int, Tensor, int] | None:
    """(keys, key_row, values, value_row) as the compiled loops (``paged_kernels``) read the
    caches (P, K, b, D): C-contiguous (P, K, R, D) arrays and the first of each block's b rows
    in them; the caches themselves where they are contiguous, else the one array both are row
    ranges of (vLLM's CPU cache: each block's keys, then its values,
    ``vllm_plugin._split_cache``). None where no compiled loop runs: no numba, not the CPU, not
    float32 or float64, or another layout."""
    if (
        _kernels() is None
        or key_cache.device.type != "cpu"
        or key_cache.dtype not in _COMPILED_DTYPES
        or value_cache.dtype != key_cache.dtype
    ):
        return None
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        return key_cache, 0, value_cache, 0
    P, K, b, D = key_cache.shape
    s0, s1, s2, s3 = key_cache.stride()
    rows = s1 // D
    gap = value_cache.storage_offset() - key_cache.storage_offset()
    if (
        (s2, s3) != (D, 1)
        or value_cache.stride() != key_cache.stride()
        or s1 != rows * D
        or s0 != K * s1
        or value_cache.untyped_storage().data_ptr() != key_cache.untyped_storage().data_ptr()
        or gap % D
        or not b <= gap // D <= rows - b
    ):
        return None
    parent = key_cache.as_strided((P, K, rows, D), (s0, s1, D, 1))
    return parent, 0, parent, gap // D


def held_band(bands: Sequence[Any]) -> int:
    """The band whose key rotation the cache holds (module docstring): the one that reaches
    back to the first key (no lower bound), or the first band."""
    return next((i for i, band in enumerate(bands) if band.lo is None), 0)


def rotate_for_cache(encoding: Any, keys: Tensor, positions: Tensor, layer: int) -> Tensor:
    """Keys (1, K, N, D) at ``positions`` (1, N) rotated as the held band reads them: what the
    plugin's rotary hands vLLM's cache. One compiled loop where nothing records gradients,
    the keys are the rows (N, K, D) of a float32 or float64 CPU tensor (vLLM's, transposed) and
    the encoding's rotation is tables (``paged_kernels.rotate_rows``: a decoding step's
    rotation was an autograd function and 8 torch calls a layer), else ``rotate_band``."""
    bands = encoding.bands(positions, positions, layer)
    held = bands[held_band(bands)].k_positions
    rows = keys[0].transpose(0, 1)  # (N, K, D)
    if (
        not torch.is_grad_enabled()
        and keys.shape[0] == 1
        and rows.is_contiguous()
        and keys.device.type == "cpu"
        and keys.dtype in _COMPILED_DTYPES
        and _pairs_known(encoding)
        and _kernels() is not None
    ):
        tables = encoding.band_tables(held, False, layer, keys.dtype)  # (1, K|1, N, F)
        if tables is not None:
            out = torch.empty_like(rows)
            _kernels().rotate_rows(
                rows.numpy(), tables[0][0].numpy(), tables[1][0].numpy(),
                encoding.pairing == "interleaved", out.numpy(),
            )  # fmt: skip
            return out.transpose(0, 1)[None]
    return encoding.rotate_band(keys, held, False, layer)


def rotations_compose(encoding: Any, n_kv_heads: int, head_dim: int, layers: int) -> bool:
    """Whether ``encoding.rotate_band`` rotating keys at a then at b is rotating them at
    a + b in every layer (checked in float64 on random keys at integer and fractional
    positions): the condition for holding keys rotated (module docstring)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, n_kv_heads, 3, head_dim, generator=g, dtype=torch.float64)
    a = torch.tensor([[0.0, 17.0, 9000.5]], dtype=torch.float64)
    b = torch.tensor([[5.0, 4096.25, 3.0]], dtype=torch.float64)
    for layer in range(layers):
        twice = encoding.rotate_band(encoding.rotate_band(x, a, False, layer), b, False, layer)
        once = encoding.rotate_band(x, a + b, False, layer)
        if not torch.allclose(twice, once, rtol=1e-9, atol=1e-9):
            return False
    return True


def _band_keys(
    keys: Tensor,
    bands: Sequence[Any],
    first: Tensor,
    stop: Tensor,
    held: Tensor | None,
    rotate: Any,
) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
    """(each distinct key rotation's keys (1, K, S, D), each band's index into them), from
    ``keys`` (a fresh copy: rotated in place where that is safe) held rotated at ``held``
    (1, S) (None: unrotated). ``first``, ``stop`` (n_bands, 1, T): each band's key index
    range per query row (``bands_fused.index_bounds``); a rotation turns only the keys in the
    union of its bands' ranges, all the fused kernel reads of them (its pieces lie within
    them); rows outside hold the keys as held, which no band of that rotation reads."""
    order: dict[int, int] = {}
    slots = tuple(order.setdefault(id(band.k_positions), len(order)) for band in bands)
    lows, highs = first.flatten(1).amin(1).tolist(), stop.flatten(1).amax(1).tolist()
    spans = []  # per rotation: (positions, first key, stop key)
    for slot in range(len(order)):
        members = [b for b, s in enumerate(slots) if s == slot]
        positions = bands[members[0]].k_positions
        spans.append((positions, min(lows[b] for b in members), max(highs[b] for b in members)))
    out = []
    for positions, lo, hi in spans:
        if positions is held or hi <= lo:
            out.append(keys)  # as held (or read by no band)
            continue
        # Rotated in place when no other rotation reads these keys (decoding: the near band's
        # window and the far band's older keys); else on a copy (a prompt's rows see a key
        # in both).
        alone = all(h <= lo or hi <= l for p, l, h in spans if p is not positions and h > l)
        target = keys if alone else keys.clone()
        turn = positions[:, lo:hi] if held is None else positions[:, lo:hi] - held[:, lo:hi]
        target[:, :, lo:hi] = rotate(keys[:, :, lo:hi], turn, False)
        out.append(target)
    return tuple(out), slots


class StepPositions:
    """Position tensors for a (first position, new tokens, keys) triple, reused by every layer
    of a step: the encoding's band and rotation-table caches match the very tensors
    (``ropekit.encodings.positions.PositionsKey``), so a step computes them once."""

    KEPT = 64

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int, str], tuple[Tensor, Tensor]] = {}

    def __call__(self, step: Step, device: torch.device) -> tuple[Tensor, Tensor]:
        key = (step.first_position, step.length, str(device))
        found = self._kept.get(key)
        if found is None:
            k_pos = torch.arange(step.length, device=device)[None]  # (1, S)
            found = (k_pos[:, step.first_position :], k_pos)  # q (1, T), k (1, S)
            if len(self._kept) >= self.KEPT:
                self._kept.pop(next(iter(self._kept)))
            self._kept[key] = found
        return found


def paged_banded_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    plan: list[Step],
    encoding: Any,
    layer: int,
    scale: float,
    out: Tensor,
    positions: StepPositions | None = None,
    keys_held: bool = False,
) -> Tensor:
    """Each request's queries (rows of ``query`` (N, H, D), unrotated) attended to its keys
    and values in the paged caches (P, K, b, D) with the remap's bands (``encoding``: a
    ``RemapEncoding``; ``layer`` its layer), written into ``out`` (N, H, D) and returned.
    ``plan``: the step's requests (``steps``). ``keys_held``: the cache holds the keys rotated
    as ``rotate_for_cache`` rotates them (else unrotated). Causal: query i sees the keys at
    positions <= i."""
    positions = StepPositions() if positions is None else positions
    rotate = functools.partial(encoding.rotate_band, layer=layer)
    for step in plan:
        blocks = block_table[step.request]
        q = query[step.start : step.stop].transpose(0, 1)[None].to(key_cache.dtype)  # (1,H,T,D)
        q_pos, k_pos = positions(step, query.device)
        bands = encoding.bands(q_pos, k_pos, layer)
        held = bands[held_band(bands)].k_positions if keys_held else None
        if held is not None and q.shape[2] == 1:
            o = _decoding_step(
                q, key_cache, value_cache, blocks, step.length, bands, k_pos, held, encoding,
                layer, scale,
            )  # fmt: skip
        else:
            keys = gather_paged(key_cache, blocks, step.length)  # (1, K, S, D)
            values = gather_paged(value_cache, blocks, step.length)
            offset = step.length - q.shape[2]  # causal: row r sees keys <= r + offset
            first, stop = bands_fused.index_bounds(bands, k_pos, q.shape[2], offset)
            band_keys, slots = _band_keys(keys, bands, first, stop, held, rotate)
            o = bands_fused.fused_banded_attention(
                q, band_keys, values, bands, k_pos, rotate, slots=slots, scale=scale,
                causal_offset=offset, mask=None,
            )  # fmt: skip
        out[step.start : step.stop] = o[0].transpose(0, 1).to(out.dtype)  # (T, H, D)
    return out
