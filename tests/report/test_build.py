"""`ropekit report` on a run folder made by real tiny runs of every command that writes
results: every kind gets its section, numbers come from the JSON, figures are embedded (only
regular files inside the folder)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import torch

from ropekit.cli import main
from ropekit.report import build_report
from ropekit.report.sections import discover, fmt
from ropekit.results import result_kind, write_result


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """pretrain, extend (fixed and learned), eval ppl/passkey, analyze, schedules, and an
    experiment's results.json, all in one folder."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("run")
    base, ada = root / "base", root / "adarope"
    tiny = "--d-model 32 --layers 2 --heads 2"
    # One command per line, as a user would type them (tmp paths hold no spaces).
    commands = [
        f"pretrain --context 32 {tiny} --steps 3 --batch-size 4 --warmup 1 --out {base}",
        f"extend --model {base} --method yarn:factor=2 --target-length 64 --samples 2 "
        f"--out {root / 'yarn'}",
        f"extend --model {base} --method adarope:init=yarn,factor=2 --target-length 64 "
        f"--samples 2 --out {ada}",
        f"eval ppl --model {base} --lengths 32,64 --tokens 128 --out {base / 'ppl'}",
        f"eval ppl --model {base} --adapter {ada} --lengths 32,64 --tokens 128 --out {ada / 'ppl'}",
        f"eval passkey --model {base} --adapter {ada} --lengths 128 --samples 1 --depths 2 "
        f"--out {ada / 'passkey'}",
        f"analyze --model {base} --adapter {ada} --lengths 32,64 --windows 1 "
        f"--out {ada / 'analysis'}",
        f"schedules --head-dim 16 --out {root / 'schedules'}",
    ]
    try:
        for command in commands:
            assert main(command.split()) == 0, command
    finally:
        torch.set_num_threads(threads)
    # An experiment folder's results (the layout experiments/*/run.py writes).
    experiment = root / "experiment"
    experiment.mkdir()
    results = {
        "config": {"description": "two encodings at two lengths", "seeds": [0, 1]},
        "bits_per_byte": {
            "rope": {"32": {"mean": 2.5, "std": 0.01, "values": [2.49, 2.51]}},
            "nope": {"32": {"mean": 2.75, "std": 0.02, "values": [2.73, 2.77]}},
        },
        "unigram_bpb": 4.81,
        "runs": [{"encoding": "rope", "seed": 0, "final_loss": 1.7}],
    }
    write_result(experiment / "results.json", "experiment", results)
    return root


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_discover_finds_each_result_once_and_skips_non_results(run_dir):
    found = discover(run_dir)
    kinds = sorted(r.kind for r in found)
    assert kinds == sorted(
        [
            "pretrain",
            "extend",
            "extend",
            "perplexity",
            "perplexity",
            "tasks",
            "analysis",
            "schedules",
            "experiment",
        ]
    )
    # The passkey run's per-stage summaries and the training loops' summaries are parts of
    # those runs: their kinds are recorded, and the report has no section for them.
    stage = next(run_dir.glob("adarope/passkey/*/*/summary.json"))
    assert result_kind(stage) == "task-stage"
    assert result_kind(run_dir / "adarope" / "train" / "summary.json") == "train"


def test_discover_skips_a_demo_whose_config_breaks_its_own_checks(run_dir):
    """A demo.json with a factor the demo refuses (1: no extension) is a bad result file:
    discovery skips it as it skips any unreadable result, instead of stopping the report."""
    data = _json(Path(__file__).parents[1] / "demo_data" / "v2" / "quick" / "demo.json")
    data["config"]["factor"] = 1
    (run_dir / "demo").mkdir()
    (run_dir / "demo" / "demo.json").write_text(json.dumps(data))
    assert all(r.kind != "demo" for r in discover(run_dir))


def test_report_has_a_section_per_kind_with_numbers_from_the_json(run_dir, capsys):
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    md = (run_dir / "report.md").read_text()
    assert str(run_dir / "report.md") in out and str(run_dir / "report.html") in out
    for title in (
        "## Pretraining",
        "## Context extension",
        "## Perplexity and bits per byte vs length",
        "## Retrieval tasks",
        "## Head analysis",
        "## Experiment results",
        "## Frequency schedules",
    ):
        assert title in md
    assert "## Demo" not in md

    pretrain = _json(run_dir / "base" / "pretrain.json")
    assert f"| {fmt(pretrain['parameters'])} |" in md
    for run in ("base", "adarope"):
        ppl = _json(run_dir / run / "ppl" / "ppl.json")
        cells = " | ".join(fmt(r["bits_per_byte"]) for r in ppl["results"])
        assert f"| {run}/ppl | `{ppl['spec']}` | 128 | {cells} |" in md
    ada = _json(run_dir / "adarope" / "extend.json")
    assert f"`{ada['spec']}`" in md and fmt(ada["trainable"]["total"]) in md
    yarn_row = next(line for line in md.splitlines() if line.startswith("| yarn |"))
    assert "| 0 |" in yarn_row  # a fixed schedule trains nothing
    passkey = _json(run_dir / "adarope" / "passkey" / "summary.json")
    scored = passkey["tasks"]["passkey"]["scores"][0]  # 1 sample x 2 depths
    assert f"| passkey | {scored['n']} | - | {fmt(scored['score'], 2)} |" in md
    assert "2.500 ± 0.010" in md and "4.8100" in md  # the experiment's mean ± std and scalars
    assert "effective length E_2" in md  # the analysis summary


def test_html_embeds_every_figure_the_markdown_links(run_dir):
    assert main(["report", str(run_dir), "--title", "tiny runs"]) == 0
    md = (run_dir / "report.md").read_text()
    page = (run_dir / "report.html").read_text()
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert len(linked) >= 8  # ppl, passkey, analysis and schedule figures
    assert all((run_dir / p).is_file() for p in linked)
    assert page.count("data:image/png;base64,") == len(linked)
    assert "<h1>tiny runs</h1>" in page and "missing figure" not in page


def test_report_of_a_folder_without_results_is_one_error_line(tmp_path, capsys):
    (tmp_path / "notes.json").write_text("{}")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds no result JSON" in err
    assert not (tmp_path / "report.md").exists()


def test_a_linked_figure_in_a_run_folder_is_named_as_skipped_and_never_embedded(tmp_path):
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
    secret = b"\x89PNG\r\n\x1a\n" + b"from outside the run" * 4
    (tmp_path / "outside.png").write_bytes(secret)
    experiment = tmp_path / "run" / "experiment"
    experiment.mkdir(parents=True)
    results = {"config": {"description": "d"}, "bits_per_byte": {}, "runs": []}
    write_result(experiment / "results.json", "experiment", results)
    (experiment / "bpb.png").write_bytes(png)
    (experiment / "stolen.png").symlink_to(tmp_path / "outside.png")

    paths = build_report(tmp_path / "run")
    md, page = paths.markdown.read_text(), paths.html.read_text()
    assert "![experiment/bpb.png](experiment/bpb.png)" in md
    assert page.count("data:image/png;base64,") == 1
    assert base64.b64encode(png).decode() in page
    for text in (md, page):
        assert (
            "skipped figure experiment/stolen.png: experiment/stolen.png is a symbolic link" in text
        )
    assert "(experiment/stolen.png)" not in md
    assert base64.b64encode(secret).decode()[:40] not in page


def test_a_result_linked_from_outside_the_run_folder_is_not_read(tmp_path):
    from ropekit.report.sections import discover

    outside = tmp_path / "outside"
    write_result(outside / "results.json", "experiment", {"config": {"description": "x"}})
    run = tmp_path / "run"
    write_result(run / "results.json", "experiment", {"config": {"description": "mine"}})
    (run / "linked").mkdir()
    (run / "linked" / "results.json").symlink_to(outside / "results.json")
    assert [r.path.as_posix() for r in discover(run)] == ["results.json"]


def test_the_search_section_reads_a_committed_search_and_its_seeds(tmp_path):
    """experiments/smollm2_16k/search (format_version 2, read through its record): one row
    with the target, the forwards, the searched NLL and each seed's."""
    committed = Path(__file__).resolve().parents[2] / "experiments/smollm2_16k/search"
    data = json.loads((committed / "search.json").read_text())
    data["nll"] -= 0.01  # its best is the YaRN seed: apart, a column read from a seed shows
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "search.json").write_text(json.dumps(data))
    md = build_report(tmp_path).markdown.read_text()
    seeds = " | ".join(fmt(data["baselines"][name], 4) for name in sorted(data["baselines"]))
    row = (
        f"| search | {fmt(data['config']['target_length'])} | {fmt(data['forwards'])} | "
        f"{fmt(data['nll'], 4)} | {seeds} |"
    )
    assert row in md, md
