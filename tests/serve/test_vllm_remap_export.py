"""Distance remaps exported for vLLM with ropekit's plugin (``export --format vllm``), checked on
tiny Llamas without vLLM: what the folder holds and says, the length it accepts (the remap's
reach), and what inspect and served_by make of it. vLLM itself serves these folders in
tests/serve/engines/test_vllm_remaps.py (``make test-serving``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ropekit.backbone import as_backbone
from ropekit.hf import ExportRefused, patch
from ropekit.serve.engines.vllm_ropekit import remap_reach
from ropekit.serve.exporting import export
from ropekit.serve.inspection import format_report, inspect_folder
from ropekit.serve.serving import served_by
from ropekit.serve.vllm_plugin import ARCHITECTURE, load_adapter_encoding
from tests.tiny import L0

REMAPS = (
    "rerope:window=8",
    "rerope:window=8,leaky=4",
    "self-extend:group=4,window=8",
    "self-extend:group=4,window=8,mode=llama.cpp",
    "dca:chunk_size=24,local_size=4",  # the authors' scale: follows the attended length
    "string:window=4",  # the authors' shift: follows the attended length
    "rerope:window=8,init=yarn,factor=2",  # on a YaRN base
)


@pytest.mark.parametrize("spec", REMAPS)
def test_a_remap_exports_for_the_plugin_with_its_base_schedule(
    spec: str, tmp_path: Path, tiny_llama
) -> None:
    model = tiny_llama()
    encoding = patch(model, spec)
    out = export(model, None, tmp_path / "v", format="vllm", max_length=4 * L0)
    config = json.loads((out / "config.json").read_text())
    record = json.loads((out / "ropekit_export.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    assert config["max_position_embeddings"] == 4 * L0 == record["target_length"]
    # What an engine without the plugin computes: the base schedule, as its own export says.
    base = tiny_llama()
    patch(base, encoding.inner.spec)
    plain = json.loads((export(base, None, tmp_path / "b") / "config.json").read_text())
    assert config["rope_parameters"] == plain["rope_parameters"]
    assert record["serve_with"] == {
        "engine": "vllm+ropekit", "recipe": "ropekit.serve.vllm_plugin",
        "command": record["serve_with"]["command"], "original_length": L0,
    }  # fmt: skip
    assert any("without the plugin" in note for note in record["notes"])
    # A remap that follows the attended length is served with each prompt in one step.
    whole = "--no-enable-chunked-prefill --no-enable-prefix-caching"
    assert (whole in record["serve_with"]["command"]) == encoding.dynamic, record["serve_with"]
    assert any(whole in note for note in record["notes"]) == encoding.dynamic, record["notes"]
    # The plugin rebuilds the very remap from the folder.
    loaded = load_adapter_encoding(out, model.config)
    assert loaded.remaps_distance and loaded.spec == encoding.spec


def test_remaps_without_a_reach_need_the_length_and_others_default_to_it(
    tmp_path: Path, tiny_llama
) -> None:
    model = tiny_llama()
    for spec in ("rerope:window=8", "dca:chunk_size=24,local_size=4", "string:window=4"):
        patch(model, spec)
        with pytest.raises(ExportRefused, match="max-length"):
            export(model, None, tmp_path / "none", format="vllm")
    encoding = patch(model, "self-extend:group=4,window=8")
    out = export(model, None, tmp_path / "se", format="vllm")
    reach = remap_reach(encoding, L0)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == reach


def test_inspect_and_served_by_name_the_plugin_for_a_remap(tmp_path: Path, tiny_llama) -> None:
    model = tiny_llama()
    patch(model, "rerope:window=8,leaky=4")
    report = inspect_folder(export(model, None, tmp_path / "v", format="vllm"))
    assert report["serve_with"]["engine"] == "vllm+ropekit"
    assert "vllm+ropekit" in report["views"][report["target_length"]]
    lines = format_report(report)
    assert "vllm+ropekit computes it in attention (ropekit.serve.vllm_plugin)" in lines[1]
    assert any("vllm+ropekit serves rerope" in line for line in lines), lines
    # Stock vLLM refuses the plugin's architecture (its registry), at every length checked.
    for n, row in report["views"].items():
        assert "RopekitLlamaForCausalLM is not supported" in row["vllm"]["error"], (n, row)
    refused = [d for d in report["disagreements"] if d["engine"] == "vllm"]
    assert refused and all("no stock engine computes" in d["fix"] for d in refused), refused
    served = served_by(as_backbone(model))
    assert {name for name, s in served.items() if s.exact} == {"vllm+ropekit"}


def test_a_remap_without_a_reach_is_served_at_a_given_target(tiny_llama) -> None:
    model = tiny_llama()
    patch(model, "rerope:window=8")
    assert "max-length" in served_by(as_backbone(model))["vllm+ropekit"].why
    served = served_by(as_backbone(model), target=4 * L0)
    assert {name for name, s in served.items() if s.exact} == {"vllm+ropekit"}
