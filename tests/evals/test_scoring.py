"""RULER's scoring rules on known strings, and the effective-length rule."""

from __future__ import annotations

import pytest

from ropekit.evals import (
    effective_length,
    match_all,
    match_part,
    string_match_all,
    string_match_part,
)
from ropekit.evals.scoring import clean_prediction


def test_match_all_counts_the_share_of_references_found():
    assert match_all(" 48213. Remember it.", ["48213"]) == 1.0
    assert match_all("The values are 11, 22 and 44.", ["11", "22", "33", "44"]) == 0.75
    assert match_all("nothing here", ["11", "22"]) == 0.0
    assert match_all("APPLE, pear", ["apple", "Pear"]) == 1.0  # case-insensitive
    assert match_all("482139", ["48213"]) == 1.0  # substring, as RULER scores


def test_match_part_needs_any_reference():
    assert match_part("It was Paris.", ["paris", "Lyon"]) == 1.0
    assert match_part("It was Nice.", ["paris", "Lyon"]) == 0.0


def test_means_over_samples():
    predictions = ["a b", "c", "nothing"]
    references = [["a", "b"], ["c", "d"], ["e"]]
    assert string_match_all(predictions, references) == pytest.approx((1 + 0.5 + 0) / 3)
    assert string_match_part(predictions, references) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="2 predictions for 3"):
        string_match_all(predictions[:2], references)
    with pytest.raises(ValueError, match="references"):
        match_all("x", [])


def test_clean_prediction_keeps_the_first_line():
    assert clean_prediction(" 48213.\nWhat is") == "48213."
    assert clean_prediction("  a\tb\x00c ") == "a"
    assert clean_prediction("\nlate") == ""


def test_effective_length_is_where_the_score_stops_staying_above_the_bar():
    scores = {256: 1.0, 512: 0.9, 1024: 0.4, 2048: 0.6}
    assert effective_length(scores) == 512  # 2048 passes again, but 1024 already failed
    assert effective_length(scores, threshold=0.35) == 2048
    assert effective_length(scores, threshold=0.95) == 256
    assert effective_length({256: 0.2, 512: 0.9}) is None
    # Relative: 80% of the shortest length's score.
    assert effective_length({256: 0.5, 512: 0.41, 1024: 0.39}, 0.8, relative=True) == 512
    assert effective_length({256: 0.0, 512: 0.0}, 0.8, relative=True) is None
    with pytest.raises(ValueError, match="threshold="):
        effective_length(scores, threshold=0.0)
