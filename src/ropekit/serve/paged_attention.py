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
    banded_attention(q, keys, values, encoding.bands(q_pos, k_pos), ...)  (1, H, T, D)

The cache holds the keys *unrotated* (the bands rotate them per band at use, as ropekit's
own KV cache does for remaps), in the same slots as an engine's rotated keys: a remap costs no
cache memory beyond stock serving; it costs rotating each band's keys at every step (O(S)
per band and layer, about what the attention's own O(S) reads cost in a decoding step) and
one transient copy of the request's keys and values per layer (gathered from the blocks).

Every function here is engine-independent (torch and ropekit.encodings only), so the main
test suite checks it against ``banded_attention`` over contiguous keys without vLLM
(``tests/serve/test_paged_attention.py``).

Holds: Step, steps, write_paged, gather_paged, paged_banded_attention, StepPositions.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import Tensor

from ropekit.encodings.bands import banded_attention


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
    slot s is block s // b, offset s % b; slots < 0 (padding) are skipped."""
    b = key_cache.shape[2]
    n = min(slot_mapping.shape[0], key.shape[0])
    slots = slot_mapping[:n].long()
    keep = slots >= 0
    slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
    blocks, offsets = torch.div(slots, b, rounding_mode="floor"), slots % b
    # Advanced indices on dims 0 and 2 around a slice: the indexed view is (n, K, D).
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)


def gather_paged(cache: Tensor, blocks: Tensor, length: int) -> Tensor:
    """A request's first ``length`` cached rows, (1, K, S, D), from the cache (P, K, b, D)
    and its block ids ``blocks`` (>= ceil(S / b) of them, in token order)."""
    _, K, b, D = cache.shape
    n_blocks = -(-length // b)
    if blocks.shape[0] < n_blocks:
        raise ValueError(
            f"{length} keys need {n_blocks} blocks of {b}; the table has {blocks.shape[0]}"
        )
    picked = cache.index_select(0, blocks[:n_blocks].long())  # (n, K, b, D)
    rows = picked.transpose(0, 1).reshape(K, n_blocks * b, D)  # (K, n b, D): token order
    return rows[None, :, :length]  # (1, K, S, D)


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
) -> Tensor:
    """Each request's queries (rows of ``query`` (N, H, D), unrotated) attended to its keys
    and values in the paged caches (P, K, b, D; keys unrotated) with the remap's bands
    (``encoding``: a ``RemapEncoding``; ``layer`` its layer), written into ``out``
    (N, H, D) and returned. ``plan``: the step's requests (``steps``). Causal: query i sees
    the keys at positions <= i."""
    positions = StepPositions() if positions is None else positions
    rotate = functools.partial(encoding.rotate_band, layer=layer)
    for step in plan:
        blocks = block_table[step.request]
        keys = gather_paged(key_cache, blocks, step.length)  # (1, K, S, D)
        values = gather_paged(value_cache, blocks, step.length)
        q = query[step.start : step.stop].transpose(0, 1)[None]  # (1, H, T, D)
        q_pos, k_pos = positions(step, query.device)
        o = banded_attention(
            q.to(keys.dtype), keys, values, encoding.bands(q_pos, k_pos, layer), k_pos, rotate,
            scale=scale, causal_offset=step.length - q.shape[2],
        )  # fmt: skip
        out[step.start : step.stop] = o[0].transpose(0, 1).to(out.dtype)  # (T, H, D)
    return out
