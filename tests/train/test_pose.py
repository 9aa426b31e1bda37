"""Cheap long-position training: PoSE in extend's config, and activation checkpointing (same
gradients, fewer saved activations) on ropekit's decoder and a Hugging Face Llama, plus the
transformers packed-sequence trap that PoSE batches must avoid. (PoSE's samples themselves:
tests/data/test_pose.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from ropekit.backbone import as_backbone
from ropekit.hf import patch
from ropekit.train.extend import ExtendConfig
from ropekit.train.loss import backbone_loss, causal_lm_loss
from tests.model.tiny import random_ids
from tests.model.tiny import tiny_model as tiny_decoder
from tests.tiny import perturb
from tests.tiny import tiny_model as tiny_hf


def test_extend_config_validates_the_pose_fields():
    assert ExtendConfig("adarope", 128, pose=True).pose_window is None
    assert ExtendConfig("adarope", 128, pose=True, pose_window=128).pose_window == 128
    with pytest.raises(ValueError, match=r"pose_window=1 .* integer >= 2"):
        ExtendConfig("adarope", 128, pose=True, pose_window=1)
    with pytest.raises(ValueError, match=r"pose_window=200 .* <= target_length=128"):
        ExtendConfig("adarope", 128, pose=True, pose_window=200)
    with pytest.raises(ValueError, match="only with pose=True"):
        ExtendConfig("adarope", 128, pose_window=32)
    with pytest.raises(ValueError, match="retrieval_ratio"):
        ExtendConfig("adarope", 128, pose=True, retrieval_ratio=0.5)


# ----------------------------------------------------------------------------- checkpointing
def _grads(model, loss_of) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_of(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _saved_bytes(model, loss_of) -> int:
    """Bytes of distinct tensors autograd keeps for the backward outside checkpointed regions
    (inside them torch's own hooks keep nothing; the block inputs a checkpoint holds are
    counted below by the caller)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model)
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("spec", ["adarope:l_ref=4", "rope", "alibi"])
def test_decoder_checkpointing_gives_the_same_gradients_and_keeps_fewer_activations(spec):
    model = tiny_decoder(spec).train()
    ids = random_ids(2, 48)
    positions = torch.cat((torch.arange(20), torch.arange(100, 128)))[None]  # a PoSE jump

    def loss_of(m):
        return causal_lm_loss(m, {"input_ids": ids, "labels": ids, "position_ids": positions})[0]

    plain = _grads(model, loss_of)
    plain_bytes = _saved_bytes(model, loss_of)
    model.gradient_checkpointing_enable()
    checkpointed = _grads(model, loss_of)
    kept_bytes = _saved_bytes(model, loss_of)
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    # Plus one (B, T, d) block input per layer, held by each checkpoint.
    block_inputs = model.config.n_layers * ids.numel() * model.config.d_model * 4
    print(f"\n{spec}: saved activations {plain_bytes:,} B -> {kept_bytes + block_inputs:,} B")
    assert kept_bytes + block_inputs < 0.5 * plain_bytes
    model.gradient_checkpointing_disable()
    assert _saved_bytes(model, loss_of) == plain_bytes


def test_decoder_checkpointing_reaches_frozen_backbones_positional_parameters():
    """Positional-only training: no block input requires grad, and the non-reentrant
    checkpoint still gives AdaRoPE its gradient (the reentrant one would give none)."""
    model = tiny_decoder("adarope:l_ref=4").train()
    model.requires_grad_(False)
    model.encoding.requires_grad_(True)
    ids = random_ids(1, 32)

    def loss_of(m):
        return causal_lm_loss(m, {"input_ids": ids, "labels": ids})[0]

    plain = _grads(model, loss_of)
    model.gradient_checkpointing_enable()
    checkpointed = _grads(model, loss_of)
    assert set(plain) == {n for n, _ in model.named_parameters() if n.startswith("encoding.")}
    for name, grad in plain.items():
        assert grad.abs().sum() > 0
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_decoder_checkpointing_is_inert_in_eval_without_grad_and_with_a_cache(monkeypatch):
    """The decoder recomputes blocks only in training, with grad on and without a cache.
    Each guard matters: a recompute in eval mode wastes a forward, one under no_grad has
    nothing to save, and one with a cache appends the recomputed keys to the cache a second
    time during the backward (the cache then holds 2T keys and the next step attends to
    duplicates). Calls to torch's checkpoint are counted, and the cache is checked after a
    backward."""
    from ropekit.model import KVCache

    calls = []
    original = torch.utils.checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    model = tiny_decoder("adarope:l_ref=4")
    ids = random_ids(1, 12)
    with torch.no_grad():
        expected = model(ids).logits
    model.gradient_checkpointing_enable()

    model.eval()  # grad on, eval mode: no recompute
    assert torch.equal(model(ids).logits.detach(), expected) and not calls
    model.train()
    with torch.no_grad():  # training mode, grad off: no recompute
        assert torch.equal(model(ids).logits, expected) and not calls
        cache = KVCache()
        first = model(ids[:, :8], cache=cache).logits
        rest = model(ids[:, 8:], cache=cache).logits
    torch.testing.assert_close(torch.cat((first, rest), 1), expected, rtol=1e-5, atol=1e-5)

    # Training mode, grad on, with a cache: no recompute, and the backward leaves the cache
    # as the forward filled it, with the gradients of the plain model.
    model.gradient_checkpointing_disable()
    plain_cache = KVCache()
    model(ids[:, :8], cache=plain_cache).logits.sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable()
    cache = KVCache()
    model(ids[:, :8], cache=cache).logits.sum().backward()
    assert not calls
    assert all(k.shape[-2] == 8 for k in cache.keys.values()) and len(cache) == 8
    for name, grad in plain.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, msg=name)

    # And the recompute does happen where it should: training, grad on, no cache.
    model(ids).logits.sum().backward()
    assert len(calls) == model.config.n_layers
    model.gradient_checkpointing_disable()


def test_hf_checkpointing_gives_the_same_gradients_and_turns_off_again():
    model = tiny_hf("llama").train()
    perturb(patch(model, "adarope:init=yarn,factor=4"))
    ids = random_ids(2, 40, vocab=97)
    positions = torch.cat((torch.arange(16), torch.arange(90, 114)))[None].expand(2, -1)
    batch = {"input_ids": ids, "labels": ids, "position_ids": positions}

    def loss_of(m):
        return backbone_loss(as_backbone(m))(m, batch)[0]

    plain = _grads(model, loss_of)
    plain_bytes = _saved_bytes(model, loss_of)
    disable = as_backbone(model).enable_grad_checkpointing()
    assert model.model.layers[0].gradient_checkpointing
    checkpointed = _grads(model, loss_of)
    kept_bytes = _saved_bytes(model, loss_of)
    assert plain.keys() == checkpointed.keys()
    assert any("ropekit_encoding" in n for n in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    print(f"\ntiny llama: saved activations {plain_bytes:,} B -> {kept_bytes:,} B (+ inputs)")
    assert kept_bytes < 0.5 * plain_bytes
    disable()
    assert not model.model.layers[0].gradient_checkpointing
    assert not model.model.embed_tokens._forward_hooks  # the input-grad hook is gone too


def test_hf_pose_batches_attend_across_the_jump():
    """transformers reads a jump in position_ids as a new packed sequence when it gets
    neither an attention mask nor a cache (use_cache=False, which activation checkpointing
    forces in training): the second chunk would not see the first. ``pose_loss`` passes a
    mask."""
    model = tiny_hf("llama", use_cache=False)
    patch(model, "yarn:factor=4")
    ids = random_ids(1, 24, vocab=97)
    other = ids.clone()
    other[:, :8] = (other[:, :8] + 1) % 97  # change chunk 0 only
    positions = torch.cat((torch.arange(8), torch.arange(100, 116)))[None]

    def chunk1_logits(x, loss_fn):
        seen = {}

        def spy(**kwargs):
            seen["kwargs"], out = kwargs, model(**kwargs)
            seen["logits"] = out.logits
            return out

        with torch.no_grad():
            loss_fn(spy, {"input_ids": x, "labels": x, "position_ids": positions})
        return seen["logits"][:, 8:], seen["kwargs"]

    # Without a mask chunk 1 ignores chunk 0 (the trap) ...
    plain, _ = chunk1_logits(ids, causal_lm_loss)
    torch.testing.assert_close(chunk1_logits(other, causal_lm_loss)[0], plain)
    # ... with pose_loss it reads it.
    masked, kwargs = chunk1_logits(ids, backbone_loss(as_backbone(model)))
    assert not torch.allclose(chunk1_logits(other, backbone_loss(as_backbone(model)))[0], masked)
    assert kwargs["attention_mask"].all() and kwargs["use_cache"] is False


def test_extend_trains_a_hf_model_on_pose_windows_with_checkpointing(tmp_path):
    """The library path on a Hugging Face model: PoSE windows of the model's training length
    (32), positions up to the target, checkpointing on for training and off after."""
    from ropekit.train.extend import extend

    model = tiny_hf("llama", vocab_size=256, use_cache=False)
    config = ExtendConfig(
        "adarope:init=yarn,factor=4",
        128,
        samples=4,
        epochs=2,
        batch_size=2,
        pose=True,
        grad_checkpointing=True,
    )
    result = extend(model, config, tmp_path / "ext", tokenizer="bytes", log=lambda *a: None)
    assert result.tokens == 4 * 2 * 32  # window = the model's training length
    assert as_backbone(model).encoding.dxi.abs().sum() > 0
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    summary = json.loads(result.summary.read_text())
    assert summary["pose_window"] == 32 and summary["config"]["grad_checkpointing"] is True
