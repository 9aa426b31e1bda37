"""Parameter counts and FLOPs per token against the model's own modules."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ropekit.model import (
    Decoder,
    DecoderConfig,
    count_parameters,
    flops_per_token,
    matmul_parameters,
    model_flops_utilization,
)

from .tiny import tiny_model


@st.composite
def configs(draw):
    n_kv = draw(st.sampled_from([1, 2]))
    n_heads = n_kv * draw(st.sampled_from([1, 2, 3]))
    return DecoderConfig(
        vocab_size=draw(st.integers(2, 300)),
        d_model=n_heads * 2 * draw(st.integers(1, 6)),
        n_layers=draw(st.integers(1, 3)),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        tie_embeddings=draw(st.booleans()),
        encoding=draw(st.sampled_from(["rope", "alibi", "nope"])),
    )


@settings(max_examples=25, deadline=None)
@given(configs())
def test_matmul_parameters_are_the_linear_weights_a_token_meets(config):
    model = Decoder(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert matmul_parameters(config) == linear  # the tied head counted as the matmul it is
    norms = (2 * config.n_layers + 1) * config.d_model
    embedding = config.vocab_size * config.d_model
    head = embedding if config.tie_embeddings else 0  # the tied head is the embedding
    assert count_parameters(model) == linear - head + embedding + norms


def test_count_parameters_counts_shared_tensors_once_and_filters_trainable():
    model = tiny_model("adarope")
    assert count_parameters(model) == sum(p.numel() for p in set(model.parameters()))
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.encoding.parameters():
        p.requires_grad_(True)
    n_encoding = sum(p.numel() for p in model.encoding.parameters())
    assert 0 < count_parameters(model, trainable_only=True) == n_encoding


def test_flops_per_token_follows_6n_plus_attention():
    config = DecoderConfig()
    n = matmul_parameters(config)
    L, width, T = config.n_layers, config.n_heads * config.head_dim, config.context_length
    assert flops_per_token(config) == 6 * n + 6 * L * width * (T + 1)
    assert flops_per_token(config, causal=False) == 6 * n + 12 * L * width * T  # PaLM/nanoGPT
    assert flops_per_token(config, 1024, training=False) == 2 * n + 2 * L * width * 1025
    assert model_flops_utilization(1000.0, 2e6, 4e9) == 0.5


def test_attention_term_matches_an_explicit_count_of_score_products():
    # Count q.k and p.v multiply-adds of one causal forward directly: 2 FLOPs each.
    config = DecoderConfig(d_model=64, n_heads=4, n_layers=2, context_length=10)
    T, width = config.context_length, config.n_heads * config.head_dim
    visible = torch.ones(T, T).tril().sum().item()  # query/key pairs under the causal mask
    attention = config.n_layers * 2 * (2 * width * visible) / T  # per token
    expected = 2 * matmul_parameters(config) + attention
    assert flops_per_token(config, training=False) == expected
