"""The CLI on a Hugging Face folder: a tiny random Llama with a BPE tokenizer trained here,
through eval ppl, extend (positional, with the adapter loaded back), analyze and export."""

from __future__ import annotations

import json

import pytest
import torch

from ropekit.cli import main

from .hf.tiny import llama_folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    torch.set_num_threads(1)
    return llama_folder(tmp_path_factory.mktemp("tiny-llama"))


def test_eval_extend_analyze_export_on_a_hf_folder(hf_folder, tmp_path, capsys):
    model = ["--model", str(hf_folder)]
    assert (
        main(
            [
                "eval",
                "ppl",
                *model,
                "--lengths",
                "32,64",
                "--tokens",
                "128",
                "--out",
                str(tmp_path / "ppl"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "ppl" / "ppl.json").read_text())["metric"] == "perplexity"

    ext = tmp_path / "ext"
    assert (
        main(
            [
                "extend",
                *model,
                "--method",
                "adarope:init=yarn,factor=2",
                "--target-length",
                "128",
                "--samples",
                "2",
                "--data",
                "essays",
                "--out",
                str(ext),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # 2 layers x 2 kv heads x 4 pairs of AdaFreq + 2 layers x 4 heads x 2 of AdaScale
    assert "training 32 positional parameters; backbone frozen" in out
    assert (
        main(
            [
                "eval",
                "ppl",
                *model,
                "--adapter",
                str(ext),
                "--lengths",
                "128",
                "--tokens",
                "128",
                "--out",
                str(tmp_path / "ppl-ext"),
            ]
        )
        == 0
    )
    spec = json.loads((tmp_path / "ppl-ext" / "ppl.json").read_text())["spec"]
    assert spec.startswith("adarope:init=yarn,factor=2")

    assert (
        main(
            [
                "analyze",
                *model,
                "--adapter",
                str(ext),
                "--lengths",
                "32,64",
                "--windows",
                "1",
                "--no-influence",
                "--out",
                str(tmp_path / "analysis"),
            ]
        )
        == 0
    )
    assert (tmp_path / "analysis" / "analysis.json").exists()

    yarn = tmp_path / "yarn"
    assert (
        main(
            [
                "extend",
                *model,
                "--method",
                "yarn:factor=2",
                "--target-length",
                "128",
                "--out",
                str(yarn),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "export",
                *model,
                "--adapter",
                str(yarn / "adapter"),
                "--out",
                str(tmp_path / "exported"),
            ]
        )
        == 0
    )
    exported = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert exported["rope_parameters"]["rope_type"] == "yarn"
    assert exported["rope_parameters"]["factor"] == 2
