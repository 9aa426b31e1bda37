"""Training-free clipping of RoPE's lowest frequencies: CoPE's soft clip and the hard clip it
is compared with (Li et al. 2026, "CoPE: Clipped RoPE as A Scalable Free Lunch for Long
Context LLMs", arXiv 2602.05258; code: hrlics/CoPE, modeling_cope.py, LlamaRotaryEmbedding).

Shape legend: F rotary pairs, f = 0..F-1 from the fastest pair to the slowest.

The pairs whose wavelength 2 pi / theta_f exceeds the training length never turned fully in
training, so beyond it they meet angles they never saw: the paper's "OOD outliers". CoPE
scales the ``clip`` slowest pairs by a raised-cosine (Hann) taper that goes from 1 at the
first clipped pair to 0 at the slowest, which freezes the slowest pair and, unlike a hard
cut, avoids the long-range ringing ("spectral leakage") a step in the spectrum causes:

    c = clip, start = F - c, m_j = (1 + cos(pi j / (c - 1))) / 2 for j = 0..c-1 (m = 1 if c = 1)
    cope:     theta'_f = theta_f                  f < start
              theta'_f = theta_f m_(f - start)    f >= start
    hardclip: theta'_f = 0                        f >= start  (the pair does not rotate)

exactly as the authors' code forms it (``torch.linspace(0, pi, steps=clip)``,
``0.5 * (1 + cos)``, the last ``clip`` entries of ``inv_freq``; min(clip, F)), here in
float64 over plain RoPE at the model's base. A theta of 0 keeps its pair at angle 0, so a
hard-clipped pair carries no position at all (NoPE channels).

Cut-off: the authors' code clips ``clip_low_n = 20`` of Llama-3-8B's 64 pairs (base 5e5,
L0 = 8192). A count does not transfer across head sizes, so ``clip`` defaults to that share,
round(F x 20 / 64): 10 of SmolLM2-135M's 32 pairs (its pairs with a wavelength beyond its
8k are 12: f >= 20). Give ``clip=`` for another count.

Holds: AUTHORS_SHARE, default_clip, cope_mask, cope, hard_clip, CopeConfig, HardClipConfig.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from torch import Tensor

from . import schedules
from .rope import RopeConfig

# The authors' cut-off: 20 of Llama-3-8B's 64 rotary pairs (modeling_cope.py, clip_low_n).
AUTHORS_SHARE = (20, 64)


def default_clip(n_pairs: int) -> int:
    """The authors' share of clipped pairs for a model with ``n_pairs`` pairs (at least 1)."""
    clipped, of = AUTHORS_SHARE
    return max(1, round(n_pairs * clipped / of))


def cope_mask(clip: int) -> Tensor:
    """The Hann taper (clip,) float64 over the clipped pairs, fastest first: 1 down to 0."""
    steps = torch.arange(clip, dtype=torch.float64)
    phase = steps * (math.pi / (clip - 1)) if clip > 1 else steps  # linspace(0, pi, clip)
    return 0.5 * (1.0 + torch.cos(phase))


def _clipped(dim: int, base: float, clip: int) -> tuple[Tensor, int]:
    inv_freq, _ = schedules.rope(dim, base)
    clip = min(clip, inv_freq.numel())
    return inv_freq.clone(), inv_freq.numel() - clip


def cope(dim: int, base: float, clip: int) -> schedules.Schedule:
    """CoPE's soft clip of the ``clip`` slowest pairs of plain RoPE (module docstring)."""
    inv_freq, start = _clipped(dim, base, clip)
    inv_freq[start:] = inv_freq[start:] * cope_mask(inv_freq.numel() - start)
    return inv_freq, 1.0


def hard_clip(dim: int, base: float, clip: int) -> schedules.Schedule:
    """The hard clip: the ``clip`` slowest pairs of plain RoPE stop rotating (theta = 0)."""
    inv_freq, start = _clipped(dim, base, clip)
    inv_freq[start:] = 0.0
    return inv_freq, 1.0


@dataclasses.dataclass(frozen=True)
class CopeConfig(RopeConfig):
    """CoPE (Li et al. 2026): plain RoPE with its ``clip`` slowest pairs softly clipped."""

    name: ClassVar[str] = "cope"
    clip: int | None = None  # pairs clipped, slowest first; default round(F x 20/64) (authors')

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip is not None and (
            isinstance(self.clip, bool) or not isinstance(self.clip, int) or self.clip < 1
        ):
            raise ValueError(f"clip={self.clip!r} is not allowed; it must be an integer >= 1")

    def pairs_clipped(self, dim: int) -> int:
        """The pairs clipped for ``dim`` rotated channels: ``clip``, else the authors' share."""
        n = schedules.n_pairs(dim)
        return min(n, default_clip(n) if self.clip is None else self.clip)

    def schedule(self, dim: int, length: int | None = None) -> schedules.Schedule:
        return cope(dim, self.base, self.pairs_clipped(dim))


@dataclasses.dataclass(frozen=True)
class HardClipConfig(CopeConfig):
    """The hard clip CoPE is compared with: the ``clip`` slowest pairs do not rotate."""

    name: ClassVar[str] = "hardclip"

    def schedule(self, dim: int, length: int | None = None) -> schedules.Schedule:
        return hard_clip(dim, self.base, self.pairs_clipped(dim))
