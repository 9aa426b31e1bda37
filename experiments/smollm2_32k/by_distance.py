"""Experiment E's retrieval by needle distance (issue 56), from the answers ``retrieval/run.sh``
commits: each method's accuracy per distance bin with its Wilson interval and its reach, and
for the pairs E's verdict asks about the difference of their accuracies past the trained
length, paired probe by probe.

    python -m experiments.smollm2_32k.by_distance [--retrieval DIR] [--figure PNG]

The probes (``retrieval/probes.sh``) were fixed before any answer was read: 56 haystacks of
32,768 tokens of essays a method, one needle each at a seeded depth in the first 5%, asked
from one seeded cut point. Every method answers the same 56 probes (the same keys, values and
cut points), so two methods' answers form pairs, and their difference's interval is
Newcombe's for paired data (`ropekit.evals.paired_probes`); the interval for independent
samples, the one the plan first named, is printed beside it.

The tables and the figure fill in once every method of ``METHODS`` has answered all its
probes, not before (``complete``): the README promised the answers would be tabulated only
then. Until that, ``progress`` says how far each method has got, from the same files.

Holds: LENGTH, HAYSTACKS, METHODS, FLOOR, PAIRS, CONFIG, REACH_ACCURACIES, answers, Progress,
progress, complete, by_method, contrasts, contrasts_by_bin, figure, main (print_progress and
print_tables, its parts, which issue 58's retrieval reads with its own methods and pairs).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ropekit.evals.intervals import accuracy_entry
from ropekit.evals.probe_haystacks import ProbeConfig
from ropekit.evals.probe_summary import (
    Accuracy,
    DistanceAccuracy,
    PairedProbes,
    Reach,
    paired_probes,
    plot_accuracy_vs_distance,
    reach,
    summarize_records,
    typed_entry,
)
from ropekit.results import read_records

from .contrasts import L0

HERE = Path(__file__).parent
RETRIEVAL = HERE / "retrieval"
LENGTH = 32768  # the haystacks' length: E's target
HAYSTACKS = 56  # a method's probes (one needle a haystack): probes.sh
# run.sh's labels, in its order (test_experiments checks the two agree); the floor last
METHODS = ("leaky-rerope", "dca", "self-extend", "yarn-x4", "adarope", "adarope-global", "rope")
FLOOR = "rope"  # the unmodified model: what an extension has to beat past L0
# The differences E's verdict asks about, fixed with the probes: the training-free leader
# against the two other remaps; YaRN x4 (where every trained method starts) against AdaRoPE;
# AdaRoPE's head-wise structure against its global control.
PAIRS = (
    ("leaky-rerope", "self-extend"),
    ("leaky-rerope", "dca"),
    ("adarope", "yarn-x4"),
    ("adarope", "adarope-global"),
)
# what probes.sh asks for, as the summary reads it: its bins and its reach's accuracy
CONFIG = ProbeConfig(lengths=(LENGTH,), needles=1, haystacks=HAYSTACKS, bins=8, seed=0)
# The reach at the summary's accuracy (0.8, the plan's), and at 0.5, added 2026-12-07 before
# the tables were read: inside its trained window the unmodified model answered 4 of 8 essay
# probes (design-check, README above) and 3 of 6 (the task's check), so at 0.8 every method's
# reach may be 0 whatever its positions do; 0.5 is about what the model scores where its
# positions are trained. Both read point accuracies of bins of about 7 probes: noisy, so the
# pooled accuracy past L0 and the pairs' intervals are what the verdict reads.
REACH_ACCURACIES = (CONFIG.reach_accuracy, 0.5)
Pairs = tuple[tuple[str, str], ...]  # (a, b): a's accuracy minus b's


def answers(folder: Path, method: str) -> list[dict[str, Any]]:
    """The method's answered probes (its probes.jsonl; [] before its first answer)."""
    path = folder / method / str(LENGTH) / "probes.jsonl"
    return read_records(path) if path.exists() else []


@dataclass(frozen=True)
class Progress:
    """How far one method has got (`progress`)."""

    method: str
    answered: int  # haystacks (one probe each)
    past: int  # of them, needles more than L0 back
    mean_cut: float | None  # tokens read per haystack, on average (None: none answered)
    seconds: dict[int, float]  # each answered haystack's wall time (prefill and answer), by index

    @property
    def median_seconds(self) -> float | None:
        return statistics.median(self.seconds.values()) if self.seconds else None

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


def progress(folder: Path, methods: tuple[str, ...] = METHODS) -> list[Progress]:
    """Each method's answers so far, with the wall time they took as recorded with each
    (``haystack_seconds``: one thread, under whatever else ran; a haystack read across a
    pause counts the pause, so the median is the pace to quote)."""
    out = []
    for method in methods:
        done = answers(folder, method)
        cuts = [r["cut"] for r in done]
        out.append(Progress(
            method, len(done), sum(r["distance"] > L0 for r in done),
            statistics.mean(cuts) if cuts else None,
            {r["haystack"]: r["haystack_seconds"] for r in done},
        ))  # fmt: skip
    return out


def seconds_left(rows: list[Progress]) -> dict[str, float | None]:
    """Each method's wall time still to come, priced haystack by haystack. Every method
    reads the same seeded haystacks, so a haystack another method has answered says what
    it costs (the median of theirs), scaled by this method's pace against those same
    haystacks where it has answered some; a haystack no one has answered is priced at
    the method's median (None: no price at all). A method's own median alone misleads
    while its few answers are the long cuts."""
    out: dict[str, float | None] = {}
    for p in rows:
        others = [q.seconds for q in rows if q is not p]
        price = {h: statistics.median(times) for h in range(HAYSTACKS)
                 if (times := [o[h] for o in others if h in o])}  # fmt: skip
        shared = [h for h in p.seconds if h in price]
        pace = sum(p.seconds[h] for h in shared) / sum(price[h] for h in shared) if shared else 1.0
        left = [h for h in range(HAYSTACKS) if h not in p.seconds]
        priced = sum(price[h] for h in left if h in price)
        unpriced = sum(h not in price for h in left)
        own = p.median_seconds
        out[p.method] = (
            None if unpriced and own is None else pace * priced + unpriced * (own or 0.0)
        )
    return out


def complete(folder: Path, methods: tuple[str, ...] = METHODS) -> bool:
    """Whether every method has answered every probe (the tables fill in then)."""
    return all(p.answered == HAYSTACKS for p in progress(folder, methods))


@dataclass(frozen=True)
class MethodRetrieval:
    """One method's probes summed up as ``ropekit eval probes`` sums them (`by_method`)."""

    by_distance: tuple[DistanceAccuracy, ...]
    reaches: tuple[Reach, ...]  # at each of REACH_ACCURACIES
    past: Accuracy  # its probes past L0, pooled: each in one bin, so each counted once


def by_method(folder: Path, methods: tuple[str, ...] = METHODS) -> dict[str, MethodRetrieval]:
    """Each method's accuracy per distance bin (the bins of probes.sh) and its reach at each
    of ``REACH_ACCURACIES``, from its answers (``summarize_records`` and ``reach``, what its
    summary.json is written with), and its probes past L0 pooled."""
    out = {}
    for method in methods:
        records = [{**r, "length": LENGTH} for r in answers(folder, method)]
        far = [r for r in records if r["distance"] > L0]
        summary = summarize_records(records, CONFIG.bin_edges, CONFIG.reach_accuracy)
        out[method] = MethodRetrieval(
            by_distance=tuple(typed_entry(DistanceAccuracy, e) for e in summary["by_distance"]),
            reaches=tuple(
                Reach(**reach(summary["by_distance"], CONFIG.bin_edges, accuracy))
                for accuracy in REACH_ACCURACIES
            ),
            past=Accuracy(**accuracy_entry(sum(r["correct"] for r in far), len(far))),
        )
    return out


def contrasts(folder: Path, pairs: Pairs = PAIRS) -> list[tuple[str, str, PairedProbes]]:
    """For each pair of ``pairs``: a, b, and their answers past L0 paired probe by probe."""
    return [
        (a, b, paired_probes(answers(folder, a), answers(folder, b), beyond=L0)) for a, b in pairs
    ]


def contrasts_by_bin(
    folder: Path, pairs: Pairs = PAIRS
) -> list[tuple[str, str, dict[tuple[int, int], PairedProbes]]]:
    """For each pair of ``pairs``: a, b, and their answers paired in each distance bin (low,
    high] that holds probes (the plan asked for the pairs per bin as well as pooled; a bin
    holds about 7 probes, so its interval is wide)."""
    out = []
    for a, b in pairs:
        mine, theirs = answers(folder, a), answers(folder, b)
        bins = {}
        for low, high in itertools.pairwise(CONFIG.bin_edges):
            inside = {(r["haystack"], r["needle"]) for r in mine if low < r["distance"] <= high}
            if inside:
                pick = [[r for r in rs if (r["haystack"], r["needle"]) in inside]
                        for rs in (mine, theirs)]  # fmt: skip
                bins[low, high] = paired_probes(*pick)
        out.append((a, b, bins))
    return out


def figure(folder: Path, path: Path, methods: tuple[str, ...] = METHODS) -> Path:
    """Accuracy against needle distance, one line per method, the trained length marked."""
    runs = {m: r.by_distance for m, r in by_method(folder, methods).items()}
    title = f"SmolLM2-135M at {LENGTH:,}: one needle per essay haystack, {HAYSTACKS} a method"
    return plot_accuracy_vs_distance(runs, path, L0, CONFIG.reach_accuracy, title)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--retrieval", type=Path, default=RETRIEVAL, help="run.sh's folder")
    parser.add_argument("--figure", type=Path, help="also draw accuracy vs distance here (PNG)")
    args = parser.parse_args(argv)
    print_progress(args.retrieval, METHODS)
    if not complete(args.retrieval):
        print("Not every method has answered every probe: no table yet.")
        return
    print_tables(args.retrieval, METHODS, PAIRS)
    if args.figure is not None:
        print(f"Figure: {figure(args.retrieval, args.figure)}")


def print_progress(folder: Path, methods: tuple[str, ...]) -> None:
    """main's progress lines: each method's answers so far."""
    for p in progress(folder, methods):
        mean = "-" if p.mean_cut is None else f"{p.mean_cut:,.0f}"
        print(
            f"{p.method}: {p.answered} of {HAYSTACKS} answered, {p.past} past {L0}, mean cut {mean}"
        )


def print_tables(folder: Path, methods: tuple[str, ...], pairs: Pairs) -> None:
    """main's tables: each method's bins, its probes past L0 and its reaches, then each pair's
    difference past L0 with its paired interval."""
    for method, r in by_method(folder, methods).items():
        bins = ", ".join(f"{b.correct}/{b.n}" for b in r.by_distance)
        reaches = ", ".join(f"{x.distance} at {x.accuracy:g}" for x in r.reaches)
        print(f"{method}: {bins}; past {L0} {r.past.correct}/{r.past.n}; reach {reaches}")
    for a, b, p in contrasts(folder, pairs):
        low, high = p.interval()
        print(f"{a} - {b} past {L0}: {p.difference:+.3f} [{low:+.3f}, {high:+.3f}]")


if __name__ == "__main__":
    main()
