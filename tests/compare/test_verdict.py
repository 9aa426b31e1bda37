"""The recommendation rule of `ropekit compare` (``ropekit.compare.verdict``): pure
functions on hand-made tables, so each rule is checked in milliseconds (and a mutation tester
can afford to run them per mutant)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ropekit.compare import recommend
from ropekit.compare.verdict import per_engine, pooled_accuracy
from ropekit.evals import wilson_interval


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
        m: {"d": {8: {"ppl": [ppl], "last_quarter_windows": [[1.0]],
                      "last_quarter_blocks": [None]},
                  32: {"ppl": [1.0], "last_quarter_windows": [windows],
                       "last_quarter_blocks": [None]}}}
        for m, (ppl, windows) in values.items()
    }  # fmt: skip


def test_the_recommendation_obeys_the_margin_and_says_when_it_is_not_resolved():
    table = _table({
        "rope": (10.0, [3.0, 3.1, 3.2, 3.0]),
        "cheap": (10.05, [2.0, 2.1, 2.2, 2.0]),  # +0.5% at L0, clearly best at N
        "costly": (12.0, [1.0, 1.0, 1.0, 1.0]),  # best at N but +20% at L0: not eligible
        "close": (10.0, [2.01, 2.12, 2.18, 2.02]),  # within noise of "cheap"
    })  # fmt: skip
    verdict = recommend(table, list(table), "rope", 8, 32, margin=0.01)
    assert verdict["winner"] == "cheap" and "costly" not in verdict["eligible"]
    assert verdict["runner_up"] == "close" and not verdict["resolved"]
    assert "No difference is resolved" in verdict["sentence"]
    clear = recommend({k: v for k, v in table.items() if k != "close"}, ["rope", "cheap"],
                      "rope", 8, 32, margin=0.01)  # fmt: skip
    assert clear["winner"] == "cheap" and clear["resolved"]
    assert clear["sentence"].startswith("Use cheap")
    tiny = {
        "a": (10.0, [2.0, 2.1, 2.2, 2.0]),
        "b": (10.0, [2.000001, 2.100001, 2.200001, 2.000001]),
    }
    twins = recommend(_table(tiny), ["a", "b"], "a", 8, 32, margin=0.01)
    assert twins["winner"] == "a" and not twins["resolved"]  # a lead of 1e-6 nats is no lead
    none = recommend(table, ["costly"], "rope", 8, 32, margin=0.01)
    assert none["winner"] is None and "none is recommended" in none["sentence"]
    assert "cannot resolve" not in verdict["sentence"]  # 4 windows: the sample could
    one = recommend(_table({"a": (10.0, [2.0]), "b": (10.0, [2.5])}), ["a", "b"], "a", 8, 32, 0.01)
    assert not one["resolved"] and "paired over 1 window:" in one["sentence"]
    assert "1 window at 32 cannot resolve a lead (the rule needs at least 3" in one["sentence"]


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
            8: {"ppl": [10.0], "last_quarter_windows": [[1.0]], "last_quarter_blocks": [None]},
            length: {"ppl": [1.0],
                     "last_quarter_windows": [[float(r[quarter:].mean()) for r in rows]],
                     "last_quarter_blocks": [[_block_means(r[quarter:]) for r in rows]]},
        }}  # fmt: skip
    return table


def test_one_window_resolves_a_large_lead_from_blocks_within_it_and_refuses_noise():
    """The new user's case of one window per domain: the error comes from blocks of positions
    within the window, so a large lead resolves and a lead inside the noise does not."""
    rng = np.random.default_rng(0)
    a = 3.0 + rng.standard_normal(4096)  # per-token NLL, sd 1 nat
    large = _token_table({"a": [a], "b": [a + 0.5 + 0.5 * rng.standard_normal(4096)]})
    verdict = recommend(large, ["a", "b"], "a", 8, 4096, margin=0.01)
    d = verdict["difference"]
    assert verdict["winner"] == "a" and verdict["resolved"], verdict["sentence"]
    assert d["n"] == 1 and d["se_windows"] is None and d["block_tokens"] >= 64
    assert d["se"] == pytest.approx(0.5 / np.sqrt(1024), rel=0.5)  # iid: sd / sqrt(tokens)
    assert "blocks of" in verdict["sentence"] and "within 1 window" in verdict["sentence"]
    # No true difference, only noise of sd 0.5 per token: whichever leads is refused.
    noise = _token_table({"a": [a], "b": [a + 0.5 * rng.standard_normal(4096)]})
    refused = recommend(noise, ["a", "b"], "a", 8, 4096, margin=0.01, min_difference=0.0)
    assert not refused["resolved"] and refused["difference"]["se"] > 0.01


def test_the_block_error_grows_with_correlated_positions_rather_than_trusting_64_tokens():
    """A difference that drifts slowly along the window (correlated over 256 tokens) has a
    64-token batch-means error far too small; the blocking analysis keeps the larger one."""
    rng = np.random.default_rng(1)
    drift = np.repeat(rng.standard_normal(16384 // 256), 256) * 0.3  # 256-token plateaus
    a = 3.0 + 0.05 * rng.standard_normal(16384)
    table = _token_table({"a": [a], "b": [a + 0.1 + drift]}, length=16384)
    d = recommend(table, ["a", "b"], "a", 8, 16384, margin=0.01)["difference"]
    blocks = [np.subtract(*(table[m]["d"][16384]["last_quarter_blocks"][0][0] for m in "ba"))]
    one_scale = np.std(blocks[0], ddof=1) / np.sqrt(len(blocks[0]))
    assert d["block_tokens"] >= 256
    assert d["se_blocks"] > 1.5 * one_scale  # one_scale: 64-token blocks taken as independent


def test_a_collapsed_method_is_named_as_such_not_as_an_unresolved_runner_up():
    """The new user's case: dynamic NTK at a last-quarter perplexity of 30.7 against the
    unmodified model's collapse to 286.7, over 1 window, was called unresolved."""
    collapse = _table({
        "rope": (10.0, [math.log(286.7)]),
        "dynamic-ntk": (10.0, [math.log(30.7)]),
    })  # fmt: skip
    verdict = recommend(collapse, ["rope", "dynamic-ntk"], "rope", 8, 32, margin=0.01)
    assert verdict["winner"] == "dynamic-ntk" and verdict["resolved"]
    assert verdict["collapsed"] == ["rope"] and verdict["runner_up"] is None
    assert verdict["sentence"].startswith("Use dynamic-ntk at 32 tokens: last-quarter perplexity")
    assert "collapses there: rope (last-quarter perplexity 286.7)" in verdict["sentence"]
    # The closest method that has not collapsed is the runner-up; the collapsed one is named.
    three = _table({
        "rope": (10.0, [math.log(286.7)] * 4),
        "a": (10.0, [3.40, 3.41, 3.42, 3.40]),
        "b": (10.0, [3.43, 3.45, 3.44, 3.46]),
    })  # fmt: skip
    verdict = recommend(three, ["rope", "a", "b"], "rope", 8, 32, margin=0.01)
    assert verdict["winner"] == "a" and verdict["runner_up"] == "b"
    assert verdict["collapsed"] == ["rope"] and "collapsed at 32: rope" in verdict["sentence"]
    # A lead inside the noise is still refused, collapse or not.
    assert not recommend(_table({"a": (10.0, [3.40]), "b": (10.0, [3.41])}), ["a", "b"], "a",
                         8, 32, 0.01)["resolved"]  # fmt: skip


def test_each_engine_gets_the_best_eligible_method_it_serves_exactly():
    table = _table({
        "rope": (10.0, [math.log(286.7)] * 4),
        "a": (10.0, [3.40, 3.41, 3.42, 3.40]),
        "b": (10.0, [3.43, 3.45, 3.44, 3.46]),
        "z": (12.0, [3.00, 3.00, 3.00, 3.00]),  # best at N, but 20% worse at L0: ineligible
        "c": (13.0, [3.20, 3.20, 3.20, 3.20]),  # over the margin too, behind z
    })  # fmt: skip
    verdict = recommend(table, ["rope", "a", "b", "z", "c"], "rope", 8, 32, margin=0.01)
    assert verdict["winner"] == "a"
    yes, per_head = {"exact": True, "why": None}, {"exact": False, "why": "per-head"}
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
    assert per_engine(verdict, served) == {
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
    assert engines["gguf"]["method"] == "b" and engines["gguf"]["why_not_best"] is None
    assert engines["gguf"]["sentence"] == (
        "gguf: b, +0.0375 nats behind a; last-quarter NLL at 32 3.4450, costing +0.0% at 8 tokens."
    )
    tie = _table({"a": (10.0, [3.4] * 4), "t": (12.0, [3.4] * 4)})
    tied = recommend(tie, ["a", "t"], "a", 8, 32, margin=0.01)
    assert per_engine(tied, {"a": {"e": yes}, "t": {"e": yes}})["e"]["beyond_margin"] is None
    # Without a verdict's collapsed list (older compare.json), collapse is judged here.
    old = {k: v for k, v in verdict.items() if k != "collapsed"}
    served = {"rope": {"e": yes}, "a": {"e": per_head}}
    assert "(collapsed at 32)" in per_engine(old, served)["e"]["sentence"]


def test_a_method_exactly_ln3_behind_has_not_collapsed():
    """Collapse is strictly more than ln 3 nats (3x the perplexity) behind the best."""
    from ropekit.compare.verdict import COLLAPSE_NATS, _collapsed

    assert _collapsed(["a", "b"], {"a": 0.0, "b": COLLAPSE_NATS}) == []
    assert _collapsed(["a", "b"], {"a": 0.0, "b": COLLAPSE_NATS * 1.001}) == ["b"]
