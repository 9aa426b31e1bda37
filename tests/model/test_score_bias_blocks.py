"""Score biases (ALiBi) outside autograd run attention in blocks of query rows, never building
the (H, T, S) bias; with autograd the bias is built once per forward and shared by the layers.
Both equal the one-call attention."""

from __future__ import annotations

import pytest
import torch

from ropekit.model import KVCache
from ropekit.model import decoder as decoder_module

from .tiny import random_ids, tiny_model


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of about head_dim rows, so a 40-token input runs as several blocks."""
    monkeypatch.setattr(decoder_module, "SCORE_BIAS_BLOCK", 1)


def _full(model, *args, **kwargs):
    """The reference: with autograd on, every layer gets the whole bias in one call."""
    with torch.enable_grad():
        return model(*args, **kwargs).logits.detach()


def _blocks(model, *args, **kwargs):
    with torch.no_grad():
        return model(*args, **kwargs).logits


def test_row_blocks_equal_one_call_causal_and_packed(small_blocks):
    model = tiny_model("alibi")
    ids = random_ids(2, 40)
    torch.testing.assert_close(_blocks(model, ids), _full(model, ids), rtol=1e-6, atol=1e-6)
    packed = torch.cat([torch.arange(13), torch.arange(20), torch.arange(7)])[None]
    torch.testing.assert_close(
        _blocks(model, ids, position_ids=packed),
        _full(model, ids, position_ids=packed),
        rtol=1e-6,
        atol=1e-6,
    )


def test_row_blocks_equal_one_call_after_a_cache(small_blocks):
    model = tiny_model("alibi")
    ids = random_ids(2, 40)
    expected = _full(model, ids)[:, 25:]
    cache = KVCache()
    with torch.no_grad():
        model(ids[:, :25], cache=cache)
        tail = model(ids[:, 25:], cache=cache).logits  # 15 queries over 40 keys, in blocks
    torch.testing.assert_close(tail, expected, rtol=1e-5, atol=1e-5)


def test_row_blocks_never_build_the_whole_bias(small_blocks):
    model = tiny_model("alibi")
    shapes = []
    score_bias = model.encoding.score_bias

    def spy(q_pos, k_pos, layer=0):
        out = score_bias(q_pos, k_pos, layer)
        shapes.append(tuple(out.shape))
        return out

    model.encoding.score_bias = spy
    with torch.no_grad():
        model(random_ids(1, 40))
    assert len(shapes) > model.config.n_layers  # several blocks per layer
    assert all(rows < 40 or keys < 40 for _, _, rows, keys in shapes)


def test_training_builds_the_bias_once_per_forward():
    model = tiny_model("alibi")
    calls = []
    score_bias = model.encoding.score_bias
    model.encoding.score_bias = lambda *a, **k: calls.append(1) or score_bias(*a, **k)
    ids = random_ids(2, 12)
    model(ids, labels=ids).loss.backward()
    assert len(calls) == 1
