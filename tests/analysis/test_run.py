"""analyze end to end: the configuration, the one-forward-serves-every-length shortcut, and the
files it writes for a ropekit Decoder and a patched Hugging Face model."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from ropekit.analysis import (
    AnalysisConfig,
    AnalysisResult,
    AnalysisRun,
    Sections,
    analyze,
    analyze_windows,
)
from ropekit.analysis.record import Influence, InfluenceKind, InfluenceUnit
from ropekit.analysis.run import _profile_heads, held_out_windows
from ropekit.data import Document, encode_documents
from ropekit.data.tokenizers import ByteTokenizer
from ropekit.results import encode, read_record

from .tiny import LLAMA_VOCAB, perturb, tiny_decoder, tiny_llama, windows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"lengths": ()}, "lengths"),
        ({"lengths": (1, 8)}, "lengths"),
        ({"lengths": (8,), "betas": (2.0, 0.0)}, "beta"),
        ({"lengths": (8,), "n_windows": 0}, "n_windows"),
        ({"lengths": (8,), "n_windows": 2, "influence_windows": 3}, "influence_windows"),
        ({"lengths": (8,), "capture": "hooks"}, "capture"),
        ({"lengths": (8,), "target_length": 1}, "target_length"),
    ],
)
def test_bad_configuration_is_refused_by_field(options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        AnalysisConfig(**options)


def test_config_normalises_lengths_and_sizes_the_windows() -> None:
    config = AnalysisConfig(lengths=(64, 16, 32, 16), betas=(1, 2, math.inf), target_length=96)
    assert config.lengths == (16, 32, 64) and config.window_length == 96
    assert config.primary_beta == 1 and config.influence_length == 96


def _mean(result: Sections) -> torch.Tensor:
    return torch.tensor(
        result.effective_length.window_mean, dtype=torch.float64
    )  # (n_b, n_L, L, H)


@torch.no_grad()
def test_one_forward_at_the_longest_length_equals_a_forward_per_length() -> None:
    model = tiny_decoder()
    perturb(model.encoding)
    data = windows(3, 48)
    config = dict(n_windows=3, betas=(1.0, 2.0), influence=False, qk_pairs=64)
    together = analyze_windows(model, model.encoding, data, AnalysisConfig((12, 48), **config))
    alone = analyze_windows(model, model.encoding, data, AnalysisConfig((12,), **config))
    # Equal up to float32 noise: SDPA over 48 or 12 keys rounds layer 0's output differently,
    # and layer 1's q and k are made from it.
    assert torch.allclose(_mean(together)[:, 0], _mean(alone)[:, 0], rtol=1e-5)
    e = _mean(together)
    assert bool((e >= 1).all()) and bool((e[:, 1] <= 48).all())
    # E_1 >= E_2 for every head (monotone in beta), and the heads are not all uniform.
    assert bool((e[0] >= e[1] - 1e-9).all()) and float(e[1, 1].min()) < 0.8 * 24.5


@torch.no_grad()
def test_dynamic_schedules_run_each_length_on_its_own() -> None:
    model = tiny_decoder("dynamic-ntk:factor=4", n_kv_heads=4)
    data = windows(2, 64)
    config = dict(n_windows=2, influence=False, qk_pairs=32)
    both = analyze_windows(model, model.encoding, data, AnalysisConfig((16, 64), **config))
    short = analyze_windows(model, model.encoding, data, AnalysisConfig((16,), **config))
    assert both.effective_length.dynamic_schedule is True
    assert torch.allclose(_mean(both)[:, 0], _mean(short)[:, 0], rtol=1e-12)
    assert both.influence is None and "influence" in both.skipped


@torch.no_grad()
def test_non_rotary_encodings_get_effective_length_only() -> None:
    model = tiny_decoder("alibi")
    result = analyze_windows(
        model, model.encoding, windows(2, 32), AnalysisConfig((8, 32), n_windows=2)
    )
    assert result.utilization is None and result.schedule is None
    assert list(result.skipped) == ["utilization", "schedule", "influence"]
    assert _mean(result).shape == (1, 2, 2, 4)


def test_held_out_windows_are_seeded_non_overlapping_slots_of_the_stream() -> None:
    model = tiny_decoder()
    docs = [Document(f"d{i}", f"document {i}: " + "lorem ipsum dolor " * 20) for i in range(6)]
    stream = encode_documents(docs, ByteTokenizer())
    config = AnalysisConfig((32,), n_windows=5, seed=3)
    got, info = held_out_windows(model, None, stream, config)
    again, _ = held_out_windows(model, None, stream, config)
    assert torch.equal(got, again) and got.shape == (5, 32)
    assert len(set(info["starts"])) == 5 and all(s % 32 == 0 for s in info["starts"])
    for row, start in zip(got, info["starts"], strict=True):
        assert torch.equal(row, stream.ids[start : start + 32])
    with pytest.raises(ValueError, match="n_windows=500"):
        held_out_windows(model, None, stream, AnalysisConfig((32,), n_windows=500))
    with pytest.raises(ValueError, match="vocab_size=256"):
        held_out_windows(model, None, windows(2, 32) + 256, AnalysisConfig((32,), n_windows=2))


def test_a_data_spec_is_read_as_the_held_out_stream_of_the_models_tokenizer(monkeypatch) -> None:
    docs = [Document(f"d{i}", "held-out text " * 10) for i in range(4)]
    stream = encode_documents(docs, ByteTokenizer())
    asked: list[tuple] = []

    def fake_heldout_stream(data, tokenizer):
        asked.append((data, tokenizer))
        return stream

    monkeypatch.setattr("ropekit.analysis.run.heldout_stream", fake_heldout_stream)
    config = AnalysisConfig((16,), n_windows=3)
    got, info = held_out_windows(tiny_decoder(), None, "shakespeare", config)
    assert got.shape == (3, 16) and [(d, t.name) for d, t in asked] == [("shakespeare", "bytes")]
    assert info["source"] == "shakespeare" and info["tokenizer"] == "bytes"
    with pytest.raises(ValueError, match="tokenizer=None"):
        held_out_windows(tiny_llama(), None, "shakespeare", config)


def _strict_json(path: Path) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"{path} holds {name}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _check_outputs(run: AnalysisRun, out: Path, expected_figures: set[str]) -> dict:
    saved = _strict_json(out / "analysis.json")
    assert saved["format_version"] == 4
    # the file reads back as the record analyze returned (NaN compares unequal: via JSON)
    back = read_record(out / "analysis.json", AnalysisResult)
    assert json.dumps(encode(back)) == json.dumps(encode(run.result))
    assert run.json == out / "analysis.json" and run.reused is False
    assert saved["kind"] == "analysis"
    for key in ("spec", "layers", "seed", "config", "data", "model", "provenance"):
        assert key in saved
    assert {"command", "spec", "seed", "versions"} <= set(saved["meta"])
    assert {"torch", "transformers", "ropekit"} <= set(saved["meta"]["versions"])
    assert set(saved["figures"]) == expected_figures
    for name, file in saved["figures"].items():
        assert (out / file).read_bytes()[:8] == PNG_MAGIC
        assert run.figures[name] == out / file
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*"))  # atomic writes left nothing
    lines = run.lines()
    assert all(isinstance(line, str) and line for line in lines)
    assert lines[-1].startswith(f"wrote {out / 'analysis.json'} and {len(expected_figures)} ")
    return saved


ALL_FIGURES = {
    "effective_length",
    "utilization",
    "distance_profile",
    "effective_base",
    "dxi",
    "adascale",
    "influence",
}


def test_analyze_a_tiny_adarope_decoder_end_to_end(tmp_path: Path) -> None:
    model = tiny_decoder()
    perturb(model.encoding)
    model.train()
    config = AnalysisConfig(
        (16, 32, 48), n_windows=2, betas=(1.0, 2.0), seed=5, qk_pairs=128, max_distance=16
    )
    result = analyze(
        model,
        config,
        tmp_path,
        data=windows(4, 48),
        command="ropekit analyze --model tiny",
        progress=False,
    )
    assert model.training  # the caller's mode is restored
    saved = _check_outputs(result, tmp_path, ALL_FIGURES)
    assert saved["spec"] == "adarope:l_ref=16" and saved["seed"] == 5
    assert saved["meta"]["command"] == "ropekit analyze --model tiny"
    assert saved["capture"] == "probe"
    assert torch.tensor(saved["effective_length"]["window_mean"]).shape == (2, 3, 2, 4)
    util = saved["utilization"]
    assert torch.tensor(util["mean_abs"]).shape == (2, 4, 4) and util["pairing"] == "half"
    assert torch.tensor(util["distance_profile"]["heads"][0]["contribution"]).shape == (4, 16)
    influence = result.result.influence
    assert len(influence.freq.units) == 4 and len(influence.scale.units) == 8
    top = influence.freq.top
    assert [u.delta_nll for u in top] == sorted((u.delta_nll for u in top), reverse=True)
    assert any(u.delta_nll != 0 for u in influence.freq.units)
    # the most influential AdaFreq kv head's first query head has its distance profile drawn
    picked = [(h.layer, h.head) for h in result.result.utilization.distance_profile.heads]
    assert (top[0].layer, top[0].head * 2) in picked
    again = analyze(model, config, tmp_path, data=windows(4, 48), progress=False)
    assert again.reused and json.dumps(encode(again.result)) == json.dumps(encode(result.result))
    assert again.lines()[-1].startswith(f"found {tmp_path / 'analysis.json'}")


def test_analyze_a_patched_hugging_face_model_end_to_end(tmp_path: Path) -> None:
    from ropekit.hf import encoding_of, patch

    model = tiny_llama()
    perturb(patch(model, "adarope"))
    config = AnalysisConfig(
        (16, 32), n_windows=2, betas=(2.0, math.inf), influence_windows=1, qk_pairs=64,
        max_distance=8,
    )  # fmt: skip
    result = analyze(
        model, config, tmp_path, data=windows(2, 32, vocab=LLAMA_VOCAB), progress=False
    )
    saved = _check_outputs(result, tmp_path, ALL_FIGURES)
    assert saved["capture"] == "encoding" and saved["model"]["patched_for_analysis"] is False
    assert saved["model"]["class_name"] == "LlamaForCausalLM" and "class" not in saved["model"]
    assert saved["model"]["n_kv_heads"] == 2 and saved["influence"]["windows"] == 1
    assert saved["layers"] == [{"index": i, "kind": "full_attention"} for i in (0, 1)]
    assert saved["effective_length"]["betas"] == [2.0, "inf"]  # JSON has no infinity
    e2, e_inf = torch.tensor(saved["effective_length"]["window_mean"], dtype=torch.float64)
    assert bool((e_inf <= e2 + 1e-9).all())
    assert encoding_of(model) is not None and "rotate_q" not in encoding_of(model).__dict__


def test_the_profiled_heads_are_the_extremes_of_cov_and_a_reader_of_the_top_adafreq_head():
    cov = torch.tensor([[0.5, 2.0, 1.0, 1.0], [0.1, 1.0, 1.0, math.nan]])  # (L, H)
    unit = InfluenceUnit(layer=0, head=1, label="L0/K1", delta_nll=0.3, computed=True)
    top = InfluenceKind(units=(unit,), top=(unit,))
    influence = Influence(target_length=8, windows=1, baseline_nll=2.0, freq=top, scale=None)
    assert _profile_heads(cov, influence, group=2, layers=(0, 1)) == [
        (0, 1, "max CoV (concentrated)"),
        (1, 0, "min CoV (uniform)"),
        (0, 2, "top AdaFreq influence"),  # kv head 1's first query head
    ]
    assert (
        _profile_heads(cov, None, group=2, layers=(0, 1))
        == _profile_heads(cov, influence, group=2, layers=(0, 1))[:2]
    )
    shared = dataclasses.replace(unit, layer=None)  # a row shared by every layer: no one head
    no_one = dataclasses.replace(influence, freq=InfluenceKind(units=(shared,), top=(shared,)))
    assert len(_profile_heads(cov, no_one, group=2, layers=(0, 1))) == 2
    repeat = dataclasses.replace(unit, head=0)  # the max-CoV head's reader: listed once
    once = InfluenceKind(units=(repeat,), top=(repeat,))
    cov[0, 0] = 3.0
    assert (
        len(_profile_heads(cov, dataclasses.replace(influence, freq=once), group=2, layers=(0, 1)))
        == 2
    )
    # rows of cov are the analysed layers 1 and 3: picks name those; layer 0's top is not one
    assert _profile_heads(cov, influence, group=2, layers=(1, 3)) == [
        (1, 0, "max CoV (concentrated)"),
        (3, 0, "min CoV (uniform)"),
    ]
