"""AdaRoPE over a remap's bands: exact in float64 against the brute-force remap definition with
the learned per-head frequencies and temperatures written here, forward and backward (the
parameters' gradients included); the remap itself at init; the spec."""

from __future__ import annotations

import math

import pytest
import torch

from ropekit.encodings import banded_attention, build

from .conftest import SHAPE, perturb
from .test_remap import rerope_distance, self_extend_distance

T = 40


def definition(enc, q, k, v, pos, remap, layer):
    """softmax_j(lambda_h(i + 1) <R(theta_h d'(i, j)) q_i, k_j> / sqrt(D)) v_j, pair by pair:
    theta_h = b^(-2f/d) exp(dxi[layer, kv(h)]) (AdaFreq), lambda_h(L) = exp(gamma_h
    ln ln(1 + max(L, L_ref) / L_ref) - ln tau_h) (AdaScale), d' the remapped distance."""
    _, H, _, D = q.shape
    K = k.shape[1]
    f = torch.arange(0, D, 2, dtype=torch.float64) / D
    theta = enc.base**-f * enc.dxi[layer].double().exp()  # (K, F)
    theta = theta.repeat_interleave(H // K, 0)  # (H, F): query head h reads kv head h // g
    d = torch.tensor(
        [[[remap(int(i), int(j)) for j in row] for i in row] for row in pos], dtype=torch.float64
    )  # (B, T, S)
    phi = d[:, None, :, :, None] * theta[None, :, None, None, :]  # (B, H, T, S, F)
    n = D // 2
    q1, q2 = q[..., :n][:, :, :, None], q[..., n:][:, :, :, None]  # (B, H, T, 1, F)
    rq = torch.cat((q1 * phi.cos() - q2 * phi.sin(), q2 * phi.cos() + q1 * phi.sin()), -1)
    keys = k.repeat_interleave(H // K, 1)[:, :, None]  # (B, H, 1, S, D)
    L = (pos + 1).double().clamp(min=enc.l_ref)  # (B, T)
    loglog = torch.log(torch.log1p(L / enc.l_ref))
    lam = torch.exp(
        enc.gamma[layer].double()[None, :, None] * loglog[:, None]
        - enc.log_tau[layer].double()[None, :, None]
    )  # (B, H, T)
    logits = (rq * keys).sum(-1) * lam[..., None] / math.sqrt(D)  # (B, H, T, S)
    logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return logits.softmax(-1) @ v.repeat_interleave(H // K, 1)


def _grads(fn, enc, q, k, v, w):
    enc.zero_grad()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    (out * w).sum().backward()
    params = [p.grad.clone() for p in (enc.dxi, enc.log_tau, enc.gamma)]
    return [out.detach(), *(t.grad for t in leaves), *params]


@pytest.mark.parametrize(
    ("spec", "remap"),
    [
        ("remap=rerope,window=6,leaky=4", rerope_distance(6, 4.0)),
        ("remap=rerope,window=6", rerope_distance(6, None)),
        ("remap=self-extend,group=3,window=5", self_extend_distance(3, 5)),
    ],
)
def test_banded_attention_equals_the_definition_with_learned_parameters(spec, remap):
    enc = perturb(build(f"adarope-remap:{spec},original_length=8,l_ref=4", **SHAPE)).double()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, T, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, T, 16, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(2, 4, T, 16, generator=g, dtype=torch.float64)
    pos = torch.arange(T)[None].expand(2, -1) + torch.tensor([[0], [17]])
    layer = 1

    def ours(q, k, v):
        bands = enc.bands(pos, pos, layer)
        rotate = lambda x, p, query: enc.rotate_band(x, p, query, layer)  # noqa: E731
        return banded_attention(q, k, v, bands, pos, rotate, causal_offset=0)

    expected = _grads(lambda q, k, v: definition(enc, q, k, v, pos, remap, layer), enc, q, k, v, w)
    got = _grads(ours, enc, q, k, v, w)
    for name, a, b in zip(
        ("out", "q", "k", "v", "dxi", "log_tau", "gamma"), got, expected, strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    assert expected[4][layer].abs().sum() > 0 and expected[4][0].abs().sum() == 0


def test_at_init_it_is_the_remap():
    ada = build("adarope-remap:remap=rerope,window=6,leaky=4,original_length=8", **SHAPE).double()
    remap = build("rerope:window=6,leaky=4,original_length=8", **SHAPE).double()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, T, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, T, 16, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(T)[None]

    def run(enc):
        return banded_attention(
            q, k, v, enc.bands(pos, pos, 1), pos, enc.rotate_band, causal_offset=0
        )

    torch.testing.assert_close(run(ada), run(remap), rtol=1e-12, atol=1e-12)


def test_the_spec_shares_one_init_and_l_ref_defaults_to_the_remaps_l0():
    enc = build(
        "adarope-remap:remap=rerope,leaky=16,share_heads=true,init=yarn,factor=4",
        original_length=64,
        **SHAPE,
    )
    assert enc.l_ref == 64 and enc.factor == 4 and enc.remaps_distance
    assert enc.spec == (
        "adarope-remap:remap=rerope,share_heads=true,init=yarn,leaky=16,factor=4,original_length=64"
    )
    assert build(enc.spec, **SHAPE).config == enc.config
    assert tuple(enc.dxi.shape) == (SHAPE["n_layers"], 1, 8)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("adarope-remap", "remap is required for adarope-remap; e.g. remap=rerope,leaky=16"),
        ("adarope-remap:remap=dca", "remap='dca' is not allowed; use one of rerope, self-extend"),
        ("adarope-remap:remap=rerope,leaky=0.5", "leaky=0.5 is not allowed"),
    ],
)
def test_bad_specs_are_refused_in_one_line(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        build(spec, **SHAPE)
    assert "\n" not in str(info.value)
