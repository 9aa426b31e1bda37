"""`ropekit compare` end to end on toy settings (two methods, toy lengths, two domains): what it
trains, scores, probes and judges, what a rerun reuses, what it refuses before it trains. (Its
config: test_config.py; its report: test_report.py.)"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch

from ropekit.cli import main
from ropekit.compare import CompareConfig
from ropekit.compare import run as compare_run
from ropekit.compare.record import (
    CompareResult,
)
from ropekit.compare.verdict import accuracy_text, retrieval_note
from ropekit.evals import PerplexityResult, probes, wilson_interval
from ropekit.evals.probe_haystacks import ProbeConfig
from ropekit.evals.probe_summary import reach
from ropekit.results import read_record

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--batch-size", "4", "--warmup", "2"]


def test_the_help_of_a_no_flag_says_it_turns_the_default_off(capsys):
    assert main(["compare", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--no-single-documents turn off what is on by default: score windows inside" in (
        help_text
    )


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("compare")
    base = root / "base"
    assert main(["pretrain", "--context", "32", "--steps", "30", *TINY, "--out", str(base)]) == 0
    argv = [
        "compare", "--model", str(base), "--target-length", "128",
        "--methods", "yarn:factor=4,adarope:init=yarn,factor=4",
        "--names", "yarn,adarope", "--seeds", "0,1", "--samples", "2", "--lrs", "0.01,0.03",
        "--selection-samples", "1", "--eval-data", "shakespeare,kjv", "--lengths", "16,32,128",
        "--spans", "2", "--probe-lengths", "96,128", "--probe-needles", "1",
        "--probe-haystacks", "3", "--probe-task", "kv1_shakespeare",
        "--race", "off",  # the exhaustive design (racing: test_race_run.py)
        "--out", str(root / "out"),
    ]  # fmt: skip
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    return root, argv


def test_compare_trains_scores_and_judges_every_method(compared):
    root, _ = compared
    data = json.loads((root / "out" / "compare.json").read_text())
    assert data["kind"] == "compare" and data["stage"] == "done"
    assert [m["label"] for m in data["methods"]] == ["rope (unmodified)", "yarn", "adarope"]
    assert [m["trained"] for m in data["methods"]] == [False, False, True]
    for label, domains in data["table"].items():
        assert set(domains) == {"shakespeare", "kjv"}
        for rows in domains.values():
            assert set(rows) == {"16", "32", "128"}
            seeds = 2 if label == "adarope" else 1
            assert len(rows["128"]["ppl"]) == seeds
            assert all(len(w) == 2 for w in rows["128"]["last_quarter_windows"])  # 2 spans
    search = data["lr_search"]["adarope"]
    nll = search["selection_nll"]
    assert set(nll) == {"0.01", "0.03"} and nll["0.01"] != nll["0.03"]
    assert search["chosen"] == float(min(nll, key=nll.get))  # the lower selection NLL wins
    verdict = data["verdict"]
    assert verdict["baseline"] == "rope (unmodified)" and verdict["sentence"]
    assert all(math.isfinite(v) for v in verdict["scores"].values())
    paired = {verdict["winner"], verdict["runner_up"]}  # adarope's 2 seeds are in the error
    assert verdict["difference"]["seeds"] == (2 if "adarope" in paired else 1), paired
    report = (root / "out" / "report.md").read_text()
    assert "## Verdict" in report and verdict["sentence"] in report
    rule = report.split("How it is decided:", 1)[1].split("## Perplexity", 1)[0]
    assert rule.count("\n- ") == 6 and "**" not in rule  # one paragraph per bullet
    assert (root / "out" / "cost_vs_gain.png").is_file()
    for domain in ("shakespeare", "kjv"):  # NLL against position at N, one figure per domain
        assert (root / "out" / f"nll_position_{domain}.png").is_file()
        assert f"](nll_position_{domain}.png)" in report
        curves = data["table"]["adarope"][domain]["128"]["position_nll"]
        assert len(curves) == 2 and all(len(c["nll"]) == len(c["start"]) for c in curves)
    assert data["single_documents"] is True and "inside single held-out documents" in report
    # No engine serves ropekit's own decoder: each says so, and the report's table shows it
    # (the served answers of a Hugging Face model: tests/test_documented_commands.py).
    assert set(data["served"]) == {"rope (unmodified)", "yarn", "adarope"}
    for engines in data["served"].values():
        assert engines and all(not e["exact"] and "not a Hugging Face" in e["why"]
                               for e in engines.values())  # fmt: skip
    serving = verdict["serving"]
    assert set(serving) == {"transformers", "vllm", "vllm+ropekit", "llama.cpp"}
    assert all(e["method"] is None and "not a Hugging Face" in e["sentence"]
               for e in serving.values())  # fmt: skip
    assert "| engine | best it serves |" in report and "| llama.cpp | none |" in report


def test_compare_probes_every_run_and_pools_seeds_per_distance(compared):
    """compare.json's retrieval is per needle distance bin, not per haystack length: each bin
    pools the seeds' probes (correct and n summed, one Wilson interval; every probe in one
    bin), each method has its reach and its probes past L0 pooled, and the report's table is
    by bin, with the accuracy-vs-distance figure and the verdict's note past L0."""
    root, _ = compared
    data = json.loads((root / "out" / "compare.json").read_text())
    assert data["probes"]["lengths"] == [96, 128] and data["probes"]["probes_per_run"] == 3
    retrieval = data["retrieval"]
    assert list(retrieval) == ["rope (unmodified)", "yarn", "adarope"]
    assert data["length_retrieval"] == {}
    edges = ProbeConfig((96, 128)).bin_edges  # 8 bins of 16 tokens up to 128
    for label, method in retrieval.items():
        seeds = 2 if label == "adarope" else 1
        bins = method["by_distance"]
        assert sum(b["n"] for b in bins) == 6 * seeds  # 3 haystacks x 2 lengths, each once
        for b in bins:
            assert b["n"] == sum(e["n"] for e in b["per_seed"]) and len(b["per_seed"]) <= seeds
            assert b["correct"] == sum(e["correct"] for e in b["per_seed"])
            assert (b["low"], b["high"]) == wilson_interval(b["correct"], b["n"])
            assert b["low_distance"] < b["mean_distance"] <= b["high_distance"]
            assert (b["low_distance"], b["high_distance"]) in itertools.pairwise(edges)
        past = [b for b in bins if b["low_distance"] >= 32]  # L0 = 32 is an edge
        assert method["past_from"] == 32
        assert method["past"]["n"] == sum(b["n"] for b in past)
        assert method["past"]["correct"] == sum(b["correct"] for b in past)
        assert method["reach"] == reach(bins, edges, 0.8)
    for seed in (0, 1):  # every seed of the trained method probes into its own folder, and
        # its bins are the pooled bins' entries of that seed
        summary = json.loads(
            (root / "out" / f"eval/adarope/s{seed}/probes/summary.json").read_text()
        )
        assert summary["kind"] == "probes" and summary["overall"]["n"] == 6
        mine = {(e["low_distance"], e["correct"], e["n"]) for e in summary["by_distance"]}
        pooled = {(b["low_distance"], e["correct"], e["n"])
                  for b in retrieval["adarope"]["by_distance"]
                  for e in b["per_seed"] if e["seed"] == seed}  # fmt: skip
        assert mine == pooled
    report = (root / "out" / "report.md").read_text()
    assert "## Retrieval" in report and "per needle distance bin" in report
    assert "@96" not in report and all(
        f"({b['low_distance']}, {b['high_distance']}]" in report
        for b in retrieval["adarope"]["by_distance"]
    )
    assert "another needle's value" not in report  # one needle per haystack: no distractor
    record = read_record(root / "out/compare.json", CompareResult)
    assert accuracy_text(record.retrieval["adarope"].past) in report
    assert "](accuracy_vs_distance.png)" in report
    assert (root / "out" / "accuracy_vs_distance.png").is_file()
    assert "past the trained length" in data["verdict"]["retrieval"]
    assert data["verdict"]["retrieval"] in report


def test_the_verdicts_retrieval_note_pairs_two_methods_probed_once_on_the_same_probes(compared):
    """Two methods each probed at one seed answered the same probes: their answers past L0
    are joined probe by probe from the probes.jsonl files (the 2x2 table counted here by
    hand) and the note's interval is the paired one; a method probed at two seeds (adarope)
    is not paired, and the note compares pooled accuracies as before."""
    import types

    from ropekit.compare.assemble import _paired_past
    from ropekit.evals import paired_difference_interval

    root, _ = compared
    record = read_record(root / "out/compare.json", CompareResult)
    setting = types.SimpleNamespace(
        out=root / "out", config=CompareConfig.from_dict(record.config), trained_at=32
    )
    written = types.SimpleNamespace(retrieval=record.retrieval)

    def answers(label: str) -> dict:
        folder = root / "out" / "eval" / label / "s0" / "probes"
        return {(n, r["haystack"]): r["correct"] for n in (96, 128)
                for r in map(json.loads, (folder / str(n) / "probes.jsonl").open())
                if r["distance"] > 32}  # fmt: skip

    a, b = answers("rope--unmodified"), answers("yarn")
    assert a.keys() == b.keys() and len(a) == record.retrieval["yarn"].past.n
    table = [sum(a[k] == x and b[k] == y for k in a) for x, y in
             [(True, True), (True, False), (False, True), (False, False)]]  # fmt: skip
    verdict = types.SimpleNamespace(winner="rope (unmodified)", runner_up="yarn")
    pairs = _paired_past(setting, written, verdict)
    assert [pairs.both, pairs.only_a, pairs.only_b, pairs.neither] == table
    note = retrieval_note(record.retrieval, dataclasses.replace(
        record.verdict, winner="rope (unmodified)", runner_up="yarn"), pairs)  # fmt: skip
    low, high = paired_difference_interval(*table)
    assert f"[{low:+.2f}, {high:+.2f}] (Newcombe's interval for paired probes: both answered " \
        f"the same {sum(table)})" in note  # fmt: skip
    verdict = types.SimpleNamespace(winner="yarn", runner_up="adarope")
    assert _paired_past(setting, written, verdict) is None  # adarope: two seeds probed


def test_a_rerun_recomputes_nothing_and_other_probes_are_refused(compared, capsys, monkeypatch):
    root, argv = compared
    out = root / "out"
    adapters = sorted(out.glob("methods/**/adapter.safetensors"))
    before = {p: p.stat().st_mtime_ns for p in adapters}
    ppl = {p: p.read_bytes() for p in out.glob("eval/**/ppl.json")}
    answers = {p: p.read_bytes() for p in out.glob("eval/**/probes/**/probes.jsonl")}
    assert len(answers) == 4 * 2  # rope, yarn, adarope at two seeds; two lengths each
    drawn = {p: p.stat().st_ino for p in out.glob("*.png")}  # a redrawn PNG is a new file
    assert len(drawn) >= 6  # per domain: two perplexity figures and NLL vs position

    def no_model_call(*args, **kwargs):
        raise AssertionError("a finished probe stage asked the model again")

    monkeypatch.setattr(probes, "answer_haystacks", no_model_call)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(argv) == 0
        assert {p: p.stat().st_mtime_ns for p in adapters} == before
        assert {p: p.read_bytes() for p in out.glob("eval/**/ppl.json")} == ppl
        assert {p: p.read_bytes() for p in out.glob("eval/**/probes/**/probes.jsonl")} == answers
        assert {p: p.stat().st_ino for p in out.glob("*.png")} == drawn  # nothing redrawn
        capsys.readouterr()
        # Another config in the same folder is refused before anything runs, naming the
        # field: nothing is mixed in and the finished comparison's files stay as they were.
        finished = {p: p.read_bytes() for p in out.glob("*") if p.is_file()}
        at = argv.index("--probe-haystacks") + 1
        changed = [*argv[:at], "2", *argv[at + 1 :]]
        assert main(changed) == 2
    finally:
        torch.set_num_threads(threads)
    assert "probe_haystacks is 3 there, 2 now" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.glob("eval/**/probes/**/probes.jsonl")} == answers
    assert {p: p.read_bytes() for p in out.glob("*") if p.is_file()} == finished


def test_a_method_added_to_a_finished_comparison_reuses_every_finished_job(
    compared, tmp_path, monkeypatch
):
    """The one change a folder takes: methods added, everything else the same. The rerun
    scores the new method and recomputes nothing else: no training, no perplexity, no probe,
    and no learning-rate selection (keyed by what it depends on, not the whole config)."""
    import shutil

    from ropekit.compare import run as compare_run

    root, argv = compared
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    at = argv.index("--out") + 1
    argv = [*argv[:at], str(out), *argv[at + 1 :]]
    before = {p: p.read_bytes() for p in [*out.glob("eval/**/ppl.json"), *out.glob("**/*.jsonl")]}
    before.pop(out / "times.jsonl")  # the job records: the new method's are added
    selections = [r for r in map(json.loads, (out / "times.jsonl").open()) if "nll" in r]
    real_selection = compare_run.Comparison.selection_nll

    def selection(self, backbone, seed):
        raise AssertionError("a finished learning-rate selection was recomputed")

    monkeypatch.setattr(compare_run.Comparison, "selection_nll", selection)
    grown = [*argv]
    grown[grown.index("--methods") + 1] += ",ntk:factor=4"
    grown[grown.index("--names") + 1] += ",ntk"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(grown) == 0
    finally:
        torch.set_num_threads(threads)
    assert real_selection is not None and len(selections) == 2
    data = json.loads((out / "compare.json").read_text())
    assert [m["label"] for m in data["methods"]] == ["rope (unmodified)", "yarn", "adarope", "ntk"]
    assert set(data["table"]["ntk"]) == {"shakespeare", "kjv"} and "ntk" in data["retrieval"]
    assert {p: p.read_bytes() for p in before} == before  # every finished result untouched
    assert len(list(out.glob("eval/ntk/s0/*/ppl.json"))) == 2  # scored on both domains
    finished = json.loads((root / "out" / "compare.json").read_text())
    assert data["lr_search"]["adarope"]["chosen"] == finished["lr_search"]["adarope"]["chosen"]
    # A held-out domain added the same way: every method scored on it, nothing else redone.
    before = {p: p.read_bytes() for p in out.glob("eval/**/ppl.json")}
    grown[grown.index("--eval-data") + 1] += ",wikipedia"
    torch.set_num_threads(1)
    try:
        assert main(grown) == 0
        changed = [*grown]
        changed[changed.index("--eval-data") + 1] = "wikipedia"  # a domain dropped: refused
        assert main(changed) == 2
    finally:
        torch.set_num_threads(threads)
    assert {p: p.read_bytes() for p in before} == before
    data = json.loads((out / "compare.json").read_text())
    assert all("wikipedia" in data["table"][m] for m in ("rope (unmodified)", "adarope", "ntk"))
    assert len(list(out.glob("eval/adarope/s*/wikipedia/ppl.json"))) == 2  # both seeds


def test_a_comparison_probes_the_first_seeds_it_is_told_to():
    config = CompareConfig("m", 64, ("rope", "adarope"), seeds=(3, 4, 5), probe_seeds=1)
    assert config.probed_seeds(True) == (3,) and config.probed_seeds(False) == (0,)
    assert CompareConfig("m", 64, ("rope",), seeds=(3, 4)).probed_seeds(True) == (3, 4)
    assert "probe_seeds" not in CompareConfig("m", 64, ("rope",)).to_dict()  # old folders
    with pytest.raises(ValueError, match="probe_seeds=3 is not allowed; there are 2 seeds"):
        CompareConfig("m", 64, ("rope",), seeds=(0, 1), probe_seeds=3)


def test_a_length_no_single_document_holds_is_left_out_and_said(compared, tmp_path):
    """Windows lie inside single documents by default; a domain whose held-out documents
    (here 40 bytes each) hold no 64-token span is scored at the lengths they hold, and the
    report says which length is missing there instead of the comparison failing."""
    root, _ = compared
    short = tmp_path / "short.jsonl"
    lines = [json.dumps({"text": f"line {i:02d} " + "abcdefgh" * 4}) for i in range(20)]
    short.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    argv = [
        "compare", "--model", str(root / "base"), "--target-length", "64", "--methods",
        "yarn:factor=2", "--eval-data", f"shakespeare,{short}", "--lengths", "16,32,64",
        "--probe-lengths", "", "--out", str(out), "--race", "off",  # racing needs N per domain
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((out / "compare.json").read_text())
    assert data["single_documents"] is True
    assert data["skipped"] == [
        {"domain": str(short), "length": 64, "span": 64, "capacity": 0, "count": 1}
    ]
    for domains in data["table"].values():
        assert set(domains[str(short)]) == {"16", "32"} and set(domains["shakespeare"]) == {
            "16", "32", "64"
        }  # fmt: skip
    assert all(math.isfinite(v) for v in data["verdict"]["scores"].values())
    report = (out / "report.md").read_text()
    assert f"No single document of 64 tokens in {short}: 64-token windows are not" in report
    assert "inside single held-out documents" in report
    saved = json.loads(next(out.glob("eval/yarn*/s0/shakespeare/ppl.json")).read_text())
    assert saved["provenance"]["config"]["single_documents"] is True
    assert data["probes"] is None and data["retrieval"] == {}  # '' turned the probes off
    assert "## Retrieval" not in report


def test_probes_that_do_not_fit_stop_the_comparison_before_it_trains(compared, tmp_path, capsys):
    root, _ = compared
    argv = [
        "compare", "--model", str(root / "base"), "--target-length", "64", "--methods",
        "adarope:init=yarn,factor=2", "--probe-lengths", "64", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    assert main(argv) == 2  # the default 12 needles per haystack: more than 64 tokens hold
    assert "needles=12 cannot fit in 64 tokens" in capsys.readouterr().err
    assert not (tmp_path / "out" / "methods").exists()


def test_specs_that_omit_the_factor_take_n_over_l0_as_extend_does(compared, tmp_path, capsys):
    """The README's own example: `dynamic-ntk` and `yarn` need a factor, which compare (like
    extend, by extend's one rule) derives from N / L0; a spec that cannot be built at all
    stops the comparison before any job, one line, nothing written."""
    root, _ = compared
    out = tmp_path / "out"
    argv = [
        "compare", "--model", str(root / "base"), "--target-length", "128",
        "--methods", "rope,dynamic-ntk,yarn,string", "--eval-data", "shakespeare",
        "--lengths", "128", "--probe-lengths", "", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((out / "compare.json").read_text())
    assert set(data["table"]) == {"rope", "dynamic-ntk", "yarn", "string"}
    extended = json.loads((out / "methods/yarn/s0/extend.json").read_text())
    assert "factor=4" in extended["spec"]  # 128 / 32
    report = (out / "report.md").read_text()
    assert "No method here trains anything" in report and "Trained methods" not in report
    plan = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("plan:"))
    assert "4 methods; 0 training runs" in plan and "4 scored models x 128 tokens" in plan
    # one span of one domain: a lead resolves only within its text, said before it starts
    assert "warning: 1 window at 128: a lead is resolved only within" in plan
    assert "raise spans" in plan
    assert re.search(r"estimated compute for every job: perplexity \d+ min \(rough", plan)
    bad = [*argv[: argv.index("--out") + 1], str(tmp_path / "bad")]
    bad[bad.index("--methods") + 1] = "rope,yarn:beta_fast=oops"
    assert main(bad) == 2
    assert not (tmp_path / "bad" / "compare.json").exists()


def test_the_plans_cost_model_grows_with_attentions_square(compared):
    """forward_seconds: positive, linear in the weights' term and quadratic in attention's,
    so doubling a long window more than doubles its time (and less than quadruples it)."""
    from ropekit.backbone import open_backbone
    from ropekit.backbone.cost import forward_seconds

    root, _ = compared
    seconds = forward_seconds(open_backbone(root / "base"))
    assert seconds(1024) > 0 and 2 * seconds(1024) < seconds(2048) < 4 * seconds(1024)


def test_the_plans_estimate_leaves_out_what_is_read_once(compared, tmp_path, monkeypatch):
    """Perplexity windows read in a longer window's reading cost nothing for an encoding that
    does not follow the length, and all of their time for one that does; a haystack costs its
    prefill up to its longest cut (one needle: its one cut), a later one less the filler it
    keeps."""
    from ropekit.compare.run import Comparison
    from ropekit.evals.adapters import BackboneLM

    # SmolLM2's chunk (a byte vocabulary's would hold a whole haystack: nothing is kept)
    monkeypatch.setattr(BackboneLM, "prefill_chunk", property(lambda self: 1365))
    root, _ = compared
    config = CompareConfig(
        str(root / "base"), 16384, ("rope", "yarn:factor=512", "dynamic-ntk:factor=512"),
        eval_data=("shakespeare",), lengths=(8192, 16384), single_documents=False,
        probe_lengths=(16384,), probe_needles=1, probe_haystacks=3, probe_task="niah_single_1",
    )  # fmt: skip
    run = Comparison(config, tmp_path, "", lambda *_: None, False)
    run.forward_seconds = float  # one second per token: the sums below are token counts
    assert {m.label for m in run.methods if m.dynamic} == {"dynamic-ntk factor512"}
    seconds = run.estimated_seconds()
    # One span of 16k: the first 8k window is read in the 16k window's reading.
    assert seconds["perplexity"] == 2 * (8192 + 16384) + (2 * 8192 + 16384)
    reads = run.reads[16384]
    (_, first), *later = reads
    kept = later[0][0]
    # the whole chunks before the needle, which sits in the first 5% of the haystack
    assert kept % 1365 == 0 and kept <= 0.05 * 16384 and all(k == kept for k, _ in later)
    # the cut of each haystack's one probe: somewhere past its needle, not the whole length
    cuts = [max(p.cut for p in hay.probes) for hay in _haystacks(run, 16384)]
    assert [to for _, to in reads] == cuts and min(cuts) < 16384 - 512
    assert seconds["probes"] == 3 * (first + sum(to - kept for _, to in later))


def _haystacks(run, length: int) -> list:
    """The comparison's haystacks of ``length``, built as its probes build them."""
    from ropekit.evals.probe_haystacks import build_haystack, probe_task
    from ropekit.evals.prompts import PromptFormat

    probes = run.config.probe_config(run.trained_at)
    task, fmt = probe_task(probes.task), PromptFormat(run.tokenizer)
    return [build_haystack(task, fmt, probes, length, h) for h in range(probes.haystacks)]


def _copied(compared, tmp_path: Path) -> tuple[Path, CompareConfig]:
    """A copy of the fixture's finished comparison, and its config as a file gives it."""
    import shutil

    from ropekit.compare.config import from_file

    root, _ = compared
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    recorded = json.loads((out / "compare.json").read_text())["config"]
    # a field left out is at the value comparisons ran at before it (race off), not the default
    written = CompareConfig.from_dict(recorded)
    (tmp_path / "config.json").write_text(json.dumps({**recorded, "race": written.race}))
    return out, from_file(tmp_path / "config.json")


def _per_token(run):
    """``run`` with its plan costed at one second per token: its sums are token counts."""
    run.forward_seconds = float
    return run


def test_the_plan_says_what_is_left_of_a_resumed_comparison(compared, tmp_path):
    """Each job is costed once and counted as left until its result is in the folder: the
    fixture's finished comparison has nothing left; each result taken away (a domain's
    ppl.json, a probes summary, a later seed's run, a selection's record) puts back exactly
    its own job's seconds, costed here at one second per token against hand sums."""
    import shutil

    from ropekit.compare.run import Comparison, _estimate

    out, config = _copied(compared, tmp_path)
    assert config.seeds == (0, 1) and config.lrs == (0.01, 0.03)

    def comparison() -> Comparison:
        return _per_token(Comparison(config, out, "", lambda *_: None, False))

    run = comparison()
    every = run.estimated_seconds()
    # 2 spans of 128 per domain, tiled by 16, 32 and 128 (windows this short are batched:
    # none is read in a longer one's reading)
    per_domain = 2 * (8 * 16 + 4 * 32 + 128)
    assert every["perplexity"] == 2 * 4 * per_domain  # 2 domains x (rope, yarn, 2 seeds)
    assert every["training"] == 3 * 2 * 3 * 128  # 3 runs x 2 samples x 3 forwards of 128 (no PoSE)
    assert every["selection"] == 2 * 128  # one sample at the target length per rate
    probes = sum(to - start for n in (96, 128) for start, to in run.reads[n])
    assert every["probes"] == 4 * probes  # rope, yarn, adarope at both seeds
    assert run.estimated_seconds(left=True) == dict.fromkeys(every, 0.0)
    assert "; left (a job in progress counted whole): none (rough" in _estimate(run)

    (out / "eval/adarope/s1/kjv/ppl.json").unlink()
    (out / "eval/yarn/s0/probes/summary.json").unlink()
    (later,) = out.glob("methods/adarope/lr-*/s1")  # seed 1 at the chosen rate
    shutil.rmtree(later)
    times = out / "times.jsonl"
    records = [json.loads(line) for line in times.read_text().splitlines()]
    times.write_text(
        "".join(json.dumps(r) + "\n" for r in records if r["job"] != "select adarope lr 0.03")
    )
    run = comparison()
    assert run.estimated_seconds() == every
    assert run.estimated_seconds(left=True) == {
        "training": 2 * 3 * 128, "selection": 128, "perplexity": per_domain, "probes": probes,
    }  # fmt: skip
    assert "; left (a job in progress counted whole): training 13 min" in _estimate(run)


def test_the_plan_scales_what_is_left_by_the_pace_of_the_finished_jobs(compared, tmp_path):
    """Each job's name in the plan is its name in times.jsonl; the pace of a kind is the
    median over its finished jobs of recorded over estimated seconds (one outlier does not
    move it; a job whose result is gone does not count), and what is left is scaled by it."""
    import shutil

    from ropekit.compare.run import Comparison, _estimate
    from ropekit.results import write_records

    out, config = _copied(compared, tmp_path)

    def comparison() -> Comparison:
        return _per_token(Comparison(config, out, "", lambda *_: None, False))

    run = comparison()
    jobs = run.job_costs()
    assert all(j.finished for j in jobs) and {j.job for j in jobs} <= set(run.ledger.records)
    assert _estimate(run).count("pace") == 0  # nothing left: no pace to state
    pace = {"training": 0.5, "selection": 1.0, "perplexity": 2.0, "probes": 3.0}
    outlier = next(j.job for j in jobs if j.kind == "perplexity")
    records = {
        j.job: {**run.ledger.records[j.job], "seconds": j.seconds * pace[j.kind]} for j in jobs
    }
    records[outlier]["seconds"] *= 50
    (out / "eval/adarope/s1/kjv/ppl.json").unlink()  # its record stays: not finished, not counted
    records["eval eval/adarope/s1/kjv"]["seconds"] = 1e9
    (later,) = out.glob("methods/adarope/lr-*/s1")
    shutil.rmtree(later)
    write_records(out / "times.jsonl", list(records.values()))

    run = comparison()
    jobs = run.job_costs()
    paces = compare_run.paces(run.ledger, jobs)
    assert {kind: r for kind, (r, _) in paces.items()} == pace
    assert paces["perplexity"][1] == 7  # 8 scored, one not finished
    left, paced = run.estimated_seconds(left=True), run.estimated_seconds(left=True, paced=True)
    assert left["perplexity"] > 0 and left["training"] > 0
    assert paced == {kind: seconds * pace[kind] for kind, seconds in left.items()}
    assert run.estimated_seconds(paced=True) != run.estimated_seconds()
    assert "; left at the pace of this folder's finished jobs: training" in _estimate(run)
    assert "perplexity x2.00 of 7" in _estimate(run)


def test_a_job_computed_elsewhere_records_its_own_time_or_none(compared, tmp_path):
    """A run finished in its folder before the comparison reached it (trained ahead, as
    experiment E's prefetch does) is loaded, and times.jsonl records the run's own time from
    its extend.json, not the load's, also in place of a load's record made before this rule;
    a record longer than the run's own time (the comparison trained it) is kept. A perplexity
    found finished with no record of it (copied in) is loaded and gets no record, so the
    plan's pace leaves it out; one begun here and killed after its result was written keeps
    its attempt's time."""

    from ropekit.compare.run import Comparison
    from ropekit.results import read_record, read_records, write_records
    from ropekit.train.extend import EXTEND_JSON, ExtendRecord

    out, config = _copied(compared, tmp_path)
    run = Comparison(config, out, "", lambda *_: None, False)
    method = next(m for m in run.methods if m.trained)
    train = next(j for j in run.jobs() if j.method == method and j.kind == "training")
    job, folder = train.name, train.folder
    assert read_record(folder / EXTEND_JSON, ExtendRecord).elapsed_s > 0
    # as long as a real run takes (this tiny one trains in a fraction of a second, as fast
    # as it loads)
    own = 1234.5
    record = json.loads((folder / EXTEND_JSON).read_text())
    (folder / EXTEND_JSON).write_text(json.dumps({**record, "elapsed_s": own}))
    records = read_records(out / "times.jsonl")
    write_records(out / "times.jsonl", [r for r in records if r["job"] != job])

    run = Comparison(config, out, "", lambda *_: None, False)
    run.run_job(train)
    assert run.ledger.records[job]["seconds"] == own
    assert {"job": job, "seconds": own} in read_records(out / "times.jsonl")
    run.ledger.set(job, {"job": job, "seconds": 0.4})  # a load recorded before the rule: mended
    run.run_job(train)
    assert run.ledger.records[job]["seconds"] == own
    run.ledger.set(job, {"job": job, "seconds": 2000.0})  # the comparison trained it: kept
    run.run_job(train)
    assert run.ledger.records[job]["seconds"] == 2000.0

    scored = next(j for j in run.jobs() if j.method == method and j.domain == "kjv")
    job, eval_folder = scored.name, scored.folder
    assert (eval_folder / "ppl.json").is_file() and job in run.ledger.records
    records = read_records(out / "times.jsonl")
    write_records(out / "times.jsonl", [r for r in records if r["job"] != job])
    run = Comparison(config, out, "", lambda *_: None, False)
    assert run.ledger.run(job, lambda: "loaded", eval_folder, "ppl.json") == "loaded"
    assert job not in run.ledger.records and job in run.ledger.jobs
    assert job not in {r["job"] for r in read_records(out / "times.jsonl")}
    paces = compare_run.paces(run.ledger, run.job_costs())
    assert paces["perplexity"][1] == sum(j.kind == "perplexity" for j in run.job_costs()) - 1
    # begun here (a kill -9 after ppl.json was written): its attempt is its time
    run.ledger.set(job, {"job": job, "started": None, "earlier": 50.0})
    run.ledger.run(job, lambda: "loaded", eval_folder, "ppl.json")
    assert 50.0 <= run.ledger.records[job]["seconds"] < 51


def test_plan_only_prints_the_plan_and_writes_nothing_even_beside_a_running_comparison(
    compared, tmp_path, capsys
):
    """--plan-only: the plan line with the compute left, nothing run or written (a new folder
    is not even made), no lock taken, so it answers while a comparison runs there."""
    from ropekit.outdir import LOCK_FILE
    from tests.processes import locked_elsewhere

    root, argv = compared
    out = root / "out"

    def snapshot() -> list[tuple[str, int, int]]:  # the holder's lock file aside
        files = (f for f in out.rglob("*") if f.name != LOCK_FILE)
        return sorted((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)

    before = snapshot()
    capsys.readouterr()
    with locked_elsewhere(out):  # as a running comparison holds it
        assert main([*argv, "--plan-only"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("plan: 3 methods") and "verdict" not in printed
    assert "; left (a job in progress counted whole): none (rough" in printed
    # the probes and the distances they measure, before any work (3 haystacks at 96 and 128)
    asked = re.search(r"asking 6 probes per run, (\d+) of them at needle distances past "
                      r"32 \(up to (\d+)\)", printed)  # fmt: skip
    assert asked and 0 < int(asked[1]) <= 6 and 32 < int(asked[2]) < 128
    assert snapshot() == before
    fresh = tmp_path / "fresh"
    assert main([*argv[: argv.index("--out") + 1], str(fresh), "--plan-only"]) == 0
    assert "left" not in capsys.readouterr().out and not fresh.exists()


@pytest.mark.parametrize("domain", ["banana", "empty.txt", "binary.txt"])
def test_a_bad_domain_is_refused_before_anything_is_written(compared, tmp_path, capsys, domain):
    """Every held-out domain is read when the comparison starts: an unknown name, an empty or
    a non-UTF-8 file is one line, exit 2, and --out is left as it was found (it once failed
    after the first domain was scored, leaving methods/, times.jsonl and a lock)."""
    root, _ = compared
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)) * 40)
    data = domain if domain == "banana" else str(tmp_path / domain)
    out = tmp_path / "out"
    argv = [
        "compare", "--model", str(root / "base"), "--target-length", "128",
        "--methods", "rope,yarn", "--eval-data", f"shakespeare,{data}",
        "--lengths", "128", "--probe-lengths", "", "--out", str(out),
    ]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and (domain in err or "banana" in err)
    assert not out.exists() or list(out.iterdir()) == []


def test_a_users_own_file_is_scored_whole(compared, tmp_path):
    """One long text file is held-out text: scored, not split into an empty validation part."""
    from ropekit.data import load_corpus

    root, _ = compared
    book = tmp_path / "book.txt"
    book.write_text("\n\n".join(d.text for d in load_corpus("kjv")[:3]))
    out = tmp_path / "out"
    argv = [
        "compare", "--model", str(root / "base"), "--target-length", "128",
        "--methods", "rope,yarn", "--eval-data", str(book), "--lengths", "128",
        "--probe-lengths", "", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((out / "compare.json").read_text())
    assert str(book) in data["table"]["yarn"]


@pytest.mark.parametrize("single", [True, False], ids=["single-documents", "joined"])
def test_the_report_names_the_held_out_documents_and_times_only_its_own_jobs(
    compared, tmp_path, single
):
    """A folder of the user's files is one domain, named as passed; the report says which of
    its documents the windows were cut from (it named none), and its time table lists only
    this comparison's jobs, not those of a stopped run with other methods in the folder."""
    from ropekit.data import load_corpus

    root, _ = compared
    books = tmp_path / "my books"
    books.mkdir()
    for i, doc in enumerate(load_corpus("kjv")[:2]):
        (books / f"book{i}.txt").write_text(doc.text)
    out = tmp_path / "out"
    out.mkdir()
    stopped = {"job": "train methods/stopped-method/s0", "seconds": 12.0}
    (out / "times.jsonl").write_text(json.dumps(stopped) + "\n")
    argv = [
        "compare", "--model", str(root / "base"), "--target-length", "128",
        "--methods", "rope,yarn", "--eval-data", str(books), "--lengths", "128",
        "--spans", "2", "--probe-lengths", "", "--out", str(out),
        *([] if single else ["--no-single-documents"]),
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((out / "compare.json").read_text())
    held = data["held_out"][str(books)]
    assert {Path(s["document"]).name for s in held} <= {"book0.txt", "book1.txt"}
    assert sum(s["tokens"] for s in held) >= 2 * 128
    report = (out / "report.md").read_text()
    assert f"Held-out text of {books}: {held[0]['document']} (tokens " in report
    jobs = [t["job"] for t in data["times"]]
    assert "train methods/stopped-method/s0" not in jobs and "train methods/yarn/s0" in jobs
    assert "stopped-method" not in report


@pytest.mark.slow  # 105 s of make test's 731 (fresh clone, 2026-12-06): make test-slow
def test_two_processes_share_one_comparison_each_job_run_once(compared, tmp_path):
    """A second process started with --join beside a running comparison takes the jobs the
    first does not hold: every result file is written by exactly one of them, both do some of
    the work, both end with the whole verdict, and every number equals the comparison run by
    one process (the fixture's, same config); times.jsonl keeps every job's record once."""
    from tests.processes import run_together, writes

    root, argv = compared
    out = tmp_path / "out"
    shared = [*argv[: argv.index("--out") + 1], "out"]  # relative: each claim released by it
    done = run_together({"first": shared, "joined": [*shared, "--join"]}, tmp_path)
    for name, process in done.items():
        assert process.returncode == 0, f"{name}: {process.stderr[-2000:]}"
    # what a job writes when it runs, never when it is reused (a reused probes job rewrites
    # its summary and figures)
    results = {"ppl.json", "extend.json", "probes.jsonl"}
    wrote = {
        name: {p for p in paths if Path(p).name in results}
        for name, paths in writes(tmp_path).items()
    }
    expected = {str(f.relative_to(root)) for f in (root / "out").rglob("*") if f.name in results}
    assert wrote["first"] and wrote["joined"], wrote  # the work was shared
    assert not wrote["first"] & wrote["joined"]  # no job run twice
    assert wrote["first"] | wrote["joined"] == expected
    mine = read_record(out / "compare.json", CompareResult)
    alone = read_record(root / "out" / "compare.json", CompareResult)
    assert mine.stage == "done" and mine.table == alone.table and mine.verdict == alone.verdict
    assert mine.retrieval == alone.retrieval and mine.lr_search == alone.lr_search
    records = [json.loads(line) for line in (out / "times.jsonl").read_text().splitlines()]
    jobs = [r["job"] for r in records]
    assert len(jobs) == len(set(jobs)) and all("seconds" in r for r in records)
    assert set(jobs) == {r.job for r in alone.times}
    # every claim released (the folder-wide writing locks, dot files, are filelock's: kept)
    assert [p.name for p in (out / ".jobs").iterdir() if not p.name.startswith(".")] == []
    # the files a process rewrites when it reuses a job (a probes summary, the verdict) record
    # the comparison's command, not the process's: the same whichever process wrote them
    rewritten = [out / "compare.json", *out.glob("eval/*/s*/probes/summary.json")]
    commands = {json.loads(f.read_text())["meta"]["command"] for f in rewritten}
    assert len(rewritten) > 3 and len(commands) == 1 and "--join" not in commands.pop()


def test_an_interim_report_keeps_what_other_processes_wrote(compared, tmp_path):
    """A --join process holds only the jobs it ran or loaded itself; its interim report keeps
    what the others wrote before (experiment E's 19:40 report, written by the joined process,
    lacked STRING's perplexity and the unmodified model's probes). A method scored as another
    spec, or a compare.json of other settings, is not taken."""
    from ropekit.compare.run import COMPARE_JSON, Comparison

    out, config = _copied(compared, tmp_path)
    finished = read_record(out / COMPARE_JSON, CompareResult)
    run = Comparison(config, out, "", lambda *_: None, False)
    interim = run.write("interim")  # this process has read nothing yet
    for field in ("table", "summary", "lr_search", "retrieval", "served", "held_out", "verdict"):
        assert getattr(interim, field) == getattr(finished, field), field
    assert {t.job for t in interim.times} == {t.job for t in finished.times}
    assert list(interim.table) == [m.label for m in finished.methods]  # in the methods' order

    spec = {m.label: m.spec for m in finished.methods}
    respecified = dataclasses.replace(
        config,
        methods=tuple("yarn:factor=8" if str(s) == spec["yarn"] else s for s in config.methods),
    )
    other = Comparison(respecified, out, "", lambda *_: None, False).write("x")
    assert "yarn" not in other.table and "yarn" not in other.retrieval
    assert set(other.table) == set(finished.table) - {"yarn"}
    moved = dataclasses.replace(config, margin=0.5)  # other settings: nothing is taken
    assert Comparison(moved, out, "", lambda *_: None, False).write("x").table == {}


def test_a_comparison_waits_for_a_job_another_process_holds_then_takes_it_over(
    compared, tmp_path, monkeypatch
):
    """The one job left is held by another live process: the run's plan names it, the run
    scores nothing twice, says once what it waits for, and once that process is gone (kill -9: it
    released nothing) takes the job over and scores it as a run alone would."""
    import contextlib

    from ropekit.compare import ledger
    from ropekit.compare import run as compare_run
    from ropekit.compare.ledger import CLAIMS, _slug
    from ropekit.compare.run import run_compare
    from ropekit.results import read_records, write_records
    from tests.processes import locked_elsewhere

    out, config = _copied(compared, tmp_path)
    folder = out / "eval" / "yarn" / "s0" / "kjv"
    original = read_record(folder / "ppl.json", PerplexityResult)
    (folder / "ppl.json").unlink()
    job = "eval eval/yarn/s0/kjv"
    write_records(
        out / "times.jsonl", [r for r in read_records(out / "times.jsonl") if r["job"] != job]
    )
    monkeypatch.setattr(ledger, "WAIT_SECONDS", 0.1)
    (out / CLAIMS).mkdir(exist_ok=True)
    holder = contextlib.ExitStack()
    holder.enter_context(locked_elsewhere(out, out / CLAIMS / f"{_slug(job)}.lock", job))
    said, looks = [], []
    sleep = compare_run.time.sleep

    def wait(seconds: float) -> None:  # the holder is killed while this run waits, 3 looks in
        looks.append(seconds)
        if len(looks) == 3:
            holder.close()
        sleep(seconds)

    monkeypatch.setattr(compare_run.time, "sleep", wait)
    with holder:
        result = run_compare(config, out, log=said.append)
    assert said[0].startswith("plan: ")  # the plan names what the other process runs
    assert said[0].endswith(f"; running now in other processes: {job}")
    waits = [line for line in said if "held by other processes" in line]
    assert looks == [0.1] * 3 and waits == [  # said once, not at every look
        f"1 job left, held by other processes of this comparison ({job}): looking again every 0.1 s"
    ]
    assert result.stage == "done"
    again = read_record(folder / "ppl.json", PerplexityResult)
    assert again.results == original.results
    assert job in {r["job"] for r in read_records(out / "times.jsonl") if "seconds" in r}


def test_the_plan_lists_the_jobs_a_run_records_and_the_prefetch_trains(compared, tmp_path, capsys):
    """One job list (compare.plan.jobs): the jobs the plan names for the fixture's finished
    comparison are the jobs its run wrote to times.jsonl, each once and in the order they
    ran; experiment E's prefetch trains exactly the plan's candidate runs (loaded here: the
    folder is finished)."""
    from experiments.smollm2_32k import prefetch

    from ropekit.compare.run import Comparison
    from ropekit.results import read_records

    root, _ = compared
    out, config = _copied(compared, tmp_path)
    run = Comparison(config, out, "", lambda *_: None, False)
    planned = [job.name for job in run.jobs()]
    recorded = [r["job"] for r in read_records(root / "out" / "times.jsonl")]
    assert planned == recorded and len(set(planned)) == len(planned)
    assert {j.kind for j in run.jobs()} == {"training", "selection", "perplexity", "probes"}
    capsys.readouterr()
    prefetch.main(["--config", str(tmp_path / "config.json"), "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    trained = [line.split(" -> ")[1] for line in printed if " -> " in line]
    candidates = [
        str(j.folder)
        for j in run.jobs()
        if j.kind == "training" and j.method.trained and j.seed == config.seeds[0]
    ]
    assert trained == candidates and len(trained) == len(config.lrs)


def test_two_spellings_of_one_method_are_one_method(compared, tmp_path, monkeypatch):
    """A method is recorded by its canonical spec (a factor left out is N / L0): the same
    method with its factor spelled out, rerun into the same folder, is the same comparison,
    and reuses every result, the learning-rate selection (keyed by the canonical spec) too;
    compare.json keeps the text the user gave."""
    from ropekit.compare import run as compare_run

    root, _ = compared
    out = tmp_path / "out"
    argv = [
        "compare", "--model", str(root / "base"), "--target-length", "128",
        "--methods", "adarope:init=yarn", "--names", "adarope", "--seeds", "0",
        "--samples", "1", "--lrs", "0.01,0.03", "--selection-samples", "1",
        "--eval-data", "shakespeare", "--lengths", "128", "--probe-lengths", "",
        "--out", str(out),
    ]  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(argv) == 0
        results = [*out.glob("eval/**/ppl.json"), *out.glob("methods/**/extend.json")]
        before = {p: p.read_bytes() for p in results}
        records = (out / "times.jsonl").read_text()

        def selection(self, backbone, seed):
            raise AssertionError("a selection was recomputed for another spelling")

        monkeypatch.setattr(compare_run.Comparison, "selection_nll", selection)
        spelled = [*argv]
        spelled[spelled.index("--methods") + 1] = "adarope:init=yarn,factor=4"
        assert main(spelled) == 0
    finally:
        torch.set_num_threads(threads)
    assert {p: p.read_bytes() for p in results} == before and len(before) == 5  # 2 + 3 runs
    assert (out / "times.jsonl").read_text() == records  # nothing run, nothing rekeyed
    data = json.loads((out / "compare.json").read_text())
    adarope = next(m for m in data["methods"] if m["label"] == "adarope")
    assert adarope["spec"] == "adarope:init=yarn,factor=4"
    assert adarope["given"] == "adarope:init=yarn,factor=4"
    assert data["config"]["methods"] == ["adarope:init=yarn,factor=4"]


def test_the_docs_tables_of_a_comparison_by_distance_name_the_distance(compared):
    """docs/tables.py reads compare.json as ropekit does (read_record), so a comparison written
    by distance renders: its passkey column is the probes past L0 pooled, with the reach."""
    from docs import tables

    root, _ = compared
    record = read_record(root / "out/compare.json", CompareResult)
    for render in (tables.comparison("out/compare.json"), tables.headline("out/compare.json")):
        rows = [[c.strip("| ") for c in line.split(" | ")] for line in render(root).splitlines()]
        assert "passkey, needle > 32 back" in rows[0]
        column = rows[0].index("passkey, needle > 32 back")
        cells = {row[0].strip("`"): row[column] for row in rows[2:]}
        for label, method in record.retrieval.items():
            past = method.past
            assert cells[label].startswith(f"{past.correct}/{past.n} [{past.low:.2f}"), cells
