"""The comparison's report, from a committed compare.json with a few fields changed: retrieval
by needle distance counts answers naming another needle; a comparison written before
distances keeps its per-length table, saying what it measured; a collapsed method does not
flatten the perplexity figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ropekit.compare.record import (
    CompareResult,
    Method,
    ProbeSettings,
    SeedBin,
    Stat,
    SummaryEntry,
)
from ropekit.compare.verdict import method_retrieval, pooled_bin
from ropekit.evals.intervals import accuracy_entry
from ropekit.evals.probe_summary import Accuracy
from ropekit.results import read_record

# The base the unit tests change a few fields of: experiment D's out-of-domain comparison as
# first committed (format version 2; its serving answers predate the vLLM plugin's remaps).
COMMITTED = Path(__file__).resolve().parent / "data/ood_v2/compare.json"
EDGES = (0, 16, 32, 48, 64)  # distance bins of probes at 64 tokens, trained at 32


def _binned(*seeds: SeedBin) -> object:
    """One method's retrieval: its seeds' probes, all in the bin (32, 48]."""
    return method_retrieval([pooled_bin(seeds, 32, 48)], EDGES, 0.8, trained_at=32)


def test_the_report_counts_answers_that_name_another_needle_when_a_haystack_holds_several(
    tmp_path,
):
    from ropekit.compare.report import _retrieval_table

    seed = SeedBin(
        correct=1, n=10, accuracy=0.1, low=0.0, high=0.4, confidence=0.95, other_needle=8,
        nearest_needle=7, seed=0, substring=None, mean_distance=40.0,
    )  # fmt: skip
    data = dataclasses.replace(
        read_record(COMMITTED, CompareResult),
        trained_at=32,
        methods=(Method("rope", "rope", False, "rope"),),
        probes=ProbeSettings(lengths=(64,), needles=5, haystacks=2, task="t", probes_per_run=10),
        retrieval={"rope": _binned(seed)},
    )
    blocks = _retrieval_table(data, tmp_path)
    assert blocks[1].rows == [["rope", "0.10 [0.02, 0.40] (1/10)"]]  # one column: (32, 48]
    assert blocks[-1].rows == [["rope", "8 of 9 (7)"]]
    assert "probe_needles=1" in blocks[-1].caption
    one = dataclasses.replace(data, probes=dataclasses.replace(data.probes, needles=1))
    assert len(_retrieval_table(one, tmp_path)) == 4  # heading, accuracies, reach, figure


def test_the_report_shows_the_substring_rule_where_it_differs_from_exact_match(tmp_path):
    """YaRN x4 at 32k in experiment E: 3/5 exact, 4/5 by RULER's rule ("7432144.0000"). The
    second table appears only where the rules differ somewhere; '?' where it was not counted."""
    from ropekit.compare.report import _retrieval_table

    def seed(correct: int, substring: int | None, label_seed: int = 0) -> SeedBin:
        exact, by_rule = (accuracy_entry(k, 5) if k is not None else None
                          for k in (correct, substring))  # fmt: skip
        return SeedBin(
            **exact, other_needle=0, nearest_needle=0, seed=label_seed, mean_distance=40.0,
            substring=by_rule and Accuracy(**by_rule),
        )  # fmt: skip

    data = dataclasses.replace(
        read_record(COMMITTED, CompareResult),
        trained_at=32,
        methods=(Method("rope", "rope", False, "rope"), Method("yarn", "yarn", False, "yarn")),
        probes=ProbeSettings(lengths=(64,), needles=1, haystacks=5, task="t", probes_per_run=5),
        retrieval={"rope": _binned(seed(0, None)), "yarn": _binned(seed(3, 4))},
    )
    blocks = _retrieval_table(data, tmp_path)
    assert len(blocks) == 5 and "substring rule" in blocks[-1].caption
    assert blocks[-1].rows == [["rope", "?"], ["yarn", "0.80 [0.38, 0.96] (4/5)"]]
    same = {"yarn": _binned(seed(3, 3))}
    assert len(_retrieval_table(dataclasses.replace(data, retrieval=same), tmp_path)) == 4


def test_a_collapsed_method_does_not_flatten_the_perplexity_figures(tmp_path):
    """The unmodified model at 286.7 against 30-ish: the axis stops at 3x the best value and
    the caption names the method above it."""
    from ropekit.compare.report import _figures

    def entry(ppl: float) -> SummaryEntry:
        return SummaryEntry(Stat(ppl, 0.0, 1), Stat(ppl, 0.0, 1))

    summary = {
        "rope": {"d": {8: entry(30.0), 32: entry(286.7)}},
        "yarn": {"d": {8: entry(30.5), 32: entry(31.0)}},
    }
    data = dataclasses.replace(
        read_record(COMMITTED, CompareResult), summary=summary, domains=("d",), table={},
        trained_at=8, target_length=32, verdict=None,
    )  # fmt: skip
    figures = _figures(data, tmp_path)
    captions = [f.caption for f in figures if f.path.startswith("ppl_")]
    assert len(captions) == 2
    assert all("stops at 3x the best method's value; above it: rope." in c for c in captions)
    alike = dataclasses.replace(data, summary={"yarn": summary["yarn"], "ntk": summary["yarn"]})
    assert not any("stops at" in f.caption for f in _figures(alike, tmp_path))


def test_the_time_table_lists_each_job_and_their_sum():
    from ropekit.compare.record import JobTime
    from ropekit.compare.report import _time_table

    times = (JobTime("eval a", 5400.0), JobTime("select b lr 0.02", 1800.0, "k", 3.1))
    data = dataclasses.replace(read_record(COMMITTED, CompareResult), times=times)
    heading, table = _time_table(data)
    assert heading.text == "Time"
    assert table.rows == [["eval a", "90.0 min"], ["select b lr 0.02", "30.0 min"]]
    assert "; 2 jobs, 2.0 h in all" in table.caption


def test_the_serving_table_gives_a_reason_several_engines_share_once_under_it():
    """Experiment D's verdict: four engines refuse Leaky ReRoPE for one reason, written once
    in the caption as (1), each cell keeping its own refusal ("export --format gguf")."""
    from ropekit.compare.report import _serving_table

    verdict = read_record(COMMITTED, CompareResult).verdict
    (table,) = _serving_table(verdict)
    whys = [row[5] for row in table.rows]
    assert whys == [f"export --format {f} refused: see (1)" for f in ("hf", "hf", "vllm", "gguf")]
    reason = verdict.serving["llama.cpp"].why_not_best.partition(": ")[2]
    assert table.caption.endswith(f" (1) {reason}") and table.caption.count(reason) == 1
    alone = {"vllm": verdict.serving["vllm"]}
    (one,) = _serving_table(dataclasses.replace(verdict, serving=alone))
    assert one.rows[0][5] == verdict.serving["vllm"].why_not_best and "(1)" not in one.caption


def test_the_reach_table_shows_the_trained_window_and_warns_where_the_baseline_misses_it(
    tmp_path,
):
    """Within the trained 32 tokens the unmodified model answers 2 of 20 (experiment E's
    12-needle check read 5/24): the reach table gives every method's accuracy there, and a
    warning under it says the reach cannot measure positions on this task; at 19 of 20
    there is no warning."""
    from ropekit.compare.report import _retrieval_table
    from ropekit.report.document import Table, Text

    def method(near: int, far: int) -> object:
        bins = [
            pooled_bin([SeedBin(**accuracy_entry(k, 10), other_needle=0, nearest_needle=0,
                                seed=0, substring=None, mean_distance=low + 8.0)], low, low + 16)
            for low, k in ((0, near // 2), (16, near - near // 2), (32, far))
        ]  # fmt: skip
        return method_retrieval(bins, EDGES, 0.8, trained_at=32)

    data = dataclasses.replace(
        read_record(COMMITTED, CompareResult),
        trained_at=32,
        methods=(Method("rope", "rope", False, "rope"), Method("yarn", "yarn", False, "yarn")),
        probes=ProbeSettings(lengths=(64,), needles=5, haystacks=2, task="t", probes_per_run=10),
        retrieval={"rope": method(2, 0), "yarn": method(4, 1)},
    )
    assert data.baseline == "rope"
    blocks = _retrieval_table(data, tmp_path)
    reach = next(b for b in blocks if isinstance(b, Table) and b.headers[1] == "reach (tokens)")
    assert reach.headers[2:] == ["within 32", "past 32 tokens"]
    assert [row[2] for row in reach.rows] == [
        "0.10 [0.03, 0.30] (2/20)",
        "0.20 [0.08, 0.42] (4/20)",
    ]
    warning = blocks[blocks.index(reach) + 1]
    assert isinstance(warning, Text) and warning.text.startswith(
        "Warning (rope): inside the trained window (needles up to 32 tokens back)"
    )
    assert "fewer needles per haystack" in warning.text
    fine = dataclasses.replace(data, retrieval={"rope": method(19, 0), "yarn": method(4, 1)})
    assert not any(isinstance(b, Text) for b in _retrieval_table(fine, tmp_path))
