"""The transformers engine's rule, held to transformers' own rope functions: every rope type at
two lengths, and dynamic NTK following the length."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ropekit.serve.engines import transformers_rope
from tests.tiny import tiny_config

from ..test_gguf_file import PARAMS


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p["rope_type"])
@pytest.mark.parametrize("length", [100, 4096])
def test_the_transformers_rule_is_transformers(params: dict, length: int) -> None:
    config = tiny_config(
        "llama", rope_parameters=dict(params), head_dim=64, max_position_embeddings=2048
    )
    ours = transformers_rope({**config.to_dict(), "rope_parameters": params}, length)
    if params["rope_type"] == "default":
        theirs, af = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs, af = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=length)
    # transformers forms inv_freq in float32; ropekit's float64 agrees to float32 rounding.
    torch.testing.assert_close(ours.inv_freq.float(), theirs, rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(af, rel=1e-6)


def test_dynamic_rule_follows_the_length_like_transformers() -> None:
    params = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    config = tiny_config("llama", rope_parameters=params, head_dim=64, max_position_embeddings=512)
    for length in (256, 512, 1024, 4096):
        ours = transformers_rope({**config.to_dict(), "rope_parameters": params}, length)
        theirs, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=length)
        torch.testing.assert_close(ours.inv_freq.float(), theirs, rtol=1e-6, atol=0)
