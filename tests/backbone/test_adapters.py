"""save_adapter / load_adapter: exact round trips, refusals that name the mismatch, corruption."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ropekit.backbone import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    as_backbone,
    load_adapter,
    read_adapter,
    save_adapter,
)
from ropekit.backbone.adapters import OTHER_WEIGHTS_ENV, add_lora, load_lora, save_lora
from ropekit.hf import encoding_of, patch

from ..tiny import VOCAB, perturb, tiny_model

IDS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    return model(IDS, use_cache=False).logits


@pytest.fixture
def trained(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    """A patched Llama with trained-looking AdaRoPE parameters, and its saved adapter."""
    model = tiny_model("llama")
    perturb(patch(model, "adarope:init=yarn,factor=2"))
    return model, save_adapter(model, tmp_path / "adapter")


def test_round_trip_reproduces_logits_exactly(trained, tiny_llama) -> None:
    model, folder = trained
    fresh = tiny_llama()  # same backbone, unpatched
    encoding = load_adapter(fresh, folder)
    assert encoding.spec == encoding_of(model).spec
    assert torch.equal(_logits(fresh), _logits(model))


def test_loading_into_a_model_patched_with_the_same_spec_replaces_its_values(
    trained, tiny_llama
) -> None:
    model, folder = trained
    other = tiny_llama()
    perturb(patch(other, "adarope:init=yarn,factor=2"), seed=9)
    assert not torch.equal(_logits(other), _logits(model))
    load_adapter(other, folder)
    assert torch.equal(_logits(other), _logits(model))


def test_adapter_holds_only_the_positional_parameters(trained) -> None:
    model, folder = trained
    assert sorted(p.name for p in folder.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    meta, tensors = read_adapter(folder)
    encoding = encoding_of(model)
    assert set(tensors) == {n for n, _ in encoding.named_parameters()}
    assert sum(t.numel() for t in tensors.values()) == sum(p.numel() for p in encoding.parameters())
    assert meta["fingerprint"] == {
        "architecture": "llama",
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "base": 10000.0,
        "original_length": 32,
    }
    assert meta["spec"] == encoding.spec


def test_frozen_parameters_are_saved_too(tmp_path: Path, tiny_llama) -> None:
    model = tiny_llama()
    perturb(patch(model, "adarope"))
    model.requires_grad_(False)  # an evaluation setup
    save_adapter(model, tmp_path)
    _, tensors = read_adapter(tmp_path)
    assert {"log_tau", "gamma"} <= set(tensors)


def test_fixed_schedule_adapter_carries_only_the_spec(tmp_path: Path) -> None:
    model = tiny_model("qwen3")
    patch(model, "yarn:factor=4")
    save_adapter(model, tmp_path)
    _, tensors = read_adapter(tmp_path)
    assert tensors == {}
    fresh = tiny_model("qwen3")
    load_adapter(fresh, tmp_path)
    assert torch.equal(_logits(fresh), _logits(model))


@pytest.mark.parametrize(
    ("arch", "overrides", "message"),
    [
        ("llama", {"num_key_value_heads": 4}, "n_kv_heads: expected 2, got 4"),
        ("llama", {"num_hidden_layers": 3}, "n_layers: expected 2, got 3"),
        ("qwen2", {}, "architecture: expected 'llama', got 'qwen2'"),
        ("llama", {"max_position_embeddings": 64}, "original_length: expected 32, got 64"),
    ],
)
def test_a_different_model_is_refused_naming_the_mismatch(
    trained, arch: str, overrides: dict, message: str
) -> None:
    _, folder = trained
    other = tiny_model(arch, **overrides)
    with pytest.raises(AdapterError, match=message):
        load_adapter(other, folder)
    assert encoding_of(other) is None


def test_a_different_base_is_refused(trained, tiny_llama) -> None:
    _, folder = trained
    other = tiny_llama({"rope_type": "default", "rope_theta": 5e5})
    with pytest.raises(AdapterError, match=r"base: expected 10000(\.0)?, got 500000\.0"):
        load_adapter(other, folder)


def test_corrupted_weights_are_reported(trained, tiny_llama) -> None:
    _, folder = trained
    weights = folder / ADAPTER_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(AdapterError, match="corrupted"):
        load_adapter(tiny_llama(), folder)


def test_unreadable_weights_with_a_matching_checksum_are_reported(trained, tiny_llama) -> None:
    _, folder = trained
    (folder / ADAPTER_WEIGHTS).write_bytes(b"not a safetensors file")
    meta = json.loads((folder / ADAPTER_CONFIG).read_text())
    meta["sha256"] = hashlib.sha256(b"not a safetensors file").hexdigest()
    meta.pop("meta_sha256")  # as a file written before the metadata checksum
    (folder / ADAPTER_CONFIG).write_text(json.dumps(meta))
    with pytest.raises(AdapterError, match="not a safetensors file"):
        load_adapter(tiny_llama(), folder)


def test_truncated_json_and_missing_files_are_reported(trained) -> None:
    _, folder = trained
    config = folder / ADAPTER_CONFIG
    config.write_text(config.read_text()[:50])
    with pytest.raises(AdapterError, match="not valid JSON"):
        read_adapter(folder)
    config.unlink()
    with pytest.raises(AdapterError, match="missing"):
        read_adapter(folder)


def test_weights_that_do_not_fit_the_spec_are_reported(trained, tiny_llama) -> None:
    _, folder = trained
    meta, tensors = read_adapter(folder)
    tensors["log_tau"] = torch.zeros(3, 3)
    data = safetensors.torch.save(tensors)
    (folder / ADAPTER_WEIGHTS).write_bytes(data)
    meta["sha256"] = hashlib.sha256(data).hexdigest()
    meta.pop("meta_sha256")  # as a file written before the metadata checksum
    (folder / ADAPTER_CONFIG).write_text(json.dumps(meta))
    with pytest.raises(AdapterError, match=r"log_tau has shape \(3, 3\)"):
        load_adapter(tiny_llama(), folder)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(spec=m["spec"].replace("factor=2", "factor=3")),
        lambda m: m["fingerprint"].update(n_layers=m["fingerprint"]["n_layers"] + 1),
    ],
    ids=["spec", "fingerprint"],
)
def test_an_edited_adapter_json_is_refused(trained, edit, tiny_llama) -> None:
    """The checksum covers the metadata, not only the weights: a spec edited from factor 2
    to 3 once loaded silently, as factor 3 with factor 2's trained parameters."""
    _, folder = trained
    meta = json.loads((folder / ADAPTER_CONFIG).read_text())
    edit(meta)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(meta))
    with pytest.raises(AdapterError, match="was edited after it was written"):
        load_adapter(tiny_llama(), folder)


def test_an_adapter_written_before_the_metadata_checksum_still_loads(trained, tiny_llama) -> None:
    model, folder = trained
    meta = json.loads((folder / ADAPTER_CONFIG).read_text())
    meta.pop("meta_sha256")
    (folder / ADAPTER_CONFIG).write_text(json.dumps(meta))
    fresh = tiny_llama()
    load_adapter(fresh, folder)
    assert torch.equal(_logits(fresh), _logits(model))


def test_saving_an_unpatched_model_is_refused(tmp_path: Path, tiny_llama) -> None:
    with pytest.raises(AdapterError, match="not patched"):
        save_adapter(tiny_llama(), tmp_path)


def _lora_run(tmp_path: Path, rank: int) -> tuple[torch.nn.Module, Path]:
    """A patched tiny Llama with LoRA of ``rank`` (trained-looking weights), saved as an
    extension run folder: adapter/ plus lora.safetensors and lora.json."""
    from ropekit.backbone import add_lora, as_backbone, save_lora

    model = tiny_model("llama")
    perturb(patch(model, "adarope:init=yarn,factor=2"))
    backbone = as_backbone(model)
    targets = add_lora(backbone, rank, 2 * rank)
    with torch.no_grad():
        for p in backbone.lora_parameters().values():
            p.normal_(0, 0.02, generator=torch.Generator().manual_seed(rank))
    run = tmp_path / f"run-r{rank}"
    save_adapter(model, run / "adapter")
    save_lora(backbone, run, rank, 2 * rank, targets)
    return model, run


def test_lora_weights_round_trip_and_are_checked(tmp_path: Path, tiny_llama) -> None:
    from ropekit.backbone import LORA_WEIGHTS

    model, run = _lora_run(tmp_path, rank=4)
    fresh = tiny_llama()
    load_adapter(fresh, run)
    assert torch.equal(_logits(fresh), _logits(model))  # positional + LoRA, exactly
    # Another run's LoRA file of another rank, swapped in: refused, not loaded.
    _, other = _lora_run(tmp_path, rank=2)
    swapped = tmp_path / "swapped"
    shutil.copytree(run, swapped)
    shutil.copy2(other / LORA_WEIGHTS, swapped / LORA_WEIGHTS)
    with pytest.raises(AdapterError, match="sha256"):
        load_adapter(tiny_llama(), swapped)
    # One flipped bit in the LoRA weights: refused.
    flipped = tmp_path / "flipped"
    shutil.copytree(run, flipped)
    data = bytearray((flipped / LORA_WEIGHTS).read_bytes())
    data[-3] ^= 0x10
    (flipped / LORA_WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(AdapterError, match="corrupted"):
        load_adapter(tiny_llama(), flipped)
    # LoRA weights without their lora.json: refused (nothing says what they are).
    bare = tmp_path / "bare"
    shutil.copytree(run, bare)
    (bare / "lora.json").unlink()
    with pytest.raises(AdapterError, match=r"lora\.json is missing"):
        load_adapter(tiny_llama(), bare)


def test_another_models_adapter_of_the_same_shape_is_refused(trained, tiny_llama) -> None:
    """The fingerprint is the shape; the weights sample names the model: an adapter made on
    one model and loaded onto another of the same shape once loaded silently."""
    _, folder = trained
    with pytest.raises(AdapterError, match="made for another model: its weights_sample"):
        load_adapter(tiny_llama(seed=1), folder)


def test_the_same_model_in_another_dtype_loads(trained, tiny_llama) -> None:
    _, folder = trained
    load_adapter(tiny_llama().to(torch.bfloat16), folder)


def test_another_models_adapter_loads_when_the_user_says_so(
    trained, monkeypatch, tiny_llama
) -> None:
    _, folder = trained
    monkeypatch.setenv(OTHER_WEIGHTS_ENV, "1")
    load_adapter(tiny_llama(seed=1), folder)


def test_another_models_lora_is_refused(tmp_path: Path, tiny_llama) -> None:
    model = tiny_llama()
    patch(model, "yarn:factor=2")
    backbone = as_backbone(model)
    targets = add_lora(backbone, 2, 4)
    save_lora(backbone, tmp_path, 2, 4, targets)
    other = as_backbone(tiny_llama(seed=1))
    with pytest.raises(AdapterError, match="made for another model"):
        load_lora(other, tmp_path)


@pytest.mark.parametrize("record", ['{"kind": "extend", "format_vers', "[1, 2]"])
def test_a_damaged_run_record_beside_good_weights_is_said(tmp_path: Path, tiny_llama, record):
    """The weights check themselves and load; a garbled extend.json beside them was once
    passed over in silence, though it means the run folder was damaged."""
    model, run = _lora_run(tmp_path, rank=2)
    (run / "extend.json").write_text(record)
    fresh = tiny_llama()
    with pytest.warns(UserWarning, match=r"extend\.json is damaged \(.*loaded without it"):
        load_adapter(fresh, run)
    assert torch.equal(_logits(fresh), _logits(model))
    (run / "extend.json").write_text('{"kind": "extend"}')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_adapter(tiny_llama(), run)


# ----------------------------------------------------------------------------- layer types
def test_an_adapter_records_its_layers_and_refuses_a_spec_that_covers_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OLMo 3 (local and global layers, one base): AdaRoPE by the family's default covers
    every layer and says so; if the default changed (a recipe of the global layers only), the
    same spec would cover half of them, and loading says so instead of applying half."""
    import dataclasses

    from ropekit.hf.archs import ARCHS

    from ..tiny import family_model

    model = family_model("olmo3")
    perturb(patch(model, "adarope:init=yarn,factor=2"))
    save_adapter(model, tmp_path / "a")
    meta = json.loads((tmp_path / "a" / "adapter.json").read_text())
    kinds = ["sliding_attention", "full_attention"] * 2
    assert meta["layers"] == [[i, kind] for i, kind in enumerate(kinds)]
    expected = _logits(model)
    fresh = family_model("olmo3")
    load_adapter(fresh, tmp_path / "a")
    assert torch.equal(_logits(fresh), expected)
    monkeypatch.setitem(ARCHS, "olmo3", dataclasses.replace(ARCHS["olmo3"], recipe=(kinds[1],)))
    with pytest.raises(AdapterError, match=r"trained on layers L0 sliding_attention.*covers L1"):
        load_adapter(family_model("olmo3"), tmp_path / "a")
