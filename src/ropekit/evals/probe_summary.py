"""Retrieval probes summed up: accuracy per needle distance bin and per haystack length with
Wilson intervals over independent probes, the reach, the trained window, and the record
(`ProbesResult`, the ``probes`` kind) that `evals.probes.run_probes` writes.

Holds:
- `summarize_records`, `reach`: accuracy per distance bin with Wilson intervals over
  independent probes, and the farthest distance up to which every bin holds;
  `distractor_answers`: the wrong answers that name another needle's value.
- `exact_match(prediction, value)`: the score of one probe.
- `paired_probes`, `PairedProbes`: two runs' answers to the same probes as a 2x2 table, and
  the interval of their difference that uses the pairing.
- `trained_window`, `floor_note`: the probes within the trained length pooled, and the
  warning that the task is beyond the model where its positions are trained.
- `Accuracy`, `NeedleAccuracy`, `LengthAccuracy`, `DistanceAccuracy`, `Reach`,
  `TrainedWindow`, `accuracy_text`: the typed numbers, and their one text.
- `ProbesResult`: the summary (the ``probes`` kind at `VERSION`); summaries from before
  distances (version 4: needles at evenly spaced depths, all asked from the end) still read,
  without distance bins or reach.
- `plot_accuracy_vs_distance`: accuracy against distance, one line per method, the trained
  length marked.

Score (`exact_match`): exact match of the first word of the answer line
(trailing punctuation and quotes stripped, case ignored) with the value: "4819302." is
right, "48193021" and "the value is 4819302" are not. RULER's substring rule is recorded
beside it (`contains`) and each bin has its accuracy by that rule too (`substring`:
"4819302.0000" is right by it). Accuracies come with Wilson score intervals
(`evals/intervals.py`). The reach is the upper edge of the last bin of the run of bins, from
the shortest distance on, at or above ``reach_accuracy``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ropekit.evals.intervals import (
    CONFIDENCE,
    accuracy_entry,
    difference_interval,
    paired_difference_interval,
)
from ropekit.evals.probe_haystacks import ProbeConfig
from ropekit.evals.tasks import TaskRecord
from ropekit.figures import figure, save
from ropekit.results import register

_TRAILING = ".,;:!?\"')]"
_LEADING = "\"'(["


def exact_match(prediction: str, value: str) -> bool:
    """Whether the first word of ``prediction`` (quotes and brackets around it and trailing
    punctuation stripped, case ignored) is ``value`` (module docstring)."""
    words = prediction.split()
    return bool(words) and words[0].lstrip(_LEADING).rstrip(_TRAILING).lower() == value.lower()


# ----------------------------------------------------------------------------- summaries
def _accuracy(
    records: Sequence[dict[str, Any]], confidence: float, rule: str = "correct"
) -> dict[str, Any]:
    """The accuracy of ``records`` by ``rule``, the field each answer's verdict is in."""
    return accuracy_entry(sum(bool(r[rule]) for r in records), len(records), confidence)


def _substring(records: Sequence[dict[str, Any]], confidence: float) -> dict[str, Any] | None:
    """The accuracy by RULER's substring rule (``contains``: the value anywhere in the answer,
    case ignored), from the answers' own records; None if any answer did not record it."""
    if any("contains" not in r for r in records):
        return None
    return _accuracy(records, confidence, rule="contains")


def distractor_answers(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many wrong answers name the value of another needle of the same haystack that the
    question could see (before its cut) (``other_needle``), and how many of those the needle
    nearest the question (``nearest_needle``, the largest needle position before the cut). A
    model that copies the latest needle whatever the key fails the binding of key to value,
    not the distance: a small base model does so inside its own window (SmolLM2-135M:
    experiment D's README), which makes K > 1 needles per haystack a test it cannot pass at
    any distance."""
    haystacks: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for r in records:
        haystacks.setdefault((r.get("length"), r["haystack"]), []).append(r)
    other = nearest = 0
    for group in haystacks.values():
        for r in group:
            if r["correct"]:
                continue
            cut = r.get("cut", math.inf)  # a record from before the cut points: the whole prefix
            seen = [o for o in group if o["needle_position"] < cut]
            last = max(seen, key=lambda o: o["needle_position"])
            named = [o for o in seen if o is not r and exact_match(r["pred"], o["value"])]
            other += bool(named)
            nearest += any(o is last for o in named)
    return {"other_needle": other, "nearest_needle": nearest}


def _needle_entry(records: Sequence[dict[str, Any]], confidence: float) -> dict[str, Any]:
    """An accuracy with the wrong answers naming another needle and the substring rule's."""
    return {
        **_accuracy(records, confidence),
        **distractor_answers(records),
        "substring": _substring(records, confidence),
    }


def summarize_records(
    records: Sequence[dict[str, Any]],
    edges: Sequence[int],
    reach_accuracy: float,
    confidence: float = CONFIDENCE,
) -> dict[str, Any]:
    """From per-probe records carrying "length", "distance", "correct" (and "contains" for
    RULER's substring rule): the accuracy overall, per haystack length and per distance bin
    (``edges``: bin i holds distances in (edges[i], edges[i + 1]]; empty bins left out),
    each with its Wilson interval over its probes, every probe counted once in each (a
    probe has its own needle, key and value); and the reach (`reach`)."""
    if not records:
        raise ValueError("records=[] is not allowed; allowed: at least one answered probe")
    edges = list(edges)
    outside = [r["distance"] for r in records if not edges[0] < r["distance"] <= edges[-1]]
    if outside:
        raise ValueError(
            f"distance {outside[0]} is outside the bins ({edges[0]}, {edges[-1]}]; allowed: "
            "bins that cover every probe's distance"
        )
    by_distance = []
    for low, high in itertools.pairwise(edges):
        inside = [r for r in records if low < r["distance"] <= high]
        if inside:
            mean = float(np.mean([r["distance"] for r in inside]))
            entry = {"low_distance": low, "high_distance": high, "mean_distance": mean}
            by_distance.append({**_needle_entry(inside, confidence), **entry})
    return {
        "overall": _accuracy(records, confidence),
        "by_length": [
            {"length": n, **_needle_entry(at, confidence)}
            for n in sorted({r["length"] for r in records})
            if (at := [r for r in records if r["length"] == n])
        ],
        "by_distance": by_distance,
        "reach": reach(by_distance, edges, reach_accuracy),
    }


@dataclass(frozen=True)
class PairedProbes:
    """Two runs' answers to the same probes, as a 2x2 table (`paired_probes`): right in both,
    in a only, in b only, in neither."""

    both: int
    only_a: int
    only_b: int
    neither: int
    confidence: float

    @property
    def n(self) -> int:
        return self.both + self.only_a + self.only_b + self.neither

    @property
    def correct_a(self) -> int:
        return self.both + self.only_a

    @property
    def correct_b(self) -> int:
        return self.both + self.only_b

    @property
    def difference(self) -> float:
        """a's accuracy minus b's."""
        return (self.only_a - self.only_b) / self.n

    def interval(self) -> tuple[float, float]:
        """The difference's interval over the pairs (Newcombe's for paired data)."""
        counts = (self.both, self.only_a, self.only_b, self.neither)
        return paired_difference_interval(*counts, self.confidence)

    def unpaired_interval(self) -> tuple[float, float]:
        """The interval as if a and b had been asked different probes (Newcombe's for two
        independent samples): the wider one where their answers go together."""
        return difference_interval(self.correct_a, self.n, self.correct_b, self.n, self.confidence)


def paired_probes(
    a: Sequence[dict[str, Any]],
    b: Sequence[dict[str, Any]],
    beyond: int = 0,
    confidence: float = CONFIDENCE,
) -> PairedProbes:
    """Two runs' answered probes (their probes.jsonl records) whose needle lies more than
    ``beyond`` tokens before its question, joined probe by probe on (length, haystack,
    needle). They must be the same probes: the same key, value and cut in both (the same
    probe settings and tokenizer), and every probe of one answered in the other; ValueError
    naming a probe that is not."""

    def keyed(records: Sequence[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
        return {(r.get("length"), r["haystack"], r["needle"]): r for r in records}

    mine, theirs = keyed(a), keyed(b)
    if mine.keys() != theirs.keys():
        (key, side), *_ = [(k, "a") for k in mine.keys() - theirs.keys()] + [
            (k, "b") for k in theirs.keys() - mine.keys()
        ]
        raise ValueError(
            f"probe (length, haystack, needle) {key} is answered by {side} only; allowed: two "
            "runs asked the same probes, each finished"
        )
    counts = {(True, True): 0, (True, False): 0, (False, True): 0, (False, False): 0}
    for key, r in mine.items():
        s = theirs[key]
        if (r["key"], r["value"], r["cut"]) != (s["key"], s["value"], s["cut"]):
            raise ValueError(
                f"probe {key} differs between the runs (key, value or cut); allowed: runs "
                "probed with the same settings and tokenizer"
            )
        if r["distance"] > beyond:
            counts[bool(r["correct"]), bool(s["correct"])] += 1
    if not any(counts.values()):
        raise ValueError(f"no probe has its needle more than {beyond} tokens back")
    return PairedProbes(
        both=counts[True, True], only_a=counts[True, False], only_b=counts[False, True],
        neither=counts[False, False], confidence=confidence,
    )  # fmt: skip


def reach(
    by_distance: Sequence[dict[str, Any]], edges: Sequence[int], accuracy: float
) -> dict[str, Any]:
    """The farthest distance up to which retrieval holds: the upper edge of the last bin of
    the run of bins, from the shortest on, whose accuracy is at least ``accuracy``; a bin
    without probes or one below ends the run (0: the shortest bin is below). The point
    accuracies decide, so a reach is as noisy as its bins (their intervals beside it)."""
    scored = {(e["low_distance"], e["high_distance"]): e["accuracy"] for e in by_distance}
    farthest = 0
    for low, high in itertools.pairwise(edges):
        if scored.get((low, high), -1.0) < accuracy:
            break
        farthest = high
    return {"distance": farthest, "accuracy": accuracy}


def trained_window(by_distance: Sequence[Any], trained_length: int | None) -> TrainedWindow | None:
    """The probes of the distance bins (``DistanceAccuracy`` or compare's pooled bins) that
    end within ``trained_length``, pooled, each probe once; None without a trained length or
    without such a bin. Where the model's positions are trained, its retrieval is what an
    extension of them sets out to keep past that length: when even these probes score
    resolvably below the reach's accuracy, the task (its needles, its haystack) is beyond the
    model, and a reach measures that, not the positions (``floor_note``)."""
    if trained_length is None:
        return None
    inside = [b for b in by_distance if b.high_distance <= trained_length]
    if not inside:
        return None
    correct, n = sum(b.correct for b in inside), sum(b.n for b in inside)
    return TrainedWindow(
        up_to=max(b.high_distance for b in inside),
        accuracy=Accuracy(**accuracy_entry(correct, n, inside[0].confidence)),
    )


def floor_note(window: TrainedWindow | None, reach_accuracy: float, needles: int) -> str | None:
    """What a reader must know when the probes inside the trained window score resolvably
    below the reach's accuracy (the upper end of their interval under it), else None: the
    model misses the task where its positions are trained, so a reach at that accuracy
    cannot measure how far the positions hold (experiment E's redo: SmolLM2-135M scored 5/24
    within its 8k window with 12 needles per essay haystack)."""
    if window is None or window.accuracy.high >= reach_accuracy:
        return None
    remedies = "a lower reach accuracy or an easier task"
    if needles > 1:
        remedies = f"fewer needles per haystack (1: no distractors to bind among), {remedies}"
    return (
        f"inside the trained window (needles up to {window.up_to:,} tokens back) the probes "
        f"score {accuracy_text(window.accuracy)}, resolvably below the reach's "
        f"{reach_accuracy:g}: the model misses this task where its positions are trained, so "
        "its reach says nothing about them; read the accuracy past that length against this "
        f"one, or probe with {remedies}"
    )


# ----------------------------------------------------------------------------- the record
@dataclass(frozen=True)
class Accuracy:
    """An accuracy with its Wilson interval (``evals.intervals.accuracy_entry``)."""

    correct: int
    n: int
    accuracy: float
    low: float
    high: float
    confidence: float


def accuracy_text(entry: Accuracy) -> str:
    """``0.70 [0.48, 0.85] (14/20)``: an accuracy, its interval and its probes."""
    return f"{entry.accuracy:.2f} [{entry.low:.2f}, {entry.high:.2f}] ({entry.correct}/{entry.n})"


@dataclass(frozen=True)
class TrainedWindow:
    """The probes at distances within the trained length, pooled (`trained_window`)."""

    up_to: int  # the upper edge of the last bin they fill (tokens)
    accuracy: Accuracy


@dataclass(frozen=True)
class NeedleAccuracy(Accuracy):
    """An accuracy of needle probes (exact match) with its wrong answers that name another
    needle's value, and of those the nearest needle's (``distractor_answers``), and the
    accuracy by RULER's substring rule (``substring``: "7432144.0000" counts for 7432144);
    each None in a summary written before it was counted."""

    other_needle: int | None
    nearest_needle: int | None
    substring: Accuracy | None


@dataclass(frozen=True)
class LengthAccuracy(NeedleAccuracy):
    """One length: its accuracy, the wrong answers naming another needle, its stage."""

    length: int
    haystacks: int  # prefills
    mean_prefix_tokens: float
    stage: str  # the stage's digest

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> LengthAccuracy:
        """A `summarize_records` by_length entry, completed by `_complete_stages`."""
        return typed_entry(cls, entry)


@dataclass(frozen=True)
class DistanceAccuracy(NeedleAccuracy):
    """One distance bin: the probes whose question starts in (low, high] tokens after its
    needle's first token, each counted once."""

    low_distance: int
    high_distance: int
    mean_distance: float  # of its probes


@dataclass(frozen=True)
class Reach:
    """The farthest distance (tokens) up to which every distance bin scores at least
    ``accuracy`` (`reach`); 0 when the shortest bin does not."""

    distance: int
    accuracy: float


VERSION = 5  # 5: by distance; 4: the substring rule per length; 3: typed; 2: untyped
SCORING = (
    "exact match of the answer's first word with the value (trailing punctuation stripped, "
    "case ignored); also RULER's substring rule (the value anywhere in the answer, case "
    "ignored)"
)


def _from_v2(data: dict[str, Any]) -> dict[str, Any]:
    """The untyped layout: summaries written before the distractor counts lack them."""
    entries = [{"other_needle": None, "nearest_needle": None, **e} for e in data["by_length"]]
    return {**data, "by_length": entries}


def _from_v3(data: dict[str, Any]) -> dict[str, Any]:
    """Before the substring rule was summed: unknown here (None). Its answers hold it, so a
    rerun in the folder (no model call once every probe is answered) writes it."""
    return {**data, "by_length": [{**e, "substring": None} for e in data["by_length"]]}


def _from_v4(data: dict[str, Any]) -> dict[str, Any]:
    """Before distances: K needles at evenly spaced depths, all asked from the end of their
    haystack, so a length's probes measured distances of about (1 - depth) x length (one
    needle: half the length). Their distances were not recorded per probe: no distance bins
    and no reach (None); the depth entries are dropped (the file keeps them), and the config
    reads with today's defaults for the settings it did not have."""
    config = {**_CONFIG_DEFAULTS, **data["config"]}
    kept = {k: v for k, v in data.items() if k not in ("depths", "by_depth", "cells")}
    paths = {k: v for k, v in data["paths"].items() if k != "heatmap"}
    return {**kept, "config": config, "paths": paths, "by_distance": [], "reach": None,
            "trained_length": None}  # fmt: skip


_CONFIG_DEFAULTS = {"needles_within": 0.05, "grain": None, "bins": 8, "reach_accuracy": 0.8}


@register("probes", VERSION, {2: _from_v2, 3: _from_v3, 4: _from_v4})
@dataclass(frozen=True)
class ProbesResult:
    """summary.json of ``run_probes`` (also what it returns)."""

    meta: dict[str, Any]  # run_metadata
    provenance: dict[str, Any]  # the model: what a rerun in the folder must match
    run: str  # "probes"
    spec: str | None  # the encoding spec the model carried, as the caller named it
    seed: int
    format: str  # the prompt format (PromptFormat.name)
    task: TaskRecord
    config: ProbeConfig
    probes_per_length: int  # K x H
    prefills_per_length: int  # H
    scoring: str  # the rule, in words
    trained_length: int | None  # the model's training length (the figure marks it)
    overall: Accuracy
    by_length: tuple[LengthAccuracy, ...]  # per haystack length: its probes at all distances
    by_distance: tuple[DistanceAccuracy, ...]  # () in a summary from before distances
    reach: Reach | None  # None in a summary from before distances
    model: dict[str, Any]  # LanguageModel.describe()
    paths: dict[str, str]  # summary, accuracy_vs_distance

    def at(self, length: int) -> LengthAccuracy:
        """The entry of ``length``; KeyError naming the lengths probed when it is not one."""
        for entry in self.by_length:
            if entry.length == length:
                return entry
        raise KeyError(f"length {length} is not probed here: {[e.length for e in self.by_length]}")


def plot_accuracy_vs_distance(
    runs: Mapping[str, Sequence[DistanceAccuracy]],
    path: str | Path,
    trained_length: int | None = None,
    reach_accuracy: float | None = None,
    title: str = "",
) -> Path:
    """Accuracy against needle distance, one line per run (method), at each bin's mean
    distance with its (asymmetric) Wilson interval as error bars; the trained length a
    vertical line (distances past it are extrapolation), the reach's accuracy a dashed one."""
    fig, axes = figure(7.2, 4.4)
    ax = axes[0, 0]
    for i, (label, entries) in enumerate(runs.items()):
        xs = [e.mean_distance for e in entries]
        ys = [e.accuracy for e in entries]
        below = [e.accuracy - e.low for e in entries]
        above = [e.high - e.accuracy for e in entries]
        shift = 1.0 + 0.01 * (i - (len(runs) - 1) / 2)  # methods side by side, not on top
        ax.errorbar([x * shift for x in xs], ys, yerr=[below, above], marker="o", ms=4,
                    capsize=3, lw=1.4, label=label)  # fmt: skip
    if trained_length is not None:
        label = f"trained length {trained_length:,}"
        ax.axvline(trained_length, color="gray", lw=1.2, label=label)
    if reach_accuracy is not None:
        label = f"reach at {reach_accuracy:g}"
        ax.axhline(reach_accuracy, color="gray", ls="--", lw=1, label=label)
    level = next((f"{100 * e.confidence:g}%" for es in runs.values() for e in es), "")
    ax.set(
        xlabel="needle distance (tokens from the needle to the question)",
        ylabel=f"accuracy ({level} Wilson interval)",
        ylim=(-0.03, 1.03),
        title=title,
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return save(fig, path)


def typed_entry(cls: type[NeedleAccuracy], entry: dict[str, Any]) -> Any:
    """A `summarize_records` entry as ``cls``, its substring rule's accuracy typed too."""
    substring = entry["substring"] and Accuracy(**entry["substring"])
    return cls(**{**entry, "substring": substring})
