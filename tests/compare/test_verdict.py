"""The recommendation rule of `ropekit compare` (``ropekit.compare.verdict``): pure
functions on hand-made tables, so each rule is checked in milliseconds (and a mutation tester
can afford to run them per mutant)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from ropekit.compare import recommend
from ropekit.compare.record import EngineAnswer, SeedBin, TableEntry, Verdict
from ropekit.compare.verdict import (
    method_retrieval,
    per_engine,
    pooled_accuracy,
    pooled_bin,
    retrieval_note,
)
from ropekit.evals import wilson_interval
from ropekit.evals.intervals import accuracy_entry, difference_interval, paired_difference_interval
from ropekit.evals.probe_summary import Accuracy, PairedProbes
from ropekit.results import encode
from tests.runaway import cpu_limit


@pytest.fixture(autouse=True)
def _ends():
    """The rule's loops (block lengths doubling) must end: every test here takes
    milliseconds, so one that runs 3 s of CPU fails instead of hanging the run."""
    with cpu_limit(3):
        yield


def test_retrieval_pools_seeds_before_taking_the_interval():
    # 3/10 and 7/10 pool to 10/20, whose Wilson interval is [0.2993, 0.7007] at 95%, narrower
    # than either seed's own; the interval is evals' (the one implementation).
    pooled = pooled_accuracy([{"correct": 3, "n": 10}, {"correct": 7, "n": 10}])
    assert (pooled["correct"], pooled["n"], pooled["runs"]) == (10, 20, 2)
    assert (pooled["low"], pooled["high"]) == wilson_interval(10, 20)
    assert pooled["low"] == pytest.approx(0.29930, abs=1e-5) and pooled["accuracy"] == 0.5
    with pytest.raises(ValueError):
        pooled_accuracy([{"correct": 3, "n": 2}])


def _table(values: dict[str, tuple[float, list[float]]]) -> dict:
    """Two lengths (8 = L0, 32 = N) of one domain: ppl at 8, last-quarter NLL windows at 32."""
    return {
        m: {"d": {8: _entry(ppl=[ppl], windows=[[1.0]]), 32: _entry(ppl=[1.0], windows=[windows])}}
        for m, (ppl, windows) in values.items()
    }


def test_the_recommendation_obeys_the_margin_and_says_when_it_is_not_resolved():
    table = _table({
        "rope": (10.0, [3.0, 3.1, 3.2, 3.0]),
        "cheap": (10.05, [2.0, 2.1, 2.2, 2.0]),  # +0.5% at L0, clearly best at N
        "costly": (12.0, [1.0, 1.0, 1.0, 1.0]),  # best at N but +20% at L0: not eligible
        "close": (10.0, [2.01, 2.12, 2.18, 2.02]),  # within noise of "cheap"
    })  # fmt: skip
    verdict = recommend(table, list(table), "rope", 8, 32, margin=0.01)
    assert verdict.winner == "cheap" and "costly" not in verdict.eligible
    assert verdict.runner_up == "close" and not verdict.resolved
    assert "No difference is resolved" in verdict.sentence
    clear = recommend({k: v for k, v in table.items() if k != "close"}, ["rope", "cheap"],
                      "rope", 8, 32, margin=0.01)  # fmt: skip
    assert clear.winner == "cheap" and clear.resolved
    assert clear.sentence.startswith("Use cheap")
    tiny = {
        "a": (10.0, [2.0, 2.1, 2.2, 2.0]),
        "b": (10.0, [2.000001, 2.100001, 2.200001, 2.000001]),
    }
    twins = recommend(_table(tiny), ["a", "b"], "a", 8, 32, margin=0.01)
    assert twins.winner == "a" and not twins.resolved  # a lead of 1e-6 nats is no lead
    none = recommend(table, ["costly"], "rope", 8, 32, margin=0.01)
    assert none.winner is None and "none is recommended" in none.sentence
    assert "cannot resolve" not in verdict.sentence  # 4 windows: the sample could
    one = recommend(_table({"a": (10.0, [2.0]), "b": (10.0, [2.5])}), ["a", "b"], "a", 8, 32, 0.01)
    assert not one.resolved and "paired over 1 window:" in one.sentence
    assert "1 window at 32 cannot resolve a lead (the rule needs at least 3" in one.sentence


def _token_table(nll: dict[str, list[np.ndarray]], length: int = 4096) -> dict:
    """One domain scored at 8 (cost 0) and at ``length`` from per-token NLLs of each window,
    summarized as the evaluation summarizes them (window means and 64-token block means of
    the last quarter)."""
    from ropekit.evals.perplexity import _block_means

    quarter = length - length // 4
    table = {}
    for m, windows in nll.items():
        rows = [torch.from_numpy(w) for w in windows]
        table[m] = {"d": {
            8: _entry(ppl=[10.0], windows=[[1.0]]),
            length: _entry(ppl=[1.0], windows=[[float(r[quarter:].mean()) for r in rows]],
                           blocks=[[_block_means(r[quarter:]) for r in rows]]),
        }}  # fmt: skip
    return table


def test_one_window_resolves_a_large_lead_from_blocks_within_it_and_refuses_noise():
    """The new user's case of one window per domain: the error comes from blocks of positions
    within the window, so a large lead resolves and a lead inside the noise does not."""
    rng = np.random.default_rng(0)
    a = 3.0 + rng.standard_normal(4096)  # per-token NLL, sd 1 nat
    large = _token_table({"a": [a], "b": [a + 0.5 + 0.5 * rng.standard_normal(4096)]})
    verdict = recommend(large, ["a", "b"], "a", 8, 4096, margin=0.01)
    d = verdict.difference
    assert verdict.winner == "a" and verdict.resolved, verdict.sentence
    assert d.n == 1 and d.se_windows is None and d.block_tokens >= 64
    assert d.se == pytest.approx(0.5 / np.sqrt(1024), rel=0.5)  # iid: sd / sqrt(tokens)
    assert "blocks of" in verdict.sentence and "within 1 window" in verdict.sentence
    # No true difference, only noise of sd 0.5 per token: whichever leads is refused.
    noise = _token_table({"a": [a], "b": [a + 0.5 * rng.standard_normal(4096)]})
    refused = recommend(noise, ["a", "b"], "a", 8, 4096, margin=0.01, min_difference=0.0)
    assert not refused.resolved and refused.difference.se > 0.01


def test_the_block_error_grows_with_correlated_positions_rather_than_trusting_64_tokens():
    """A difference that drifts slowly along the window (correlated over 256 tokens) has a
    64-token batch-means error far too small; the blocking analysis keeps the larger one."""
    rng = np.random.default_rng(1)
    drift = np.repeat(rng.standard_normal(16384 // 256), 256) * 0.3  # 256-token plateaus
    a = 3.0 + 0.05 * rng.standard_normal(16384)
    table = _token_table({"a": [a], "b": [a + 0.1 + drift]}, length=16384)
    d = recommend(table, ["a", "b"], "a", 8, 16384, margin=0.01).difference
    blocks = [np.subtract(*(table[m]["d"][16384].last_quarter_blocks[0][0] for m in "ba"))]
    one_scale = np.std(blocks[0], ddof=1) / np.sqrt(len(blocks[0]))
    assert d.block_tokens >= 256
    assert d.se_blocks > 1.5 * one_scale  # one_scale: 64-token blocks taken as independent


def test_a_collapsed_method_is_named_as_such_not_as_an_unresolved_runner_up():
    """The new user's case: dynamic NTK at a last-quarter perplexity of 30.7 against the
    unmodified model's collapse to 286.7, over 1 window, was called unresolved."""
    collapse = _table({
        "rope": (10.0, [math.log(286.7)]),
        "dynamic-ntk": (10.0, [math.log(30.7)]),
    })  # fmt: skip
    verdict = recommend(collapse, ["rope", "dynamic-ntk"], "rope", 8, 32, margin=0.01)
    assert verdict.winner == "dynamic-ntk" and verdict.resolved
    assert list(verdict.collapsed) == ["rope"] and verdict.runner_up is None
    assert verdict.sentence.startswith("Use dynamic-ntk at 32 tokens: last-quarter perplexity")
    assert "collapses there: rope (last-quarter perplexity 286.7)" in verdict.sentence
    # The closest method that has not collapsed is the runner-up; the collapsed one is named.
    three = _table({
        "rope": (10.0, [math.log(286.7)] * 4),
        "a": (10.0, [3.40, 3.41, 3.42, 3.40]),
        "b": (10.0, [3.43, 3.45, 3.44, 3.46]),
    })  # fmt: skip
    verdict = recommend(three, ["rope", "a", "b"], "rope", 8, 32, margin=0.01)
    assert verdict.winner == "a" and verdict.runner_up == "b"
    assert list(verdict.collapsed) == ["rope"] and "collapsed at 32: rope" in verdict.sentence
    # A lead inside the noise is still refused, collapse or not.
    assert not recommend(_table({"a": (10.0, [3.40]), "b": (10.0, [3.41])}), ["a", "b"], "a",
                         8, 32, 0.01).resolved  # fmt: skip


def test_each_engine_gets_the_best_eligible_method_it_serves_exactly():
    table = _table({
        "rope": (10.0, [math.log(286.7)] * 4),
        "a": (10.0, [3.40, 3.41, 3.42, 3.40]),
        "b": (10.0, [3.43, 3.45, 3.44, 3.46]),
        "z": (12.0, [3.00, 3.00, 3.00, 3.00]),  # best at N, but 20% worse at L0: ineligible
        "c": (13.0, [3.20, 3.20, 3.20, 3.20]),  # over the margin too, behind z
    })  # fmt: skip
    verdict = recommend(table, ["rope", "a", "b", "z", "c"], "rope", 8, 32, margin=0.01)
    assert verdict.winner == "a"
    yes, per_head = EngineAnswer(True, ""), EngineAnswer(False, "per-head")
    served = {
        "rope": {"hf": yes, "gguf": yes, "old": yes, "odd": per_head},
        "a": {"hf": yes, "gguf": per_head, "old": per_head, "odd": per_head},
        "b": {"hf": yes, "gguf": yes, "old": per_head, "odd": per_head},
        "z": {"hf": yes, "gguf": yes, "old": yes, "odd": yes},
        "c": {"hf": yes, "gguf": yes, "old": yes, "odd": yes},
    }
    over = {"method": "z", "score": 3.0, "cost": pytest.approx(0.2)}
    tail = "; over the cost margin it serves z (last-quarter NLL 3.0000, costing +20.0%)."
    b, rope = np.mean([3.43, 3.45, 3.44, 3.46]), math.log(286.7)
    assert {e: encode(c) for e, c in per_engine(verdict, served).items()} == {
        "hf": {"method": "a", "score": 3.4075, "cost": 0.0, "behind": 0.0,
               "why_not_best": None, "beyond_margin": over,
               "sentence": "hf: a (the recommended method); last-quarter NLL at 32 3.4075, "
                           "costing +0.0% at 8 tokens" + tail},
        "gguf": {"method": "b", "score": pytest.approx(b), "cost": 0.0,
                 "behind": pytest.approx(b - 3.4075), "why_not_best": "per-head",
                 "beyond_margin": over,
                 "sentence": "gguf: b, +0.0375 nats behind a; last-quarter NLL at 32 3.4450, "
                             "costing +0.0% at 8 tokens" + tail},
        # The only eligible method it serves has collapsed: named, and said so.
        "old": {"method": "rope", "score": pytest.approx(rope), "cost": 0.0,
                "behind": pytest.approx(rope - 3.4075), "why_not_best": "per-head",
                "beyond_margin": over,
                "sentence": "old: rope, +2.2509 nats behind a (collapsed at 32); last-quarter "
                            "NLL at 32 5.6584, costing +0.0% at 8 tokens" + tail},
        # Serving only methods over the margin is serving none of the eligible ones.
        "odd": {"method": None, "score": None, "cost": None, "behind": None,
                "why_not_best": "per-head", "beyond_margin": over,
                "sentence": "odd: serves none of the eligible methods exactly (per-head)" + tail},
    }  # fmt: skip
    # An engine missing from a method's answers does not serve it; a method over the margin
    # that scores no better than the one served is not offered.
    served = {"a": {"hf": yes}, "b": {"hf": yes, "gguf": yes}, "z": {}, "c": {}}
    engines = per_engine(verdict, served)
    assert engines["gguf"].method == "b" and engines["gguf"].why_not_best is None
    assert engines["gguf"].sentence == (
        "gguf: b, +0.0375 nats behind a; last-quarter NLL at 32 3.4450, costing +0.0% at 8 tokens."
    )
    tie = _table({"a": (10.0, [3.4] * 4), "t": (12.0, [3.4] * 4)})
    tied = recommend(tie, ["a", "t"], "a", 8, 32, margin=0.01)
    assert per_engine(tied, {"a": {"e": yes}, "t": {"e": yes}})["e"].beyond_margin is None
    # Without a verdict's collapsed list (older compare.json), collapse is judged here.
    old = dataclasses.replace(verdict, collapsed=())
    served = {"rope": {"e": yes}, "a": {"e": per_head}}
    assert "(collapsed at 32)" in per_engine(old, served)["e"].sentence


def test_a_method_exactly_ln3_behind_has_not_collapsed():
    """Collapse is strictly more than ln 3 nats (3x the perplexity) behind the best."""
    from ropekit.compare.verdict import COLLAPSE_NATS, _collapsed

    assert _collapsed(["a", "b"], {"a": 0.0, "b": COLLAPSE_NATS}) == []
    assert _collapsed(["a", "b"], {"a": 0.0, "b": COLLAPSE_NATS * 1.001}) == ["b"]


def test_mean_std_of_no_one_two_and_three_values():
    from ropekit.compare.verdict import mean_std

    assert mean_std([]) == {"mean": None, "std": None, "n": 0}
    assert mean_std([5]) == {"mean": 5.0, "std": 0.0, "n": 1}
    assert mean_std([1, 3]) == {"mean": 2.0, "std": math.sqrt(2.0), "n": 2}
    assert mean_std([1, 2, 6]) == {"mean": 3.0, "std": math.sqrt(7.0), "n": 3}  # (4+1+9)/2


def test_pooled_retrieval_keeps_the_confidence_level_asked_for():
    pooled = pooled_accuracy([{"correct": 3, "n": 10}, {"correct": 7, "n": 10}], confidence=0.9)
    assert (pooled["low"], pooled["high"]) == wilson_interval(10, 20, 0.9)
    assert pooled["confidence"] == 0.9


def _accuracy(correct, n, confidence=0.95) -> Accuracy:
    return Accuracy(**accuracy_entry(correct, n, confidence))


def _seed(
    correct, n, seed, other=None, nearest=None, confidence=0.95, substring=None, distance=40.0
):
    """One seed's probes in one distance bin, its interval Wilson's at ``confidence``;
    ``substring`` correct by RULER's rule (None: not counted)."""
    low, high = wilson_interval(correct, n, confidence)
    return SeedBin(
        correct=correct, n=n, accuracy=correct / n, low=low, high=high, confidence=confidence,
        other_needle=other, nearest_needle=nearest, seed=seed, mean_distance=distance,
        substring=None if substring is None else _accuracy(substring, n, confidence),
    )  # fmt: skip


def test_a_pooled_bin_sums_the_substring_rule_apart_and_refuses_a_partial_count():
    """3/10 and 7/10 exact, 4/10 and 9/10 by the substring rule: 13/20 with its own Wilson
    interval. A seed whose summary did not count it leaves the pooled one unknown."""
    pooled = pooled_bin([_seed(3, 10, 0, substring=4), _seed(7, 10, 1, substring=9)], 32, 48)
    assert (pooled.correct, pooled.substring) == (10, _accuracy(13, 20))
    partial = pooled_bin([_seed(3, 10, 0, substring=4), _seed(7, 10, 1)], 32, 48)
    assert partial.substring is None and partial.correct == 10


def test_a_pooled_bin_sums_the_probes_and_the_wrong_answers_naming_another_needle():
    """3/10 and 7/30 pool to 10/40 with one Wilson interval; the wrong answers naming another
    needle (and the nearest one) are summed like the probes, a seed's 0 counting as 0; the
    bin's mean distance is that of all its probes."""
    seeds = [_seed(3, 10, 0, other=0, nearest=2, distance=36.0),
             _seed(7, 30, 1, other=3, nearest=0, distance=44.0)]  # fmt: skip
    pooled = pooled_bin(seeds, 32, 48)
    assert (pooled.correct, pooled.n, pooled.runs, pooled.accuracy) == (10, 40, 2, 0.25)
    assert (pooled.low, pooled.high) == wilson_interval(10, 40) and pooled.confidence == 0.95
    assert (pooled.other_needle, pooled.nearest_needle) == (3, 2)
    assert (pooled.low_distance, pooled.high_distance, pooled.mean_distance) == (32, 48, 42.0)
    assert pooled.per_seed == tuple(seeds)


def test_a_pooled_bin_keeps_the_seeds_level_and_refuses_a_partial_count():
    """One seed at 90%: its interval stays at 90%. A seed whose summary did not count the
    wrong answers (None) leaves the pooled count unknown, not the other seeds' sum."""
    one = pooled_bin([_seed(3, 10, 0, other=1, nearest=1, confidence=0.9)], 32, 48)
    assert (one.low, one.high) == wilson_interval(3, 10, 0.9) and one.confidence == 0.9
    assert (one.runs, one.other_needle, one.nearest_needle) == (1, 1, 1)
    partial = pooled_bin([_seed(3, 10, 0, other=2, nearest=1), _seed(7, 10, 1)], 32, 48)
    assert (partial.other_needle, partial.nearest_needle) == (None, None)


def _verdict(winner="a", runner_up="b", target=32) -> Verdict:
    return Verdict(
        rule="r", margin=0.05, min_difference=0.0, short_length=8, target_length=target,
        baseline="rope", costs={}, scores={}, eligible=("a", "b"), winner=winner,
        runner_up=runner_up, difference=None, resolved=False, collapsed=(), sentence="s",
    )  # fmt: skip


EDGES = (0, 8, 16, 24, 32)  # distance bins up to N = 32, trained at L0 = 8


def _probed(correct: dict[int, int], confidence=0.95):
    """A method's retrieval: {a bin's low edge: correct of its 10 probes}."""
    bins = [
        pooled_bin([_seed(k, 10, 0, confidence=confidence, distance=low + 4.0)], low, low + 8)
        for low, k in sorted(correct.items())
    ]
    return method_retrieval(bins, EDGES, 0.8, trained_at=8)


def _text(correct: int, n: int = 10, confidence=0.95) -> str:
    low, high = wilson_interval(correct, n, confidence)
    return f"{correct / n:.2f} [{low:.2f}, {high:.2f}] ({correct}/{n})"


def test_a_method_pools_its_probes_past_the_trained_length_each_once_and_has_its_reach():
    """Bins (0, 8] 10/10, (8, 16] 9/10, (16, 24] 7/10, (24, 32] 9/10: past L0 = 8 are the
    last three, 25/30; the reach at 0.8 ends where the first bin below it starts, 16."""
    method = _probed({0: 10, 8: 9, 16: 7, 24: 9})
    assert method.past_from == 8 and method.past == _accuracy(25, 30)
    assert (method.reach.distance, method.reach.accuracy) == (16, 0.8)
    between = method_retrieval(method.by_distance, EDGES, 0.8, trained_at=12)
    assert between.past_from == 16 and between.past == _accuracy(16, 20)  # the next edge
    assert method_retrieval(method.by_distance, EDGES, 0.8, trained_at=33).past is None
    empty = method_retrieval([], EDGES, 0.8, trained_at=8)
    assert (empty.reach, empty.past) == (None, None)


def test_the_retrieval_note_gives_winner_and_runner_up_past_the_trained_length():
    retrieval = {"a": _probed({0: 10, 8: 7, 16: 2}), "b": _probed({0: 9, 8: 3, 16: 1})}
    low, high = difference_interval(9, 20, 4, 20)
    assert retrieval_note(retrieval, _verdict()) == (
        "Retrieval past the trained length (needles more than 8 tokens back: accuracy, 95% "
        "Wilson interval, correct/probes; the reach: the farthest distance up to which every "
        "bin scores the accuracy named), beside the rule, not part of it: a "
        f"{_text(9, 20)}, reach 8 at 0.8; b {_text(4, 20)}, reach 8 at 0.8; the difference "
        f"+0.25 [{low:+.2f}, {high:+.2f}] (Newcombe's interval) does not tell them apart."
    )
    assert low < 0 < high
    apart = {"a": _probed({8: 10, 16: 10}), "b": _probed({8: 1, 16: 0})}
    assert retrieval_note(apart, _verdict()).endswith(") tells them apart.")


def test_the_retrieval_note_uses_the_paired_interval_where_the_answers_are_paired():
    """The same accuracies (9/20 against 4/20) with their 2x2 table: b right only where a is
    too, so the pairing tells them apart where the unpaired interval does not."""
    retrieval = {"a": _probed({0: 10, 8: 7, 16: 2}), "b": _probed({0: 9, 8: 3, 16: 1})}
    pairs = PairedProbes(both=4, only_a=5, only_b=0, neither=11, confidence=0.95)
    low, high = paired_difference_interval(4, 5, 0, 11)
    note = retrieval_note(retrieval, _verdict(), pairs)
    assert note.endswith(
        f"the difference +0.25 [{low:+.2f}, {high:+.2f}] (Newcombe's interval for paired "
        "probes: both answered the same 20) tells them apart."
    )
    assert low > 0 and retrieval_note(retrieval, _verdict()).endswith("does not tell them apart.")


def test_the_retrieval_note_names_only_the_methods_probed_past_the_trained_length():
    alone = {"a": _probed({8: 7})}
    assert retrieval_note(alone, _verdict()).endswith(
        f"not part of it: a {_text(7)}, reach 0 at 0.8."
    )
    assert retrieval_note(alone, _verdict(runner_up=None)).endswith(
        f"a {_text(7)}, reach 0 at 0.8."
    )
    near = {**alone, "b": _probed({0: 3})}  # b has no probe past L0
    assert retrieval_note(near, _verdict()) == retrieval_note(alone, _verdict())
    assert retrieval_note(alone, _verdict(winner=None, runner_up=None)) is None
    assert retrieval_note({}, _verdict()) is None
    assert retrieval_note({"a": _probed({0: 7})}, _verdict()) is None  # none past L0


def _entry(ppl=None, windows=None, blocks=None) -> TableEntry:
    """One length's entry: ppl per seed, last-quarter window NLLs and blocks per seed."""
    windows = windows or []
    return TableEntry(
        ppl=tuple(ppl or ()), nll=(), last_quarter_windows=tuple(tuple(w) for w in windows),
        last_quarter_blocks=tuple(blocks or [None] * len(windows)), position_nll=(),
    )  # fmt: skip


def test_cost_and_score_average_only_the_domains_scored_at_that_length():
    from ropekit.compare.verdict import cost_at, score_at

    table = {
        "m": {
            "b": {32: _entry(windows=[[6.0]])},  # no document of b holds 8 tokens: no cost there
            "a": {8: _entry(ppl=[12.0, 14.0]), 32: _entry(windows=[[1.0, 3.0], [3.0, 5.0]])},
            "c": {8: _entry(ppl=[20.0])},  # nor one of c 32 tokens: no score there
            "z": {8: _entry(ppl=[5.0]), 32: _entry(windows=[[9.0]])},  # the baseline lacks z
        },
        "base": {"a": {8: _entry(ppl=[10.0])}, "b": {8: _entry(ppl=[10.0])},
                 "c": {8: _entry(ppl=[10.0])}},
    }  # fmt: skip
    # Cost: a's seeds average 13 against 10 (+30%), c's 20 against 10 (+100%); b and z unpaired.
    assert cost_at(table, "m", "base", 8) == pytest.approx(0.65)
    # Score: b 6, a's windows averaged over its two seeds (2 and 4, so 3), z 9; c has none.
    assert score_at(table, "m", 32) == pytest.approx(6.0)
    assert cost_at(table, "m", "base", 99) is None and score_at(table, "m", 99) is None
    # Seeds scored on different windows are refused, not silently truncated.
    ragged = {"m": {"a": {32: _entry(windows=[[1.0, 2.0], [3.0]])}}}
    with pytest.raises(ValueError):
        score_at(ragged, "m", 32)


def test_pairing_uses_the_domains_both_methods_scored_and_every_window_of_them():
    from ropekit.compare.verdict import paired_blocks, paired_windows

    table = {
        "a": {"only": {32: _entry(windows=[[5.0]])},
              "x": {32: _entry(windows=[[1.5]], blocks=[[[1.0, 2.0]]])},
              "y": {32: _entry(windows=[[1.0, 2.0]], blocks=[[[1.0, 1.0], [2.0, 2.0]]])}},
        "b": {"only": {},
              "x": {32: _entry(windows=[[1.0]], blocks=[[[0.5, 1.5]]])},
              "y": {32: _entry(windows=[[2.0, 2.5]], blocks=[[[2.0, 2.0], [3.0, 2.0]]])}},
    }  # fmt: skip
    assert paired_windows(table, "a", "b", 32) == [0.5, -1.0, -0.5]
    diffs = paired_blocks(table, "a", "b", 32)
    assert [d.tolist() for d in diffs] == [[0.5, 0.5], [-1.0, -1.0], [-1.0, 0.0]]
    # One side without blocks somewhere: no block pairing at all.
    table["b"]["y"][32] = dataclasses.replace(table["b"]["y"][32], last_quarter_blocks=(None,))
    assert paired_blocks(table, "a", "b", 32) is None
    # Methods, or seeds, scored on different numbers of windows are refused.
    table["b"]["y"][32] = _entry(windows=[[2.0]], blocks=[[[2.0, 2.0]]])
    with pytest.raises(ValueError):
        paired_windows(table, "a", "b", 32)
    with pytest.raises(ValueError):
        paired_blocks(table, "a", "b", 32)
    seeds = {"a": {"d": {32: _entry(windows=[[1.0], [1.0, 2.0]],
                                    blocks=[[[1.0, 1.0]], [[1.0, 1.0], [2.0, 2.0]]])}},
             "b": {"d": {32: _entry(windows=[[1.0]], blocks=[[[1.0, 1.0]]])}}}  # fmt: skip
    with pytest.raises(ValueError):
        paired_blocks(seeds, "a", "b", 32)


def test_the_block_error_needs_eight_blocks_averages_windows_and_keeps_the_first_of_ties():
    from ropekit.compare.verdict import block_error

    w = np.array([0.0, 1.0] * 4)  # 8 blocks: sample variance 2/7, so Var(mean) = 2/7 / 8
    assert block_error([w]) == {"se_blocks": math.sqrt(1 / 28), "block_tokens": 64, "blocks": 8}
    # Two windows: the variance of their mean is the sum over windows over 2^2.
    assert block_error([w, w]) == {
        "se_blocks": pytest.approx(math.sqrt(1 / 56)), "block_tokens": 64, "blocks": 16,
    }  # fmt: skip
    assert block_error([w[:7]]) is None  # 7 blocks are too few
    # Equal errors at every block length (none at all): the shortest blocks are reported.
    assert block_error([np.zeros(16)]) == {"se_blocks": 0.0, "block_tokens": 64, "blocks": 16}
    # 16 blocks merged into 8 pairs when the pairs' error is larger.
    trend = np.array([0.0, 0.0, 1.0, 1.0] * 4)
    got = block_error([trend])
    assert (got["block_tokens"], got["blocks"]) == (128, 8)
    assert got["se_blocks"] == pytest.approx(math.sqrt(8 / 7 / 4 / 8))


def test_the_block_error_doubles_the_block_length_up_to_the_last_that_keeps_eight_blocks():
    """1024 blocks, the first half 0 and the second 1: with m blocks of the doubled length the
    error is sqrt(1/4 / (m - 1)), largest at m = 8, so the lengths run 64, 128, ..., 8192 tokens
    (128 blocks merged into each) and stop there."""
    from ropekit.compare.verdict import block_error

    step = np.repeat([0.0, 1.0], 512)
    got = block_error([step])
    assert (got["block_tokens"], got["blocks"]) == (64 * 128, 8)
    assert got["se_blocks"] == pytest.approx(math.sqrt(0.25 / 7))


def _blocks_table(windows: dict[str, list[list[float]]]) -> dict:
    """One domain, cost 0 at 8; at 32 each method's windows given by their block means (one
    seed), each window's NLL the mean of its blocks."""
    return {
        m: {"d": {8: _entry(ppl=[10.0], windows=[[1.0]]),
                  32: _entry(ppl=[1.0], windows=[[float(np.mean(w)) for w in ws]],
                             blocks=[ws])}}
        for m, ws in windows.items()
    }  # fmt: skip


def test_the_recommendation_record_without_an_eligible_method_and_with_only_one():
    table = _table({"rope": (10.0, [3.0]), "x": (12.0, [2.0])})
    none = encode(recommend(table, ["x"], "rope", 8, 32, margin=0.01))
    rule = none.pop("rule")
    assert rule.startswith("- **Cost at L0** of a method: the relative change")
    assert rule.endswith("deploy there and what it costs against the overall best.")
    assert "Retrieval accuracy" not in rule and "The rule:" not in rule
    assert none == {
        "margin": 0.01, "min_difference": 0.005, "short_length": 8, "target_length": 32,
        "baseline": "rope", "costs": {"x": pytest.approx(0.2)}, "scores": {"x": 2.0},
        "eligible": [], "winner": None, "runner_up": None, "difference": None,
        "resolved": False, "collapsed": [],
        "sentence": "No method costs at most 1.0% at 8 tokens; none is recommended.",
        "retrieval": None, "serving": None,
    }  # fmt: skip
    only = encode(recommend(table, ["rope", "x"], "rope", 8, 32, margin=0.01))
    assert only["rule"] == rule
    assert {k: v for k, v in only.items() if k != "rule"} == {
        **none, "costs": {"rope": 0.0, "x": pytest.approx(0.2)},
        "scores": {"rope": 3.0, "x": 2.0}, "eligible": ["rope"], "winner": "rope",
        "resolved": True,
        "sentence": "rope is the only method within 1.0% of the unmodified model at 8 tokens "
                    "(last-quarter NLL at 32: 3.0000).",
    }  # fmt: skip


def test_eligible_methods_are_ranked_by_score_and_a_cost_equal_to_the_margin_is_eligible():
    table = _table({
        "base": (10.0, [2.0]),
        "zeta": (12.5, [1.0]),  # +25% at L0 exactly: the margin itself
        "mid": (10.0, [1.5]),
        "alpha": (10.0, [1.8]),
    })  # fmt: skip
    verdict = recommend(table, list(table), "base", 8, 32, margin=0.25)
    assert verdict.costs["zeta"] == 0.25
    assert list(verdict.eligible) == ["zeta", "mid", "alpha", "base"]
    assert verdict.winner == "zeta" and verdict.runner_up == "mid"
    assert list(verdict.collapsed) == []


def test_a_lead_of_exactly_min_difference_with_no_spread_resolves_over_three_windows():
    table = _table({"a": (10.0, [1.5, 1.5, 1.5]), "b": (10.0, [2.0, 2.0, 2.0])})
    verdict = recommend(table, ["a", "b"], "a", 8, 32, margin=0.01, min_difference=0.5)
    assert verdict.resolved and verdict.runner_up == "b"
    assert encode(verdict.difference) == {
        "mean": -0.5, "std": 0.0, "n": 3, "se": 0.0, "se_windows": 0.0,
        "se_blocks": None, "block_tokens": None, "blocks": None, "se_seeds": None, "seeds": 1,
    }  # fmt: skip
    assert verdict.sentence == (
        "Use a at 32 tokens: last-quarter NLL at 32 1.5000 against b's 2.0000 (paired over 3 "
        "windows: -0.5000 ± 0.0000 s.e. over windows), costing +0.0% at 8 tokens."
    )
    above = recommend(table, ["a", "b"], "a", 8, 32, margin=0.01, min_difference=0.5000001)
    assert not above.resolved


def test_two_windows_without_blocks_have_a_window_error_but_cannot_resolve():
    table = _table({"a": (10.0, [1.0, 2.0]), "b": (10.0, [2.0, 2.0])})
    verdict = recommend(table, ["a", "b"], "a", 8, 32, margin=0.01)
    assert not verdict.resolved
    assert encode(verdict.difference) == {
        "mean": -0.5, "std": pytest.approx(math.sqrt(0.5)), "n": 2, "se": None,
        "se_windows": pytest.approx(0.5), "se_blocks": None, "block_tokens": None,
        "blocks": None, "se_seeds": None, "seeds": 1,
    }  # fmt: skip
    assert verdict.sentence == (
        "No difference is resolved at this sample size between a and b at 32 tokens: "
        "last-quarter NLL at 32 1.5000 against b's 2.0000 (paired over 2 windows: -0.5000); a "
        "is ahead, costing +0.0% at 8 tokens. 2 windows at 32 cannot resolve a lead (the rule "
        "needs at least 3, or 8 blocks of 64 tokens in each window's last quarter): score more "
        "held-out spans (spans)."
    )
    one = recommend(_table({"a": (10.0, [2.0]), "b": (10.0, [2.5])}), ["a", "b"], "a", 8, 32, 0.01)
    assert "(paired over 1 window: -0.5000); a is ahead" in one.sentence


def test_the_lead_must_exceed_twice_its_standard_error_strictly():
    # Nine windows, differences 2, -4 and seven -1: mean -1, sd 1.5, s.e. 0.5 exactly, so the
    # lead is exactly two standard errors: not resolved.
    edge = _table({"a": (10.0, [12.0, 6.0] + [9.0] * 7), "b": (10.0, [10.0] * 9)})
    verdict = recommend(edge, ["a", "b"], "a", 8, 32, margin=0.01)
    d = verdict.difference
    assert (d.mean, d.std, d.se) == (-1.0, 1.5, 0.5) and not verdict.resolved
    # Differences 1.4, -3.4 and seven -1: s.e. 0.4, a lead of 2.5 standard errors: resolved.
    clear = _table({"a": (10.0, [11.4, 6.6] + [9.0] * 7), "b": (10.0, [10.0] * 9)})
    verdict = recommend(clear, ["a", "b"], "a", 8, 32, margin=0.01)
    assert verdict.difference.se == pytest.approx(0.4) and verdict.resolved


def test_the_error_text_names_where_the_error_came_from():
    # One window, 8 blocks, a constant lead: resolved within that window's text only.
    one = _blocks_table({"a": [[1.0, 1.5] * 4], "b": [[2.0, 2.5] * 4]})
    verdict = recommend(one, ["a", "b"], "a", 8, 32, margin=0.01)
    assert verdict.resolved and verdict.sentence == (
        "Use a at 32 tokens: last-quarter NLL at 32 1.2500 against b's 2.2500 (paired over 1 "
        "window: -1.0000 ± 0.0000 s.e. from 8 blocks of 64 tokens within the windows), costing "
        "+0.0% at 8 tokens. The error is from within 1 window: more held-out spans (spans) "
        "would say whether the lead holds across documents."
    )
    # Three windows, each constant within but differing across: the window error is larger.
    three = _blocks_table({"a": [[1.0] * 8, [1.5] * 8, [2.0] * 8], "b": [[2.0] * 8] * 3})
    verdict = recommend(three, ["a", "b"], "a", 8, 32, margin=0.01)
    d = verdict.difference
    assert d.se_blocks == 0.0 and d.se == d.se_windows == pytest.approx(0.5 / 3**0.5)
    assert verdict.sentence == (
        "No difference is resolved at this sample size between a and b at 32 tokens: "
        "last-quarter NLL at 32 1.5000 against b's 2.0000 (paired over 3 windows: -0.5000 ± "
        "0.2887 s.e. over windows); a is ahead, costing +0.0% at 8 tokens."
    )


def test_every_collapsed_method_is_named_in_the_sentence():
    four = _table({
        "rope": (10.0, [5.0] * 3), "alibi": (10.0, [6.0] * 3),
        "a": (10.0, [1.0] * 3), "b": (10.0, [1.5] * 3),
    })  # fmt: skip
    verdict = recommend(four, list(four), "rope", 8, 32, margin=0.01)
    assert list(verdict.collapsed) == ["rope", "alibi"] and verdict.resolved
    assert verdict.sentence == (
        "Use a at 32 tokens: last-quarter NLL at 32 1.0000 against b's 1.5000 (paired over 3 "
        "windows: -0.5000 ± 0.0000 s.e. over windows); collapsed at 32: rope, alibi, costing "
        "+0.0% at 8 tokens."
    )
    alone = _table({"rope": (10.0, [5.0]), "alibi": (10.0, [6.0]), "a": (10.0, [1.0])})
    verdict = recommend(alone, list(alone), "rope", 8, 32, margin=0.01)
    assert verdict.resolved and verdict.sentence == (
        "Use a at 32 tokens: last-quarter perplexity at 32 2.7 (NLL 1.0000), costing +0.0% at 8 "
        "tokens; every other method within 1.0% collapses there: rope (last-quarter perplexity "
        "148.4), alibi (last-quarter perplexity 403.4)."
    )


def test_an_engine_with_no_answer_for_the_recommended_method_gives_no_reason():
    table = _table({"a": (10.0, [1.0] * 3), "b": (10.0, [1.5] * 3)})
    verdict = recommend(table, ["a", "b"], "a", 8, 32, margin=0.01)
    engines = per_engine(verdict, {"b": {"e": EngineAnswer(False, "per-head")}})
    assert encode(engines["e"]) == {
        "method": None, "score": None, "cost": None, "behind": None, "why_not_best": None,
        "beyond_margin": None, "sentence": "e: serves none of the eligible methods exactly.",
    }  # fmt: skip
    # An exact answer's reason is "" (ropekit.serve.serving.Served): no reason to report.
    exact = per_engine(verdict, {"a": {"e": EngineAnswer(True, "")}})
    assert exact["e"].method == "a" and exact["e"].why_not_best is None


def test_any_two_methods_differ_by_the_rules_paired_difference_and_the_verdict_states_its_own():
    """``paired_difference`` is the verdict's difference for any pair: a minus b, window by
    window over the domains both scored (seeds averaged), with its error over windows (3
    here, no blocks) and over seeds; the recommendation states exactly that of the winner and
    runner-up."""
    from ropekit.compare.verdict import paired_difference, recommend

    def method(ppl, *windows):
        return {"d": {8: _entry(ppl=[ppl], windows=[[1.0]]), 32: _entry(windows=windows)}}

    table = {
        "base": method(10.0, [9.0, 9.0, 9.0]),
        "a": method(10.0, [1.0, 2.0, 3.0]),
        "b": method(10.0, [1.5, 2.0, 4.0], [1.5, 3.0, 4.0]),  # two seeds: 1.5, 2.5, 4.0
        "c": method(10.0, [4.0, 4.0, 4.0]),
    }
    d = paired_difference(table, "a", "b", 32)
    diffs = np.array([-0.5, -0.5, -1.0])
    assert (d.n, d.mean) == (3, pytest.approx(diffs.mean()))
    assert d.se_windows == pytest.approx(diffs.std(ddof=1) / 3**0.5) and d.se_blocks is None
    seeds = np.array([-0.5, -2.5 / 3])  # b's two seeds, each against a over the 3 windows
    assert d.se_seeds == pytest.approx(seeds.std(ddof=1) / 2**0.5)
    assert d.se == pytest.approx(math.hypot(d.se_windows, d.se_seeds))
    assert paired_difference(table, "b", "a", 32).mean == pytest.approx(-diffs.mean())
    assert paired_difference(table, "a", "c", 32).mean == pytest.approx(-2.0)
    verdict = recommend(table, ["a", "b", "c"], "base", 8, 32, 0.01)
    assert verdict.runner_up == "b" and verdict.difference == d


def _seeds_table(methods: dict[str, list[list[float]]]) -> dict:
    """One domain, cost 0 at 8; at 32 each method's last-quarter window NLLs per seed."""
    return {m: {"d": {8: _entry(ppl=[10.0] * len(runs), windows=[[1.0]] * len(runs)),
                      32: _entry(ppl=[1.0] * len(runs), windows=runs)}}
            for m, runs in methods.items()}  # fmt: skip


def test_the_spread_over_seeds_enters_the_error_and_can_unresolve_a_lead():
    """A trained method's seeds differ by which training run it is: their paired differences'
    error over seeds is added in quadrature to the error over windows, so a lead that one
    lucky seed carries is not resolved, and the sentence says the seeds are in the error."""
    from ropekit.compare.verdict import paired_difference, paired_seeds

    # 4 windows; the trained method's three seeds lead the fixed one by 0.9, 0.1 and 0.2.
    base = [2.0, 2.1, 2.2, 2.0]
    runs = [[v - lead + 0.01 * i for i, v in enumerate(base)] for lead in (0.9, 0.1, 0.2)]
    table = _seeds_table({"trained": runs, "fixed": [base]})
    seeds = paired_seeds(table, "trained", "fixed", 32)
    assert seeds == pytest.approx([-0.885, -0.085, -0.185])  # + mean of 0.00..0.03
    d = paired_difference(table, "trained", "fixed", 32)
    windows = np.mean([np.subtract(w, base) for w in runs], axis=0)  # seeds averaged
    assert d.mean == pytest.approx(np.mean(seeds)) == pytest.approx(windows.mean())
    assert d.se_windows == pytest.approx(windows.std(ddof=1) / 2)
    assert d.se_seeds == pytest.approx(np.std(seeds, ddof=1) / 3**0.5) and d.seeds == 3
    assert d.se == pytest.approx(math.hypot(d.se_windows, d.se_seeds))
    verdict = recommend(table, ["trained", "fixed"], "fixed", 8, 32, margin=0.01)
    assert verdict.winner == "trained" and not verdict.resolved  # 0.39 ± 0.25 over seeds
    assert f"± {d.se:.4f} s.e. over windows and over 3 seeds" in verdict.sentence
    # The same mean lead from one seed: the windows' error alone, resolved.
    one = _seeds_table({"trained": [np.mean(runs, axis=0).tolist()], "fixed": [base]})
    alone = recommend(one, ["trained", "fixed"], "fixed", 8, 32, margin=0.01)
    assert alone.resolved and alone.difference.se_seeds is None and alone.difference.seeds == 1
    assert alone.difference.se == alone.difference.se_windows
    assert "seeds" not in alone.sentence  # nothing says the method was trained
    told = recommend(one, ["trained", "fixed"], "fixed", 8, 32, margin=0.01, trained=["trained"])
    assert told.resolved and told.sentence == alone.sentence + (
        " trained was trained at one seed, so the error lacks the spread over training runs: "
        "more seeds (seeds) would say whether the lead is more than that seed's."
    )
    both = recommend(one, ["trained", "fixed"], "fixed", 8, 32, 0.01, trained=["fixed", "trained"])
    assert both.sentence.endswith(
        " trained and fixed were trained at one seed, so the error lacks the spread over "
        "training runs: more seeds (seeds) would say whether the lead is more than that seed's."
    )
    # Consistent seeds: the spread is small and the lead resolves.
    steady = [[v - lead for v in base] for lead in (0.40, 0.39, 0.41)]
    clear = recommend(_seeds_table({"trained": steady, "fixed": [base]}), ["trained", "fixed"],
                      "fixed", 8, 32, margin=0.01)  # fmt: skip
    assert clear.resolved and clear.difference.se_seeds == pytest.approx(0.01 / 3**0.5)
    told = recommend(_seeds_table({"trained": steady, "fixed": [base]}), ["trained", "fixed"],
                     "fixed", 8, 32, margin=0.01, trained=["trained"])  # fmt: skip
    assert told.sentence == clear.sentence  # three seeds: their spread is in the error


def test_two_trained_methods_pair_their_seeds_by_position():
    """Seed k of one trained method against seed k of the other (the same training samples):
    a run-to-run swing they share cancels, so the paired error is smaller than either
    method's own spread; methods scored at different numbers of seeds do not pair."""
    from ropekit.compare.verdict import paired_difference, paired_seeds

    swing = [0.0, 0.5, -0.5]  # what each seed's samples do to both methods
    a = [[2.0 + s, 2.2 + s] for s in swing]
    b = [[2.1 + s + e, 2.3 + s + e] for s, e in zip(swing, [0.01, -0.01, 0.0], strict=True)]
    table = _seeds_table({"a": a, "b": b, "c": a[:2]})
    assert paired_seeds(table, "a", "b", 32) == pytest.approx([-0.11, -0.09, -0.1])
    d = paired_difference(table, "a", "b", 32)
    assert d.se_seeds == pytest.approx(0.01 / 3**0.5) and d.seeds == 3
    assert d.se_seeds < np.std([np.mean(w) for w in a], ddof=1) / 10
    assert paired_seeds(table, "b", "a", 32) == pytest.approx([0.11, 0.09, 0.1])
    with pytest.raises(ValueError, match="a and c are scored at 32 with 2 and 3 seeds"):
        paired_difference(table, "a", "c", 32)


def test_seeds_pair_only_where_both_were_scored_and_windows_must_match():
    """Methods that share no scored domain have no seeds to pair (and no difference, not an
    error); the same domain with different windows is refused, never silently truncated."""
    from ropekit.compare.verdict import paired_difference, paired_seeds

    table = {
        "a": {"x": {32: _entry(windows=[[1.0, 2.0], [1.5, 2.5]])}},
        "b": {"y": {32: _entry(windows=[[2.0, 2.0], [2.0, 2.0]])}},
        "c": {"x": {32: _entry(windows=[[2.0], [2.0]])}},
    }
    assert paired_seeds(table, "a", "b", 32) == []
    d = paired_difference(table, "a", "b", 32)
    assert (d.n, d.mean, d.se, d.seeds, d.se_seeds) == (0, None, None, 0, None)
    with pytest.raises(ValueError, match=r"shorter|longer"):
        paired_seeds(table, "a", "c", 32)
