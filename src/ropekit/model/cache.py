"""The key/value cache for incremental decoding.

Shape legend: B batch · K key/value heads · T new tokens · S cached + new tokens · D head dim.

What the keys hold depends on the encoding (the decoder decides, this class only stores):
- static encodings (``encoding.dynamic`` False): keys are stored *rotated*, once, since a
  key's rotation depends only on its own position;
- distance remaps (``encoding.remaps_distance``: ReRoPE, Self-Extend, DCA, STRING): keys are
  stored *unrotated*; each band rotates them at its own positions when attending (a key is
  rotated differently for near and far queries), which is exact at every step;
- dynamic encodings (dynamic NTK, LongRoPE): the frequencies follow the current length
  L = max(position) + 1, so keys are stored *unrotated* and every step rotates all of them
  again at the current L. Every layer's attention for the new tokens is then exactly what a
  full forward at length L computes from the same layer inputs (caching keys rotated at their
  own step's length, as transformers does, would pair new-frequency queries with
  old-frequency keys). What no cache can revisit are the past tokens' hidden states: in layers
  above the first, an earlier token's keys and values were computed at the length of its own
  step. So a one-layer model decodes exactly as full forwards over each prefix; a deeper one
  differs from them past the original length (recomputing the prefix is the only cure), as
  ``ropekit.hf``'s patched models do too. Measured (float64, greedy steps past 5x the
  original length of 8 on ``tests/model/tiny.py``'s sharp-attention decoder, logit std 1.4):
  max |cached - full forward of the prefix| = 9e-15 with one layer, 1.15 (dynamic-ntk x2) and
  2.0 (longrope) with two layers, 0.9 and 1.7 with four; within the original length 1e-14.
  On ``tests/tiny.py``'s 2-layer Llama (L0 = 32, 24 prompt + 24 new tokens, logit std
  0.65): 0.035 (dynamic-ntk x4) and 0.11 (longrope); one layer 1e-7.

Positions of every cached key are kept too: bias encodings (ALiBi) need them, dynamic
encodings re-rotate with them, and packed rows (positions that restart) need them to mask
across documents.

``crop(n)`` keeps the first n tokens: keys, values and positions alike, so a cache cropped
back to a prefix is the cache a fresh prefill of that prefix leaves (bit for bit: nothing is
recomputed, and with a dynamic schedule the kept keys are still unrotated, their positions
beside them). Many questions can then be asked of one long prefix, each from the same state
(``ropekit.evals.probes``).

Holds: KVCache (``update``, ``append_positions``, ``crop``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ropekit.encodings.bands import RotatedKeys


def _cat(a: Tensor, b: Tensor, dim: int) -> Tensor:
    """Concatenate along ``dim`` after broadcasting a batch of 1 (dim 0) against B."""
    batch = max(a.shape[0], b.shape[0])
    return torch.cat((a.expand(batch, *a.shape[1:]), b.expand(batch, *b.shape[1:])), dim=dim)


class KVCache:
    """Per-layer keys and values of every token seen so far, and their positions.

    Start empty (``KVCache()``), pass it to ``Decoder.forward(..., cache=cache)`` and keep
    passing it: each call appends the new tokens. One cache serves one model and one batch.
    A forward that raises midway leaves the cache unusable.
    """

    def __init__(self) -> None:
        self.keys: dict[int, Tensor] = {}  # layer -> (B, K, S, D): rotated, unrotated if dynamic
        self.values: dict[int, Tensor] = {}  # layer -> (B, K, S, D)
        self.positions: Tensor | None = None  # (B|1, S) absolute position of each cached key
        # layer -> a distance remap's rotated keys per band (bands.RotatedKeys), so decoding
        # rotates only the new keys; cropped with the keys.
        self.rotated: dict[int, RotatedKeys] = {}

    def __len__(self) -> int:
        """S: number of cached tokens."""
        return 0 if self.positions is None else self.positions.shape[-1]

    def append_positions(self, positions: Tensor) -> Tensor:
        """Record the new tokens' positions (B|1, T); return those of all keys (B|1, S).

        The cache keeps its own copy: a caller that advances its positions tensor in place
        (``pos += 1``) must not rewrite the positions of keys already cached."""
        if self.positions is not None:
            positions = _cat(self.positions, positions, dim=-1)  # (B|1, S), a new tensor
        else:
            positions = positions.clone()
        self.positions = positions
        return positions

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (0 <= length <= len(self)), drop the rest.

        The kept tensors are views of the old ones: the next ``update`` concatenates, so it
        writes new storage and the prefix is never modified in place."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= len(self):
            raise ValueError(
                f"length={length!r} is not allowed; allowed: an integer in 0..{len(self)} (the "
                "tokens cached)"
            )
        if length == 0:  # empty again: default positions restart at 0, as in a new cache
            self.keys, self.values, self.positions, self.rotated = {}, {}, None, {}
            return
        for memo in self.rotated.values():
            memo.truncate(length)
        for layer in self.keys:
            self.keys[layer] = self.keys[layer][:, :, :length]  # (B, K, length, D)
            self.values[layer] = self.values[layer][:, :, :length]
        assert self.positions is not None
        self.positions = self.positions[:, :length]  # (B|1, length)

    def rotated_keys(self, layer: int) -> RotatedKeys:
        """The rotated keys a distance remap keeps for ``layer`` (made on first use)."""
        return self.rotated.setdefault(layer, RotatedKeys())

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k, v (B, K, T, D) to ``layer``; return all keys and values (B, K, S, D)."""
        if layer in self.keys:
            k = _cat(self.keys[layer], k, dim=-2)
            v = _cat(self.values[layer], v, dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v
