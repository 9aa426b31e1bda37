"""Rotary encodings with a fixed schedule: rope, linear (PI), ntk, dynamic-ntk, yarn, llama3,
longrope; all with either pairing and partial rotation.

Shape legend: B batch · H query heads · K key/value heads · T length · D head dim ·
F rotary pairs.

One module, ``RotaryEncoding``, serves every schedule: the config names the schedule
function (see ``schedules.py``), the module turns it into cos/sin tables once per forward
(cached for the positions tensor and its version counter, so every layer reuses them and a
positions tensor advanced in place gets new ones) and rotates q and k.

Holds: RopeConfig and one subclass per schedule (ProportionalConfig: p-RoPE as transformers'
"proportional"), RotaryEncoding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from torch import Tensor

from . import schedules
from .base import (
    EncodingConfig,
    Extension,
    PositionEncoding,
    check_choice,
    check_positive,
    resolve_positions,
)
from .positions import PositionsKey
from .rotary import PAIRINGS, angles, rotate, tables


@dataclasses.dataclass(frozen=True)
class RopeConfig(EncodingConfig):
    """Plain RoPE (Su et al. 2021)."""

    name: ClassVar[str] = "rope"
    base: float = 10000.0  # b in theta_f = b^(-2f/d); Llama 2: 1e4, Llama 3: 5e5, Qwen2: 1e6
    pairing: str = "half"  # "half" (NeoX/Llama rotate_half) or "interleaved" (GPT-J, RoPE paper)
    fraction: float = 1.0  # partial RoPE: share of head_dim that rotates (GPT-NeoX rotary_pct)
    # Proportional RoPE (p-RoPE, Barbero et al. 2025; Gemma 4's rope_type "proportional"):
    # share of the rotated pairs that keep their frequency; the slowest pairs get theta = 0 and
    # so never turn. Unlike ``fraction`` the exponents 2f/d keep the whole rotated dim d, so
    # the pairs that do rotate have exactly the frequencies of full RoPE (schedules.proportional).
    proportion: float = 1.0

    CONTEXT_FIELDS: ClassVar[tuple[str, ...]] = (
        "base",
        "pairing",
        "fraction",
        "proportion",
        "original_length",
    )
    dynamic: ClassVar[bool] = False
    mixable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_positive("base", self.base, minimum=1.0)
        check_choice("pairing", self.pairing, PAIRINGS)
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction={self.fraction!r} is not allowed; it must lie in (0, 1]")
        if not 0 <= self.proportion <= 1:
            raise ValueError(
                f"proportion={self.proportion!r} is not allowed; it must lie in [0, 1]"
            )

    def rotary_dim(self, head_dim: int) -> int:
        """Rotated channels, as transformers computes them: int(head_dim * fraction)."""
        return int(head_dim * self.fraction)

    def kept_pairs(self, dim: int) -> int:
        """Pairs of ``dim`` rotated channels that keep their frequency under ``proportion``,
        as transformers counts them: int(proportion * d // 2)."""
        return int(self.proportion * dim // 2)

    def frequencies(self, dim: int, length: int | None = None) -> schedules.Schedule:
        """The schedule with p-RoPE's ``proportion`` applied: what an encoding rotates by."""
        inv_freq, attention_factor = self.schedule(dim, length)
        if self.proportion < 1:
            inv_freq = schedules.proportional(inv_freq, self.kept_pairs(dim))
        return inv_freq, attention_factor

    @property
    def base_schedule(self) -> RopeConfig:
        return self

    def extension(self) -> Extension:
        return Extension(self.base, None, None)

    def schedule(self, dim: int, length: int | None = None) -> schedules.Schedule:
        return schedules.rope(dim, self.base)


def _require(config: EncodingConfig, name: str, minimum: float, strict: bool = False) -> None:
    value = getattr(config, name)
    if value is None:
        raise ValueError(f"{name} is required for {type(config).__name__}; e.g. {name}=4")
    check_positive(name, value, minimum=minimum, strict=strict)


@dataclasses.dataclass(frozen=True)
class LinearConfig(RopeConfig):
    """Position interpolation (Chen et al. 2023): every frequency divided by ``factor``."""

    name: ClassVar[str] = "linear"
    factor: float | None = None  # s = target length / original length; s >= 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self, "factor", 1.0)

    def extension(self) -> Extension:
        return Extension(self.base, self.factor, None)

    def schedule(self, dim: int, length: int | None = None) -> schedules.Schedule:
        return schedules.linear(dim, self.base, self.factor)


@dataclasses.dataclass(frozen=True)
class ProportionalConfig(LinearConfig):
    """Proportional RoPE as transformers' rope_type "proportional" (Gemma 4's global layers):
    RoPE over the whole head with only the fastest ``proportion`` of pairs turning, every
    frequency divided by ``factor`` (1 by default, as there; so is ``proportion``, which makes
    it plain RoPE: Gemma 4 gives 0.25)."""

    name: ClassVar[str] = "proportional"
    factor: float | None = 1.0  # s: frequencies / s, as linear; transformers' default 1


@dataclasses.dataclass(frozen=True)
class NTKConfig(LinearConfig):
    """NTK-aware scaling (bloc97 2023): base * s^(d/(d-2))."""

    name: ClassVar[str] = "ntk"

    def schedule(self, dim: int, length: int | None = None) -> schedules.Schedule:
        return schedules.ntk(dim, self.base, self.factor)


@dataclasses.dataclass(frozen=True)
class DynamicNTKConfig(LinearConfig):
    """Dynamic NTK (transformers' "dynamic"): the base follows the current length."""

    name: ClassVar[str] = "dynamic-ntk"
    original_length: int | None = None  # L0: the context the model was trained at (tokens)

    dynamic: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self, "original_length", 1)

    def extension(self) -> Extension:
        return Extension(self.base, self.factor, self.original_length)

    def schedule(self, dim: int, length: int | None = None) -> schedules.Schedule:
        length = self.original_length if length is None else length
        return schedules.dynamic_ntk(dim, self.base, self.factor, self.original_length, length)


@dataclasses.dataclass(frozen=True)
class YarnConfig(LinearConfig):
    """YaRN (Peng et al. 2023); defaults and attention-factor rules as in transformers."""

    name: ClassVar[str] = "yarn"
    original_length: int | None = None  # L0 (tokens)
    beta_fast: float = 32.0  # pairs with more rotations than this within L0 extrapolate
    beta_slow: float = 1.0  # pairs with fewer rotations than this interpolate by 1/s
    mscale: float | None = None  # DeepSeek-style temperature numerator (used with mscale_all_dim)
    mscale_all_dim: float | None = None  # DeepSeek-style temperature denominator
    attention_factor: float | None = None  # explicit cos/sin scale; default 0.1 ln s + 1
    truncate: bool = True  # round the ramp ends to whole pairs (transformers' default)

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self, "original_length", 1)
        check_positive("beta_slow", self.beta_slow)
        if self.beta_fast <= self.beta_slow:
            raise ValueError(
                f"beta_fast={self.beta_fast!r} is not allowed; "
                f"it must exceed beta_slow={self.beta_slow!r}"
            )
        if self.attention_factor is not None:
            check_positive("attention_factor", self.attention_factor)
        for name in ("mscale", "mscale_all_dim"):  # inf made the attention factor inf or nan
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name}={value!r} is not allowed; it must be a finite number")

    def extension(self) -> Extension:
        return Extension(self.base, self.factor, self.original_length)

    def schedule(self, dim: int, length: int | None = None) -> schedules.Schedule:
        return schedules.yarn(
            dim,
            self.base,
            self.factor,
            self.original_length,
            beta_fast=self.beta_fast,
            beta_slow=self.beta_slow,
            mscale=self.mscale,
            mscale_all_dim=self.mscale_all_dim,
            attention_factor=self.attention_factor,
            truncate=self.truncate,
        )


@dataclasses.dataclass(frozen=True)
class Llama3Config(LinearConfig):
    """Llama 3.1 frequency-band scaling (Meta 2024); paper values s=8, 1, 4, L0=8192."""

    name: ClassVar[str] = "llama3"
    original_length: int | None = None  # L0 (tokens)
    low_freq_factor: float = 1.0  # wavelengths above L0 / low_freq_factor are divided by s
    high_freq_factor: float = 4.0  # wavelengths below L0 / high_freq_factor are kept

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self, "original_length", 1)
        check_positive("low_freq_factor", self.low_freq_factor)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor={self.high_freq_factor!r} is not allowed; it must exceed "
                f"low_freq_factor={self.low_freq_factor!r}"
            )

    def extension(self) -> Extension:
        return Extension(self.base, self.factor, self.original_length)

    def schedule(self, dim: int, length: int | None = None) -> schedules.Schedule:
        return schedules.llama3(
            dim,
            self.base,
            self.factor,
            self.original_length,
            self.low_freq_factor,
            self.high_freq_factor,
        )


@dataclasses.dataclass(frozen=True)
class LongRopeConfig(RopeConfig):
    """LongRoPE (Ding et al. 2024): per-pair rescale factors, short below L0, long above.

    A single number broadcasts to every pair: ``long_factor=[4]``.
    """

    name: ClassVar[str] = "longrope"
    short_factor: tuple[float, ...] | None = None  # lambda_f used while length <= L0
    long_factor: tuple[float, ...] | None = None  # lambda_f used once length > L0
    original_length: int | None = None  # L0 (tokens)
    factor: float | None = None  # s = target / L0, sets the default attention factor
    attention_factor: float | None = None  # default sqrt(1 + ln s / ln L0)

    dynamic: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self, "original_length", 1)
        _require(self, "factor", 1.0)
        for name in ("short_factor", "long_factor"):
            for v in getattr(self, name) or ():
                check_positive(name, v)
        if self.attention_factor is not None:
            check_positive("attention_factor", self.attention_factor)
        elif self.original_length == 1:
            raise ValueError(
                "original_length=1 is not allowed without attention_factor; the default "
                "sqrt(1 + ln s / ln L0) needs L0 >= 2"
            )

    def extension(self) -> Extension:
        return Extension(self.base, self.factor, self.original_length)

    def factors(self, name: str, n: int) -> tuple[float, ...]:
        values = getattr(self, name) or (1.0,)  # unset: no rescaling
        if len(values) == 1:
            return values * n
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} values; this model has {n} rotary pairs")
        return values

    def schedule(self, dim: int, length: int | None = None) -> schedules.Schedule:
        n = schedules.n_pairs(dim)
        return schedules.longrope(
            dim,
            self.base,
            self.factors("short_factor", n),
            self.factors("long_factor", n),
            self.original_length,
            self.factor,
            self.attention_factor,
            length,
        )


def set_rotary_layout(encoding: PositionEncoding, schedule: RopeConfig) -> None:
    """The rotary layout every rotary encoding declares (``PositionEncoding``): rotated
    channels, pairs and pairing, refusing an odd head dim or fewer than 2 rotated channels."""
    if encoding.head_dim % 2:
        raise ValueError(
            f"head_dim={encoding.head_dim} is not allowed; rotary encodings need it even"
        )
    encoding.rotary_dim = schedule.rotary_dim(encoding.head_dim)
    if encoding.rotary_dim < 2:
        raise ValueError(
            f"fraction={schedule.fraction} of head_dim={encoding.head_dim} rotates "
            f"{encoding.rotary_dim} channels; at least 2 are needed"
        )
    encoding.n_pairs = schedules.n_pairs(encoding.rotary_dim)
    encoding.pairing = schedule.pairing


# Tables kept per encoding: the queries' and keys' of one forward, and the few of each band of
# a distance remap (up to 4 distinct positions in DCA), so every layer of a forward reuses them.
TABLES_KEPT = 8


class RotaryEncoding(PositionEncoding):
    """Rotary position embedding with a fixed (or length-following) schedule."""

    config: RopeConfig

    def __init__(self, config: RopeConfig, **dims: int) -> None:
        super().__init__(config, **dims)
        set_rotary_layout(self, config)
        self.dynamic = config.dynamic
        # Validate the schedule now (e.g. LongRoPE factor counts) rather than at first forward;
        # a fixed schedule is computed this once.
        self._fixed = config.frequencies(self.rotary_dim, None)
        self._cache: list[tuple[PositionsKey, torch.dtype, tuple[Tensor, Tensor]]] = []

    def frequencies(self, length: int | None) -> schedules.Schedule:
        """(inv_freq (F,), attention_factor) for a sequence of ``length`` positions."""
        if not self.dynamic:
            return self._fixed
        return self.config.frequencies(self.rotary_dim, length)

    def inv_freq(self, layer: int = 0, length: int | None = None) -> tuple[Tensor, float]:
        """theta (1, F): one schedule for every layer and key/value head."""
        inv_freq, attention_factor = self.frequencies(length)
        return inv_freq[None], float(attention_factor)

    def tables(
        self, positions: Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor, Tensor]:
        """cos, sin (B|1, 1, T, F) for positions (B|1, T); cached for reuse by every layer.

        A dynamic schedule takes its length from the positions seen in this call
        (max + 1, as transformers does), so queries and their keys agree. The cache matches
        the same tensor at the same version only (``PositionsKey``): positions advanced in
        place (``pos += 1`` in a decoding loop) get new tables.
        """
        for key, cached_dtype, result in self._cache:
            if cached_dtype == dtype and key.matches(positions):
                return result
        length = None
        if self.dynamic:  # an empty sequence has no max: the schedule at length 0 (unscaled)
            length = int(positions.max()) + 1 if positions.numel() else 0
        inv_freq, attention_factor = self.frequencies(length)
        phi = angles(positions, inv_freq.to(positions.device))  # (B, T, F)
        cos, sin = tables(phi[:, None], attention_factor, dtype)  # (B, 1, T, F)
        entry = (PositionsKey(positions), dtype, (cos, sin))
        self._cache = [entry, *self._cache[: TABLES_KEPT - 1]]
        return cos, sin

    def _rotate(self, x: Tensor, positions: Tensor | None, what: str) -> Tensor:
        positions = resolve_positions(x, positions, what)
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        return rotate(x, *self.tables(positions, dtype), self.pairing)

    def rotate_q(self, q: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        return self._rotate(q, positions, "query")

    def rotate_k(self, k: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        return self._rotate(k, positions, "key")
