"""What ropekit.hf reads from a config: the architecture by model_type, the model's dims (head
dim and kv heads defaulted as transformers does), the RoPE settings a spec may omit, and the
decoder stack inside a causal LM."""

from __future__ import annotations

import pytest

from ropekit.hf.archs import (
    ARCHS,
    arch_for,
    base_model,
    model_dims,
    original_length,
    rope_context,
    rope_parameters,
)

from ..tiny import ARCH_NAMES, L0, tiny_config


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_each_architecture_is_chosen_by_its_model_type(arch):
    spec = arch_for(tiny_config(arch))
    assert spec.model_type == arch
    assert spec.attention_class().__name__ == spec.attention


def test_an_unsupported_model_type_is_refused_naming_the_supported_ones():
    config = tiny_config("llama")
    config.model_type = "gpt2"
    with pytest.raises(
        ValueError, match=f"model_type='gpt2'.*supported: {', '.join(sorted(ARCHS))}"
    ):
        arch_for(config)


def test_model_dims_default_head_dim_and_kv_heads_as_transformers_does():
    dims = model_dims(tiny_config("llama"))
    assert (dims.n_heads, dims.n_kv_heads, dims.head_dim, dims.n_layers, dims.d_model) == (
        4, 2, 16, 2, 64,
    )  # fmt: skip
    config = tiny_config("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=None)
    config.head_dim = None  # absent: hidden_size // heads
    dims = model_dims(config)
    assert (dims.n_heads, dims.n_kv_heads, dims.head_dim) == (3, 3, 16)


def test_rope_context_fills_base_original_length_fraction_and_pairing():
    plain = tiny_config("llama", {"rope_type": "default", "rope_theta": 5e5})
    assert rope_context(plain) == {
        "base": 5e5, "original_length": L0, "fraction": 1.0, "proportion": 1.0,
        "pairing": "half",
    }  # fmt: skip
    scaled = tiny_config(
        "llama",
        {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
         "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    assert original_length(scaled) == 16  # a scaled config's L0 is its original length
    assert rope_context(scaled)["fraction"] == 0.5


def test_rope_parameters_read_per_layer_type_settings_and_refuse_a_missing_theta():
    config = tiny_config("llama")
    config.rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert rope_parameters(config) == {"rope_type": "default", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="no settings for layer type 'sliding_attention'"):
        rope_parameters(config, "sliding_attention")
    config.rope_parameters = {"rope_type": "default"}
    with pytest.raises(ValueError, match="no rope_theta"):
        rope_parameters(config)


def test_base_model_is_the_decoder_stack_and_refuses_other_modules(tiny_llama):
    model = tiny_llama()
    assert base_model(model) is model.model
    with pytest.raises(ValueError, match="no decoder stack"):
        base_model(model.lm_head)
