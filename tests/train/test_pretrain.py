"""pretrain: a decoder trained from scratch on a corpus at its context length; the model folder
reloads as the trained weights, and pretrain.json records what was trained and how fast (the
MFU against this machine's measured matmul throughput)."""

from __future__ import annotations

import json

import pytest
import torch

from ropekit.model import Decoder, DecoderConfig
from ropekit.train import TrainConfig
from ropekit.train.pretrain import measure_matmul_flops, pretrain


def test_pretrain_writes_the_trained_model_and_what_it_trained(tmp_path):
    config = DecoderConfig(d_model=16, n_layers=1, n_heads=2, context_length=16, encoding="alibi")
    train = TrainConfig(out_dir=tmp_path / "elsewhere", steps=2, batch_size=2, warmup_steps=1,
                        checkpoint_interval=2, log_interval=1)  # fmt: skip
    result = pretrain(tmp_path, model=config, train_config=train, command="ropekit pretrain")
    assert result.model_dir == tmp_path / "model"
    # out_dir wins over the train config's: metrics and checkpoints go beside the model.
    assert (tmp_path / "metrics.jsonl").is_file() and not (tmp_path / "elsewhere").exists()
    trained = Decoder.load(result.model_dir)
    assert trained.config == config and trained.encoding.spec == "alibi"
    summary = json.loads(result.summary.read_text())
    assert summary["kind"] == "pretrain" and summary["meta"]["command"] == "ropekit pretrain"
    # The training loop's own summary records the command it was given, not this process's.
    trained_by = json.loads(result.train.summary.read_text())["meta"]["command"]
    assert trained_by == "ropekit pretrain"
    assert (summary["steps"], summary["data"], summary["encoding"]) == (2, "shakespeare", "alibi")
    assert summary["tokens"] == 2 * 2 * 16 == result.train.tokens
    fpt, peak = summary["flops_per_token"], summary["matmul_flops_per_s"]
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * fpt / peak)
    assert summary["final_loss"] == pytest.approx(result.train.final_loss)


def test_matmul_throughput_is_positive_and_finite():
    torch.manual_seed(0)
    assert 0 < measure_matmul_flops(n=64, repeats=2) < float("inf")
