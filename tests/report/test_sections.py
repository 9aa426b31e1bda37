"""The report's probes section: accuracies with their Wilson intervals read from the summaries
`ropekit.evals.probes` writes, per length and per needle distance, with the reach and the
figures beside them."""

from __future__ import annotations

import json

from ropekit.evals.probe_haystacks import ProbeConfig
from ropekit.evals.probes import run_probes
from ropekit.report import build_report
from ropekit.report.sections import discover

from ..evals.models import SuffixCopyLM


def test_probes_section_reads_every_interval_from_the_summaries(tmp_path):
    config = ProbeConfig((300, 400), needles=2, haystacks=2)
    for name, model in (("reads", SuffixCopyLM()), ("blind", SuffixCopyLM(window=16))):
        run_probes(
            model, config, tmp_path / name, tokenizer="bytes", spec=f"copy-{name}", progress=False
        )
    assert [r.kind for r in discover(tmp_path)] == ["probes", "probes"]  # stages are parts
    md = build_report(tmp_path).markdown.read_text()
    assert "## Retrieval probes (many per prefill, Wilson intervals)" in md
    for name in ("reads", "blind"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        cells = " | ".join(
            f"{e['accuracy']:.2f} [{e['low']:.2f}, {e['high']:.2f}]" for e in summary["by_length"]
        )
        assert f"| {name} | `copy-{name}` | niah_single_2 | 4 | 2 | {cells} |" in md
        reach = f"{summary['reach']['distance']:,} (>= 0.8)"
        bins = " | ".join(
            f"{e['accuracy']:.2f} [{e['low']:.2f}, {e['high']:.2f}]" for e in summary["by_distance"]
        )
        assert f"| {name} | `copy-{name}` | {reach} | {bins} |" in md
        assert f"({name}/accuracy_vs_distance.png)" in md
    assert "| reads | `copy-reads` | niah_single_2 | 4 | 2 | 1.00 [0.51, 1.00] |" in md
    assert "0.00 [0.00, 0.49]" in md  # the blind model: 0 of 4, Wilson's upper end


def test_perplexity_section_says_when_windows_came_from_single_documents(tmp_path):
    from ropekit.evals import PerplexityConfig, run_perplexity

    from ..evals.models import tiny_decoder

    config = PerplexityConfig((32, 64), n_tokens=128, single_documents=True)
    run_perplexity(tiny_decoder(), config, tmp_path / "docs", data="kjv", progress=False)
    run_perplexity(tiny_decoder(), PerplexityConfig((32, 64), 128), tmp_path / "joined")
    md = build_report(tmp_path).markdown.read_text()
    assert "docs: every window inside one held-out document (2 spans of 64 tokens in 2 " in md
    assert "joined: every window" not in md
