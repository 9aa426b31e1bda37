"""The CLI on a Hugging Face folder: a tiny random Llama with a BPE tokenizer trained here,
through eval ppl, extend (positional, with the adapter loaded back), analyze and export."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ropekit.cli import main

from .tiny import llama_folder


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


def test_eval_in_bfloat16_records_its_dtype_and_is_never_reused_as_float32(hf_folder, tmp_path):
    """--dtype casts the weights (not the encoding's parameters); the result says so, a
    float32 rerun into the folder is refused naming the model, and the numbers differ from
    float32's by bf16 rounding, not more."""
    out = tmp_path / "ppl"
    args = ["eval", "ppl", "--model", str(hf_folder), "--lengths", "32,64", "--tokens", "128"]
    assert main([*args, "--dtype", "bfloat16", "--out", str(out)]) == 0
    bf16 = json.loads((out / "ppl.json").read_text())
    assert bf16["provenance"]["model"]["config"]["dtype"] == "torch.bfloat16"
    assert main([*args, "--out", str(out)]) == 2  # refused: made in another dtype
    assert main([*args, "--out", str(tmp_path / "f32")]) == 0
    f32 = json.loads((tmp_path / "f32" / "ppl.json").read_text())
    for a, b in zip(bf16["results"], f32["results"], strict=True):
        assert a["perplexity"] != b["perplexity"]
        assert abs(math.log(a["perplexity"] / b["perplexity"])) < 0.05


def test_cast_keeps_the_encodings_parameters_in_their_dtype(hf_folder):
    from ropekit.backbone import open_backbone

    backbone = open_backbone(hf_folder)
    backbone.set_encoding("adarope:init=yarn,factor=2")
    backbone.cast(torch.bfloat16)
    assert backbone.dtype == torch.bfloat16
    assert all(p.dtype == torch.float64 or p.dtype == torch.float32
               for p in backbone.positional_parameters().values())  # fmt: skip
    assert backbone.model.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, backbone.vocab_size, (1, 40))
    assert torch.isfinite(backbone.token_nll(ids, 16)).all()
    with pytest.raises(ValueError, match=r"dtype=torch\.int8 is not allowed; allowed: float32"):
        backbone.cast(torch.int8)


def test_extend_eval_and_export_follow_gemma3s_layer_types(tmp_path, capsys):
    """Gemma 3 (local layers on 10k, global on 1M): extend trains AdaRoPE on the global
    layers only (the family's recipe) and its adapter says so; eval loads it back; a yarn
    run exports rope_parameters per layer type, the local layers' kept."""
    from .tiny import bpe_tokenizer_folder, family_model

    folder = bpe_tokenizer_folder(tmp_path / "gemma3", vocab_size=300, essays=2)
    family_model(
        "gemma3_text", vocab_size=300, max_position_embeddings=64, pad_token_id=None,
        eos_token_id=0,
    ).save_pretrained(folder)  # fmt: skip
    model = ["--model", str(folder)]
    train = ["--target-length", "128", "--samples", "2", "--data", "essays"]
    ext = tmp_path / "ext"
    assert main(["extend", *model, "--method", "adarope:init=yarn,factor=2", *train,
                 "--out", str(ext)]) == 0  # fmt: skip
    meta = json.loads((ext / "adapter" / "adapter.json").read_text())
    assert meta["layers"] == [[1, "full_attention"], [3, "full_attention"]]
    assert main(["eval", "ppl", *model, "--adapter", str(ext), "--lengths", "128",
                 "--tokens", "128", "--out", str(tmp_path / "ppl")]) == 0  # fmt: skip
    yarn = tmp_path / "yarn"
    assert main(["extend", *model, "--method", "yarn:factor=2", "--target-length", "128",
                 "--out", str(yarn)]) == 0  # fmt: skip
    out = tmp_path / "exported"
    assert main(["export", *model, "--adapter", str(yarn / "adapter"), "--out", str(out)]) == 0
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope["full_attention"]["rope_type"] == "yarn"
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    # compare: a spec naming the local layers beside the recipe's default (the global ones)
    assert main(["compare", *model, "--target-length", "128",
                 "--methods", "yarn:factor=2,yarn:factor=2,layers=local", "--names", "g,l",
                 "--samples", "1", "--lrs", "0.01", "--eval-data", "shakespeare",
                 "--lengths", "64,128", "--spans", "1", "--probe-lengths", "128",
                 "--probe-needles", "1", "--probe-haystacks", "1",
                 "--probe-task", "kv1_shakespeare", "--race", "off",
                 "--out", str(tmp_path / "compare")]) == 0  # fmt: skip
    record = json.loads((tmp_path / "compare" / "compare.json").read_text())
    specs = {m["label"]: m["spec"] for m in record["methods"]}
    assert "layers" not in specs["g"] and specs["l"].endswith("layers=local")
    capsys.readouterr()
