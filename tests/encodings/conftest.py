"""Shared fixtures: one spec per rotary encoding, AdaRoPE variants with random parameters."""

from __future__ import annotations

import pytest
import torch

from ropekit.encodings import AdaRoPE, PositionEncoding, TunedYarn, build
from ropekit.encodings.temperature import Temperature

ROTARY_SPECS = [
    "rope",
    "rope:pairing=interleaved",
    "rope:fraction=0.5",
    "rope:fraction=0.25,pairing=interleaved",
    "linear:factor=4",
    "ntk:factor=4",
    "dynamic-ntk:factor=4,original_length=64",
    "yarn:factor=8,original_length=64",
    "yarn:factor=8,original_length=64,mscale=1,mscale_all_dim=0.707",
    "llama3:factor=8,original_length=64",
    "longrope:factor=4,original_length=64,long_factor=[3],short_factor=[1.5]",
    "adarope",
    "adarope:init=yarn,factor=8,original_length=64",
    "adarope:share_heads=true,share_layers=true,pairing=interleaved",
    "adarope:scale=false,fraction=0.5",
    "tuned-yarn:factor=8,original_length=64",
    "cope",
    "cope:clip=3,fraction=0.5",
    "hardclip:clip=3,pairing=interleaved",
    "harpe:factor=4",
    "temperature:rule=logn,l_ref=16",
    "temperature:rule=ssmax,learn=true,method=yarn,factor=8,original_length=64",
    "temperature:rule=llama4,method=harpe,factor=4,l_ref=16",
    "temperature:rule=logn,method=cope,l_ref=16,pairing=interleaved",
    "adarope-remap:remap=rerope,window=6,leaky=4,original_length=16",
]

SHAPE = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "n_layers": 3}


def perturb(encoding: PositionEncoding, seed: int = 0) -> PositionEncoding:
    """Move learnable encodings away from their initial values, so properties are tested on
    trained-looking parameters rather than on the base schedule in disguise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if isinstance(encoding, AdaRoPE):
            if encoding.config.freq:
                encoding.dxi.add_(0.3 * torch.randn(encoding.dxi.shape, generator=g))
            if encoding.config.scale:
                encoding.log_tau.add_(0.2 * torch.randn(encoding.log_tau.shape, generator=g))
                encoding.gamma.add_(0.5 * torch.rand(encoding.gamma.shape, generator=g))
        elif isinstance(encoding, Temperature) and encoding.config.learn:
            encoding.log_s.add_(0.3 * torch.randn(encoding.log_s.shape, generator=g))
        elif isinstance(encoding, TunedYarn):
            for p in encoding.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return encoding


@pytest.fixture(params=ROTARY_SPECS)
def rotary(request) -> PositionEncoding:
    return perturb(build(request.param, **SHAPE)).double()


def output_and_grads(fn, q, k, v, w) -> tuple:
    """fn(q, k, v) and the gradients of sum(out * w) for fresh leaf copies of q, k and v: what
    the attention tests compare between a kernel and its pairwise definition."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    (out * w).sum().backward()
    return (out.detach(), *(t.grad for t in leaves))
