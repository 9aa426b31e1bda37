"""Racing (``compare.race``): the stopping rule on made-up windows whose answer is known, and
replayed on experiments D and E from their committed files."""

from __future__ import annotations

import math
import statistics

import pytest

from ropekit.compare.race import RaceRule, race
from ropekit.compare.record import TableEntry

N, L0 = 64, 16
DOMAINS = ("a", "b", "c")


def _entry(windows: list[float]) -> TableEntry:
    """One seed's windows at N, each with 8 blocks spread +-0.01 around its mean."""
    blocks = tuple(tuple(w + 0.01 * (-1) ** k for k in range(8)) for w in windows)
    return TableEntry((1.0,), (1.0,), (tuple(windows),), (blocks,), (None,))


def _table(scores: dict[str, list[list[float]]], rounds: int) -> dict:
    """label -> domain -> {N: entry}: ``scores[label][domain index]`` its windows, cut to the
    first ``rounds``."""
    return {
        label: {d: {N: _entry(windows[i][:rounds])} for i, d in enumerate(DOMAINS)}
        for label, windows in scores.items()
    }


def _race(scores, l0, rounds=3, margin=0.01, min_difference=0.005):
    rule = RaceRule(rounds, margin, min_difference)
    return race(
        list(scores), "rope", N, rule, lambda r: _table(scores, r),
        lambda r: {m: values[: r * len(DOMAINS)] for m, values in l0.items()},
    )  # fmt: skip


def _windows(level: float, jitter: float = 0.002) -> list[list[float]]:
    return [[level + jitter * ((i + 2 * r) % 3 - 1) for r in range(3)] for i in range(3)]


def test_the_level_is_alpha_spent_over_the_planned_rounds():
    """z = Phi^-1(1 - alpha / K): one look is the one-sided 95% bound, more looks ask more."""
    assert RaceRule(1, 0.01, 0.0).z == pytest.approx(statistics.NormalDist().inv_cdf(0.95))
    assert RaceRule(2, 0.01, 0.0).z == pytest.approx(1.95996, abs=1e-4)
    assert RaceRule(1, 0.01, 0.0).z < RaceRule(3, 0.01, 0.0).z < RaceRule(10, 0.01, 0.0).z
    with pytest.raises(ValueError, match="rounds=0 is not allowed"):
        RaceRule(0, 0.01, 0.0)


def test_a_collapsed_a_costly_and_a_resolvably_behind_method_stop_the_leader_runs_on():
    """The baseline collapses at N but never stops (costs are measured against it); a method
    ln 3 above the leader stops after its first round, one whose L0 cost is beyond the margin
    and one resolvably behind stop once their pairs say so, the leader and a method tied with
    it (within min_difference) finish."""
    l0 = {m: [2.0] * 9 for m in ("rope", "best", "tied", "behind", "collapsed")}
    l0["costly"] = [2.0 + 0.1 + 0.001 * k for k in range(9)]  # +10% perplexity at L0
    scores = {
        "rope": _windows(8.0), "best": _windows(2.9), "tied": _windows(2.901),
        "behind": _windows(2.95), "collapsed": _windows(2.9 + math.log(3) + 0.1),
        "costly": _windows(2.5),
    }  # fmt: skip
    stops = _race(scores, l0)
    assert set(stops) == {"collapsed", "costly", "behind"}
    assert stops["collapsed"].round == 1 and stops["collapsed"].reason == "collapsed"
    assert stops["costly"].reason.startswith("over the margin at L0 (cost +10.")
    assert stops["behind"].reason.startswith("behind best by 0.05")
    assert stops["behind"].score == pytest.approx(2.95, abs=0.01)


def test_a_cost_is_not_called_over_the_margin_on_one_pair():
    """One paired L0 value has no error: however costly it looks, the method races on until a
    second round gives its cost an error."""
    l0 = {"rope": [2.0] * 3, "best": [2.0] * 3, "costly": [2.1, 2.1001, 2.0999]}
    scores = {"rope": _windows(8.0), "best": _windows(2.9), "costly": _windows(2.5)}
    rule = RaceRule(3, 0.01, 0.005)
    stops = race(
        list(scores), "rope", N, rule, lambda r: _table(scores, r),
        lambda r: {m: v[:r] for m, v in l0.items()},
    )  # fmt: skip
    assert stops["costly"].round == 2


@pytest.mark.parametrize("experiment", ["D", "E"])
def test_racing_replayed_on_d_and_e_keeps_their_verdict(experiment):
    """The replay (experiments/smollm2_32k/race.py) reads the committed files only: racing,
    a round per window as the runner races, recommends what each comparison recommended,
    resolved as it was, for at most a third of E's recorded compute (issue 55), the same
    compute where there was one round (D)."""
    from experiments.smollm2_32k.race import FOLDERS, replay

    name = next(n for n in FOLDERS if n.startswith(experiment))
    result = replay(FOLDERS[name])
    assert result["verdict"].winner == result["committed"].winner
    assert result["verdict"].resolved == result["committed"].resolved
    spent, total = sum(result["spent"].values()), sum(result["total"].values())
    if experiment == "D":
        assert result["rule"].rounds == 1 and spent == total
    else:
        assert result["stops"]["string"].reason == "collapsed" and spent <= total / 3
        assert "rope" not in result["stops"]  # the baseline runs every round


def test_race_md_is_what_the_replay_writes(tmp_path):
    """experiments/smollm2_32k/race.md holds no hand-typed number: it is race.py's output."""
    from experiments.smollm2_32k.race import HERE, main

    main(["--out", str(tmp_path / "race.md")])
    assert (tmp_path / "race.md").read_text() == (HERE / "race.md").read_text()
