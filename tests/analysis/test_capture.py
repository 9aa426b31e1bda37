"""Per-layer q/k capture for ropekit Decoders (probe hooks) and patched Hugging Face models
(wrapped encoding methods), checked against what the models' own attention computes.

Hugging Face's eager attention returns its weights, an oracle independent of this package:
attention rebuilt from the captured q and k must match it to float32 noise.
"""

from __future__ import annotations

import functools

import pytest
import torch

from ropekit.analysis.capture import capture_qk, forward_logits, model_encoding, own_encoding

from .tiny import LLAMA_VOCAB, attention, perturb, tiny_decoder, tiny_llama, windows


def _capture(model, ids, method: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_layer(layer, q, k):
        seen[layer] = (q.clone(), k.clone())

    with torch.no_grad(), capture_qk(model, on_layer, method) as used:
        forward_logits(model, ids)
    assert used == ("probe" if method == "auto" and hasattr(model, "blocks") else method)
    return seen


def test_probe_and_encoding_paths_capture_the_same_rotated_q_and_k() -> None:
    model = tiny_decoder()
    perturb(model.encoding)  # AdaScale on: q carries the temperature
    ids = windows(2, 40)
    by_probe = _capture(model, ids, "probe")
    by_encoding = _capture(model, ids, "encoding")
    assert sorted(by_probe) == sorted(by_encoding) == [0, 1]
    for layer in (0, 1):
        q, k = by_probe[layer]
        assert q.shape == (2, 4, 40, 8) and k.shape == (2, 2, 40, 8)
        assert torch.equal(q, by_encoding[layer][0]) and torch.equal(k, by_encoding[layer][1])
    # The wrappers are gone afterwards and the model is unchanged.
    assert "rotate_q" not in model.encoding.__dict__ and "rotate_k" not in model.encoding.__dict__
    assert _capture(model, ids, "auto").keys() == by_probe.keys()


def _layer_bias(encoding, layer, q_pos, k_pos):
    return encoding.score_bias(q_pos, k_pos, layer)


def test_recomputed_attention_matches_what_the_decoder_masks_and_biases() -> None:
    # ALiBi: the probe receives the bias SDPA gets (score bias + causal -inf); attention rebuilt
    # from the encoding's score_bias must be the same distribution.
    model = tiny_decoder("alibi")
    ids = windows(1, 24)
    got: dict[int, torch.Tensor] = {}

    def hook(probe, args, output):
        q, k, bias = args
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # query head h reads h // g
        logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
        got[probe.layer] = logits.double().log_softmax(-1).exp()

    handles = [b.attn.probe.register_forward_hook(hook) for b in model.blocks]
    captured = _capture(model, ids, "probe")
    for h in handles:
        h.remove()
    encoding = model.encoding
    for layer, (q, k) in captured.items():
        bias = functools.partial(_layer_bias, encoding, layer)
        assert torch.allclose(attention(q, k, bias=bias, chunk=5), got[layer], atol=1e-6)


def test_probe_capture_is_refused_without_probes() -> None:
    model = tiny_llama()
    with (
        pytest.raises(ValueError, match="method='probe'"),
        own_encoding(model),
        capture_qk(model, lambda *a: None, "probe"),
    ):
        pass
    with (
        pytest.raises(ValueError, match="method='sideways'"),
        capture_qk(tiny_decoder(), lambda *a: None, "sideways"),
    ):
        pass


def test_patched_hf_capture_reproduces_eager_attention_weights_with_gqa() -> None:
    from ropekit.hf import patch

    model = tiny_llama(attn_implementation="eager")  # 4 query heads over 2 kv heads
    encoding = perturb(patch(model, "adarope"))
    ids = windows(2, 30, vocab=LLAMA_VOCAB)
    captured = _capture(model, ids, "encoding")
    with torch.no_grad():
        reference = model(ids, use_cache=False, output_attentions=True).attentions
    assert sorted(captured) == [0, 1] and model_encoding(model) is encoding
    for layer, (q, k) in captured.items():
        alpha = attention(q, k, chunk=7)  # (B, H, T, T)
        assert torch.allclose(alpha, reference[layer].double(), atol=1e-5)


def test_own_encoding_patches_an_unpatched_hf_model_only_for_the_block() -> None:
    from ropekit.hf import encoding_of, patch

    model = tiny_llama()
    with pytest.raises(ValueError, match="not patched"):
        model_encoding(model)
    with own_encoding(model) as (encoding, patched):
        assert patched and encoding_of(model) is encoding and encoding.spec == "rope"
    assert encoding_of(model) is None
    mine = patch(model, "yarn:factor=2")
    with own_encoding(model) as (encoding, patched):
        assert encoding is mine and not patched
    assert encoding_of(model) is mine
    with pytest.raises(ValueError, match="Linear"):
        model_encoding(torch.nn.Linear(2, 2))
