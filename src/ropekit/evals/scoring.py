"""Scoring as RULER does it, and the summaries built from the scores.

Holds:
- `clean_prediction`: the answer text that gets scored (first line, stripped).
- `match_all`, `match_part`: one prediction against its references; `string_match_all`,
  `string_match_part`: their means over samples (RULER's `string_match_all/part`, as fractions
  in [0, 1] rather than percentages).
- `SCORERS`: metric name -> per-sample scorer.
- `effective_length`: the longest length up to which a score stays at or above a threshold.

Matching is case-insensitive substring search, as in RULER: the reference "48213" is found in
"The pass key is 48213." and also in "482139" (RULER accepts the latter too; task values are
drawn distinct, so it never credits a different needle).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_prediction(text: str) -> str:
    """The scored part of a generation: up to the first newline (answers are one line; any
    other control character also ends it, as RULER's post-processing does), stripped."""
    return _CONTROL.sub("\n", text).split("\n", 1)[0].strip()


def match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of `references` found in `prediction` (retrieval, tracing, aggregation)."""
    if not references:
        raise ValueError("references=[] is not allowed; allowed: at least one reference")
    found = prediction.lower()
    return sum(r.lower() in found for r in references) / len(references)


def match_part(prediction: str, references: Sequence[str]) -> float:
    """1 if any of `references` is found in `prediction`, else 0 (RULER's QA rule)."""
    if not references:
        raise ValueError("references=[] is not allowed; allowed: at least one reference")
    found = prediction.lower()
    return float(any(r.lower() in found for r in references))


SCORERS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": match_all,
    "string_match_part": match_part,
}


def _mean(scores: Iterable[float]) -> float:
    scores = list(scores)
    if not scores:
        raise ValueError("no predictions to score")
    return sum(scores) / len(scores)


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Mean over samples of the fraction of each sample's references found in its prediction."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")
    return _mean(match_all(p, r) for p, r in zip(predictions, references, strict=True))


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Mean over samples of whether any of each sample's references is in its prediction."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")
    return _mean(match_part(p, r) for p, r in zip(predictions, references, strict=True))


# Defaults of the effective length: an absolute floor, and a share of the short-context score.
THRESHOLD = 0.5
RELATIVE_THRESHOLD = 0.8


def effective_length(
    scores: Mapping[int, float], threshold: float = THRESHOLD, relative: bool = False
) -> int | None:
    """The longest length L such that every evaluated length up to L scores >= the bar.

    The bar is `threshold` (absolute, default 0.5: the model answers at least half right), or
    with `relative=True` `threshold` times the score at the shortest length (default 0.8 in the
    summaries: the model keeps 80% of its short-context ability). "Up to L" makes the answer
    a context the model can be trusted with, not a lucky long length after a failing one
    (RULER's effective length compares each length with a fixed bar in the same way). None
    when the shortest length already fails (or scores 0 under the relative rule).
    """
    if not scores:
        raise ValueError("scores={} is not allowed; allowed: at least one length")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold={threshold!r} is not allowed; allowed: 0 < threshold <= 1")
    lengths = sorted(scores)
    bar = threshold * scores[lengths[0]] if relative else threshold
    if relative and bar <= 0.0:
        return None
    best = None
    for length in lengths:
        if scores[length] < bar:
            break
        best = length
    return best
