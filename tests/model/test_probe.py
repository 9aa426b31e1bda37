"""The analysis hook: forward hooks on ``attn.probe`` see what SDPA receives, per layer."""

from __future__ import annotations

import math

import pytest
import torch

from ropekit.model import KVCache, Probe

from .tiny import FP32, SPECS, random_ids, tiny_model


def capture(model):
    """Hook every probe; return the list the hooks fill with (layer, q, k, bias)."""
    seen = []
    for module in model.modules():
        if isinstance(module, Probe):
            module.register_forward_hook(
                lambda probe, args, out: seen.append((probe.layer, *out, args[2]))
            )
    return seen


@pytest.mark.parametrize("name", ["rope", "alibi", "adarope", "learned"])
def test_hooked_q_k_bias_reproduce_each_attention_output(name):
    # Recompute every layer's attention from what the probe saw and the values (from the
    # layer's own input): it must equal what the output projection receives.
    model = tiny_model(SPECS[name])
    seen = capture(model)
    inputs, attended = {}, {}
    for block in model.blocks:
        layer = block.attn.layer
        block.attn.qkv.register_forward_hook(
            lambda m, args, out, layer=layer: inputs.__setitem__(layer, out)
        )
        block.attn.proj.register_forward_pre_hook(
            lambda m, args, layer=layer: attended.__setitem__(layer, args[0])
        )
    B, T = 2, 9
    model(random_ids(B, T))
    H, K, D = model.config.n_heads, model.config.n_kv_heads, model.config.head_dim
    assert [layer for layer, *_ in seen] == list(range(model.config.n_layers))
    for layer, q, k, bias in seen:
        assert q.shape == (B, H, T, D) and k.shape == (B, K, T, D)
        assert (bias is not None) == (name == "alibi")
        v = inputs[layer][..., (H + K) * D :].view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)
        k, v = (t.repeat_interleave(H // K, dim=1) for t in (k, v))  # (B, H, T, D)
        logits = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, T, T)
        if bias is None:
            logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        else:
            assert torch.isinf(bias[..., 0, 1:]).all() and torch.isfinite(bias.tril()).all()
            logits = logits + bias
        y = (logits.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * D)
        torch.testing.assert_close(y, attended[layer], **FP32)


def test_hooked_queries_carry_the_adascale_temperature():
    # Rotation preserves norms, so the hooked q's norm over the projected q's norm is exactly
    # AdaScale's lambda_h(position + 1), which random parameters move away from 1.
    model = tiny_model("adarope:l_ref=2")
    seen = capture(model)
    projected = {}
    for block in model.blocks:
        block.attn.qkv.register_forward_hook(
            lambda m, args, out, layer=block.attn.layer: projected.__setitem__(layer, out)
        )
    positions = torch.arange(12)[None]
    model(random_ids(1, 12), position_ids=positions)
    H, D = model.config.n_heads, model.config.head_dim
    for layer, q, _, _ in seen:
        raw = projected[layer][..., : H * D].view(1, 12, H, D).transpose(1, 2)  # (1, H, T, D)
        scale = model.encoding.temperature(positions, layer)[..., 0]  # (1, H|1, T)
        assert not torch.allclose(scale, torch.ones_like(scale), atol=1e-2)
        torch.testing.assert_close(q.norm(dim=-1) / raw.norm(dim=-1), scale.expand(1, H, 12))


def test_hooks_see_all_cached_keys_and_may_intervene():
    model = tiny_model("rope")
    seen = capture(model)
    cache = KVCache()
    ids = random_ids(1, 6)
    model(ids[:, :5], cache=cache)
    model(ids[:, 5:], cache=cache)
    _, q, k, _ = seen[-1]
    assert q.shape[2] == 1 and k.shape[2] == 6  # one query, every key so far

    baseline = model(ids).logits
    handle = model.blocks[0].attn.probe.register_forward_hook(
        lambda probe, args, out: (torch.zeros_like(out[0]), out[1])  # uniform attention
    )
    assert not torch.allclose(model(ids).logits, baseline, atol=1e-3)
    handle.remove()
    torch.testing.assert_close(model(ids).logits, baseline, atol=0, rtol=0)
