"""Frequency schedules as pure functions.

Every function returns ``(inv_freq, attention_factor)``: ``inv_freq`` is a float64 tensor of
shape (F,) holding theta_f for the F rotary pairs, and ``attention_factor`` multiplies cos and
sin (so it scales q.k by its square), as transformers' ``ROPE_INIT_FUNCTIONS`` do. The math
follows transformers' ``modeling_rope_utils`` (the reference every server uses) but runs in
float64; tests hold the two together.

``dim`` is the number of rotated channels (``int(head_dim * fraction)``), so partial RoPE is
just a smaller ``dim``. Note the equivalence transformers records: scaling positions by 1/s is
the same as scaling ``inv_freq`` by 1/s, which is why PI is a schedule here.

Holds: rope, linear (PI), proportional (p-RoPE), ntk, dynamic_ntk, yarn (+ its helpers), llama3,
longrope, n_pairs, unseen_rotations.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

Schedule = tuple[Tensor, float]


def n_pairs(dim: int) -> int:
    """Number of rotary pairs for ``dim`` rotated channels (transformers: ``arange(0, dim, 2)``)."""
    return (dim + 1) // 2


def _exponents(dim: int) -> Tensor:
    # 2f/d for f = 0..F-1, exactly as transformers forms it (int arange divided by the int dim).
    return torch.arange(0, dim, 2, dtype=torch.float64) / dim


def rope(dim: int, base: float) -> Schedule:
    """Plain RoPE (Su et al. 2021, eq. 15): theta_f = base^(-2f/d)."""
    return 1.0 / base ** _exponents(dim), 1.0


def linear(dim: int, base: float, factor: float) -> Schedule:
    """Position interpolation (Chen et al. 2023): positions / s, i.e. every theta_f / s."""
    inv_freq, _ = rope(dim, base)
    return inv_freq / factor, 1.0


def proportional(inv_freq: Tensor, kept: int) -> Tensor:
    """p-RoPE (Barbero et al. 2025, "Round and round we go"; transformers' "proportional"):
    the first ``kept`` pairs keep theta_f, the slower rest get theta = 0 (angle 0 at every
    position: cos 1, sin 0), so they carry content, never position. Applied after any schedule;
    zero stays zero under PI's 1/s and YaRN's blend, so the order does not matter."""
    out = inv_freq.clone()
    out[kept:] = 0.0
    return out


def _stretched_base(dim: int, base: float, multiplier: float, factor: float) -> float:
    """b * m^(d/(d-2)), refusing (ValueError naming the factor) what float64 cannot hold: a
    huge factor overflows the power, or cancels to m = 0 in dynamic NTK's s L / L0 - (s - 1)."""
    if dim <= 2:
        raise ValueError(
            f"NTK scaling needs more than one rotary pair: b * s^(d/(d-2)) is undefined for "
            f"rotated dim d = {dim}; rotate more channels (fraction) or use linear scaling"
        )
    exponent = dim / (dim - 2)
    limit = math.log(sys.float_info.max)
    if not (math.isfinite(multiplier) and multiplier > 0) or (
        math.log(base) + exponent * math.log(multiplier) >= limit
    ):
        raise ValueError(
            f"factor={factor!r} is too large: the NTK base b * s^(d/(d-2)) (b = {base:g}, "
            f"d = {dim}) does not fit a float64; it must stay below {sys.float_info.max:.3g}"
        )
    return base * multiplier**exponent


def ntk_base(dim: int, base: float, factor: float) -> float:
    """NTK-aware base (bloc97 2023): b' = b * s^(d/(d-2)); the slowest pair ends up exactly PI."""
    return _stretched_base(dim, base, factor, factor)


def ntk(dim: int, base: float, factor: float) -> Schedule:
    """NTK-aware scaling: change the base, leave the fastest pairs (nearly) alone."""
    return rope(dim, ntk_base(dim, base, factor))


def dynamic_ntk(
    dim: int, base: float, factor: float, original_length: int, length: int
) -> Schedule:
    """Dynamic NTK (emozilla 2023; transformers' "dynamic"): the base follows the current length.

    b' = b * (s * L / L0 - (s - 1))^(d/(d-2)) with L = max(length, L0), so sequences within the
    original window see plain RoPE and the stretch grows only as the input does.
    """
    length = max(length, original_length)
    multiplier = (factor * length / original_length) - (factor - 1)
    return rope(dim, _stretched_base(dim, base, multiplier, factor))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature sqrt(1/t) = 0.1 * m * ln(s) + 1 (Peng et al. 2023, eq. 22)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_dim(rotations: float, dim: int, base: float, original_length: int) -> float:
    """Pair index (in channel units) whose wavelength fits ``rotations`` times in L0."""
    return dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_attention_factor(
    factor: float,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    attention_factor: float | None = None,
) -> float:
    """transformers' rule: explicit value, else mscale/mscale_all_dim ratio when *both* are
    set and non-zero (DeepSeek), else the YaRN paper's 0.1 ln s + 1."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn(
    dim: int,
    base: float,
    factor: float,
    original_length: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    attention_factor: float | None = None,
    truncate: bool = True,
) -> Schedule:
    """YaRN "NTK-by-parts" (Peng et al. 2023, eqs. 17-20) with its attention temperature.

    Pairs that rotate more than ``beta_fast`` times within L0 keep their frequency
    (extrapolate), pairs rotating fewer than ``beta_slow`` times are interpolated by 1/s, and a
    linear ramp over the pair index blends the two in between.
    """
    low = yarn_correction_dim(beta_fast, dim, base, original_length)
    high = yarn_correction_dim(beta_slow, dim, base, original_length)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    extrapolated, _ = rope(dim, base)
    ramp = ((torch.arange(n_pairs(dim), dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    # ramp = 0: keep theta (extrapolate); ramp = 1: theta / s (interpolate).
    inv_freq = extrapolated / factor * ramp + extrapolated * (1 - ramp)
    return inv_freq, yarn_attention_factor(factor, mscale, mscale_all_dim, attention_factor)


def llama3(
    dim: int,
    base: float,
    factor: float,
    original_length: int,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
) -> Schedule:
    """Llama 3.1's schedule (Meta 2024): wavelengths above L0/low_freq_factor are divided by s,
    below L0/high_freq_factor kept, and smoothly blended in between."""
    inv_freq, _ = rope(dim, base)
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = original_length / low_freq_factor
    high_freq_wavelength = original_length / high_freq_factor
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    smooth = (original_length / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(medium, blended, scaled), 1.0


def longrope_attention_factor(factor: float, original_length: int) -> float:
    """LongRoPE / Phi-3 default: sqrt(1 + ln s / ln L0), 1 when s <= 1."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_length))


def longrope(
    dim: int,
    base: float,
    short_factor: Sequence[float],
    long_factor: Sequence[float],
    original_length: int,
    factor: float,
    attention_factor: float | None = None,
    length: int | None = None,
) -> Schedule:
    """LongRoPE (Ding et al. 2024): searched per-pair rescale factors, theta_f / lambda_f.

    The long factors apply once the sequence is longer than L0, the short ones otherwise
    (transformers switches on ``max(position_ids) + 1 > L0``).
    """
    use_long = length is not None and length > original_length
    factors = torch.tensor(list(long_factor if use_long else short_factor), dtype=torch.float64)
    inv_freq, _ = rope(dim, base)
    if attention_factor is None:
        attention_factor = longrope_attention_factor(factor, original_length)
    return inv_freq / factors, float(attention_factor)


def unseen_rotations(
    inv_freq: Tensor, trained: Tensor, length: int, original_length: int
) -> Tensor:
    """Which rotary pairs of ``inv_freq`` turn past every angle they saw in training when the
    model reads ``length`` tokens: a bool tensor (F,), against the schedule it was trained
    with (``trained``, over ``original_length`` tokens).

    A pair whose wavelength 2 pi / theta_f exceeds the training length never completed a turn,
    so it knows only the angles theta_f p for p < L0; an extension must interpolate such pairs,
    not extrapolate them. This is YaRN's objection to NTK-aware scaling, that it extrapolates
    some dimensions to out-of-bound values, and why NTK-by-parts divides every pair whose
    wavelength exceeds the context by the whole s (Peng et al. 2023, eqs. 17-20). The extended
    pair reaches theta'_f N at N tokens and stays in range when theta'_f N <= theta_f L0:
    lengths rather than last positions, so PI at exactly s = N / L0 counts as in range, as it
    is used. Pairs that turned fully in training saw every angle and never count. NTK-aware at
    s = N / L0 leaves the slow pairs short of s (experiment E: 11 of SmolLM2's 32 pairs at 4x).
    """
    turned = trained * original_length >= 2 * math.pi
    reach = inv_freq * length
    return ~turned & (reach > trained * original_length * (1 + 1e-12))
