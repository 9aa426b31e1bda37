"""The KV cache: decoding token by token (or in chunks) equals a forward over the whole prefix,
for every encoding, dynamic ones past their original length included.

Dynamic schedules re-rotate every cached key at the current length, which makes each layer's
attention exact given its inputs; the inputs of layers above the first were computed at
earlier lengths (see ``ropekit.model.cache``). So their whole-model test runs one layer, and a
second test holds every layer of a deeper model to the full computation from the same inputs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ropekit.model import KVCache
from ropekit.model.decoder import Visibility

from .tiny import CONTEXT, DYNAMIC, FP32, SPECS, random_ids, tiny_model

T = 2 * CONTEXT + 3  # well past the original length: dynamic schedules change as it grows


def layers_for(name: str) -> int:
    return 1 if name in DYNAMIC else 2


@pytest.mark.parametrize("name", sorted(SPECS))
def test_token_by_token_equals_full_forward_of_each_prefix(name):
    model = tiny_model(SPECS[name], n_layers=layers_for(name))
    ids = random_ids(2, T)
    cache = KVCache()
    steps = [model(ids[:, t : t + 1], cache=cache).logits[:, 0] for t in range(T)]
    assert len(cache) == T
    for t, step in enumerate(steps):
        prefix = model(ids[:, : t + 1]).logits[:, -1]
        torch.testing.assert_close(step, prefix, **FP32, msg=f"{name} at position {t}")
    if name not in DYNAMIC:
        # A static encoding's logits at t do not depend on later tokens: one forward serves.
        torch.testing.assert_close(torch.stack(steps, dim=1), model(ids).logits, **FP32)


@pytest.mark.parametrize("name", ["rope", "alibi", "adarope", "dynamic-ntk", "learned"])
def test_chunked_prefill_and_decode_equal_full_forward(name):
    # Chunks of several tokens after a non-empty cache need the offset causal mask.
    model = tiny_model(SPECS[name], n_layers=layers_for(name))
    ids = random_ids(2, T)
    cache = KVCache()
    bounds = [0, 5, 6, 13, T]
    chunks = [model(ids[:, a:b], cache=cache).logits for a, b in itertools.pairwise(bounds)]
    torch.testing.assert_close(chunks[-1], model(ids).logits[:, bounds[-2] :], **FP32)
    if name not in DYNAMIC:
        torch.testing.assert_close(torch.cat(chunks, dim=1), model(ids).logits, **FP32)


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_dynamic_schedule_every_layer_attends_as_a_full_call(name):
    # Each attention of a 2-layer model, fed the same inputs token by token with a cache,
    # returns at every step what one call over the whole prefix returns: the cached keys are
    # rotated again at the current length, past the original one.
    model = tiny_model(SPECS[name], n_layers=2)
    x = torch.randn(2, T, model.config.d_model, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(T)[None]
    for block in model.blocks:
        cache = KVCache()
        for t in range(T):
            pos = positions[:, t : t + 1]
            keys = cache.append_positions(pos)
            step = block.attn(
                x[:, t : t + 1], model.encoding, pos, keys, Visibility(pos, keys, True), cache
            )
            prefix = positions[:, : t + 1]
            full = block.attn(
                x[:, : t + 1],
                model.encoding,
                prefix,
                prefix,
                Visibility(prefix, prefix, False),
                None,
            )
            torch.testing.assert_close(
                step, full[:, -1:], **FP32, msg=f"layer {block.attn.layer}, {t}"
            )


def test_default_positions_continue_after_offset_cached_positions():
    model = tiny_model("learned:max_length=64")  # absolute: a wrong position shows at once
    ids = random_ids(1, 12)
    positions = 30 + torch.arange(12)[None]
    cache = KVCache()
    model(ids[:, :7], position_ids=positions[:, :7], cache=cache)
    tail = model(ids[:, 7:], cache=cache).logits
    torch.testing.assert_close(cache.positions, positions)
    torch.testing.assert_close(tail, model(ids, position_ids=positions).logits[:, 7:], **FP32)


def test_packed_prompt_then_decoding_stays_in_the_last_document():
    model = tiny_model("alibi")
    ids = random_ids(1, 12)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    cache = KVCache()
    model(ids[:, :10], position_ids=positions[:, :10], cache=cache)
    last = model(ids[:, 10:], cache=cache).logits  # positions 5, 6 by default
    alone = model(ids[:, 5:]).logits[:, -2:]  # the second document by itself
    torch.testing.assert_close(last, alone, **FP32)


@pytest.mark.parametrize("name", ["rope", "dynamic-ntk"])
def test_cache_keeps_rotated_keys_only_for_static_encodings(name):
    model = tiny_model(SPECS[name])
    seen = {}
    model.blocks[0].attn.probe.register_forward_hook(lambda m, args, out: seen.update(k=out[1]))
    cache = KVCache()
    model(random_ids(1, 6), cache=cache)
    stored_rotated = torch.equal(cache.keys[0], seen["k"])
    assert stored_rotated == (name not in DYNAMIC)


def test_learned_encoding_stops_decoding_at_the_end_of_its_table():
    model = tiny_model("learned:max_length=10")
    cache = KVCache()
    model(random_ids(1, 10), cache=cache)
    with pytest.raises(ValueError, match="past the learned table"):
        model(random_ids(1, 1), cache=cache)


def test_batch_of_one_positions_broadcast_against_a_batch_cache():
    model = tiny_model("rope")
    ids = random_ids(3, 8)
    cache = KVCache()
    model(ids[:, :4], position_ids=torch.arange(4)[None], cache=cache)  # (1, T) positions
    tail = model(ids[:, 4:], position_ids=torch.arange(4, 8).expand(3, 4), cache=cache).logits
    assert cache.positions.shape == (3, 8)
    torch.testing.assert_close(tail, model(ids).logits[:, 4:], **FP32)
