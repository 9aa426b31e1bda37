"""Decoder properties: shapes, loss, positions (default, offset, packed), GQA, tying, config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ropekit.encodings import names
from ropekit.model import Decoder, DecoderConfig, count_parameters, lm_loss

from .tiny import DYNAMIC, FP32, RELATIVE, SPECS, random_ids, tiny_model


def test_every_registered_encoding_has_a_tiny_spec():
    assert set(SPECS) == set(names())
    assert {name for name in SPECS if tiny_model(SPECS[name]).encoding.dynamic} == DYNAMIC


@pytest.mark.parametrize("name", sorted(SPECS))
def test_shapes_and_gqa_for_every_encoding(name):
    model = tiny_model(SPECS[name])  # 4 query heads over 2 key/value heads
    ids = random_ids(3, 11)
    out = model(ids, labels=ids)
    assert out.logits.shape == (3, 11, 256)
    assert out.loss.shape == () and torch.isfinite(out.loss)
    assert out.cache is None
    out.loss.backward()
    for name_, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name_


@pytest.mark.parametrize("spec", ["rope", "alibi", "nope"])
def test_gqa_equals_attention_with_repeated_key_value_heads(spec):
    gqa = tiny_model(spec, n_kv_heads=2)
    mha = tiny_model(spec, n_kv_heads=4)
    state = gqa.state_dict()
    H, K, D = 4, 2, gqa.config.head_dim
    for layer in range(gqa.config.n_layers):
        key = f"blocks.{layer}.attn.qkv.weight"
        q, k, v = state[key].split((H * D, K * D, K * D))

        # Query head h reads key head h // (H / K): repeat each key/value head H / K times.
        def repeat(w):
            return w.view(K, D, -1).repeat_interleave(H // K, dim=0).reshape(H * D, -1)

        state[key] = torch.cat((q, repeat(k), repeat(v)))
    mha.load_state_dict(state)
    ids = random_ids(2, 9)
    torch.testing.assert_close(gqa(ids).logits, mha(ids).logits, **FP32)


def test_loss_is_mean_next_token_cross_entropy_over_unmasked_labels():
    model = tiny_model("rope")
    ids = random_ids(2, 10)
    labels = ids.clone()
    labels[0, 3:6] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 256)
    target = labels[:, 1:].reshape(-1)
    keep = target != -100
    expected = F.cross_entropy(logits[keep], target[keep])
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(lm_loss(out.logits, labels), expected)
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=labels[:, :5])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_explicit_arange_positions_equal_default(name):
    model = tiny_model(SPECS[name])
    ids = random_ids(2, 12)
    default = model(ids).logits
    explicit = model(ids, position_ids=torch.arange(12).expand(2, 12)).logits
    torch.testing.assert_close(explicit, default, atol=0, rtol=0)
    torch.testing.assert_close(model(ids, position_ids=torch.arange(12)[None]).logits, default)


@pytest.mark.parametrize("spec", RELATIVE)
def test_offset_positions_equal_separate_runs_for_relative_encodings(spec):
    model = tiny_model(spec)
    ids = random_ids(3, 10)
    offsets = torch.tensor([[0], [37], [1000]])
    batched = model(ids, position_ids=offsets + torch.arange(10)).logits
    for row in range(3):
        alone = model(ids[row : row + 1]).logits
        torch.testing.assert_close(batched[row : row + 1], alone, **FP32)


@pytest.mark.parametrize("name", sorted(set(SPECS) - DYNAMIC))
def test_packed_documents_equal_separate_runs(name):
    # Positions restart at each document, so attention stays within it: any encoding, the
    # absolute ones included, then gives each document the logits it gets alone. Dynamic
    # schedules are left out: they take one length for the whole row (max position + 1, as
    # transformers does), so a short document packed beside a long one sees other frequencies.
    model = tiny_model(SPECS[name])
    lengths = [5, 9, 3]
    docs = [random_ids(1, n, seed=i) for i, n in enumerate(lengths)]
    packed_ids = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model(packed_ids, position_ids=positions).logits
    alone = torch.cat([model(doc).logits for doc in docs], dim=1)
    torch.testing.assert_close(packed, alone, **FP32)


def test_positions_that_jump_forward_stay_in_one_document():
    # A gap (PoSE-style position skipping) is not a restart: the second half still sees the
    # first, so its logits differ from a run of the second half alone.
    model = tiny_model("rope")
    ids = random_ids(1, 10)
    positions = torch.cat([torch.arange(5), 20 + torch.arange(5)])[None]
    skipped = model(ids, position_ids=positions).logits[:, 5:]
    alone = model(ids[:, 5:], position_ids=positions[:, 5:]).logits
    assert not torch.allclose(skipped, alone, atol=1e-3)


def test_learned_encoding_refuses_positions_past_its_table():
    model = tiny_model("learned:max_length=16")
    model(random_ids(1, 16))  # the whole table is fine
    with pytest.raises(ValueError, match="past the learned table"):
        model(random_ids(1, 17))
    with pytest.raises(ValueError, match="past the learned table"):
        model(random_ids(1, 4), position_ids=torch.arange(14, 18)[None])


def test_bad_inputs_raise_with_shapes():
    model = tiny_model("rope")
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids"):
        model(random_ids(2, 4), position_ids=torch.arange(5)[None])
    with pytest.raises(ValueError, match="integer"):
        model(random_ids(2, 4), position_ids=torch.arange(4.0)[None])


def test_one_encoding_module_shared_by_every_layer():
    model = tiny_model("adarope")
    assert sum(1 for m in model.modules() if m is model.encoding) == 1
    keys = model.state_dict().keys()
    assert any(k.startswith("encoding.") for k in keys)
    assert not any(".encoding." in k for k in keys)  # no per-layer copies
    assert [b.attn.layer for b in model.blocks] == list(range(model.config.n_layers))


def test_context_length_reaches_the_encoding_as_original_length():
    model = Decoder(
        DecoderConfig(d_model=32, n_heads=2, encoding="yarn:factor=8", context_length=128)
    )
    assert model.encoding.config.original_length == 128
    assert "original_length=128" in model.encoding.spec
    # An explicit value in the spec wins.
    model = Decoder(
        DecoderConfig(d_model=32, n_heads=2, encoding="yarn:factor=8,original_length=64")
    )
    assert model.encoding.config.original_length == 64


def test_tied_and_untied_embeddings():
    tied = tiny_model("rope")
    assert tied.lm_head.weight is tied.embed.weight
    untied = tiny_model("rope", tie_embeddings=False)
    assert untied.lm_head.weight is not untied.embed.weight
    extra = untied.config.vocab_size * untied.config.d_model
    assert count_parameters(untied) - count_parameters(tied) == extra


def test_default_config_is_the_reference_18m_byte_model():
    config = DecoderConfig()
    assert (config.vocab_size, config.n_layers, config.context_length) == (256, 4, 256)
    assert config.ffn_hidden == 512 and config.n_kv_heads == config.n_heads
    assert 1.7e6 < count_parameters(Decoder(config)) < 1.9e6


def test_odd_head_dim_fails_for_rotary_encodings_when_built():
    config = DecoderConfig(d_model=12, n_heads=4, encoding="rope")  # head_dim 3
    with pytest.raises(ValueError, match="head_dim"):
        Decoder(config)
    Decoder(DecoderConfig(d_model=12, n_heads=4, encoding="alibi"))  # no rotation: fine


@pytest.mark.parametrize("name", ["rope", "alibi", "adarope"])
def test_bf16_autocast_agrees_with_float32_to_bf16_precision(name):
    model = tiny_model(SPECS[name])
    ids = random_ids(2, 12)
    reference = model(ids, labels=ids).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    # bf16 keeps 8 significant bits (relative step 2^-8 = 0.004); a few roundings per layer.
    torch.testing.assert_close(out.loss, reference, atol=0, rtol=0.02)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_grouped_attention_equals_pytorchs_with_grouped_heads():
    from ropekit.model.decoder import _attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 30, 16, generator=g) for h in (6, 2, 2))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(_attention(q, k, v, is_causal=True), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_attention_in_float32_on_cuda_runs_on_a_fused_kernel():
    """Without repeating the key/value heads, grouped float32 attention on CUDA has only the
    math kernel: with the memory-efficient kernel alone allowed, PyTorch would refuse it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ropekit.model.decoder import _attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 300, 16, generator=g) for h in (6, 2, 2))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        got = _attention(q.cuda(), k.cuda(), v.cuda(), is_causal=True)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)
