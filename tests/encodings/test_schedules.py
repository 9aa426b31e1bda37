"""Schedule laws, then parity with transformers' rope-init functions on a grid."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ropekit.encodings import schedules
from ropekit.encodings.rope import ProportionalConfig, RopeConfig

from ..tiny import tiny_config

DIM, BASE, L0 = 64, 10000.0, 512


# ----------------------------------------------------------------------------- laws
def test_pi_keeps_slowest_angle_inside_trained_range():
    for factor in (2, 4, 8, 16):
        trained_max = L0 * schedules.rope(DIM, BASE)[0][-1]
        scaled = schedules.linear(DIM, BASE, factor)[0][-1]
        assert factor * L0 * scaled <= trained_max * (1 + 1e-12)


def test_ntk_keeps_the_fastest_frequency_and_interpolates_the_slowest():
    rope = schedules.rope(DIM, BASE)[0]
    for factor in (2, 8, 32):
        ntk = schedules.ntk(DIM, BASE, factor)[0]
        assert abs(ntk[0] / rope[0] - 1) < 1e-3  # fastest pair changes < 0.1%
        # the slowest pair is exactly PI: b^(-(d-2)/d) / s
        torch.testing.assert_close(ntk[-1], rope[-1] / factor, rtol=1e-12, atol=0)


def test_yarn_frequencies_lie_between_pi_and_rope():
    rope = schedules.rope(DIM, BASE)[0]
    for factor, truncate in itertools.product((2, 8, 32), (True, False)):
        yarn = schedules.yarn(DIM, BASE, factor, L0, truncate=truncate)[0]
        assert torch.all(yarn <= rope * (1 + 1e-12))
        assert torch.all(yarn >= rope / factor * (1 - 1e-12))
        assert yarn[0] == rope[0] and torch.isclose(yarn[-1], rope[-1] / factor)


@pytest.mark.parametrize("name", ["linear", "ntk", "dynamic", "yarn", "llama3", "longrope"])
def test_factor_one_is_plain_rope(name):
    rope = schedules.rope(DIM, BASE)[0]
    inv_freq, attention_factor = {
        "linear": lambda: schedules.linear(DIM, BASE, 1.0),
        "ntk": lambda: schedules.ntk(DIM, BASE, 1.0),
        # Dynamic NTK's alpha = s L / L0 - (s - 1) is L / L0 at s = 1: past L0 it still
        # stretches by its formula (transformers' too), so the law holds within the window.
        "dynamic": lambda: schedules.dynamic_ntk(DIM, BASE, 1.0, L0, L0),
        "yarn": lambda: schedules.yarn(DIM, BASE, 1.0, L0),
        "llama3": lambda: schedules.llama3(DIM, BASE, 1.0, L0),
        "longrope": lambda: schedules.longrope(DIM, BASE, [1.0] * 32, [1.0] * 32, L0, 1.0),
    }[name]()
    torch.testing.assert_close(inv_freq, rope, rtol=1e-12, atol=0)
    assert attention_factor == 1.0


def test_dynamic_ntk_is_plain_rope_within_the_original_window_and_grows_after():
    rope = schedules.rope(DIM, BASE)[0]
    inside = schedules.dynamic_ntk(DIM, BASE, 4.0, L0, L0)[0]
    torch.testing.assert_close(inside, rope, rtol=1e-12, atol=0)
    slow = [schedules.dynamic_ntk(DIM, BASE, 4.0, L0, n)[0][-1] for n in (L0, 2 * L0, 8 * L0)]
    assert slow[0] > slow[1] > slow[2]


def test_partial_rope_has_fewer_pairs_with_transformers_exponents():
    inv_freq = schedules.rope(int(64 * 0.25), BASE)[0]
    assert inv_freq.shape == (8,)
    torch.testing.assert_close(inv_freq[1], torch.tensor(BASE ** (-2 / 16), dtype=torch.float64))


# ----------------------------------------------------------------------------- parity
def _hf(rope_type: str, head_dim: int, base: float, max_len: int, seq_len=None, **params):
    config = tiny_config(
        "llama",
        {"rope_type": rope_type, "rope_theta": base, **params},
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_len,
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    return inv_freq.double(), factor


GRID = list(itertools.product((32, 64, 128), (1e4, 5e5, 1e6), (2.0, 4.0, 8.0, 16.0, 32.0)))
# transformers computes in float32; ropekit in float64: agree to float32 rounding.
TOL = {"rtol": 2e-6, "atol": 0.0}


@pytest.mark.parametrize(("head_dim", "base", "factor"), GRID)
def test_linear_dynamic_llama3_match_transformers(head_dim, base, factor):
    ours = schedules.linear(head_dim, base, factor)
    theirs = _hf("linear", head_dim, base, 4096, factor=factor)
    torch.testing.assert_close(ours[0], theirs[0], **TOL)
    for seq_len in (1000, 4096, 30_000):
        ours = schedules.dynamic_ntk(head_dim, base, factor, 4096, seq_len)
        theirs = _hf("dynamic", head_dim, base, 4096, seq_len=seq_len, factor=factor)
        torch.testing.assert_close(ours[0], theirs[0], **TOL)
    ours = schedules.llama3(head_dim, base, factor, 8192, 1.0, 4.0)
    theirs = _hf(
        "llama3",
        head_dim,
        base,
        8192 * int(factor),
        factor=factor,
        original_max_position_embeddings=8192,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    )
    torch.testing.assert_close(ours[0], theirs[0], **TOL)
    assert ours[1] == theirs[1]


YARN_VARIANTS = [
    {},
    {"mscale": 1.0, "mscale_all_dim": 0.707},
    {"mscale": 0.707, "mscale_all_dim": 0.707},
    {"mscale": 1.0},  # transformers ignores mscale unless mscale_all_dim is set too
    {"attention_factor": 1.3},
    {"beta_fast": 16.0, "beta_slow": 2.0},
    {"truncate": False},
]


@pytest.mark.parametrize(("head_dim", "base", "factor"), GRID)
@pytest.mark.parametrize("variant", YARN_VARIANTS, ids=lambda v: ",".join(v) or "default")
def test_yarn_matches_transformers(head_dim, base, factor, variant):
    ours = schedules.yarn(head_dim, base, factor, 4096, **variant)
    theirs = _hf(
        "yarn",
        head_dim,
        base,
        int(4096 * factor),
        factor=factor,
        original_max_position_embeddings=4096,
        **variant,
    )
    torch.testing.assert_close(ours[0], theirs[0], **TOL)
    assert math.isclose(ours[1], theirs[1], rel_tol=1e-12)


@pytest.mark.parametrize(("head_dim", "base", "factor"), GRID)
def test_longrope_matches_transformers(head_dim, base, factor):
    g = torch.Generator().manual_seed(head_dim)
    n = head_dim // 2
    short = (1 + torch.rand(n, generator=g)).tolist()
    long = (1 + factor * torch.rand(n, generator=g)).tolist()
    for seq_len in (None, 2048, 4097):
        ours = schedules.longrope(head_dim, base, short, long, 4096, factor, None, seq_len)
        theirs = _hf(
            "longrope",
            head_dim,
            base,
            int(4096 * factor),
            seq_len=seq_len,
            factor=factor,
            original_max_position_embeddings=4096,
            short_factor=short,
            long_factor=long,
        )
        torch.testing.assert_close(ours[0], theirs[0], **TOL)
        assert math.isclose(ours[1], theirs[1], rel_tol=1e-12)
        assert math.isclose(ours[1], math.sqrt(1 + math.log(factor) / math.log(4096)))


@pytest.mark.parametrize(("low", "high"), [(1.0, 4.0), (2.0, 8.0), (0.5, 3.0)])
def test_llama3_bands_match_transformers_at_other_band_factors(low, high):
    """Wavelengths above L0/low_freq_factor are divided by s, below L0/high_freq_factor kept:
    the band edges follow both factors, not only the paper's 1 and 4 (the defaults)."""
    ours = schedules.llama3(64, 5e5, 8.0, 8192, low, high)
    theirs = _hf(
        "llama3",
        64,
        5e5,
        8192 * 8,
        factor=8.0,
        original_max_position_embeddings=8192,
        low_freq_factor=low,
        high_freq_factor=high,
    )
    torch.testing.assert_close(ours[0], theirs[0], **TOL)
    if (low, high) == (1.0, 4.0):
        torch.testing.assert_close(schedules.llama3(64, 5e5, 8.0, 8192)[0], ours[0], rtol=0, atol=0)


def test_llama3_divides_a_wavelength_of_exactly_l0_over_low_freq_factor():
    """At the low band edge (wavelength = L0/low_freq_factor) the pair is divided by s, like
    every longer wavelength: the blend meets the divided band there without a jump. With base
    16 and d = 4 the wavelengths are exactly 2 pi and 8 pi; L0 = 8 pi puts pair 1 on the edge."""
    inv_freq, _ = schedules.llama3(4, 16.0, 8.0, 8 * math.pi, 1.0, 4.0)
    assert inv_freq.tolist() == [1.0, 0.25 / 8]


def test_longrope_switches_to_the_long_factors_only_past_l0_and_divides_in_float64():
    """theta_f / lambda_f with the short factors while length <= L0 (transformers: max(pos) + 1
    > L0 switches), the long ones after; the division is float64 (1.1 is not a float32)."""
    rope = schedules.rope(DIM, BASE)[0]
    short, long = [1.1] * (DIM // 2), [2.7] * (DIM // 2)
    for length, factors in ((None, short), (L0, short), (L0 + 1, long)):
        inv_freq, _ = schedules.longrope(DIM, BASE, short, long, L0, 4.0, None, length)
        torch.testing.assert_close(inv_freq, rope / factors[0], rtol=1e-15, atol=0)


def test_ntk_refuses_a_factor_whose_base_overflows_naming_the_factor():
    """b * s^(d/(d-2)) past float64's range is refused with the factor the user gave."""
    with pytest.raises(ValueError, match=re.escape("factor=1e+300 is too large: the NTK base")):
        schedules.ntk(DIM, BASE, 1e300)


@pytest.mark.parametrize("dim", [3, 4, 5, 64])
def test_ntk_stretches_the_base_by_s_to_the_d_over_d_minus_2_from_three_channels(dim):
    """NTK's base b * s^(d/(d-2)) (bloc97) for every rotated dim with a second pair, odd ones
    and the smallest, d = 3 (s^3), included; its frequencies are b'^(-2f/d)."""
    for factor in (2.0, 8.0):
        stretched = BASE * factor ** (dim / (dim - 2))
        assert math.isclose(schedules.ntk_base(dim, BASE, factor), stretched, rel_tol=1e-14)
        expected = [stretched ** (-2 * f / dim) for f in range((dim + 1) // 2)]
        inv_freq, attention_factor = schedules.ntk(dim, BASE, factor)
        torch.testing.assert_close(inv_freq, torch.tensor(expected, dtype=torch.float64))
        assert attention_factor == 1.0


def _yarn_correction(rotations: float, dim: int, base: float, original_length: int) -> float:
    """YaRN's ramp edge (Peng et al. 2023, eq. 19 solved for the pair): the channel index
    whose wavelength 2 pi b^(2f/d) fits ``rotations`` times in L0."""
    return dim * math.log(original_length / (2 * math.pi * rotations)) / (2 * math.log(base))


@pytest.mark.parametrize(("original_length", "edge"), [(4, 0), (10**10, 7)])
def test_yarn_with_a_zero_width_ramp_keeps_the_pairs_up_to_its_edge_and_divides_the_rest(
    original_length, edge
):
    """When both ramp ends fall on one pair k (floor and ceil of the two edges clamped to
    [0, d - 1] meet: a tiny L0 puts both at 0, a huge one both at d - 1), the ramp is a step,
    as transformers' zero-width guard makes it: pairs f <= k keep theta_f, pairs f > k get
    theta_f / s; nothing is blended."""
    dim, factor = 8, 4.0
    low = max(math.floor(_yarn_correction(32.0, dim, BASE, original_length)), 0)
    high = min(math.ceil(_yarn_correction(1.0, dim, BASE, original_length)), dim - 1)
    assert low == high == edge  # the case under test
    theta = [BASE ** (-2 * f / dim) for f in range(dim // 2)]
    expected = [t if f <= edge else t / factor for f, t in enumerate(theta)]
    inv_freq, _ = schedules.yarn(dim, BASE, factor, original_length)
    torch.testing.assert_close(
        inv_freq, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0
    )


def _unseen(inv_freq, length, dim=64, base=1e5, original_length=8192):
    trained, _ = schedules.rope(dim, base)
    return schedules.unseen_rotations(inv_freq, trained, length, original_length)


def test_unseen_rotations_are_the_slow_pairs_an_extension_divides_by_less_than_the_ratio():
    """SmolLM2's schedule (64 dims, base 1e5, L0 8192): pairs 20-31 never turned fully in
    training. At 32k plain RoPE turns all 12 past their trained angles, NTK-aware at s = 4 all
    but the slowest (divided by 4^(f/31), the factors experiment E's search kept), and PI, YaRN
    and Llama 3 none; at 16k NTK-aware none (each slow pair divided by at least 2.45 > 2)."""
    rope, _ = schedules.rope(64, 1e5)
    ntk, _ = schedules.ntk(64, 1e5, 4.0)
    assert _unseen(rope, 32768).nonzero().flatten().tolist() == list(range(20, 32))
    assert _unseen(ntk, 32768).nonzero().flatten().tolist() == list(range(20, 31))
    assert not _unseen(ntk, 16384).any()
    for inv_freq in (
        schedules.linear(64, 1e5, 4.0)[0],
        schedules.yarn(64, 1e5, 4.0, 8192)[0],
        schedules.llama3(64, 1e5, 4.0, 8192)[0],
    ):
        assert not _unseen(inv_freq, 32768).any()
    # PI at exactly s = N / L0 is in range (lengths, not last positions); a hair less is not,
    # for every slow pair and no fast one (those saw every angle).
    assert not _unseen(schedules.linear(64, 1e5, 4.0)[0], 32768).any()
    short = _unseen(schedules.linear(64, 1e5, 3.999)[0], 32768)
    assert short.nonzero().flatten().tolist() == list(range(20, 32))
    # Inside the trained window nothing is unseen, whatever the schedule.
    assert not _unseen(rope, 8192).any()


# ----------------------------------------------------------------------------- p-RoPE
@pytest.mark.parametrize("head_dim", [32, 64, 256])
@pytest.mark.parametrize("proportion", [0.125, 0.25, 0.5, 0.75])
@pytest.mark.parametrize("factor", [1.0, 8.0])
def test_proportional_matches_transformers(head_dim, proportion, factor):
    """Gemma 4's rope_type "proportional": the kept pairs equal full RoPE's first pairs (to
    float32 rounding: transformers computes in float32), the rest are exactly zero."""
    config = ProportionalConfig(base=1e6, proportion=proportion, factor=factor)
    ours, attention = config.frequencies(head_dim)
    theirs, their_attention = _hf(
        "proportional", head_dim, 1e6, 4096, partial_rotary_factor=proportion, factor=factor
    )
    assert ours.shape == theirs.shape == (head_dim // 2,)
    kept = config.kept_pairs(head_dim)
    assert kept == int(proportion * head_dim // 2)
    assert torch.equal(ours[kept:], torch.zeros(head_dim // 2 - kept, dtype=torch.float64))
    assert torch.equal(theirs[kept:] == 0, torch.ones(head_dim // 2 - kept, dtype=torch.bool))
    torch.testing.assert_close(ours[:kept], theirs[:kept], **TOL)
    assert attention == their_attention == 1.0


def test_proportional_differs_from_partial_rope_in_its_exponents():
    """p-RoPE keeps full RoPE's fastest frequencies; ``fraction`` cuts the head and spreads
    the exponents over the channels it keeps (so its slowest pair is much slower)."""
    p = RopeConfig(base=BASE, proportion=0.25).frequencies(64)[0]
    f = RopeConfig(base=BASE, fraction=0.25).frequencies(int(64 * 0.25))[0]
    full = schedules.rope(64, BASE)[0]
    assert torch.equal(p[:8], full[:8]) and torch.equal(p[8:], torch.zeros(24, dtype=p.dtype))
    assert f.shape == (8,) and f[-1] < p[7] / 100
