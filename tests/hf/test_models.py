"""Model discovery and loading (fast: tiny local folders; the real install is in
test_smollm2.py, marked slow), and an install's temporary files on failure, SIGTERM, kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ropekit.hf import KNOWN_MODELS, cache_dir, list_models, load_model, model_dir, models
from ropekit.hf.models import find_source, resolve_model
from ropekit.outdir import OutDirLocked

from ..tiny import VOCAB, tiny_model

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


# ----------------------------------------------------------------------------- install cleanup
# `models install` in a child process whose conversion writes part of a model, says so, and
# then takes its time: the tests stop it there (the real conversion is test_smollm2.py's).
SLOW_INSTALL = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ropekit.hf import models

    def slow(known, source, dtype, folder):
        (folder / "model.safetensors").write_bytes(b"half a model")
        print("converting", flush=True)
        time.sleep(120)

    models.find_source = lambda name: Path(sys.argv[1])
    models._convert = slow
    models.install_model("smollm2-135m")
    """
)


def _temporary(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "models").glob(".smollm2-135m.*"))


@pytest.fixture
def cache(monkeypatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("ROPEKIT_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "fake.gguf"
    source.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "find_source", lambda name: source)
    return tmp_path / "cache"


def _fast_convert(known, source, dtype, folder):
    (folder / "config.json").write_text("{}")
    return 7


def _start_slow_install(cache: Path) -> subprocess.Popen:
    src = str(Path(__file__).parents[2] / "src")
    env = os.environ | {"PYTHONPATH": src, "ROPEKIT_CACHE": str(cache)}
    fake = cache.parent / "fake.gguf"
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_INSTALL, str(fake)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "converting"
    return child


def test_an_install_killed_outright_is_cleaned_up_by_the_next_one(cache, monkeypatch):
    child = _start_slow_install(cache)
    child.send_signal(signal.SIGKILL)
    child.wait()
    leftovers = _temporary(cache)
    assert any(name.endswith(".tmp") for name in leftovers)  # what kill -9 leaves

    monkeypatch.setattr(models, "_convert", _fast_convert)
    with pytest.warns(UserWarning, match=f"left by pid {child.pid}"):  # its lock, taken over
        out = models.install_model("smollm2-135m")
    assert _temporary(cache) == []
    assert json.loads((out / "ropekit_model.json").read_text())["parameters"] == 7


def test_sigterm_during_an_install_removes_its_temporary_folder(cache):
    child = _start_slow_install(cache)
    assert _temporary(cache)  # the folder (and the lock) exist while it runs
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
    assert _temporary(cache) == []


@pytest.mark.parametrize("error", [RuntimeError("conversion failed"), KeyboardInterrupt()])
def test_a_failed_or_interrupted_install_leaves_nothing(cache, monkeypatch, error):
    def failing(known, source, dtype, folder):
        (folder / "model.safetensors").write_bytes(b"half")
        raise error

    monkeypatch.setattr(models, "_convert", failing)
    with pytest.raises(type(error)):
        models.install_model("smollm2-135m")
    assert _temporary(cache) == [] and not models.is_installed("smollm2-135m")
    assert list((cache / "models").iterdir()) == []


def test_a_second_install_while_one_runs_fails_at_once_naming_it(cache, monkeypatch):
    child = _start_slow_install(cache)
    try:
        monkeypatch.setattr(models, "_convert", _fast_convert)
        with pytest.raises(
            OutDirLocked, match=rf"being installed by another process \(pid {child.pid}"
        ):
            models.install_model("smollm2-135m")
        assert any(name.endswith(".tmp") for name in _temporary(cache))  # its work is left alone
    finally:
        child.kill()
        child.wait()


# ----------------------------------------------------------------------------- bad configs
def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("family", "edit", "message"),
    [
        # a family the registry refuses, named with why (before any weight is read)
        ("llama", lambda c: c.update(model_type="deepseek_v3"), "multi-head latent attention"),
        # per-layer lists that do not cover the layers: the config class's, the registry's
        ("gemma3_text", lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
        ("smollm3", lambda c: c.update(no_rope_layers=[1]), "one 0/1 flag per layer"),
        (
            "gemma3_text",
            lambda c: c.update(layer_types=["full_attention", "weird"] * 2),
            "entries must",
        ),
    ],
)
def test_a_config_the_registry_cannot_take_is_one_line_exit_2_and_writes_nothing(
    family, edit, message, tmp_path: Path, capsys
) -> None:
    from ropekit.cli import main
    from tests.tiny import family_model

    family_model(family).save_pretrained(tmp_path / "model")
    _edit_config(tmp_path / "model", edit)
    out = tmp_path / "out"
    capsys.readouterr()  # save_pretrained's progress bar
    code = main(["export", "--model", str(tmp_path / "model"), "--spec", "linear:factor=2",
                 "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert "its config cannot be used" in err
    assert not out.exists()
