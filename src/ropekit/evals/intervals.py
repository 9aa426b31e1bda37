"""Confidence intervals for accuracies: how far a score measured on n probes can be trusted.

Holds: `wilson_interval(successes, n, confidence)`, `accuracy_entry(successes, n, confidence)`,
`difference_interval(a, n_a, b, n_b, confidence)` (two independent samples),
`paired_difference_interval(both, only_a, only_b, neither, confidence)` (two methods asked the
same probes).

Why Wilson: an accuracy of k correct out of n is a binomial proportion. The textbook (Wald)
interval p +- z sqrt(p(1-p)/n) collapses to a single point at 0/n and n/n, exactly where
retrieval scores of failing and working models sit, and its coverage is erratic for small n.
The score interval of Wilson (1927) inverts the normal test of the proportion instead; it
stays inside [0, 1], is never empty at 0 or n, and its coverage is close to nominal from
n ~ 10 (Brown, Cai & DasGupta 2001, "Interval Estimation for a Binomial Proportion",
Statistical Science 16(2), who recommend it for n < 40; Newcombe 1998, "Two-sided confidence
intervals for the single proportion", Statistics in Medicine 17, method 3).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

CONFIDENCE = 0.95  # the default two-sided level: z = 1.95996...


def wilson_interval(successes: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval (lower, upper) of a proportion successes / n.

    With p = k / n and z the (1 + confidence) / 2 quantile of the standard normal
    (Wilson 1927, "Probable inference, the law of succession, and statistical inference",
    JASA 22(158), p. 209-212; Brown, Cai & DasGupta 2001, eq. 4):

        center = (p + z^2 / (2n)) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))
        interval = [center - half, center + half]

    At k = 0 the lower end is exactly 0 and at k = n the upper end exactly 1 (the two
    expressions are then equal); they are set so, not left to rounding.
    """
    for name, value in (("successes", successes), ("n", n)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} is not allowed; allowed: an integer")
    if n < 1:
        raise ValueError(f"n={n!r} is not allowed; allowed: n >= 1 (no interval of no probes)")
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes!r} is not allowed; allowed: 0..n={n}")
    if isinstance(confidence, bool) or not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r} is not allowed; allowed: 0 < confidence < 1")
    z = NormalDist().inv_cdf((1.0 + confidence) / 2.0)
    p = successes / n
    z2n = z * z / n
    center = (p + z2n / 2.0) / (1.0 + z2n)
    half = z / (1.0 + z2n) * math.sqrt(p * (1.0 - p) / n + z2n / (4.0 * n))
    lower = 0.0 if successes == 0 else max(0.0, center - half)
    upper = 1.0 if successes == n else min(1.0, center + half)
    return lower, upper


def accuracy_entry(successes: int, n: int, confidence: float = CONFIDENCE) -> dict[str, Any]:
    """{"correct", "n", "accuracy", "low", "high", "confidence"}: an accuracy with its Wilson
    interval, the form every probe summary records."""
    low, high = wilson_interval(successes, n, confidence)
    return {
        "correct": successes,
        "n": n,
        "accuracy": successes / n,
        "low": low,
        "high": high,
        "confidence": confidence,
    }


def difference_interval(
    a: int, n_a: int, b: int, n_b: int, confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """An interval (lower, upper) for the difference of two independent accuracies, a / n_a -
    b / n_b: Newcombe's hybrid score interval (1998, "Interval estimation for the difference
    between independent proportions: comparison of eleven methods", Statistics in Medicine
    17, method 10), built from each accuracy's Wilson interval (l, u):

        lower = d - sqrt((p_a - l_a)^2 + (u_b - p_b)^2)
        upper = d + sqrt((u_a - p_a)^2 + (p_b - l_b)^2),    d = p_a - p_b

    Why this one: like Wilson's it stays inside [-1, 1] and is not degenerate at 0/n or n/n,
    where retrieval scores sit (10/10 against 7/10 is [-0.04, 0.60] at 95%: ten probes do not
    tell them apart), and it is one of the two Newcombe recommends for small samples. Two
    methods asked the same probes are paired; where their answers go together, as they do
    (the same needles are hard), this interval for independent samples is the wider one."""
    low_a, high_a = wilson_interval(a, n_a, confidence)  # each checks its counts
    low_b, high_b = wilson_interval(b, n_b, confidence)
    p_a, p_b = a / n_a, b / n_b
    d = p_a - p_b
    lower = d - math.sqrt((p_a - low_a) ** 2 + (high_b - p_b) ** 2)
    upper = d + math.sqrt((high_a - p_a) ** 2 + (p_b - low_b) ** 2)
    return max(-1.0, lower), min(1.0, upper)


def paired_difference_interval(
    both: int, only_a: int, only_b: int, neither: int, confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """An interval (lower, upper) for the difference of two accuracies measured on the same
    probes, (both + only_a) / n - (both + only_b) / n with n the four counts' sum (each probe
    answered right by both, by a only, by b only, by neither): Newcombe's score interval for
    paired data (1998, "Improved confidence intervals for the difference between binomial
    proportions based on paired data", Statistics in Medicine 17, method 10). It is
    `difference_interval` with the two accuracies' correlation put back:

        lower = d - sqrt((p_a - l_a)^2 - 2 phi (p_a - l_a)(u_b - p_b) + (u_b - p_b)^2)
        upper = d + sqrt((u_a - p_a)^2 - 2 phi (u_a - p_a)(p_b - l_b) + (p_b - l_b)^2)

    with (l, u) each accuracy's Wilson interval over the n probes and phi the correlation of
    the 2x2 table, (both neither - only_a only_b) / sqrt(product of its four margins), shrunk
    when positive to max(both neither - only_a only_b - n/2, 0) / sqrt(...) (Newcombe's
    correction, which method 10 is) and 0 where a margin is empty.

    Why paired: methods probed on the same haystacks answer the same needles, and the hard
    needles are hard for both; the interval for independent samples ignores that and is the
    wider one when they go together (phi > 0), the narrower, wrongly, when they go apart."""
    counts = {"both": both, "only_a": only_a, "only_b": only_b, "neither": neither}
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} is not allowed; allowed: an integer >= 0")
    n = both + only_a + only_b + neither
    a, b = both + only_a, both + only_b  # each method's correct answers
    low_a, high_a = wilson_interval(a, n, confidence)  # checks n >= 1 and the confidence
    low_b, high_b = wilson_interval(b, n, confidence)
    p_a, p_b = a / n, b / n
    d = p_a - p_b
    agree = both * neither - only_a * only_b
    margins = a * (n - a) * b * (n - b)
    if agree > 0:
        agree = max(agree - n / 2, 0)
    phi = agree / math.sqrt(margins) if margins else 0.0

    def half(x: float, y: float) -> float:  # (x^2 - 2 phi x y + y^2)^(1/2), never of < 0
        return math.sqrt(max(0.0, x * x - 2.0 * phi * x * y + y * y))

    lower = d - half(p_a - low_a, high_b - p_b)
    upper = d + half(high_a - p_a, p_b - low_b)
    return max(-1.0, lower), min(1.0, upper)
