"""Fixed per-head RoPE bases: HARPE (Lian et al. 2024, "Breaking the Stage Barrier: A Novel
Single-Stage Approach to Long Context Extension for Large Language Models", arXiv 2412.07171),
the fixed control for AdaFreq's learned per-head frequencies.

Shape legend: B batch · H query heads · K key/value heads · g = H/K · T length · D head dim ·
F rotary pairs.

HARPE gives different attention heads different RoPE bases, so one training pass holds the
bases a multi-stage extension would move through one after another. The rule here (the paper's
abstract states the idea, not a transferable rule; this one is ropekit's, stated so it can be
tested): the K key/value heads are the K stages of an NTK-aware extension to s = ``factor``,
stage k taking s^((k+1)/K):

    b_k = b * (s^((k+1)/K))^(d/(d-2)),  theta_(k,f) = b_k^(-2f/d),  k = 0..K-1

so the last head reads at the target's NTK base (``schedules.ntk_base``), the first at the
first stage's, and with one key/value head HARPE is ``ntk:factor=s`` exactly. Bases live per
key/value head for the reason AdaFreq's frequencies do: with grouped-query attention a key is
rotated once and read by g query heads, which must rotate alike.

Holds: harpe_bases, HarpeConfig, Harpe.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from . import schedules
from .base import Extension, PositionEncoding, check_positive, resolve_positions
from .rope import RopeConfig, set_rotary_layout
from .rotary import rotate_angles


def harpe_bases(dim: int, base: float, factor: float, n_heads: int) -> list[float]:
    """The base of each of ``n_heads`` key/value heads: NTK-aware at s^((k+1)/K)."""
    return [schedules.ntk_base(dim, base, factor ** ((k + 1) / n_heads)) for k in range(n_heads)]


@dataclasses.dataclass(frozen=True)
class HarpeConfig(RopeConfig):
    """HARPE: key/value head k rotates at the NTK base of stage s^((k+1)/K) (module docstring)."""

    name: ClassVar[str] = "harpe"
    factor: float | None = None  # s = target length / original length; s >= 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.factor is None:
            raise ValueError("factor is required for HarpeConfig; e.g. factor=4")
        check_positive("factor", self.factor, minimum=1.0, strict=False)
        if self.proportion < 1:
            raise ValueError(
                f"proportion={self.proportion!r} is not allowed for harpe, whose per-head bases "
                "span every pair; use a schedule with proportion=... instead"
            )

    @property
    def base_schedule(self) -> RopeConfig:
        return RopeConfig(base=self.base, pairing=self.pairing, fraction=self.fraction)

    def extension(self) -> Extension:
        return Extension(self.base, self.factor, None)

    def schedule(self, dim: int, length: int | None = None) -> schedules.Schedule:
        """The target stage's schedule (the last head's): ``ntk`` at s."""
        return schedules.ntk(dim, self.base, self.factor)


class Harpe(PositionEncoding):
    """Fixed per-key/value-head frequencies theta (K, F), float64, never cast."""

    config: HarpeConfig

    def __init__(self, config: HarpeConfig, **dims: int) -> None:
        super().__init__(config, **dims)
        set_rotary_layout(self, config)
        bases = harpe_bases(self.rotary_dim, config.base, config.factor, self.n_kv_heads)
        self.bases = tuple(bases)
        self._theta = torch.stack([schedules.rope(self.rotary_dim, b)[0] for b in bases])  # (K, F)

    def inv_freq(self, layer: int = 0, length: int | None = None) -> tuple[Tensor, float]:
        """theta (K, F) float64: one row per key/value head, the same in every layer."""
        return self._theta, 1.0

    def _rotate(self, x: Tensor, positions: Tensor, query: bool) -> Tensor:
        theta = self._theta.to(x.device)
        if query:
            x = x.unflatten(1, (self.n_kv_heads, -1))  # (B, K, g, T, D): the heads of one key
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        out = rotate_angles(x, positions, theta, 1.0, self.pairing, dtype)
        return out.flatten(1, 2) if query else out  # (B, H, T, D) or (B, K, S, D)

    def rotate_q(self, q: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        return self._rotate(q, resolve_positions(q, positions, "query"), True)

    def rotate_k(self, k: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        return self._rotate(k, resolve_positions(k, positions, "key"), False)
