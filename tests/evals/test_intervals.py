"""Wilson score intervals: published values, laws of the interval, parity with scipy."""

from __future__ import annotations

import itertools
import math
import re

import pytest

from ropekit.evals.intervals import (
    accuracy_entry,
    difference_interval,
    paired_difference_interval,
    wilson_interval,
)

# Newcombe (1998), "Two-sided confidence intervals for the single proportion: comparison of
# seven methods", Statistics in Medicine 17, Table II, method 3 (score, no continuity
# correction), 95%: his four worked examples, to the 4 decimals printed there.
NEWCOMBE = [
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0000, 0.1611),
    (1, 29, 0.0061, 0.1718),
]


@pytest.mark.parametrize(("k", "n", "low", "high"), NEWCOMBE)
def test_published_values(k, n, low, high):
    got = wilson_interval(k, n)
    assert got == pytest.approx((low, high), abs=5e-5)


def test_formula_by_hand_at_half():
    # k = 5 of 10, z = 1.959964: center 0.5, half = z/(1+z^2/10) sqrt(0.025 + z^2/400).
    z = 1.959963984540054
    half = z / (1 + z * z / 10) * math.sqrt(0.25 / 10 + z * z / 400)
    assert wilson_interval(5, 10) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-12)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=5e-5)


@pytest.mark.parametrize("n", [1, 2, 7, 20, 63])
def test_laws(n):
    previous_low = -1.0
    for k in range(n + 1):
        low, high = wilson_interval(k, n)
        assert 0.0 <= low <= k / n <= high <= 1.0
        assert low > previous_low  # more successes, higher interval
        previous_low = low
        mirror = wilson_interval(n - k, n)  # failures are successes of the complement
        assert (low, high) == pytest.approx((1 - mirror[1], 1 - mirror[0]), abs=1e-12)
    assert wilson_interval(0, n)[0] == 0.0 and wilson_interval(n, n)[1] == 1.0
    # Never a point at the edges, unlike the Wald interval.
    assert wilson_interval(0, n)[1] > 0.0 and wilson_interval(n, n)[0] < 1.0


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_the_ends_are_exactly_0_and_1_at_no_and_all_successes(confidence):
    """The docstring's promise: at k = 0 the lower end is exactly 0 and at k = n the upper end
    exactly 1, set so rather than left to rounding (the formula alone gives 0.9999999999999999
    at n = 13 of 13 and 2.8e-17 at 0 of 10, 95%)."""
    for n in range(1, 101):
        assert wilson_interval(0, n, confidence)[0] == 0.0, n
        assert wilson_interval(n, n, confidence)[1] == 1.0, n


def test_more_probes_and_lower_confidence_narrow_it():
    widths = [wilson_interval(n // 2, n)[1] - wilson_interval(n // 2, n)[0] for n in (10, 40, 160)]
    assert widths[0] > widths[1] > widths[2]
    assert widths[1] / widths[2] == pytest.approx(2.0, rel=0.05)  # ~ 1 / sqrt(n)
    low90, high90 = wilson_interval(7, 20, confidence=0.9)
    low95, high95 = wilson_interval(7, 20)
    assert low95 < low90 and high90 < high95


def test_parity_with_scipy():
    stats = pytest.importorskip("scipy.stats")
    for n in (1, 3, 10, 25, 100):
        for k in range(n + 1):
            for confidence in (0.8, 0.95, 0.99):
                ci = stats.binomtest(k, n).proportion_ci(confidence, method="wilson")
                assert wilson_interval(k, n, confidence) == pytest.approx(
                    (ci.low, ci.high), abs=1e-12
                ), (k, n, confidence)


def test_accuracy_entry():
    entry = accuracy_entry(3, 4)
    assert entry["accuracy"] == 0.75 and entry["correct"] == 3 and entry["n"] == 4
    assert (entry["low"], entry["high"]) == wilson_interval(3, 4)
    assert entry["confidence"] == 0.95
    wide = accuracy_entry(3, 4, 0.99)  # the interval is the one at the confidence recorded
    assert (wide["low"], wide["high"]) == wilson_interval(3, 4, 0.99) and wide["confidence"] == 0.99
    assert wide["low"] < entry["low"] and wide["high"] > entry["high"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1, 0), "n=0 is not allowed"),
        ((5, 4), "successes=5 is not allowed; allowed: 0..n=4"),
        ((-1, 4), "successes=-1 is not allowed"),
        ((1.0, 4), "successes=1.0 is not allowed; allowed: an integer"),
        ((1, True), "n=True is not allowed"),
        ((1, 4, 1.0), "confidence=1.0 is not allowed"),
        ((1, 4, 0.0), "confidence=0.0 is not allowed"),
    ],
)
def test_bad_inputs(args, message):
    with pytest.raises(ValueError, match=f"^{message}") as info:
        wilson_interval(*args)
    assert "\n" not in str(info.value)


# Newcombe (1998), "Interval estimation for the difference between independent proportions:
# comparison of eleven methods", Statistics in Medicine 17, Table II, method 10 (the hybrid
# score interval), 95%: his worked examples (a)-(g), to the 4 decimals printed there.
NEWCOMBE_DIFFERENCES = [
    (56, 70, 48, 80, 0.0524, 0.3339),
    (9, 10, 3, 10, 0.1705, 0.8090),
    (6, 7, 2, 7, 0.0582, 0.8062),
    (5, 56, 0, 29, -0.0381, 0.1926),
    (0, 10, 0, 20, -0.1611, 0.2775),
    (0, 10, 0, 10, -0.2775, 0.2775),
    (10, 10, 0, 20, 0.6791, 1.0000),
]


@pytest.mark.parametrize(("a", "n_a", "b", "n_b", "low", "high"), NEWCOMBE_DIFFERENCES)
def test_difference_interval_published_values(a, n_a, b, n_b, low, high):
    assert difference_interval(a, n_a, b, n_b) == pytest.approx((low, high), abs=5e-5)


@pytest.mark.parametrize(("n_a", "n_b"), [(5, 5), (10, 7), (20, 40)])
def test_difference_interval_laws(n_a, n_b):
    """It holds the difference, stays in [-1, 1], turns over when the two are swapped, and
    widens with the confidence asked."""
    for a in range(n_a + 1):
        for b in range(n_b + 1):
            low, high = difference_interval(a, n_a, b, n_b)
            assert -1.0 <= low <= a / n_a - b / n_b <= high <= 1.0
            assert difference_interval(b, n_b, a, n_a) == pytest.approx((-high, -low))
            wider = difference_interval(a, n_a, b, n_b, confidence=0.99)
            assert wider[0] <= low and high <= wider[1]


def test_difference_interval_refuses_what_wilson_refuses():
    with pytest.raises(ValueError, match="n=0"):
        difference_interval(0, 0, 1, 5)
    with pytest.raises(ValueError, match="successes=6"):
        difference_interval(1, 5, 6, 5)


# Newcombe's paired interval (1998, "Improved confidence intervals for the difference between
# binomial proportions based on paired data", Statistics in Medicine 17, method 10), 95%, as
# (both, only a, only b, neither, lower, upper): his worked example; Fagerland, Lydersen &
# Laake 2014 (Statistics in Medicine 33, their airway example, 3 decimals); Tang, Li & Tang
# 2010 (Statistical Methods in Medical Research 21, 4 decimals); Chang et al. 2024 (Journal of
# Applied Statistics 51, 3 decimals). The first and third have a positive correlation that
# Newcombe's correction shrinks, the second one it sets to 0.
NEWCOMBE_PAIRED = [
    (20, 12, 2, 16, 0.0562, 0.3292, 5e-5),
    (1, 1, 7, 12, -0.507, -0.026, 5e-4),
    (8, 3, 1, 2, -0.1574, 0.4136, 5e-5),
    (7, 25, 2, 68, 0.133, 0.318, 5e-4),
]


@pytest.mark.parametrize(
    ("both", "only_a", "only_b", "neither", "low", "high", "tol"), NEWCOMBE_PAIRED
)
def test_paired_difference_interval_published_values(both, only_a, only_b, neither, low, high, tol):
    got = paired_difference_interval(both, only_a, only_b, neither)
    assert got == pytest.approx((low, high), abs=tol)


@pytest.mark.parametrize("n", [1, 4, 9])
def test_paired_difference_interval_laws(n):
    """Over every 2x2 table of n probes: it holds the difference, stays in [-1, 1], turns
    over when a and b swap, widens with the confidence asked, and is the independent
    samples' interval where the two methods' answers are uncorrelated (phi = 0) and no
    wider than it where they go together."""
    for both, only_a, only_b in itertools.product(range(n + 1), repeat=3):
        neither = n - both - only_a - only_b
        if neither < 0:
            continue
        a, b = both + only_a, both + only_b
        low, high = paired_difference_interval(both, only_a, only_b, neither)
        assert -1.0 <= low <= (a - b) / n <= high <= 1.0
        swapped = paired_difference_interval(both, only_b, only_a, neither)
        assert swapped == pytest.approx((-high, -low))
        wider = paired_difference_interval(both, only_a, only_b, neither, confidence=0.99)
        assert wider[0] <= low + 1e-12 and high <= wider[1] + 1e-12
        unpaired = difference_interval(a, n, b, n)
        if both * neither - only_a * only_b <= n / 2 and both * neither >= only_a * only_b:
            assert (low, high) == pytest.approx(unpaired)  # the correction zeroes phi
        if both * neither >= only_a * only_b:
            assert unpaired[0] <= low + 1e-12 and high <= unpaired[1] + 1e-12


def test_paired_difference_interval_is_narrower_for_methods_that_agree():
    """30 probes, a right on 21 and b on 12, b only where a is too: the pairing narrows the
    interval of the 0.3 difference (the unpaired one spans 0.46, the paired one 0.34)."""
    low, high = paired_difference_interval(12, 9, 0, 9)
    unpaired = difference_interval(21, 30, 12, 30)
    assert 0 < low < 0.3 < high
    assert high - low < 0.75 * (unpaired[1] - unpaired[0])


@pytest.mark.parametrize(
    ("args", "message"),
    [((0, 0, 0, 0), "n=0"), ((1, -1, 0, 0), "only_a=-1"), ((1, 0, 0.5, 0), "only_b=0.5"),
     ((True, 0, 0, 1), "both=True"), ((1, 0, 0, 1, 1.0), "confidence=1.0")],
)  # fmt: skip
def test_paired_difference_interval_bad_inputs(args, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        paired_difference_interval(*args)
    assert "\n" not in str(info.value)
