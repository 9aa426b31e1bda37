"""analyze per layer type: only the layers the encoding rotates are captured and reported, each
with its index and type; a covered layer's numbers are those of the same layer analysed where
every layer is covered (the same model, so the same q and k reach it).

Tiny random models of tests/tiny.py: Gemma 3 (local, global, local, global; the family's recipe
extends the global layers), SmolLM3 (layer 3 is NoPE) and Llama (every layer)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ropekit.analysis import AnalysisConfig, AnalysisResult, analyze, analyze_windows
from ropekit.analysis.plots import write_figures
from ropekit.analysis.record import AnalysedLayer
from ropekit.backbone import as_backbone
from ropekit.hf import patch, unpatch
from ropekit.results import read_record

from ..tiny import VOCAB, family_model, perturb
from .tiny import tiny_decoder, tiny_llama, windows

FULL, SLIDING = "full_attention", "sliding_attention"
CONFIG = AnalysisConfig((16, 32), n_windows=2, influence=False, qk_pairs=64, max_distance=8)
# Gemma 3 with one base for both layer types, so one encoding may cover every layer.
ONE_BASE = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in (FULL, SLIDING)}


def _grid(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_the_backbone_names_the_layers_its_encoding_rotates_with_their_types() -> None:
    gemma = as_backbone(family_model("gemma3_text"))
    assert gemma.encoded_layers() == {1: FULL, 3: FULL}  # unpatched: what own_encoding covers
    patch(gemma.model, "yarn:factor=2,layers=local")
    assert gemma.encoded_layers() == {0: SLIDING, 2: SLIDING}
    patch(gemma.model, "yarn:factor=2")  # the family's recipe: global layers
    assert gemma.encoded_layers() == {1: FULL, 3: FULL}
    unpatch(gemma.model)
    smol = as_backbone(family_model("smollm3"))  # no_rope_layers [1, 1, 1, 0]
    patch(smol.model, "yarn:factor=2,layers=all")
    assert smol.encoded_layers() == {0: SLIDING, 1: FULL, 2: SLIDING}
    assert as_backbone(tiny_llama()).encoded_layers() == {0: FULL, 1: FULL}
    assert as_backbone(tiny_decoder(n_layers=3)).encoded_layers() == dict.fromkeys(range(3), FULL)


def test_gemma3_is_analysed_on_its_global_layers_as_where_every_layer_is_covered(
    tmp_path: Path,
) -> None:
    model = family_model("gemma3_text", rope_parameters=ONE_BASE)
    data = windows(2, 32, vocab=VOCAB)
    run = analyze(model, CONFIG, tmp_path, data=data, progress=False)
    result = run.result
    assert result.layers == (AnalysedLayer(1, FULL), AnalysedLayer(3, FULL))
    assert result.model.patched_for_analysis and result.model.n_layers == 4
    assert read_record(run.json, AnalysisResult).layers == result.layers
    assert run.lines()[1] == (
        "analysed layers (2 of 4, those the encoding rotates): L1 full_attention, L3 full_attention"
    )
    assert {h.layer for h in result.utilization.distance_profile.heads} <= {1, 3}

    patch(model, "rope:layers=all")
    with torch.no_grad():
        every = analyze_windows(model, as_backbone(model).encoding, data, CONFIG)
    assert [layer.index for layer in every.layers] == [0, 1, 2, 3]
    assert [layer.kind for layer in every.layers] == [SLIDING, FULL, SLIDING, FULL]
    rows = [1, 3]  # layers 1 and 3 of the all-layers analysis
    el, every_el = result.effective_length, every.effective_length
    for got, expected in (
        (el.window_mean, _grid(every_el.window_mean)[:, :, rows]),  # (n_b, n_L, L, H)
        (el.last_quarter, _grid(every_el.last_quarter)[:, :, rows]),
        (result.utilization.mean_abs, _grid(every.utilization.mean_abs)[rows]),  # (L, H, F)
        (
            result.schedule.effective_base.per_head,
            _grid(every.schedule.effective_base.per_head)[rows],
        ),
    ):
        assert torch.allclose(_grid(got), expected, rtol=1e-6, atol=0)


@torch.no_grad()
def test_smollm3_nope_layer_is_not_analysed_and_the_layers_before_it_match() -> None:
    nope = family_model("smollm3")  # layer 3 rotates nothing
    rotating = family_model("smollm3", no_rope_layers=[1, 1, 1, 1])  # the same weights
    weights = [m.state_dict() for m in (nope, rotating)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[1])
    data = windows(2, 32, vocab=VOCAB)
    results = []
    for model in (nope, rotating):
        patch(model, "yarn:factor=2,layers=all")
        results.append(analyze_windows(model, as_backbone(model).encoding, data, CONFIG))
    assert [layer.index for layer in results[0].layers] == [0, 1, 2]
    assert [layer.index for layer in results[1].layers] == [0, 1, 2, 3]
    # Layers 0..2 come before the NoPE layer: the same q and k, so the same numbers.
    e = [_grid(r.effective_length.window_mean) for r in results]  # (n_b, n_L, L, H)
    assert e[0].shape[2] == 3 and torch.allclose(e[0], e[1][:, :, :3], rtol=1e-6, atol=0)
    u = [_grid(r.utilization.mean_abs) for r in results]  # (L, H, F)
    assert torch.allclose(u[0], u[1][:3], rtol=1e-6, atol=0)


def test_a_model_whose_layers_all_rotate_nothing_is_refused_in_one_line(tmp_path: Path) -> None:
    model = family_model("smollm3", no_rope_layers=[0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"^model_type='smollm3': no layer of this model rotates$"):
        analyze(model, CONFIG, tmp_path, data=windows(2, 32, vocab=VOCAB), progress=False)
    assert not list(tmp_path.iterdir())  # nothing written


@torch.no_grad()
def test_adarope_influence_covers_the_analysed_layers_only() -> None:
    model = family_model("gemma3_text")
    perturb(
        patch(model, "adarope")
    )  # every layer's rows move, though layers 0 and 2 never read theirs
    config = dataclasses.replace(CONFIG, influence=True, influence_windows=1)
    result = analyze_windows(
        model, as_backbone(model).encoding, windows(2, 32, vocab=VOCAB), config
    )
    assert [layer.index for layer in result.layers] == [1, 3]
    for kind, section in result.influence.kinds().items():
        assert {unit.layer for unit in section.units} == {1, 3}, kind
        assert all(unit.computed for unit in section.units)


@torch.no_grad()
def test_figures_label_the_analysed_layers_by_index_and_type(monkeypatch, tmp_path: Path) -> None:
    model = family_model("gemma3_text")
    patch(model, "rope")  # the family's recipe: layers 1 and 3 (global)
    result = analyze_windows(
        model, as_backbone(model).encoding, windows(2, 32, vocab=VOCAB), CONFIG
    )
    texts: dict[str, list[str]] = {}

    def keep(fig, path: Path) -> Path:  # the figure's titles and tick labels instead of a PNG
        axes = fig.axes
        labels = [t.get_text() for ax in axes for t in ax.get_xticklabels() + ax.get_yticklabels()]
        texts[path.stem] = [ax.get_title() for ax in axes] + labels
        return path

    monkeypatch.setattr("ropekit.analysis.plots.save", keep)
    write_figures(result, tmp_path)
    labels = ["L1 full_attention", "L3 full_attention"]
    assert [t for t in texts["effective_length"] if t.startswith("layer")] == [
        "layer 1 (full_attention)",
        "layer 3 (full_attention)",
    ]
    assert all(label in texts["utilization"] for label in labels)
    assert all(label in texts["effective_base"] for label in labels)
    assert all(
        t.startswith(("layer 1 (full_attention)", "layer 3 (full_attention)"))
        for t in texts["distance_profile"]
        if t.startswith("layer")
    )
