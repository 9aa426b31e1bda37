"""export: plain transformers reloads the folder and computes the patched model's logits.

Reloads use ``AutoModelForCausalLM.from_pretrained`` with nothing from ropekit; fp32
tolerance as in tests/hf/test_patching.py (transformers forms angles in float32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

from ropekit.backbone import load_adapter, save_adapter
from ropekit.hf import ExportRefused, encoding_of, patch
from ropekit.serve.exporting import EXPORT_RECORD, export
from ropekit.serve.inspection import inspect_folder
from tests.tiny import VOCAB, perturb, tiny_model

ATOL = 1e-5


def _ids(length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def _logits(model, length: int) -> torch.Tensor:
    return model(_ids(length), use_cache=False).logits


def _reload(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()


def _assert_serves_like(model, folder: Path, lengths=(24, 56)) -> None:
    for length in lengths:
        # A fresh load per length: transformers' dynamic/longrope frequencies remember the
        # longest sequence a model has seen.
        torch.testing.assert_close(
            _logits(_reload(folder), length), _logits(model, length), atol=ATOL, rtol=0
        )


STATIC_SPECS = [
    "rope:base=500000",
    "linear:factor=4",
    "ntk:factor=4",
    "dynamic-ntk:factor=4",
    "yarn:factor=4",
    "yarn:factor=4,attention_factor=1.3,beta_fast=16,beta_slow=2,truncate=false",
    "yarn:factor=4,mscale=1,mscale_all_dim=0.707",
    "llama3:factor=4,low_freq_factor=1,high_freq_factor=4",
    "longrope:factor=4,short_factor=[1.1],long_factor=[1,1.2,1.5,2,2.5,3,3.5,4]",
]


@pytest.mark.parametrize("spec", STATIC_SPECS)
def test_fixed_schedules_export_to_transformers_rope_types(
    spec: str, tmp_path: Path, tiny_llama
) -> None:
    model = tiny_llama()
    patch(model, spec)
    out = export(model, None, tmp_path / "out")
    _assert_serves_like(model, out)
    record = json.loads((out / EXPORT_RECORD).read_text())
    assert record["spec"] == encoding_of(model).spec
    weights = safetensors.torch.load_file(out / "model.safetensors")
    assert not any("ropekit" in k for k in weights)


def test_export_writes_rope_parameters_by_name(tmp_path: Path) -> None:
    model = tiny_model("qwen2")
    patch(model, "ntk:factor=4")
    config = json.loads((export(model, None, tmp_path / "o") / "config.json").read_text())
    # NTK is plain RoPE at base * s^(d/(d-2)) (bloc97 2023): d = 16, s = 4.
    assert config["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": pytest.approx(10000.0 * 4 ** (16 / 14), rel=1e-12),
    }
    patch(model, "dynamic-ntk:factor=2,original_length=16")
    config = json.loads((export(model, None, tmp_path / "d") / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "dynamic"
    assert config["max_position_embeddings"] == 16  # transformers' dynamic measures against it


# --------------------------------------------------------------------------- learned schedules
SHARED = "adarope:init=yarn,factor=2,share_heads=true,share_layers=true"


@pytest.mark.parametrize(
    ("spec", "scale"),
    [
        (SHARED.replace("share_heads", "scale=false,share_heads"), True),  # no AdaScale
        (SHARED, False),  # AdaScale at its identity
        ("adarope:init=linear,factor=2", False),  # per-head parameters, all still equal
    ],
)
def test_shared_learned_frequencies_export_as_longrope(
    spec: str, scale: bool, tmp_path: Path, tiny_llama
) -> None:
    model = tiny_llama()
    encoding = patch(model, spec)
    if encoding.config.share_heads:
        perturb(encoding, scale=scale)
    out = export(model, None, tmp_path / "out")
    params = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert params["rope_type"] == "longrope"
    assert params["short_factor"] == params["long_factor"]
    _assert_serves_like(model, out)


def test_a_constant_adascale_temperature_folds_into_the_attention_factor(tmp_path: Path) -> None:
    model = tiny_model("mistral")
    encoding = patch(model, SHARED)
    perturb(encoding, scale=False)
    with torch.no_grad():
        encoding.log_tau.fill_(-0.4)  # tau = e^-0.4: logits x 1.49 at every length; gamma = 0
    out = export(model, None, tmp_path / "out")
    assert any("folded" in note for note in json.loads((out / EXPORT_RECORD).read_text())["notes"])
    _assert_serves_like(model, out)


def test_a_length_dependent_temperature_is_refused_or_frozen_on_request(
    tmp_path: Path, tiny_llama
) -> None:
    model = tiny_llama()
    encoding = patch(model, SHARED)
    perturb(encoding)  # gamma > 0
    with pytest.raises(ExportRefused, match="grows with the query position"):
        export(model, None, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    out = export(model, None, tmp_path / "frozen", temperature_at=64)
    notes = json.loads((out / EXPORT_RECORD).read_text())["notes"]
    assert any(note.startswith("approximate") for note in notes)


def test_per_head_frequencies_are_refused_with_the_reason(tmp_path: Path, tiny_llama) -> None:
    model = tiny_llama()
    perturb(patch(model, "adarope:init=yarn,factor=2"))
    with pytest.raises(ExportRefused, match="differ across") as info:
        export(model, None, tmp_path / "out")
    message = str(info.value)
    assert "one frequency per rotary pair" in message
    assert "share_heads=true,share_layers=true" in message


def test_per_head_temperatures_are_refused(tmp_path: Path, tiny_llama) -> None:
    model = tiny_llama()
    encoding = patch(model, "adarope:freq=false")
    with torch.no_grad():
        encoding.log_tau.copy_(
            torch.linspace(-0.3, 0.3, encoding.log_tau.numel()).view_as(encoding.log_tau)
        )
    with pytest.raises(ExportRefused, match="differ across heads or layers"):
        export(model, None, tmp_path / "out")


def test_tuned_yarn_exports_exactly(tmp_path: Path) -> None:
    model = tiny_model("qwen3")
    perturb(patch(model, "tuned-yarn:factor=4"))
    _assert_serves_like(model, export(model, None, tmp_path / "out"))


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("rope:pairing=interleaved", "rotate_half"),
        ("rope:fraction=0.5", r"rotates 16 \(partial_rotary_factor=1\)"),
        ("nope", "only rotary encodings export"),
        ("mixed:method=yarn,factor=2", "no rope_type does both"),  # was an AttributeError
        ("rerope", "remaps query-key distances"),
        # Self-Extend has one route, llama.cpp through the recipe: the HF export names it
        ("self-extend:mode=llama.cpp,group=4,window=8", "--format gguf"),
    ],
)
def test_what_llama_attention_cannot_compute_is_refused(
    spec: str, why: str, tmp_path: Path, tiny_llama
) -> None:
    model = tiny_llama()
    patch(model, spec)
    with pytest.raises(ExportRefused, match=why):
        export(model, None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("format", ["hf", "vllm", "gguf"])
@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("cope", "no transformers rope_type computes 'cope'"),
        ("hardclip", "no transformers rope_type computes 'hardclip'"),
        ("harpe:factor=2", "no transformers rope_type computes 'harpe'"),
        ("temperature:rule=logn", "a factor that follows its position"),
        ("temperature:rule=llama4,method=rerope,leaky=4,window=8", "scales queries of its own"),
        ("adarope-remap:remap=rerope,leaky=4,window=8", "scales queries of its own"),
    ],
)
def test_the_issue_58_encodings_are_refused_in_one_line(
    spec: str, why: str, format: str, tmp_path: Path, tiny_llama
) -> None:
    """No rope type computes CoPE's taper, per-head bases or a position-dependent query
    temperature; a remap whose queries carry learned or fixed factors of their own is not
    served by the plugin (was: an AttributeError on the plugin's path)."""
    model = tiny_llama()
    patch(model, spec)
    with pytest.raises(ExportRefused) as info:
        export(model, None, tmp_path / "out", format=format)
    message = str(info.value)
    assert "\n" not in message and (why in message or "only Self-Extend" in message)
    assert not (tmp_path / "out").exists()


def test_export_from_a_folder_and_an_adapter(tmp_path: Path, tiny_llama) -> None:
    model = tiny_llama()
    model.save_pretrained(tmp_path / "base")
    perturb(patch(model, SHARED.replace("share_heads", "scale=false,share_heads")))
    adapter = save_adapter(model, tmp_path / "adapter")
    out = export(tmp_path / "base", adapter, tmp_path / "out")
    _assert_serves_like(model, out)
    with pytest.raises(FileExistsError, match="overwrite"):
        export(tmp_path / "base", adapter, tmp_path / "out")
    export(tmp_path / "base", adapter, tmp_path / "out", overwrite=True)
    fresh = tiny_llama()
    load_adapter(fresh, adapter)
    _assert_serves_like(fresh, out, lengths=(40,))


# --------------------------------------------------------------------------- length fields
@pytest.mark.parametrize(
    ("spec", "max_pos", "extra"),
    [
        # vLLM takes yarn/llama3/longrope lengths from max_position_embeddings unscaled ...
        ("yarn:factor=4", 4 * 32, {}),
        ("llama3:factor=4", 4 * 32, {}),
        ("longrope:factor=4,short_factor=[1.1],long_factor=[1.1],attention_factor=1.2", 128, {}),
        ("ntk:factor=4", 4 * 32, {}),
        # ... and multiplies the others by the factor; dynamic must stay at L0 for transformers.
        ("linear:factor=4", 32, {}),
        ("dynamic-ntk:factor=4", 32, {}),
        ("rope", 32, {}),
    ],
)
def test_exports_set_the_length_vllm_reads(
    spec: str, max_pos: int, extra, tmp_path, tiny_llama
) -> None:
    from ropekit.serve.engines import vllm_max_length

    model = tiny_llama()
    patch(model, spec)
    out = export(model, None, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == max_pos
    target = json.loads((out / EXPORT_RECORD).read_text())["target_length"]
    assert target == (32 if spec == "rope" else 128)
    assert vllm_max_length(config)[0] >= target
    _assert_serves_like(model, out)  # and transformers still computes the patched model


def test_longrope_exports_carry_vllms_mscales(tmp_path: Path, tiny_llama) -> None:
    model = tiny_llama()
    perturb(patch(model, SHARED.replace("share_heads", "scale=false,share_heads")))
    params = json.loads((export(model, None, tmp_path / "o") / "config.json").read_text())[
        "rope_parameters"
    ]
    # vLLM's longrope reads only short_mscale/long_mscale (get_rope), never attention_factor.
    assert params["short_mscale"] == params["long_mscale"] == params["attention_factor"]
    # transformers warns about those keys on every load: the folder says why, where users read.
    for text in (
        (tmp_path / "o" / EXPORT_RECORD).read_text(),
        (tmp_path / "o" / "README.md").read_text(),
    ):
        assert "Unrecognized keys" in text and "vLLM's" in text


def test_every_export_folder_says_what_serves_it(tmp_path: Path, tiny_llama) -> None:
    model = tiny_llama()
    perturb(patch(model, "adarope:init=yarn,factor=2"))
    plugin = (export(model, None, tmp_path / "v", format="vllm") / "README.md").read_text()
    assert "vllm+ropekit" in plugin and "Without the plugin" in plugin
    assert "nearest shared schedule" in plugin and "largest move is" in plugin  # by how much
    # What stock vLLM does with it (vLLM 0.32's registry: unknown architecture) and the way out.
    assert "stock vLLM refuses this folder" in plugin and "without an error" not in plugin
    assert "`--nearest`" in plugin
    report = inspect_folder(tmp_path / "v")
    stock = report["views"][report["target_length"]]["vllm"]
    assert "not supported" in stock["error"] and stock["max_length"] is None, stock
    fixes = [d["fix"] for d in report["disagreements"] if d["engine"] == "vllm"]
    assert fixes and all("--nearest" in fix for fix in fixes), report["disagreements"]
    patch(model, "self-extend:group=4,window=8")
    remap = (export(model, None, tmp_path / "se", format="vllm") / "README.md").read_text()
    assert "No stock engine computes the remap" in remap and "`--nearest`" not in remap
    patch(model, "yarn:factor=2")
    for fmt, engines in (("hf", "transformers, vllm"), ("gguf", "llama.cpp")):
        readme = (export(model, None, tmp_path / fmt, format=fmt) / "README.md").read_text()
        assert f"`--format {fmt}` for {engines}" in readme and "Without the plugin" not in readme


def test_max_length_and_the_tokenizer_cap(tmp_path: Path, tiny_llama) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
        model_max_length=32,
    )
    model = tiny_llama()
    patch(model, "yarn:factor=4")
    out = export(model, None, tmp_path / "o", tokenizer=tokenizer, max_length=100)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 100
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert saved["model_max_length"] == 100  # vLLM caps its length at the tokenizer's
    with pytest.raises(ValueError, match="format='onnx' is not allowed"):
        export(model, None, tmp_path / "x", format="onnx")


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("self-extend:group=4,window=8", "mode=llama.cpp"),  # the paper's sliding window
        ("self-extend:mode=llama.cpp,group=4,window=8,init=yarn,factor=2", "build_rope_shift"),
        ("string", "only Self-Extend"),
    ],
)
def test_gguf_refuses_remaps_llamacpp_cannot_serve(
    spec: str, why: str, tmp_path: Path, tiny_llama
) -> None:
    model = tiny_llama()
    patch(model, spec)
    with pytest.raises(ExportRefused, match=why):
        export(model, None, tmp_path / "out", format="gguf")
