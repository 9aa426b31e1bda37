"""Positional skip-wise (PoSE) samples: short windows of real text whose position ids jump, so
that training at a short length sees the relative distances of a long target context.

PoSE (Zhu et al. 2023, "PoSE: Efficient Context Window Extension of LLMs via Positional
Skip-wise Training", arXiv:2309.10400, Sec. 3.2) keeps the training window at ``window`` tokens
(memory and time of a short sequence) and adds skipping biases to the position ids of its
chunks, so that over many samples every relative distance 1..target-1 is trained.

Layout of one sample (N = 2 chunks, the paper's default):

    positions  [start, start + split)  U  [start + skip + split, start + skip + window)
    chunk 0: ``split`` tokens           chunk 1: ``window - split`` tokens, ``skip`` later

Sampling (per sample, seeded by (seed, sample index); see ``draw_layout``):
- ``split`` ~ U{1, ..., ceil(window / 2)}: chunk lengths are random (Eq. 3); the authors' code
  (github.com/dwzhu-pku/PoSE, ``train_preprocess_function_pose``) caps chunk 0 at half the
  window so the long-distance chunk keeps at least half the tokens.
- ``skip`` ~ U{0, ..., target - window}: the skipping bias of chunk 1 (Eq. 4, u_1 ~ U). The
  largest distance in the sample, skip + window - 1, is then uniform over window-1..target-1,
  the "more uniform coverage of large relative positions" of the authors' revised sampling.
- ``start`` ~ U{0, ..., target - window - skip}: chunk 0's own offset. The paper's final
  version fixes u_0 = 0; drawing the offset of the pair *after* the gap leaves the relative
  distances distributed exactly as there while also varying absolute positions, which
  length-aware encodings see (AdaScale's temperature depends on the query position).
- Text: the tokens of the full-length window *at those positions* (the paper's v_i = u_i,
  Appendix A, Table 4: as good as its default), with their true next tokens as labels. A PoSE
  sample is thus a subsequence of the same window a full-length run trains on: every method
  sees the same text, and positions are where the tokens really are.

Positions increase strictly, so a model that reads non-increasing positions as a document
boundary (ropekit's ``Decoder``) keeps the two chunks in one document. transformers (5.24,
``masking_utils.find_packed_sequence_indices``) reads any jump (diff != 1) in ``position_ids``
as a packed-sequence boundary when neither ``attention_mask`` nor a cache is given, and chunk 1
would then not see chunk 0: pass an all-ones ``attention_mask`` with PoSE batches (what
``ropekit.train.extend`` does for Hugging Face models).

Holds: PoseLayout, draw_layout, PoseDataset.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import Tensor

# Own random stream, independent of packing's order and retrieval streams (packing.py).
_POSE_STREAM = 2


@dataclasses.dataclass(frozen=True)
class PoseLayout:
    """Where the ``window`` tokens of one PoSE sample sit in a ``target``-position context."""

    window: int  # real tokens in the sample
    target: int  # context the positions cover (positions < target)
    split: int  # tokens in chunk 0 (1 <= split <= window - 1)
    start: int  # position of chunk 0's first token
    skip: int  # extra distance between the chunks (0 = contiguous)

    def __post_init__(self) -> None:
        if not 2 <= self.window <= self.target:
            raise ValueError(
                f"window={self.window} is not allowed with target={self.target}; "
                "it must satisfy 2 <= window <= target"
            )
        if not 1 <= self.split <= self.window - 1:
            raise ValueError(f"split={self.split} must lie in [1, window - 1 = {self.window - 1}]")
        if self.start < 0 or self.skip < 0:
            raise ValueError(f"start={self.start} and skip={self.skip} must be >= 0")
        if self.start + self.skip + self.window > self.target:
            raise ValueError(
                f"start + skip + window = {self.start + self.skip + self.window} exceeds "
                f"target={self.target}: the last position must be < target"
            )

    def positions(self) -> Tensor:
        """Position ids (window,), long, strictly increasing, all < target."""
        steps = torch.arange(self.window)  # (window,)
        return steps + self.start + torch.where(steps < self.split, 0, self.skip)


def draw_layout(window: int, target: int, rng: np.random.Generator) -> PoseLayout:
    """One PoSE layout drawn as the paper does (module docstring); ``window == target`` gives
    the plain window (skip 0, start 0)."""
    if not 2 <= window <= target:
        raise ValueError(
            f"window={window} is not allowed with target={target}; it must satisfy "
            "2 <= window <= target"
        )
    split = int(rng.integers(1, (window + 1) // 2, endpoint=True))
    skip = int(rng.integers(0, target - window, endpoint=True))
    start = int(rng.integers(0, target - window - skip, endpoint=True))
    return PoseLayout(window, target, split, start, skip)


class PoseDataset(torch.utils.data.Dataset):
    """PoSE samples cut from a dataset of full-length (``target``-token) samples.

    Item ``i`` takes base item ``i % len(base)`` and a layout seeded by (seed, i): with
    ``repeats`` > 1 (epochs), a window seen again gets fresh positions, as every PoSE training
    example does in the paper. Items: ``input_ids``, ``labels`` and any other (target,) tensor
    of the base item at the layout's positions, plus ``position_ids`` (window,). The same
    index gives the same item every time (resuming and multi-process training rely on it).
    """

    def __init__(
        self, base: Any, window: int, target: int, *, seed: int = 0, repeats: int = 1
    ) -> None:
        if not 2 <= window <= target:
            raise ValueError(
                f"pose window={window} is not allowed with target length {target}; it must "
                "satisfy 2 <= window <= target"
            )
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats={repeats!r} is not allowed; it must be an integer >= 1")
        if len(base) < 1:
            raise ValueError("a PoSE dataset needs at least one base sample")
        self.base, self.window, self.target = base, window, target
        self.seed, self.repeats = seed, repeats

    def __len__(self) -> int:
        return len(self.base) * self.repeats

    def layout(self, index: int) -> PoseLayout:
        """The layout of item ``index`` (a pure function of seed and index)."""
        rng = np.random.default_rng([self.seed, _POSE_STREAM, index])
        return draw_layout(self.window, self.target, rng)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} PoSE samples")
        item = self.base[index % len(self.base)]
        if "position_ids" in item:
            raise ValueError(
                "PoSE needs base samples with default positions (0..target-1); this one has "
                "position_ids"
            )
        if item["input_ids"].shape != (self.target,):
            raise ValueError(
                f"PoSE base samples must hold target={self.target} tokens; got input_ids "
                f"{tuple(item['input_ids'].shape)}"
            )
        positions = self.layout(index).positions()  # (window,)
        sample = {key: value[positions] for key, value in item.items()}  # (window,) each
        sample["position_ids"] = positions
        return sample
