"""refresh_comparison (``ropekit report DIR`` on a compare folder): a comparison written before
the per-engine verdict gets which engines serve each method and the verdict per engine, and
says it was amended; one that has them is left as written. A trained method is asked at a
seeded point 1% off its initialization. (Engines asked for real: tests/serve.)"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ropekit.compare import refresh
from ropekit.compare.record import CompareResult, EngineAnswer
from ropekit.compare.verdict import per_engine
from ropekit.encodings import build
from ropekit.results import read_record

# Experiment D's out-of-domain comparison as first committed (format version 2; its serving
# answers predate the vLLM plugin's remaps): see test_record.
COMMITTED = Path(__file__).resolve().parent / "data/ood_v2/compare.json"


def test_a_comparison_before_the_per_engine_verdict_gets_it_and_says_so(tmp_path, monkeypatch):
    committed = read_record(COMMITTED, CompareResult)
    raw = json.loads(COMMITTED.read_text())
    del raw["served"], raw["verdict"]["serving"], raw["meta"]["amended"]
    (tmp_path / "compare.json").write_text(json.dumps(raw))
    asked = []

    def served(config, methods):  # the engines' answers, as the committed run got them
        asked.append([m.label for m in methods])
        return committed.served

    monkeypatch.setattr(refresh, "_served", served)
    log = []
    md, html = refresh.refresh_comparison(tmp_path, log=log.append)
    assert asked == [[m.label for m in committed.methods]]
    assert "predates the per-engine verdict" in log[0]
    data = read_record(tmp_path / "compare.json", CompareResult)
    assert data.served == committed.served
    assert data.verdict.serving == per_engine(committed.verdict, committed.served)
    assert data.meta["amended"] == {
        "command": f"ropekit report {tmp_path}", "added": ["served", "verdict.serving"],
    }  # fmt: skip
    assert md.is_file() and html.is_file()


def test_a_comparison_that_has_the_per_engine_verdict_is_left_as_written(tmp_path, monkeypatch):
    (tmp_path / "compare.json").write_bytes(COMMITTED.read_bytes())
    monkeypatch.setattr(refresh, "_served", lambda *a: (_ for _ in ()).throw(AssertionError))
    md, _ = refresh.refresh_comparison(tmp_path, log=lambda line: None)
    assert (tmp_path / "compare.json").read_bytes() == COMMITTED.read_bytes()
    assert md == tmp_path / "report.md"


def test_a_trained_method_is_asked_one_percent_off_its_initialization_seeded():
    def moved():
        encoding = build("adarope:init=yarn,factor=2,original_length=16,share_heads=true",
                         n_heads=4, n_kv_heads=2, head_dim=8, n_layers=2)  # fmt: skip
        before = {n: p.detach().clone() for n, p in encoding.named_parameters()}
        refresh._move_off_initialization(encoding)
        return before, dict(encoding.named_parameters())

    before, after = moved()
    for name, p in after.items():
        step = (p.detach() - before[name]).abs().mean()
        scale = before[name].abs().mean().clamp_min(1.0)
        assert 0.002 * scale < step < 0.02 * scale, name  # about 1% (a standard normal's 0.8)
        assert p.shape == before[name].shape  # a shared parameter stays one parameter
    again = moved()[1]
    assert all(torch.equal(after[n], again[n]) for n in after)  # seeded


def test_asked_again_a_comparison_gets_this_versions_engine_answers(tmp_path, monkeypatch):
    """Experiment D's comparison ran before the vLLM plugin served remaps: its record says
    vllm+ropekit refuses Leaky ReRoPE. --engines asks again and redoes the per-engine verdict,
    its scores untouched."""
    committed = read_record(COMMITTED, CompareResult)
    (tmp_path / "compare.json").write_bytes(COMMITTED.read_bytes())
    now = {**committed.served, "leaky-rerope": {
        **committed.served["leaky-rerope"], "vllm+ropekit": EngineAnswer(True, "")}}  # fmt: skip
    monkeypatch.setattr(refresh, "_served", lambda config, methods: now)
    log = []
    refresh.refresh_comparison(tmp_path, engines=True, log=log.append)
    assert "asked again" in log[0]
    data = read_record(tmp_path / "compare.json", CompareResult)
    assert data.served == now and data.table == committed.table
    assert data.verdict.serving["vllm+ropekit"].method == committed.verdict.winner == "leaky-rerope"
    assert committed.verdict.serving["vllm+ropekit"].method != "leaky-rerope"
    amended = {"command": f"ropekit report {tmp_path} --engines"}
    assert data.meta["amended"] == {**amended, "replaced": ["served", "verdict.serving"]}
