"""The fixed query temperatures (log-n, Scalable-Softmax, Llama 4's tuning), on their own and
over a schedule or a remap: float64 parity with each source (Qwen's log-n list, SSMax's
softmax(s ln n z), transformers' Llama4TextAttention), the composition with a remap against a
brute-force definition, the learnable s, and the spec. (The properties every rotary encoding
has run over the wrappers in test_properties.py through conftest.ROTARY_SPECS.)"""

from __future__ import annotations

import math

import pytest
import torch

from ropekit.encodings import banded_attention, build
from ropekit.encodings.base import spec_of

from .conftest import SHAPE, output_and_grads, perturb
from .test_remap import brute_force, rerope_distance

T = 40


def qwen_logn(n_tokens: int, seq_length: int) -> torch.Tensor:
    """Qwen (modeling_qwen.py, QWenModel): logn_list[i - 1] multiplies the query at position
    i - 1."""
    return torch.tensor(
        [math.log(i, seq_length) if i > seq_length else 1 for i in range(1, n_tokens + 1)],
        dtype=torch.float64,
    )


def test_logn_is_qwens_list():
    enc = build("temperature:rule=logn,l_ref=16", **SHAPE)
    pos = torch.arange(300)[None]
    t = enc.query_temperature(pos)[0, 0, :, 0]
    torch.testing.assert_close(t, qwen_logn(300, 16), rtol=4e-16, atol=0)


def _attention(enc, q, k, v):
    """Causal attention of the encoding's rotated queries and keys (float64)."""
    rq, rk = enc.rotate_q(q), enc.rotate_k(k)
    g = q.shape[1] // k.shape[1]
    logits = rq @ rk.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return logits.masked_fill(~mask, float("-inf")).softmax(-1) @ v.repeat_interleave(g, 1)


def _qkv(seed=0, B=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 4, T, 16, generator=g, dtype=torch.float64)
    k = torch.randn(B, 2, T, 16, generator=g, dtype=torch.float64)
    v = torch.randn(B, 2, T, 16, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("learn", [False, True])
def test_ssmax_is_softmax_of_s_ln_n_times_the_logits(learn):
    """Nakanishi 2025, eq. 2: attention_i = softmax_j(s_h ln(n) z_ij) with n = i + 1 keys."""
    spec = "temperature:rule=ssmax,method=yarn,factor=4,original_length=16"
    spec += ",learn=true" if learn else ""
    enc = perturb(build(spec, **SHAPE)).double()
    inner = build("yarn:factor=4,original_length=16", **SHAPE).double()
    q, k, v = _qkv()
    s = torch.stack([enc.s(layer) for layer in range(SHAPE["n_layers"])])[0]  # (H|1,)
    if learn:
        assert s.unique().numel() == SHAPE["n_heads"]  # perturbed: one s per head
    else:
        assert s.tolist() == [1 / math.log(16)]
    rq, rk = inner.rotate_q(q), inner.rotate_k(k).repeat_interleave(2, 1)
    z = rq @ rk.transpose(-1, -2) / math.sqrt(16)  # (1, H, T, S)
    n = torch.arange(1, T + 1, dtype=torch.float64)[:, None]  # (T, 1)
    z = z * s[:, None, None] * torch.log(n)
    z = z.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    expected = z.softmax(-1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(_attention(enc, q, k, v), expected, rtol=1e-12, atol=1e-12)


class _Queries(torch.nn.Module):
    """forward() = rotate_q, so torch.func.functional_call can swap the encoding's log_s."""

    def __init__(self, encoding) -> None:
        super().__init__()
        self.encoding = encoding

    def forward(self, q, layer):
        return self.encoding.rotate_q(q, None, layer)


def test_learned_s_is_one_parameter_per_layer_and_head_with_exact_gradients():
    enc = perturb(build("temperature:rule=ssmax,learn=true,l_ref=8", **SHAPE)).double()
    assert set(enc.positional_parameters()) == {"log_s"}
    assert tuple(enc.log_s.shape) == (SHAPE["n_layers"], SHAPE["n_heads"])
    assert enc.head_rows("scale").parameters == (enc.log_s,)
    probe, q = _Queries(enc), _qkv()[0]
    log_s = enc.log_s.detach().clone().requires_grad_()

    def f(value):
        return torch.func.functional_call(probe, {"encoding.log_s": value}, (q, 1))

    assert torch.autograd.gradcheck(f, (log_s,))


def test_llama4_equals_transformers_attention_temperature_tuning(monkeypatch):
    """Llama4TextAttention.forward on a NoPE layer scales its queries by
    log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1; captured where it hands them to
    attention. transformers forms the factor in float32 (positions.float()), so the two agree
    to float32 rounding of the factor (one ulp, 1.2e-7) and not beyond."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4 import modeling_llama4

    config = Llama4TextConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=1,
        no_rope_layers=[0],  # layer 0 is a NoPE layer: the one that tunes its temperature
        floor_scale=4,
        attn_scale=0.1,
        attn_temperature_tuning=True,
        use_qk_norm=False,
        intermediate_size=16,
        intermediate_size_mlp=16,
    )
    config._attn_implementation = "eager"
    attention = modeling_llama4.Llama4TextAttention(config, 0).double()
    seen = {}

    def capture(module, query, key, value, mask, **kwargs):
        seen["query"] = query  # (B, H, T, D)
        return query.new_zeros(query.shape).transpose(1, 2), None  # (B, T, H, D)

    monkeypatch.setattr(modeling_llama4, "eager_attention_forward", capture)
    h = torch.randn(2, T, 32, dtype=torch.float64)
    attention(h, None, None)
    enc = build(
        "temperature:rule=llama4,method=nope,l_ref=4,attn_scale=0.1",
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
    )
    q = attention.q_proj(h).view(2, T, 4, 8).transpose(1, 2)  # (B, H, T, D)
    ours = enc.rotate_q(q, torch.arange(T)[None].expand(2, -1))
    torch.testing.assert_close(ours, seen["query"], rtol=1.2e-7, atol=0)
    assert (seen["query"][:, :, -1] / q[:, :, -1] - 1).abs().min() > 0.1  # it did scale


def test_a_temperature_over_a_remap_scales_every_band_by_the_true_position():
    """Leaky ReRoPE with log-n: softmax_j(t(i) <R(d'(i, j)) q_i, k_j> / sqrt(D)) v_j with t of
    the true query position, against the brute-force remap (test_remap.brute_force)."""
    spec = "temperature:rule=logn,method=rerope,window=6,leaky=4,original_length=8"
    enc = build(spec, **SHAPE).double()
    q, k, v = _qkv(B=2)
    w = torch.randn(2, 4, T, 16, dtype=torch.float64)
    pos = torch.arange(T)[None].expand(2, -1)

    def ours(q, k, v):
        bands = enc.bands(pos, pos, 1)
        return banded_attention(q, k, v, bands, pos, enc.rotate_band, causal_offset=0)

    def reference(q, k, v):
        logn = lambda p: qwen_logn(T, 8)[p]  # noqa: E731 - the scale at each query position
        return brute_force(enc.inner, q, k, v, pos, rerope_distance(6, 4.0), q_scale=logn)

    expected = output_and_grads(reference, q, k, v, w)
    for a, b in zip(output_and_grads(ours, q, k, v, w), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert enc.remaps_distance and not build("temperature:rule=logn,l_ref=8", **SHAPE).dynamic


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("temperature", "rule is required for temperature; use one of logn, ssmax, llama4"),
        ("temperature:rule=cosine", "rule='cosine' is not allowed; use one of logn, ssmax"),
        ("temperature:rule=logn", "l_ref is required for temperature"),
        ("temperature:rule=logn,l_ref=1", "l_ref=1 is not allowed; it must be an integer >= 2"),
        ("temperature:rule=logn,l_ref=8,learn=true", "learn is not allowed with rule=logn"),
        ("temperature:rule=llama4,l_ref=8,s=0.5", "s is not allowed with rule=llama4"),
        ("temperature:rule=ssmax,l_ref=8,s=0", "s=0.0 is not allowed"),
        ("temperature:rule=logn,l_ref=8,method=adarope", "method='adarope' is not allowed"),
        ("temperature:rule=logn,l_ref=8,method=yarn", "factor is required"),
    ],
)
def test_bad_temperature_specs_are_refused_in_one_line(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        build(spec, **SHAPE)
    assert "\n" not in str(info.value)


def test_the_spec_round_trips_and_l_ref_follows_the_method_then_the_model():
    enc = build("temperature:rule=llama4,method=yarn,factor=4", original_length=64, **SHAPE)
    assert enc.l_ref == 64 and enc.spec == (
        "temperature:rule=llama4,method=yarn,factor=4,original_length=64"
    )
    enc = build("temperature:rule=llama4,method=nope", original_length=64, **SHAPE)
    assert enc.l_ref == 64 and enc.spec == "temperature:rule=llama4,method=nope,l_ref=64"
    assert spec_of(build(enc.spec, **SHAPE).config) == enc.spec
