"""`ropekit demo` end to end on toy settings, its base-model cache and its out-dir rules."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ropekit.cli import main
from ropekit.demo import METHODS, PRESETS, VERSION, DemoResult, check_data, claim_out_dir
from ropekit.report.sections import fmt
from ropekit.results import read_record
from ropekit.train.recipe import base_model_dir, prepare_base_model


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private ROPEKIT_CACHE, so tests never read or fill the user's cache."""
    path = tmp_path / "cache"
    monkeypatch.setenv("ROPEKIT_CACHE", str(path))
    return path


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_demo_quick_runs_end_to_end_and_caches_its_base_model(tmp_path, cache, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--tiny", "--out", str(out)]) == 0
    first = capsys.readouterr().out
    assert "training the base model" in first
    for stage in range(1, 6):
        assert f"[{stage}/5]" in first
    assert f"wrote {out / 'report.md'} and {out / 'report.html'}" in first

    assert _json(out / "demo.json")["format_version"] == VERSION
    demo = read_record(out / "demo.json", DemoResult)
    outcome = demo.finished()
    assert demo.status == "done" and demo.config == PRESETS["tiny"]
    assert [m.name for m in outcome.methods] == list(METHODS)
    assert Path(outcome.base.path).parent == cache / "demo"
    # The terminal table and the report have a row for every method...
    md = (out / "report.md").read_text()
    for name in METHODS:
        assert re.search(rf"^{re.escape(name)} +\d", first, re.M)
        assert f"| {name} |" in md
    # ...with the numbers of the run's own JSON files.
    for m in outcome.methods:
        ppl = _json(out / m.files.ppl)
        bpb = {r["length"]: r["bits_per_byte"] for r in ppl["results"]}
        assert m.bpb == bpb and sorted(bpb) == demo.config.lengths
        row = next(line for line in md.splitlines() if line.startswith(f"| {m.name} | "))
        for n in demo.config.lengths:
            assert f"| {fmt(bpb[n])} |" in row
    trained = {m.name: m.trainable for m in outcome.methods}
    assert trained["rope"] == trained["linear"] == trained["yarn"] == 0
    assert trained["adarope"] > trained["tuned-yarn"] > 0
    for figure in ("bpb_vs_length.png", "nll_vs_position.png", "retrieval_vs_length.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "analysis" / "analysis.json").is_file()
    assert (out / "analysis" / "influence.png").is_file()
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 10 and "missing figure" not in page

    # `ropekit report` rebuilds the same report from the folder.
    assert main(["report", str(out), "--title", "again"]) == 0
    rebuilt = (out / "report.md").read_text()
    assert rebuilt.startswith("# again\n")
    assert rebuilt.split("\n", 3)[3] == md.split("\n", 3)[3]  # all but title and timestamp

    # The next run finds the base model in the cache (a full second run redoes every other
    # stage, which the first run has already tested).
    lines: list[str] = []
    path, reused, seconds = prepare_base_model(PRESETS["tiny"].base, lines.append)
    assert reused and seconds == 0.0 and path == base_model_dir(PRESETS["tiny"].base)
    assert lines == [f"reusing the cached base model {path}"]


def test_demo_refuses_to_clobber_another_runs_folder(tmp_path, cache, capsys):
    out = tmp_path / "someone-else"
    out.mkdir()
    (out / "results.json").write_text("{}")
    assert main(["demo", "--tiny", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not from a previous `ropekit demo`" in err and "--overwrite" in err
    assert (out / "results.json").exists() and not cache.exists()


def test_claim_out_dir_rules(tmp_path):
    fresh = tmp_path / "fresh"
    assert claim_out_dir(fresh, overwrite=False) is False and fresh.is_dir()
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "demo.json").write_text(json.dumps({"kind": "demo"}))
    (demo / "stale.txt").write_text("x")
    assert claim_out_dir(demo, overwrite=False) is True and not any(demo.iterdir())
    old = tmp_path / "old"  # what the previous `make demo` (schedules only) left
    old.mkdir()
    (old / "schedules.json").write_text("{}")
    assert claim_out_dir(old, overwrite=False) is True
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("x")
    with pytest.raises(FileExistsError):
        claim_out_dir(other, overwrite=False)
    assert claim_out_dir(other, overwrite=True) is True and not any(other.iterdir())


def test_missing_corpus_names_make_setup(monkeypatch):
    from ropekit.data import CorpusNotInstalledError

    def not_installed(name, split="all"):
        raise CorpusNotInstalledError(f"corpus {name!r} is not installed")

    monkeypatch.setattr("ropekit.data.load_corpus", not_installed)
    with pytest.raises(FileNotFoundError, match="make setup"):
        check_data(PRESETS["tiny"])


@pytest.mark.parametrize(
    ("where", "change"),
    [
        ("base", {"context": 0}),
        ("demo", {"factor": 1}),
        ("demo", {"length_multiples": ()}),
        ("demo", {"influence_windows": 99}),
    ],
)
def test_bad_settings_raise(where, change):
    with pytest.raises(ValueError):
        if where == "base":
            dataclasses.replace(PRESETS["full"].base, **change)
        else:
            dataclasses.replace(PRESETS["full"], **change)
