"""Distance remaps and the mixed window in the reference decoder: cached decoding (greedy
tokens and logits) equals full forwards, the cache keeps unrotated keys, and the remaps are
really in effect at these lengths."""

from __future__ import annotations

import pytest
import torch

from ropekit.model import KVCache

from .test_generate import reference_greedy
from .tiny import FP32, REMAPS, SPECS, random_ids, tiny_model

T = 21  # past every tiny remap's window (4-6 tokens) and the mixed window (8)


@pytest.mark.parametrize("name", sorted(REMAPS))
def test_generate_equals_argmax_of_full_forwards(name):
    model = tiny_model(SPECS[name], n_layers=2).double()
    prompt = random_ids(2, 5)
    out = model.generate(prompt, max_new_tokens=16)
    torch.testing.assert_close(out, reference_greedy(model, prompt, 16), atol=0, rtol=0)


@pytest.mark.parametrize("name", sorted(REMAPS))
def test_chunked_prefill_and_decoding_equal_a_full_forward(name):
    model = tiny_model(SPECS[name])
    ids = random_ids(2, T)
    full = model(ids).logits
    cache = KVCache()
    chunks = [model(ids[:, a:b], cache=cache).logits for a, b in ((0, 7), (7, 8), (8, 15), (15, T))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, **FP32)
    # Offset rows: positions far from 0 decode like a prefix at those positions.
    offset = torch.arange(T)[None] + torch.tensor([[0], [100]])
    cache = KVCache()
    steps = [
        model(ids[:, t : t + 1], position_ids=offset[:, t : t + 1], cache=cache).logits
        for t in range(T)
    ]
    torch.testing.assert_close(torch.cat(steps, 1), model(ids, position_ids=offset).logits, **FP32)


@pytest.mark.parametrize("name", sorted(REMAPS))
def test_the_cache_keeps_unrotated_keys(name):
    model = tiny_model(SPECS[name])
    projected = {}
    attn = model.blocks[0].attn
    attn.qkv.register_forward_hook(lambda m, args, out: projected.update(qkv=out))
    cache = KVCache()
    model(random_ids(1, 6), cache=cache)
    H, K, D = model.config.n_heads, model.config.n_kv_heads, model.config.head_dim
    k = projected["qkv"][..., H * D : (H + K) * D].view(1, 6, K, D).transpose(1, 2)
    assert torch.equal(cache.keys[0], k)


# What a remap is inside its window, where it is not plain RoPE: its learned rotation.
INSIDE = {"adarope-remap": "adarope:l_ref=4"}


@pytest.mark.parametrize("name", sorted(REMAPS))
def test_remaps_are_in_effect_past_their_windows_and_absent_inside(name):
    """(The tiny specs are the positional variants, scale=none: the authors' DCA and STRING
    scales change every logit, inside the window too.)"""
    model = tiny_model(SPECS[name])
    plain = tiny_model(INSIDE.get(name, "rope"))
    plain.load_state_dict(model.state_dict())
    ids = random_ids(1, T)
    with torch.no_grad():
        short = 4  # within every tiny window: the remap is the identity
        torch.testing.assert_close(
            model(ids[:, :short]).logits, plain(ids[:, :short]).logits, **FP32
        )
        assert (model(ids).logits - plain(ids).logits).abs().max() > 1e-2


def test_mixed_window_is_plain_rope_inside_and_its_method_beyond():
    mixed = tiny_model(SPECS["mixed"])  # context 8
    inner = tiny_model("adarope:init=yarn,factor=4")
    plain = tiny_model("rope")
    for target in (inner, plain):
        target.load_state_dict(
            {k: v for k, v in mixed.state_dict().items() if not k.startswith("encoding.")},
            strict=False,
        )
    inner.encoding.load_state_dict(mixed.encoding.schedule_encoding.state_dict())
    ids = random_ids(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(mixed(ids[:, :8]).logits, plain(ids[:, :8]).logits, **FP32)
        torch.testing.assert_close(mixed(ids).logits, inner(ids).logits, **FP32)
        assert (mixed(ids).logits - plain(ids).logits).abs().max() > 1e-2
