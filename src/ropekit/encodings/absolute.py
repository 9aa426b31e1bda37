"""Encodings that add to token states, and the absence of one: nope, sinusoidal, learned.

Shape legend: B batch · T length · d model width.

Holds: NoPEConfig/NoPE, SinusoidalConfig/Sinusoidal, LearnedConfig/Learned.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor, nn

from .base import EncodingConfig, PositionEncoding, check_positive


@dataclasses.dataclass(frozen=True)
class NoPEConfig(EncodingConfig):
    """No positional encoding (Haviv et al. 2022): causal masking alone carries order."""

    name: ClassVar[str] = "nope"


class NoPE(PositionEncoding):
    """Identity everywhere."""


@dataclasses.dataclass(frozen=True)
class SinusoidalConfig(EncodingConfig):
    """Fixed sinusoids added to the embeddings (Vaswani et al. 2017, sec. 3.5)."""

    name: ClassVar[str] = "sinusoidal"
    base: float = 10000.0  # PE(p, 2i) = sin(p / base^(2i/d)), PE(p, 2i+1) = cos(...)
    # Amplitude of the added table; None = 1/sqrt(d), a position vector of norm ~0.7, the size
    # of a token embedding at GPT-2 init. Vaswani et al. add PE at amplitude 1 but scale the
    # embeddings by sqrt(d); ropekit's decoder does not, and amplitude 1 would drown tokens.
    scale: float | None = None

    def __post_init__(self) -> None:
        check_positive("base", self.base, minimum=1.0)
        if self.scale is not None:
            check_positive("scale", self.scale)


class Sinusoidal(PositionEncoding):
    config: SinusoidalConfig
    adds_to_embeddings: ClassVar[bool] = True

    def embed(self, h: Tensor, positions: Tensor) -> Tensor:
        d = h.shape[-1]
        # Frequencies and angles in float64: float32 angles drift at large positions.
        inv_freq = self.config.base ** (
            -torch.arange(0, d, 2, dtype=torch.float64, device=h.device) / d
        )
        phi = positions.to(torch.float64)[..., None] * inv_freq  # (B, T, ceil(d/2))
        pe = torch.stack((phi.sin(), phi.cos()), dim=-1).flatten(-2)[..., :d]  # (B, T, d)
        scale = d**-0.5 if self.config.scale is None else self.config.scale
        return h + (scale * pe).to(h.dtype)


@dataclasses.dataclass(frozen=True)
class LearnedConfig(EncodingConfig):
    """A learned table of absolute position vectors (GPT-2); undefined past its last row."""

    name: ClassVar[str] = "learned"
    max_length: int = 2048  # rows in the table: the longest sequence it can encode (tokens)
    # Rows are parameters (max_length x d_model floats, 2 GiB at 2^20 rows and d = 512): a
    # longer table would fail to allocate, or page the machine out, before it could train.
    MAX_ROWS: ClassVar[int] = 1 << 20

    def __post_init__(self) -> None:
        check_positive("max_length", self.max_length, minimum=1, strict=False)
        if self.max_length > self.MAX_ROWS:
            raise ValueError(
                f"max_length={self.max_length} is not allowed; a learned table holds at most "
                f"{self.MAX_ROWS} rows (use a relative encoding for longer sequences)"
            )


class Learned(PositionEncoding):
    config: LearnedConfig
    adds_to_embeddings: ClassVar[bool] = True

    def __init__(self, config: LearnedConfig, **dims: int) -> None:
        super().__init__(config, **dims)
        self.table = nn.Parameter(torch.randn(config.max_length, self.d_model) * 0.02)

    def embed(self, h: Tensor, positions: Tensor) -> Tensor:
        top = int(positions.max()) if positions.numel() else 0
        low = int(positions.min()) if positions.numel() else top
        if top >= self.config.max_length or low < 0:
            raise ValueError(
                f"position {top} is past the learned table of {self.config.max_length} rows; "
                f"positions must lie in [0, {self.config.max_length - 1}] (build with a larger "
                "max_length, or use a relative encoding to run longer)"
            )
        return h + self.table[positions].to(h.dtype)
