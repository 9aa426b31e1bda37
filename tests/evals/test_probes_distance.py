"""Retrieval as a function of needle distance: a question asked from a cut point of one cached
prefill is the cut haystack read alone (every encoding family, through a fresh cache bit for
bit and in one forward without a cache), every probe has its own needle, a distance bin's
interval counts each probe once, the reach reads the bins, old summaries still read.

Models: 2-layer ropekit Decoders and tiny Llamas with sharp random attention in float64 (so
their answers depend on the context and near-ties do not hang on float noise), one layer
where a length-following encoding is compared with a forward without a cache (a cache is
exact for those only one layer deep: ``ropekit.model.cache``); `SuffixCopyLM` (exact
induction) where a model must really retrieve.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ropekit.evals import as_language_model
from ropekit.evals.adapters import chunk_dividing
from ropekit.evals.intervals import paired_difference_interval, wilson_interval
from ropekit.evals.probe_haystacks import ProbeConfig, build_haystack, probe_task
from ropekit.evals.probe_summary import (
    VERSION,
    DistanceAccuracy,
    ProbesResult,
    floor_note,
    paired_probes,
    plot_accuracy_vs_distance,
    reach,
    summarize_records,
    trained_window,
)
from ropekit.evals.probes import answer_probes, answer_separately, run_probes
from ropekit.evals.prompts import PromptFormat
from ropekit.evals.tasks import TaskDoesNotFit
from ropekit.hf import patch
from ropekit.results import read_record, read_records

from ..model.tiny import tiny_model as sharp_decoder
from ..tiny import tiny_model as sharp_llama
from .models import NearestNeedleLM, NearestNumberLM, SuffixCopyLM

GRAIN = 32
OPTIONS = {"progress": False}


def _haystack(lm, length=480, needles=4, index=0, task="niah_single_2", grain=GRAIN):
    config = ProbeConfig((length,), needles=needles, task=task, grain=grain)
    return build_haystack(probe_task(task), PromptFormat(lm.tokenizer), config, length, index)


class Runs:
    """Records (tokens the cache held before, logits) of every ``Backbone.run`` call."""

    def __init__(self, lm):
        self.calls: list[tuple[int, torch.Tensor]] = []
        backbone = lm.backbone
        inner = backbone.run

        def run(ids, cache, *args, **kwargs):
            before = 0 if cache is None else backbone.cache_length(cache)
            out = inner(ids, cache, *args, **kwargs)
            self.calls.append((before, out.clone()))
            return out

        backbone.run = run

    def take(self):
        taken, self.calls = self.calls, []
        return taken


# ----------------------------------------------------------------------------- haystacks
def test_needles_sit_near_the_start_and_each_is_asked_from_its_own_cut(byte_tok):
    lm = as_language_model(SuffixCopyLM(), byte_tok)
    hay = _haystack(lm, length=640, needles=5)
    ends = []
    for p in hay.probes:
        needle = f"The value of key {p.key} is {p.value}."
        assert byte_tok.decode(list(hay.prefix[p.needle_position :])).startswith(needle)
        assert p.depth <= 0.05 and p.needle_depth < 0.1  # near the start (snapped to a line)
        ends.append(p.needle_position + len(byte_tok.encode(needle)))
        assert hay.prompt(p) == [*hay.prefix[: p.cut], *p.question]
        assert p.distance == p.cut - p.needle_position
    cuts = sorted(p.cut for p in hay.probes)
    P = len(hay.prefix)
    assert all(c % GRAIN == 0 and max(ends) <= c <= P for c in cuts)
    assert len(set(cuts)) == 5
    # one cut in each fifth of the cut points: the distances spread over the haystack
    grid = list(range(max(GRAIN, -(-max(ends) // GRAIN) * GRAIN), P + 1, GRAIN))
    fifths = np.array_split(grid, 5)  # as even as can be, the longer ones first
    assert all(c in fifth for c, fifth in zip(cuts, fifths, strict=True))


def test_no_key_or_value_is_asked_twice_across_haystacks_and_lengths(byte_tok):
    lm = as_language_model(SuffixCopyLM(), byte_tok)
    hays = [_haystack(lm, length=n, index=h) for n in (480, 960) for h in range(3)]
    keys = [p.key for hay in hays for p in hay.probes]
    values = [p.value for hay in hays for p in hay.probes]
    assert len(set(keys)) == len(keys) == 24 and len(set(values)) == len(values)


def test_a_haystack_without_enough_cut_points_behind_its_needles_is_refused(byte_tok):
    lm = as_language_model(SuffixCopyLM(), byte_tok)
    with pytest.raises(TaskDoesNotFit, match=r"8 needles .* need 8 cut points .*holds \d"):
        build_haystack(
            probe_task("niah_single_2"), PromptFormat(byte_tok),
            ProbeConfig((640,), needles=8, grain=128), 640, 0,
        )  # fmt: skip
    assert _haystack(lm, length=640, needles=8, grain=16).probes  # a finer grain fits them


# ----------------------------------------------------------------------------- exactness
FAMILIES = [
    ("rope", False),  # static: keys cached rotated
    ("alibi", False),  # a bias
    ("dynamic-ntk:factor=2", False),  # length-following: unrotated keys re-rotated each step
    ("longrope:factor=4,long_factor=[2]", False),
    ("self-extend:group=2,window=4", False),  # a distance remap: rotated keys cached per band
    (None, True),
    ("yarn:factor=2", True),
    ("dynamic-ntk:factor=2", True),
    ("rerope:window=8,leaky=4", True),
    ("string:shift=4,window=2", True),
    ("dca", True),
]


def _model(encoding, hf, layers):
    if hf:
        model = sharp_llama("llama", vocab_size=256, num_hidden_layers=layers).double()
        if encoding is not None:
            patch(model, encoding)
        return model  # original length 32: the haystacks run 15x past it
    return sharp_decoder(encoding, n_layers=layers).double().eval()


@pytest.mark.parametrize(("encoding", "hf"), FAMILIES)
def test_a_cropped_cache_probe_is_the_cut_haystack_read_alone(byte_tok, encoding, hf):
    """Cached: every logit of every question and answer asked from a cut of the one prefill
    is, bit for bit, that of the cut haystack and its question read from scratch through a
    fresh cache, two layers deep and far past the original length."""
    lm = as_language_model(_model(encoding, hf, layers=2), byte_tok, chunk_size=GRAIN)
    hay = _haystack(lm)
    runs = Runs(lm)
    cropped = answer_probes(lm, hay, ())  # no stop ids: every answer runs its whole budget
    calls = runs.take()
    longest = max(p.cut for p in hay.probes)
    prefill = -(-longest // GRAIN)  # the prefill's chunks, read once; then the questions
    assert [b for b, _ in calls[:prefill]] == list(range(0, longest, GRAIN))
    asked = calls[prefill:]
    alone = answer_separately(lm, hay, ())
    assert cropped == alone and len({tuple(a) for a in cropped}) > 1
    fresh = runs.take()
    # Read alone, each probe's calls start from an empty cache (its prefill, then its
    # question and answer), in the order of hay.probes; the cropped cache asks the longest
    # cut first. Compare each probe's calls from its cut on.
    alone_calls: list[list[tuple[int, torch.Tensor]]] = []
    for before, logits in fresh:
        if before == 0:
            alone_calls.append([])
        alone_calls[-1].append((before, logits))
    by_cut = sorted(range(len(hay.probes)), key=lambda i: -hay.probes[i].cut)
    expected = [(b, x) for i in by_cut for b, x in alone_calls[i] if b >= hay.probes[i].cut]
    assert len(asked) == len(expected)
    assert all(a == b and torch.equal(x, y) for (a, x), (b, y) in zip(asked, expected, strict=True))


@pytest.mark.parametrize(("encoding", "hf"), FAMILIES)
def test_a_cropped_cache_probe_is_the_cut_haystack_in_one_forward_without_a_cache(
    byte_tok, encoding, hf
):
    """Uncached: the first answer's logits from a cut of the one prefill are those of one
    forward over the cut haystack and its question with no cache at all. One layer: a
    length-following encoding's cache is exact only there (``ropekit.model.cache``)."""
    lm = as_language_model(_model(encoding, hf, layers=1), byte_tok, chunk_size=GRAIN)
    hay = _haystack(lm)
    runs = Runs(lm)
    answer_probes(lm, hay, ())
    calls = runs.take()
    position = -(-max(p.cut for p in hay.probes) // GRAIN)  # the prefill's calls come first
    for probe in sorted(hay.probes, key=lambda p: -p.cut):  # then each probe's, longest cut
        questions = -(-len(probe.question) // GRAIN)  # its question's chunks
        first = calls[position + questions - 1][1]  # the last one: the first answer's logits
        position += questions + probe.max_new_tokens - 1  # then one call per answer token
        whole = lm.backbone.run(torch.tensor([hay.prompt(probe)]), None, None, None, True)
        torch.testing.assert_close(first[:, -1], whole[:, -1], rtol=1e-9, atol=1e-9)
    assert position == len(calls)


def test_the_prefill_reads_in_chunks_that_divide_every_cut():
    assert chunk_dividing(1365, [1024, 2048]) == 1024
    assert chunk_dividing(1365, [1536, 3072]) == 768
    assert chunk_dividing(100, [96, 160]) == 32
    assert chunk_dividing(64, []) == 64


# ----------------------------------------------------------------------------- summaries
def _record(distance, correct, haystack=0, length=1000):
    return {"length": length, "haystack": haystack, "needle_position": 10, "value": "1",
            "pred": "1" if correct else "2", "correct": correct, "contains": correct,
            "distance": distance, "cut": 10 + distance}  # fmt: skip


def test_a_distance_bin_counts_each_probe_once_with_its_wilson_interval():
    records = [
        _record(100, True, 0),
        _record(200, True, 1),
        _record(250, False, 2),  # same bin (0, 250]: the edge belongs to the lower bin
        _record(600, False, 3),
        _record(999, True, 4),
    ]
    summary = summarize_records(records, [0, 250, 500, 750, 1000], 0.6)
    bins = summary["by_distance"]
    assert [(b["low_distance"], b["high_distance"], b["correct"], b["n"]) for b in bins] == [
        (0, 250, 2, 3),
        (500, 750, 0, 1),  # (250, 500] has no probe: left out, not an n=0 interval
        (750, 1000, 1, 1),
    ]
    assert sum(b["n"] for b in bins) == len(records) == summary["overall"]["n"]
    assert (bins[0]["low"], bins[0]["high"]) == wilson_interval(2, 3)
    assert bins[0]["mean_distance"] == pytest.approx(550 / 3)
    with pytest.raises(ValueError, match=r"distance 1200 is outside the bins \(0, 1000\]"):
        summarize_records([_record(1200, True)], [0, 500, 1000], 0.5)


def test_the_reach_is_the_end_of_the_run_of_bins_at_or_above_the_accuracy():
    edges = [0, 10, 20, 30, 40]

    def bins(*accuracies):
        return [{"low_distance": a, "high_distance": b, "accuracy": acc}
                for (a, b), acc in zip(itertools.pairwise(edges), accuracies, strict=True)
                if acc is not None]  # fmt: skip

    assert reach(bins(1.0, 0.8, 0.8, 1.0), edges, 0.8)["distance"] == 40
    assert reach(bins(1.0, 0.8, 0.2, 1.0), edges, 0.8)["distance"] == 20  # a dip ends it
    assert reach(bins(1.0, None, 1.0, 1.0), edges, 0.8)["distance"] == 10  # unmeasured too
    assert reach(bins(0.5, 1.0, 1.0, 1.0), edges, 0.8)["distance"] == 0
    assert reach(bins(1.0, 0.79, 1.0, 1.0), edges, 0.8)["distance"] == 10


@pytest.mark.parametrize("needles", [1, 4])
def test_the_expected_reads_follow_the_haystacks_longest_cuts(byte_tok, needles):
    """What the plan prices before building the haystacks (``expected_reads``) is what they
    read once built: each is read to its longest cut, anywhere past its needle with one
    needle (about half the length on average), near the end with four."""
    config = ProbeConfig((960,), needles=needles, haystacks=64, grain=8, seed=3)
    task, fmt = probe_task(config.task), PromptFormat(byte_tok)
    built = sorted(
        max(p.cut for p in build_haystack(task, fmt, config, 960, h).probes) for h in range(64)
    )
    reads = config.expected_reads(960)
    expected = sorted(t for t, count in reads.items() for _ in range(count))
    assert len(expected) == 64
    assert np.mean(built) == pytest.approx(np.mean(expected), rel=0.1)
    # the cost's quadratic term: the mean square read, within 15%
    assert np.mean(np.square(built)) == pytest.approx(np.mean(np.square(expected)), rel=0.15)
    if needles == 1:
        assert min(built) < 960 / 3 and min(expected) < 960 / 3
    else:
        assert min(built) > 960 * 0.7 and min(expected) > 960 * 0.7


def test_an_absurd_number_of_haystacks_is_priced_in_a_few_reads():
    """A billion haystacks (refused later, by check_probe_sizes) are dealt among at most 64
    reads, so saying their cost takes no time; each read is priced as often as it is read."""
    reads = ProbeConfig((128,), haystacks=10**9).expected_reads(128)
    assert len(reads) <= 64 and sum(reads.values()) == 10**9
    assert sum(ProbeConfig((128,), haystacks=3).expected_reads(128).values()) == 3
    assert sum(ProbeConfig((128,), haystacks=3).expected_reads(128, answered=2).values()) == 1
    assert ProbeConfig((128,), haystacks=3).expected_reads(128, answered=3) == {}


def test_the_trained_window_pools_the_bins_that_end_within_it_each_probe_once():
    """Bins (0, 10] 3/4, (10, 20] 1/4, (20, 30] 4/4: within 20 (or 25: a bin that crosses
    the trained length is not within it) the first two, 4/8; none within 5."""
    records = [_record(d, ok) for d, ok in
               [(5, True)] * 3 + [(5, False)] + [(15, True)] + [(15, False)] * 3
               + [(25, True)] * 4]  # fmt: skip
    bins = [_typed_bin(e) for e in summarize_records(records, [0, 10, 20, 30], 0.8)["by_distance"]]
    for trained in (20, 25):
        window = trained_window(bins, trained)
        assert window.up_to == 20 and (window.accuracy.correct, window.accuracy.n) == (4, 8)
        assert (window.accuracy.low, window.accuracy.high) == wilson_interval(4, 8)
    assert trained_window(bins, 30).accuracy.n == 12
    assert trained_window(bins, 5) is None and trained_window(bins, None) is None


def test_the_floor_note_warns_only_where_the_trained_window_is_resolvably_below_the_reach():
    """5/24 within the window (experiment E's 12-needle check) is resolvably below 0.8: the
    note names the window and the remedies, fewer needles only where there are several;
    12/12 is not, and neither is 6/8 (0.75, but its interval reaches 0.8)."""

    def window(correct, n):
        by_distance = summarize_records(
            [_record(1, i < correct) for i in range(n)], [0, 8, 16], 0.8
        )["by_distance"]
        return trained_window([_typed_bin(e) for e in by_distance], 8)

    note = floor_note(window(5, 24), 0.8, needles=12)
    low, high = wilson_interval(5, 24)
    assert note.startswith(
        f"inside the trained window (needles up to 8 tokens back) the probes score 0.21 "
        f"[{low:.2f}, {high:.2f}] (5/24), resolvably below the reach's 0.8"
    )
    assert "fewer needles per haystack" in note
    assert "fewer needles" not in floor_note(window(5, 24), 0.8, needles=1)
    assert floor_note(window(12, 12), 0.8, needles=12) is None
    assert floor_note(window(6, 8), 0.8, needles=12) is None
    assert floor_note(None, 0.8, needles=12) is None


def _typed_bin(entry):
    return DistanceAccuracy(**{**entry, "substring": None})


CONFIG = ProbeConfig((480, 960), needles=4, haystacks=3, seed=1, grain=GRAIN, bins=6)


def test_a_model_that_does_not_reach_far_loses_the_far_bins_only(tmp_path, byte_tok):
    """Exact induction retrieves at every distance; the same head that attends 200 tokens
    back retrieves inside that distance and nowhere past it: its reach is the last bin
    wholly inside 200 tokens."""
    full = run_probes(SuffixCopyLM(), CONFIG, tmp_path / "full", tokenizer=byte_tok, **OPTIONS)
    near = run_probes(
        SuffixCopyLM(window=200), CONFIG, tmp_path / "near", tokenizer=byte_tok, **OPTIONS
    )
    assert full.overall.n == 24 and full.overall.accuracy == 1.0
    # every bin with probes: the last one holds none (no needle sits at the very start)
    assert full.reach.distance == full.by_distance[-1].high_distance == 800
    assert full.reach.accuracy == CONFIG.reach_accuracy
    assert sum(e.n for e in full.by_distance) == 24
    # The value must lie within 200 tokens of the answer, the question (about 40) between.
    records = [
        r for n in CONFIG.lengths for r in read_records(tmp_path / "near" / str(n) / "probes.jsonl")
    ]
    assert all(r["correct"] for r in records if r["distance"] <= 150)
    assert not any(r["correct"] for r in records if r["distance"] >= 200)
    assert near.by_distance[0].accuracy == 1.0  # edges 0, 160, 320, ...
    assert all(e.accuracy == 0.0 for e in near.by_distance[1:])
    assert near.reach.distance == 160
    assert (tmp_path / "full" / "accuracy_vs_distance.png").is_file()
    assert read_record(tmp_path / "full" / "summary.json", ProbesResult) == full


def test_a_summary_from_before_distances_still_reads(tmp_path, byte_tok):
    """A version 4 summary (needles at evenly spaced depths, asked from the end) reads as
    today's record: its lengths and intervals kept, no distance bins, no reach."""
    summary = run_probes(SuffixCopyLM(), CONFIG, tmp_path, tokenizer=byte_tok, **OPTIONS)
    path = tmp_path / "summary.json"
    data = json.loads(path.read_text())
    assert data["format_version"] == VERSION == 5
    old = {k: v for k, v in data.items() if k not in ("by_distance", "reach", "trained_length")}
    old["config"] = {
        k: v for k, v in data["config"].items()
        if k not in ("needles_within", "grain", "bins", "reach_accuracy")
    }  # fmt: skip
    old["paths"] = {**data["paths"], "heatmap": "heatmap.png"}
    old["depths"] = [0.0, 1.0]
    old["by_depth"] = [{"depth": 0.0, "needle_depth": 0.0, **data["overall"]}]
    old["cells"] = []
    path.write_text(json.dumps({**old, "format_version": 4}))
    migrated = read_record(path, ProbesResult)
    assert migrated.by_length == summary.by_length and migrated.overall == summary.overall
    assert migrated.by_distance == () and migrated.reach is None


def test_the_figure_draws_one_line_per_method_and_marks_the_trained_length(tmp_path, monkeypatch):
    from ropekit.evals import probe_summary
    from ropekit.evals.intervals import accuracy_entry

    drawn = []
    monkeypatch.setattr(probe_summary, "save", lambda fig, path: drawn.append(fig) or Path(path))

    def entry(low, high, correct):
        return DistanceAccuracy(
            **accuracy_entry(correct, 8), other_needle=0, nearest_needle=0, substring=None,
            low_distance=low, high_distance=high, mean_distance=(low + high) / 2,
        )  # fmt: skip

    runs = {"a": [entry(0, 4096, 8), entry(4096, 8192, 6)], "b": [entry(0, 4096, 2)]}
    plot_accuracy_vs_distance(runs, tmp_path / "f.png", trained_length=2048, reach_accuracy=0.8)
    ax = drawn[0].axes[0]
    assert [list(c.lines[0].get_ydata()) for c in ax.containers] == [[1.0, 0.75], [0.25]]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["trained length 2,048", "reach at 0.8", "a", "b"]
    assert [line.get_xdata()[0] for line in ax.lines if line.get_label().startswith("trained")]


# ----------------------------------------------------------------------------- the task
def test_a_copier_that_reads_no_key_passes_the_noise_haystack_and_fails_the_essays(tmp_path):
    """RULER's noise haystack holds one number, the needle's value: copying the number
    nearest the question passes it at every distance. In Paul Graham's essays (the probes'
    default, niah_single_2) numbers abound, and the same copier fails: the task asks for
    the value bound to the key."""
    accuracy = {}
    for task in ("niah_single_1", "niah_single_2"):
        config = ProbeConfig((4096,), needles=1, haystacks=12, task=task)
        result = run_probes(NearestNumberLM(), config, tmp_path / task, **OPTIONS)
        accuracy[task] = result.overall.accuracy
    assert ProbeConfig((4096,)).task == "niah_single_2"
    assert accuracy["niah_single_1"] == 1.0 and accuracy["niah_single_2"] <= 0.25


def test_a_copier_of_the_nearest_needle_passes_one_needle_a_haystack_and_fails_several(
    tmp_path,
):
    """A model that answers with the value of the needle nearest the question, whatever the
    key asked (SmolLM2-135M's way: NearestNeedleLM), passes the essays with one needle per
    haystack (the nearest needle is the one asked) and fails them with K needles (compare's
    default K = 12): every needle precedes every cut, so it is right only for the probe whose
    needle is the nearest, 1 of K per haystack, and every wrong answer is the nearest needle's.
    So for such a model the harder task is the distractors, and K = 1 is the only layout in
    which its probes measure distance (issue 56's report: that layout cannot give 40 probes
    past L0 for E's prefill budget)."""
    results = {}
    for needles in (1, 4):
        config = ProbeConfig((4096,), needles=needles, haystacks=3, task="niah_single_2")
        results[needles] = run_probes(NearestNeedleLM(), config, tmp_path / str(needles), **OPTIONS)
    assert results[1].overall.accuracy == 1.0
    several = results[4].by_length[0]
    assert (several.correct, several.n) == (3, 12)  # one probe per haystack
    assert several.other_needle == several.nearest_needle == 9  # every wrong answer


def _answered(correct: list[bool], distances: list[int], shift: int = 0) -> list[dict]:
    """Probe records of haystacks 0..n-1, one needle each (keys and values from the index)."""
    return [
        {"haystack": i, "needle": 0, "key": f"k{i}", "value": str(1000 + i + shift),
         "cut": d + 100, "distance": d, "correct": c}
        for i, (c, d) in enumerate(zip(correct, distances, strict=True))
    ]  # fmt: skip


def test_two_runs_on_the_same_probes_are_paired_probe_by_probe():
    """The 2x2 table joins each probe with itself (not the i-th answer of each), counts only
    needles past ``beyond``, and its interval is the paired one of those counts."""
    distances = [1000, 9000, 10000, 12000, 20000, 30000]
    a = _answered([True, True, True, False, True, False], distances)
    b = _answered([True, True, False, False, False, True], distances)
    pairs = paired_probes(a, list(reversed(b)), beyond=8192)
    assert (pairs.both, pairs.only_a, pairs.only_b, pairs.neither) == (1, 2, 1, 1)
    assert (pairs.n, pairs.correct_a, pairs.correct_b) == (5, 3, 2)
    assert pairs.difference == pytest.approx(0.2)
    assert pairs.interval() == paired_difference_interval(1, 2, 1, 1)
    swapped = paired_probes(b, a, beyond=8192)
    assert (swapped.only_a, swapped.only_b) == (1, 2)
    every = paired_probes(a, b)
    assert (every.both, every.n) == (2, 6)


def test_runs_asked_different_probes_are_not_paired():
    a = _answered([True, False, True], [9000, 10000, 11000])
    with pytest.raises(ValueError, match=r"\(None, 2, 0\) is answered by a only"):
        paired_probes(a, a[:2])
    with pytest.raises(ValueError, match=r"differs between the runs"):
        paired_probes(a, _answered([True, False, True], [9000, 10000, 11000], shift=1))
    with pytest.raises(ValueError, match="no probe has its needle more than 20000 tokens back"):
        paired_probes(a, a, beyond=20000)
