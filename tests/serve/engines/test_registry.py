"""The engine registry (ropekit.serve.engines): one entry per engine, the export formats and
the CLI's choices derived from it, floors equal to what `make test-serving` measured, and the
plugin engine as inspect's reference for the folders written for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ropekit.cli import build_parser, main
from ropekit.hf import patch
from ropekit.serve.engines import ENGINES, FORMATS, Engine, engine, is_plugin_folder
from ropekit.serve.exporting import export
from ropekit.serve.inspection import format_report, inspect_folder, read_folder
from tests.tiny import perturb, tiny_model

SERVING = Path(__file__).parents[3] / "docs" / "serving" / "serving.json"


def test_every_engine_is_registered_once_with_its_export_format() -> None:
    assert list(ENGINES) == ["transformers", "vllm", "vllm+ropekit", "llama.cpp"]
    assert all(isinstance(e, Engine) and e.name == name for name, e in ENGINES.items())
    assert FORMATS == {
        "hf": ("transformers", "vllm"),
        "vllm": ("vllm+ropekit",),
        "gguf": ("llama.cpp",),
    }
    assert engine("llama.cpp") is ENGINES["llama.cpp"]
    with pytest.raises(ValueError, match=r"allowed: transformers, vllm, vllm\+ropekit, llama\.cpp"):
        engine("tgi")


def test_the_cli_offers_the_registrys_formats() -> None:
    export_parser = build_parser()._subparsers._group_actions[0].choices["export"]
    (fmt,) = [a for a in export_parser._actions if a.dest == "format"]
    assert tuple(fmt.choices) == tuple(FORMATS)
    for e in ENGINES.values():
        assert e.label in fmt.help  # each format says which engines serve it


def test_floors_are_what_the_serving_run_measured() -> None:
    measured = json.loads(SERVING.read_text())["tolerance"]
    runs = {
        "transformers": "transformers",
        "vllm": "vllm",
        "vllm+ropekit": "vllm",
        "llama.cpp": "llamacpp",
    }
    for name, e in ENGINES.items():
        assert {str(n): dict(f) for n, f in e.floor.items()} == measured[runs[name]], name


@pytest.fixture(scope="module")
def plugin_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_model("llama")
    perturb(patch(model, "adarope:init=yarn,factor=2"))  # per head, with AdaScale
    return export(model, None, tmp_path_factory.mktemp("x") / "plugin", format="vllm")


def test_a_plugin_folder_is_served_per_head_by_the_plugin_alone(plugin_folder: Path) -> None:
    folder = read_folder(plugin_folder)
    assert is_plugin_folder(folder)
    view = ENGINES["vllm+ropekit"].rope(folder, 256)
    layers, kv_heads = folder.hf_config.num_hidden_layers, folder.hf_config.num_key_value_heads
    assert view.per_head.shape[:2] == (layers, kv_heads)
    assert view.per_head.std(dim=(0, 1)).max() > 0  # really per head
    report = inspect_folder(plugin_folder)
    assert report["reference"] == "vllm+ropekit"
    plain = {d["engine"] for d in report["disagreements"] if "one shared schedule" in d["what"]}
    assert plain == {"transformers", "llama.cpp"}
    # stock vLLM does not open a plugin folder at all (its registry knows no such architecture)
    refusals = {d["engine"] for d in report["disagreements"] if d["what"].startswith("refuses")}
    assert refusals == {"vllm"}
    lines = "\n".join(format_report(report))
    assert "vllm+ropekit" in lines and "no disagreements" not in lines
    assert "nearest" in lines  # the export record's notes say what the folder approximates


def test_the_plugin_does_not_apply_to_a_plain_folder(tmp_path: Path) -> None:
    model = tiny_model("llama")
    perturb(
        patch(model, "adarope:init=yarn,factor=2,share_heads=true,share_layers=true"), scale=False
    )
    out = export(model, None, tmp_path / "hf")
    assert ENGINES["vllm+ropekit"].rope(read_folder(out), 256) is None
    report = inspect_folder(out)
    assert report["reference"] == "transformers"
    assert all("vllm+ropekit" not in row for row in report["views"].values())


def test_inspect_prints_the_plugin_row(plugin_folder: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(plugin_folder)]) == 0
    out = capsys.readouterr().out
    assert "vllm+ropekit" in out and "DISAGREES transformers" in out
