"""Cropping a KV cache back to a prefix through the Backbone: what follows equals what follows a
fresh prefill of that prefix, for ropekit's Decoder and for Hugging Face models (unpatched,
patched with static schedules, with dynamic ones and with distance remaps, whose keys are
cached unrotated beside their positions), past the original length.

Reference: a new cache filled with the same prefix in the same chunks. Cropping recomputes
nothing and the continuation runs the same operations on the same cached values, so the
logits agree to float32 noise (in practice exactly).
"""

from __future__ import annotations

import pytest
import torch

from ropekit.backbone import as_backbone
from ropekit.hf import patch, spec_from_config

from ..model.tiny import CONTEXT
from ..model.tiny import tiny_model as tiny_decoder
from ..tiny import L0, VOCAB, perturb
from ..tiny import tiny_model as tiny_hf

ATOL = 1e-5
DECODER_SPECS = [
    "rope",
    "alibi",
    "adarope:l_ref=4",
    "dynamic-ntk:factor=2",
    "longrope:factor=4,long_factor=[2],short_factor=[1.5]",
    "rerope:window=5,leaky=2",  # distance remaps: unrotated keys too, rotated per band
    "dca:chunk_size=6,local_size=2",
]
HF_SPECS = [
    None,  # unpatched: transformers' own RoPE and cache
    "own",  # patched with the spec equal to its own RoPE
    "yarn:factor=2",
    "adarope:init=yarn,factor=2",
    "dynamic-ntk:factor=2",
    "longrope:factor=2,long_factor=[1.5],short_factor=[1.2]",
    "self-extend:group=4,window=8",
    "string:shift=10,window=3",
]


def _decoder(spec: str):
    return as_backbone(tiny_decoder(spec, n_layers=2).eval())


def _hf(spec: str | None):
    model = tiny_hf("llama")
    if spec is not None:
        perturb(patch(model, spec_from_config(model.config) if spec == "own" else spec))
    return as_backbone(model)


def _ids(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _fill(backbone, ids: torch.Tensor, cache, chunk: int = 16):
    logits = None
    for start in range(0, ids.shape[1], chunk):
        logits = backbone.run(ids[:, start : start + chunk], cache, None, None, last_only=False)
    return logits


@torch.no_grad()
def _check_crop_equals_fresh_prefill(backbone, prefix_len: int, vocab: int) -> None:
    prefix = _ids(prefix_len, 1, vocab)
    first, second = _ids(7, 2, vocab), _ids(5, 3, vocab)
    cache = backbone.new_cache()
    _fill(backbone, prefix, cache)
    _fill(backbone, first, cache)  # a question and its answer after the prefix
    _fill(backbone, first[:, :3], cache)  # and a few generated tokens one chunk later
    assert backbone.cache_length(cache) == prefix_len + 10
    backbone.crop_cache(cache, prefix_len)
    assert backbone.cache_length(cache) == prefix_len
    after_crop = _fill(backbone, second, cache)

    fresh = backbone.new_cache()
    _fill(backbone, prefix, fresh)
    expected = _fill(backbone, second, fresh)
    torch.testing.assert_close(after_crop, expected, atol=ATOL, rtol=0)

    # Cropping into the prefix: the cache is that shorter prefix's.
    backbone.crop_cache(cache, prefix_len - 9)
    shorter = backbone.new_cache()
    _fill(backbone, prefix[:, : prefix_len - 9], shorter)
    torch.testing.assert_close(
        _fill(backbone, second, cache), _fill(backbone, second, shorter), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("spec", DECODER_SPECS)
def test_decoder_crop_then_continue_equals_a_fresh_prefill(spec):
    # 3x the original length: dynamic schedules change with every token after CONTEXT.
    _check_crop_equals_fresh_prefill(_decoder(spec), 3 * CONTEXT + 1, 256)


@pytest.mark.parametrize("spec", HF_SPECS)
def test_hf_crop_then_continue_equals_a_fresh_prefill(spec):
    _check_crop_equals_fresh_prefill(_hf(spec), L0 + 9, VOCAB)


@torch.no_grad()
def test_crop_to_zero_starts_over_at_position_zero():
    for backbone, vocab in ((_decoder("rope"), 256), (_hf("dynamic-ntk:factor=2"), VOCAB)):
        ids = _ids(12, 4, vocab)
        cache = backbone.new_cache()
        _fill(backbone, _ids(9, 5, vocab), cache)
        backbone.crop_cache(cache, 0)
        assert backbone.cache_length(cache) == 0
        torch.testing.assert_close(
            _fill(backbone, ids, cache), backbone.forward_logits(ids), atol=ATOL, rtol=0
        )


@pytest.mark.parametrize("length", [-1, 10, 2.0, True, None])
def test_crop_out_of_range_is_one_line_value_error(length):
    for backbone, vocab in ((_decoder("rope"), 256), (_hf(None), VOCAB)):
        cache = backbone.new_cache()
        _fill(backbone, _ids(9, 6, vocab), cache)
        with pytest.raises(ValueError, match=r"^length=.* is not allowed; allowed: an integer "):
            backbone.crop_cache(cache, length)
        assert backbone.cache_length(cache) == 9  # untouched


@torch.no_grad()
def test_a_windowed_model_crops_its_backbones_cache_and_refuses_a_full_sliding_one():
    """The backbone's cache keeps every layer whole, so a sliding-window model crops back to
    any prefix (the window is the mask's, and the continuation equals a fresh prefill past
    the window); a sliding-window cache of the model's own that dropped the prefix cannot."""
    from transformers import DynamicCache

    model = tiny_hf("mistral", sliding_window=8)
    backbone = as_backbone(model)
    _check_crop_equals_fresh_prefill(backbone, 20, VOCAB)
    cache = DynamicCache(config=model.config)  # sliding layers that drop their oldest keys
    _fill(backbone, _ids(12, 7, VOCAB), cache)
    with pytest.raises(ValueError, match="sliding window of 8 tokens"):
        backbone.crop_cache(cache, 4)
