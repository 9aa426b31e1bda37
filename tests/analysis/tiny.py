"""Tiny models and data for the analysis tests.

Holds:
    tiny_decoder    a 2-layer ropekit Decoder (4 query heads over 2 kv heads, head dim 8),
                    initialised with a large std so attention is peaked, not uniform.
    tiny_llama      a 2-layer randomly initialised Hugging Face Llama (4 query heads over 2 kv
                    heads, head dim 16, vocabulary LLAMA_VOCAB), unpatched.
    perturb         moves AdaRoPE's parameters off init, like a trained adapter.
    windows         seeded random token windows (N, T).
    attention       the chunks of ``iter_log_attention`` joined into full weights (B, H, T, S).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ropekit.analysis.metrics import iter_log_attention
from ropekit.encodings import AdaRoPE
from ropekit.model import Decoder, DecoderConfig

VOCAB = 256  # byte-level
LLAMA_VOCAB = 97


def tiny_decoder(
    encoding: str = "adarope:l_ref=16",
    *,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_model: int = 32,
    seed: int = 0,
) -> Decoder:
    torch.manual_seed(seed)
    config = DecoderConfig(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        encoding=encoding,
        context_length=64,
        init_std=0.3,  # peaked attention, so heads differ and reverting a head shows
    )
    return Decoder(config).eval()


def tiny_llama(*, attn_implementation: str = "sdpa", seed: int = 0) -> nn.Module:
    """The shared tiny Llama (tests/tiny.py) with transformers' default special tokens."""
    from ..tiny import tiny_model  # transformers: a slow import, only where needed

    return tiny_model(
        "llama", seed=seed, attn_implementation=attn_implementation, pad_token_id=None,
        eos_token_id=2,
    )  # fmt: skip


def perturb(encoding: AdaRoPE, *, seed: int = 0) -> AdaRoPE:
    """Trained-looking AdaRoPE: dxi ~ N(0, 0.3), gamma ~ U(0, 0.4), log_tau ~ N(0, 0.2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        encoding.dxi.copy_(0.3 * torch.randn(encoding.dxi.shape, generator=g))
        encoding.gamma.copy_(0.4 * torch.rand(encoding.gamma.shape, generator=g))
        encoding.log_tau.copy_(0.2 * torch.randn(encoding.log_tau.shape, generator=g))
    return encoding


def windows(n: int, length: int, *, vocab: int = VOCAB, seed: int = 1) -> Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def attention(q: Tensor, k: Tensor, **kwargs) -> Tensor:
    """Attention weights (B, H, T, S) float64 from the chunks of ``iter_log_attention``, each
    padded with zeros for the keys its queries cannot see."""
    S = k.shape[2]
    rows = []
    for _, log_alpha in iter_log_attention(q, k, **kwargs):  # (B, H, Tc, S_c)
        alpha = log_alpha.double().exp()
        rows.append(torch.nn.functional.pad(alpha, (0, S - alpha.shape[-1])))
    return torch.cat(rows, dim=2)
