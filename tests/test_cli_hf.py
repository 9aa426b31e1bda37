"""The CLI on a Hugging Face folder: a tiny random Llama with a BPE tokenizer trained here,
through eval ppl, extend (positional, with the adapter loaded back), analyze and export."""

from __future__ import annotations

import json

import pytest
import torch

from ropekit.cli import main
from ropekit.data import load_corpus


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("tiny-llama")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator([d.text for d in load_corpus("essays")[:2]], trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(
        folder
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


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
