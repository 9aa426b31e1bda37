"""Size and cost of a decoder: parameter counts, FLOPs per token, model-FLOPs utilization.

Holds: count_parameters, matmul_parameters, flops_per_token, model_flops_utilization.
"""

from __future__ import annotations

from torch import nn

from .config import DecoderConfig


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of distinct parameters (a tied embedding/LM head counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def matmul_parameters(config: DecoderConfig) -> int:
    """N in the 6N rule: weights every token multiplies by.

    The block projections and the LM head (counted even when tied: the head is a matmul, the
    embedding a lookup). Norms, the embedding lookup and the encoding are left out: they are
    elementwise or lookups and cost O(d) per token, not O(d^2).
    """
    d, H, K, D = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
    per_layer = d * (H + 2 * K) * D + H * D * d + 3 * d * config.ffn_hidden
    return config.n_layers * per_layer + d * config.vocab_size


def flops_per_token(
    config: DecoderConfig,
    seq_len: int | None = None,
    *,
    training: bool = True,
    causal: bool = True,
) -> float:
    """FLOPs per token of one training step (forward + backward) or, with training=False,
    of one forward, at sequence length ``seq_len`` (default: the training context).

    Matmuls: 2N per token forward, 3x that with the backward (Kaplan et al. 2020): 6N.
    Attention: per layer, q.k and probs.v each take 2 (H D) FLOPs per visible key. A causal
    query at position t sees t + 1 keys, (T + 1)/2 on average, so training costs
    6 L H D (T + 1). ``causal=False`` counts every key, 12 L H D T: the PaLM / nanoGPT
    convention, which double-counts the masked half and inflates MFU.
    """
    T = config.context_length if seq_len is None else seq_len
    keys = (T + 1) / 2 if causal else T
    attention = 4 * config.n_layers * config.n_heads * config.head_dim * keys
    forward = 2 * matmul_parameters(config) + attention
    return 3 * forward if training else forward


def model_flops_utilization(
    tokens_per_second: float, flops_per_token: float, peak_flops_per_second: float
) -> float:
    """Achieved model FLOPs over the hardware peak (DESIGN.md: ~190 GFLOP/s fp32 here)."""
    return tokens_per_second * flops_per_token / peak_flops_per_second
