"""Factors float64 cannot carry through a schedule are refused with a one-line ValueError
naming the factor, never an OverflowError or a silently degenerate schedule."""

from __future__ import annotations

import pytest

from ropekit.encodings import build, schedules


@pytest.mark.parametrize(
    ("spec", "head_dim"),
    [
        ("ntk:factor=1e308", 8),
        ("dynamic-ntk:factor=1e308,original_length=64", 8),
        ("ntk:factor=1e160", 4),  # s^(d/(d-2)) = s^2 at d = 4: 1e320
    ],
)
def test_a_factor_that_overflows_the_ntk_base_is_refused(spec, head_dim):
    with pytest.raises(ValueError, match="factor=") as info:
        build(spec, n_heads=2, head_dim=head_dim)
    assert "\n" not in str(info.value)


def test_the_same_factor_fits_where_the_exponent_is_smaller():
    assert build("ntk:factor=1e160", n_heads=2, head_dim=64).inv_freq(0)[0].isfinite().all()


def test_dynamic_ntk_refuses_a_factor_whose_stretch_cancels_to_zero():
    # s L / L0 - (s - 1) at L = L0 is 1 in exact arithmetic, 0 in float64 for s = 1e17.
    with pytest.raises(ValueError, match="factor=1e"):
        schedules.dynamic_ntk(64, 10000.0, 1e17, 4096, 4096)
    assert schedules.dynamic_ntk(64, 10000.0, 1e6, 4096, 4096)[0].isfinite().all()


def test_ntk_needs_more_than_one_pair():
    with pytest.raises(ValueError, match="more than one rotary pair"):
        schedules.ntk(2, 10000.0, 2.0)
