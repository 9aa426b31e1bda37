"""`ropekit compare` racing end to end on toy settings (the unmodified model, YaRN and a
sinusoidal table loud enough to drown the tokens, which collapses): rounds, stops, what a
stopped method is spared, the report, resume after a kill mid-race, and bad input. (The rule
itself on made-up windows: test_race.py.)"""

from __future__ import annotations

import pytest
import torch

from ropekit.cli import main
from ropekit.compare import run as compare_run
from ropekit.compare.record import CompareResult
from ropekit.evals import perplexity
from ropekit.results import read_record

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--batch-size", "4", "--warmup", "2"]
COLLAPSED = "sinusoidal scale30"  # the label derived from its spec


def _argv(base, out, *more):
    return [
        "compare", "--model", str(base), "--target-length", "128",
        "--methods", "yarn:factor=4,sinusoidal:scale=30", "--eval-data", "shakespeare,kjv",
        "--lengths", "32,128", "--spans", "3", "--probe-lengths", "128", "--probe-needles", "1",
        "--probe-haystacks", "2", "--probe-task", "kv1_shakespeare", "--out", str(out), *more,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny byte-level model trained at 32 tokens."""
    root = tmp_path_factory.mktemp("race")
    pretrain = ["pretrain", "--context", "32", "--steps", "30", *TINY]
    assert main([*pretrain, "--out", str(root / "base")]) == 0
    return root


@pytest.fixture(scope="module")
def raced(base):
    """The comparison raced (the default) and the same one with --race off."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = base
    try:
        assert main(_argv(root / "base", root / "on")) == 0
        assert main(_argv(root / "base", root / "off", "--race", "off")) == 0
    finally:
        torch.set_num_threads(threads)
    return root


def _flat(nested) -> list[float]:
    return [x for item in nested for x in (_flat(item) if isinstance(item, tuple) else [item])]


def _record(folder) -> CompareResult:
    return read_record(folder / "compare.json", CompareResult)


def test_the_plan_of_a_race_says_so_and_counts_the_most_it_can_run(base, tmp_path, capsys):
    """Before any round is decided the plan costs every method at every round, with its
    probes (3 methods x 2 haystacks at one length), and says it is an upper bound."""
    assert main([*_argv(base / "base", tmp_path / "out"), "--plan-only"]) == 0
    line = capsys.readouterr().out
    assert "6 probe prefills" in line and "3 scored models" in line
    assert "raced in 6 rounds (at most the above" in line  # 3 spans x 2 domains


def test_a_collapsed_method_stops_after_round_one_and_is_never_probed(raced):
    out = raced / "on"
    data = _record(out)
    assert data.race is not None and (data.race.rounds, data.race.decided) == (6, 6)
    assert set(data.race.stops) == {COLLAPSED}
    stop = data.race.stops[COLLAPSED]
    assert stop.round == 1 and stop.reason == "collapsed"
    # its score so far is round 1's one window (of the first domain) at N, the last quarter's
    # mean NLL: one window is all it cost
    assert set(data.table[COLLAPSED]) == {"shakespeare"}
    windows = data.table[COLLAPSED]["shakespeare"][128].last_quarter_windows[0]
    assert len(windows) == 1 and stop.score == pytest.approx(windows[0])
    folder = out / "eval" / "sinusoidal-scale30" / "s0"
    assert [p.relative_to(folder).as_posix() for p in folder.glob("*/*")] == ["shakespeare/round-1"]
    assert not (folder / "probes").exists() and COLLAPSED not in data.retrieval
    jobs = [t.job for t in data.times]
    assert [j for j in jobs if "sinusoidal" in j and j.startswith("eval")] == [
        "eval eval/sinusoidal-scale30/s0/shakespeare/round-1",
    ]
    assert sum(j.startswith("probes") for j in jobs) == 2  # the two that finished the race
    assert data.verdict is not None and COLLAPSED not in data.verdict.scores
    # the verdict's sentence names it, so "every other method" reads as the methods still in
    assert data.verdict.sentence.endswith(
        f" Out of the race, so not candidates: {COLLAPSED} after round 1 (collapsed)."
    )
    report = (out / "report.md").read_text()
    assert "## Race" in report and f"| {COLLAPSED} | 1 | {stop.score:.4f} | collapsed |" in report
    assert "| yarn factor4 | - |  | finished the race |" in report


def test_race_off_scores_every_window_as_before(raced):
    """--race off is the exhaustive design: no rounds, no race in compare.json, every method
    probed, the job names of a comparison made before racing."""
    data = _record(raced / "off")
    assert data.race is None and "race" not in data.config  # the config as before racing
    assert COLLAPSED in data.retrieval and COLLAPSED in data.verdict.scores
    jobs = [t.job for t in data.times]
    assert "eval eval/sinusoidal-scale30/s0/kjv" in jobs and not any("round-" in j for j in jobs)
    assert "## Race" not in (raced / "off" / "report.md").read_text()


def test_the_methods_that_finish_the_race_have_the_numbers_of_the_exhaustive_run(raced):
    """Rounds joined are the windows a whole reading scores: each method that finished the
    race has race off's table (to float rounding), and the same verdict between them."""
    on, off = _record(raced / "on"), _record(raced / "off")
    for label in ("rope (unmodified)", "yarn factor4"):
        for domain in on.domains:
            for n in on.lengths:
                a, b = on.entry(label, domain, n), off.entry(label, domain, n)
                assert _flat(a.last_quarter_windows) == pytest.approx(
                    _flat(b.last_quarter_windows), abs=1e-9
                )
                assert _flat(a.last_quarter_blocks) == pytest.approx(
                    _flat(b.last_quarter_blocks), abs=1e-9
                )
                assert a.nll == pytest.approx(b.nll, abs=1e-9)
                assert a.ppl == pytest.approx(b.ppl, rel=1e-9)
    assert on.verdict.winner == off.verdict.winner and on.verdict.resolved == off.verdict.resolved
    for label, score in on.verdict.scores.items():
        assert score == pytest.approx(off.verdict.scores[label], abs=1e-9)
    assert on.retrieval == {k: v for k, v in off.retrieval.items() if k != COLLAPSED}


def test_a_race_killed_mid_round_resumes_recomputing_nothing(raced, tmp_path, monkeypatch):
    """Killed at its first round-2 job, the rerun scores no window of round 1 again, decides
    the same stops and ends with the uninterrupted race's numbers (round r: span (r - 1) // 2
    of shakespeare, then of kjv)."""
    out = tmp_path / "out"
    real_score = compare_run.RUNNERS["perplexity"]

    def killed(self, job):
        if job.round == 2:
            raise KeyboardInterrupt  # what a stop Python sees leaves behind
        return real_score(self, job)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setitem(compare_run.RUNNERS, "perplexity", killed)
        assert main(_argv(raced / "base", out)) != 0
        monkeypatch.undo()
        round_1 = {p: p.read_bytes() for p in out.glob("eval/**/round-1/ppl.json")}
        assert len(round_1) == 3 and not list(out.glob("eval/**/round-2/ppl.json"))
        parts = []
        real_evaluate = perplexity.evaluate_perplexity

        def counted(lm, stream, config, *args, **kwargs):
            parts.append(config.part)
            return real_evaluate(lm, stream, config, *args, **kwargs)

        monkeypatch.setattr(perplexity, "evaluate_perplexity", counted)
        assert main(_argv(raced / "base", out)) == 0
    finally:
        torch.set_num_threads(threads)
    # rope and yarn (the collapsed method stopped in round 1): kjv's span 0 (round 2), then
    # spans 1 and 2 of both domains (rounds 3 to 6)
    assert sorted(parts) == [0] * 2 + [1] * 4 + [2] * 4
    assert {p: p.read_bytes() for p in round_1} == round_1
    again, first = _record(out), _record(raced / "on")
    assert again.race == first.race and again.table == first.table


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--race", "maybe", "invalid choice: 'maybe' (choose from 'on', 'off')"),
        ("--spans", "0", "spans=0 is not allowed; it must be an integer >= 1"),
        ("--margin", "-0.01", "margin=-0.01 is not allowed; it must lie in [0, 1)"),
        ("--lengths", "32,96", "race=on is not allowed here: domain shakespeare is scored at"),
    ],
)
def test_bad_racing_input_is_one_line_and_exit_2_with_nothing_written(
    raced, tmp_path, capsys, option, value, says
):
    """An unknown --race value, zero rounds (spans), a negative margin, or lengths that do not
    come in spans of N tokens (racing's rounds): refused before anything runs."""
    out = tmp_path / "out"
    argv = _argv(raced / "base", out)
    at = argv.index(option) + 1 if option in argv else len(argv)
    argv = [*argv[:at], value, *argv[at + 1 :]] if option in argv else [*argv, option, value]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not out.exists() or not list(out.glob("**/*.json"))
