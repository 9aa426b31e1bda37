"""Stock vLLM's rule, without vLLM: the length it accepts per rope type and the tokenizer's cap;
dynamic NTK as vLLM computes it (static, plain RoPE by default, a cache of
max_position_embeddings rows). The same rules against the real vLLM: make test-serving."""

from __future__ import annotations

import torch

from ropekit.serve.engines import transformers_rope, vllm_max_length, vllm_rope


def test_vllm_lengths_follow_its_rule() -> None:
    base = {"max_position_embeddings": 8192, "hidden_size": 64, "num_attention_heads": 4}
    yarn = {**base, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}
    linear = {**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    assert vllm_max_length(yarn)[0] == 8192  # yarn: max_position_embeddings as it is
    assert vllm_max_length(linear)[0] == 16384  # linear: times the factor
    assert vllm_max_length(yarn, {"model_max_length": 4096})[0] == 4096  # the tokenizer caps


def test_vllm_dynamic_is_static_plain_rope_by_default() -> None:
    params = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    config = {
        "max_position_embeddings": 512,
        "head_dim": 64,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "rope_parameters": params,
    }
    plain = transformers_rope(
        {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, 1
    )
    for length in (100, 1024):
        view = vllm_rope(config, length)
        torch.testing.assert_close(view.inv_freq, plain.inv_freq, rtol=0, atol=0)
    assert any("cache holds 512" in n for n in vllm_rope(config, 1024).notes)
