"""Haystacks: pieces inserted on their own lines at sentence boundaries, with their spans;
distinct streams that follow the seed; the small text helpers."""

from __future__ import annotations

import numpy as np
import pytest

from ropekit.evals.haystack import (
    Distinct,
    Haystack,
    and_list,
    load_haystack,
    number,
    uuid,
)


def test_pieces_at_the_ends_of_the_haystack():
    hay = load_haystack("noise")
    first = hay.context(40, [(0.0, "FIRST"), (1.0, "LAST")])
    assert first.text.startswith("FIRST\nThe grass") and first.text.endswith("\nLAST")
    assert [first.text[a:b] for a, b in first.spans] == ["FIRST", "LAST"]


def test_a_piece_snaps_to_a_sentence_end_within_reach_on_a_line_of_its_own():
    hay = Haystack("toy", ["w "] * 9 + ["end. "])  # a sentence ends after every 10th unit
    n = 80  # reach: n // SNAP_FRACTION = 2 units either side
    assert [i for i in range(n + 1) if hay.is_boundary(i, n)] == list(range(0, n + 1, 10))
    assert hay.snap(0.26, n) == 20  # round(20.8) = 21: one unit from a sentence end
    assert hay.snap(0.3, n) == 24  # no sentence end within 2 units: the word boundary itself
    built = hay.context(n, [(0.26, "NEEDLE"), (0.26, "SECOND")])  # in the given order
    lines = built.text.split("\n")
    assert lines[0] == " ".join(["w"] * 9 + ["end."] + ["w"] * 9 + ["end."])
    assert lines[1:3] == ["NEEDLE", "SECOND"] and len(lines) == 4
    assert [built.text[a:b] for a, b in built.spans] == ["NEEDLE", "SECOND"]
    with pytest.raises(ValueError, match="holds no text"):
        Haystack("empty", [])


def test_a_distinct_stream_is_a_pure_function_of_its_seed_and_never_repeats():
    def digit(rng):
        return str(int(rng.integers(0, 10)))

    stream = Distinct(digit, seed=3, exclude=["7"])
    ten = stream.take(9)
    assert sorted(ten) == [d for d in "012345689"]  # every digit but the excluded one, once
    assert Distinct(digit, seed=3, exclude=["7"]).take(4, start=0) == ten[:4]
    assert stream[2] == ten[2]  # fixed once drawn
    with pytest.raises(ValueError, match="ran out of distinct items"):
        stream[9]


def test_helpers_write_numbers_lists_and_uuids_as_a_reader_expects():
    rng = np.random.default_rng(0)
    assert all(len(n) == 5 and n[0] != "0" for n in (number(rng, 5) for _ in range(50)))
    a, b = uuid(np.random.default_rng(1)), uuid(np.random.default_rng(1))
    assert a == b and a[14] == "4"  # seeded, version 4
    assert [and_list(x) for x in ([], ["a"], ["a", "b"], ["a", "b", "c"])] == [
        "", "a", "a and b", "a, b and c",
    ]  # fmt: skip
