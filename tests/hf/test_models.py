"""Model discovery and loading (fast: tiny local folders; the real install is in
test_smollm2.py, marked slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ropekit.hf import KNOWN_MODELS, cache_dir, list_models, load_model, model_dir
from ropekit.hf.models import find_source, resolve_model

from .tiny import VOCAB, tiny_model

# A model folder whose config points at code inside the folder (transformers' auto_map).
REMOTE_CONFIG = """
from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "ropekit-remote-test"
"""
REMOTE_MODEL = """
from transformers import LlamaForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig
"""


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROPEKIT_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    assert model_dir("smollm2-135m") == tmp_path / "models" / "smollm2-135m"
    monkeypatch.delenv("ROPEKIT_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "ropekit"


def test_the_smollm2_gguf_is_found_in_its_package() -> None:
    source = find_source("smollm2-135m")
    assert source.name == KNOWN_MODELS["smollm2-135m"].filename
    assert source.stat().st_size > 50_000_000


def test_unknown_and_uninstalled_names_say_what_to_do(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROPEKIT_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="ropekit models install smollm2-135m"):
        resolve_model("smollm2-135m")
    with pytest.raises(FileNotFoundError, match="neither a model folder nor a known model"):
        resolve_model("gpt-9")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_model(tmp_path)
    with pytest.raises(ValueError, match="unknown model"):
        find_source("gpt-9")
    assert list_models() == [
        {
            "name": "smollm2-135m",
            "summary": KNOWN_MODELS["smollm2-135m"].summary,
            "installed": False,
            "path": str(tmp_path / "models" / "smollm2-135m"),
        }
    ]


def test_load_model_opens_a_local_folder(tmp_path: Path) -> None:
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert not loaded.training
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_code_inside_a_folder_runs_only_when_trusted(tmp_path: Path) -> None:
    tiny_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(
        model_type="ropekit-remote-test",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        },
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (tmp_path / "modeling_remote.py").write_text(REMOTE_MODEL)
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(tmp_path)
    assert type(load_model(tmp_path, trust_remote_code=True)).__name__ == "RemoteForCausalLM"
