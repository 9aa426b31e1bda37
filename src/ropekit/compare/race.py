"""Racing: stop spending on a method once it is resolvably out of the verdict's reach.

A comparison scores every method on every window; most of that compute goes to methods the
verdict could never recommend (experiment E: the unmodified model and STRING collapsed at the
first 32k window, several others were resolvably behind after a few). Racing, as tuning tools
do it (successive halving, Ray Tune's ASHA), scores the windows in rounds and stops a method
when the numbers so far already say it is out, with the rule stated:

- **Rounds.** Round r holds one window at N of one held-out domain (``plan.race_cells``: span
  1 of each domain in turn, then span 2, ...), at every seed of a trained method; K = spans x
  domains rounds are planned. A round per window, not per span of every domain: a method that
  is out is resolvably so after its first window (collapsed, or behind by more than the error
  of that window's blocks allows), and then it has cost one window, not one per domain.
- **Leader.** After each round, the method with the lowest score so far (the verdict's score:
  last-quarter NLL at N over the windows scored) among those whose cost at L0 so far is
  within the margin (the verdict's eligibility, on the windows so far).
- **Stops.** A method other than the baseline stops receiving perplexity and probe jobs when,
  after a round, it is
  - *collapsed*: its score is more than ln 3 above the leader's (the verdict's collapse rule:
    far-position perplexity at least 3x the leader's), which a method shows at its first
    window, so it stops after its first round;
  - *over the margin*: its cost at L0 is above the margin beyond doubt: exp(m - z s) - 1 >
    margin, for m and s the mean and standard error of its paired L0 NLL differences against
    the baseline (per domain and span, seeds averaged);
  - *behind*: its paired last-quarter NLL difference against the leader at N has
    mean - z se > min_difference, se the verdict's error (windows, blocks within them, seeds:
    ``verdict.paired_difference``), so it could not be the recommendation, nor tie with it.
- **Level.** z = Phi^-1(1 - alpha / K): each look is a one-sided test at alpha / K, so over the
  K planned looks a method that is not behind by more than ``min_difference`` (or is within
  the margin) is stopped with probability at most alpha, however the looks correlate (the
  union bound: alpha spent evenly over the rounds, a Bonferroni split with a constant,
  Pocock-like boundary). alpha = 0.05.
- The baseline never stops: every cost is measured against its L0 windows.

The verdict is then the verdict's own rule on the methods still in the race, every window.

Holds: RaceRule, Stop, race.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence

from .record import Stop
from .verdict import COLLAPSE_NATS, paired_difference, score_at

Table = Mapping[str, Mapping[str, Mapping[int, object]]]


@dataclasses.dataclass(frozen=True)
class RaceRule:
    """The stopping rule (module docstring)."""

    rounds: int  # K: looks planned (spans per domain)
    margin: float  # the cost at L0 a recommended method may have (relative perplexity)
    min_difference: float  # nats a lead needs to count (CompareConfig.min_difference)
    alpha: float = 0.05  # one-sided, per method over all its looks

    def __post_init__(self) -> None:
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds={self.rounds!r} is not allowed; it must be an integer >= 1")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha={self.alpha!r} is not allowed; it must lie in (0, 1)")

    @property
    def z(self) -> float:
        """The one-sided bound at each look: alpha spent evenly over the planned rounds."""
        return statistics.NormalDist().inv_cdf(1 - self.alpha / self.rounds)


def race(
    methods: Sequence[str],
    baseline: str,
    length: int,
    rule: RaceRule,
    table_after: Callable[[int], Table],
    l0_after: Callable[[int], Mapping[str, Sequence[float]]],
    looks: int | None = None,
) -> dict[str, Stop]:
    """label -> `Stop` for each method that leaves the race in its first ``looks`` rounds
    (None: all ``rule.rounds``); the others go on.
    ``table_after(r)``: the comparison's table (``CompareResult.table``) with the windows of
    rounds 1..r only; ``l0_after(r)``: label -> its whole-window NLL at L0 per domain and
    span of rounds 1..r (seeds averaged), in one order for every method."""
    stops: dict[str, Stop] = {}
    for r in range(1, (rule.rounds if looks is None else looks) + 1):
        table, l0 = table_after(r), l0_after(r)
        active = [m for m in methods if m not in stops]
        scores = {m: score_at(table, m, length) for m in active}
        costs = {m: _cost(l0[m], l0[baseline], rule.z) for m in active}
        eligible = [m for m in active if costs[m][0] <= rule.margin]
        leader = min(eligible, key=lambda m: scores[m])
        for m in active:
            if m in (baseline, leader):
                continue
            reason = None
            if scores[m] - scores[leader] > COLLAPSE_NATS:
                reason = "collapsed"
            elif costs[m][1] > rule.margin:
                reason = f"over the margin at L0 (cost {costs[m][0]:+.1%})"
            else:
                d = paired_difference(table, m, leader, length)
                if d.se is not None and d.mean - rule.z * d.se > rule.min_difference:
                    reason = f"behind {leader} by {d.mean:.4f} ± {d.se:.4f} nats"
            if reason is not None:
                stops[m] = Stop(r, scores[m], reason)
    return stops


def _cost(mine: Sequence[float], base: Sequence[float], z: float) -> tuple[float, float]:
    """The cost at L0 on the paired values so far (exp of the mean NLL difference against the
    baseline, less one: the relative perplexity change) and its lower bound at ``z`` (-1, no
    bound, while a single pair gives no error; 0 and -1 with no pair)."""
    diffs = [a - b for a, b in zip(mine, base, strict=True)]
    if not diffs:  # not scored at L0 (lengths without it): no cost known, none over the margin
        return 0.0, -1.0
    mean = sum(diffs) / len(diffs)
    if len(diffs) < 2:
        return math.expm1(mean), -1.0
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    return math.expm1(mean), math.expm1(mean - z * se)
