"""The fast rotation against the plain reference and against transformers, forward and
backward; precision at long positions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from ropekit.encodings import build, rotary
from ropekit.encodings.rotary import PAIRINGS, angles, rotate, rotate_reference, tables

from ..tiny import tiny_config
from .conftest import SHAPE

# Tolerances tied to dtype: measured float noise of one multiply-add chain.
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float64: 1e-12}


@pytest.mark.parametrize("pairing", PAIRINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_pairs", [8, 5])  # full and partial rotation of D = 16
def test_fast_path_matches_reference_forward_and_backward(pairing, dtype, rot_pairs):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 16, generator=g).to(dtype).requires_grad_()
    phi = angles(torch.randint(0, 50_000, (2, 7), generator=g), torch.rand(rot_pairs, generator=g))
    cos, sin = tables(phi[:, None])  # (2, 1, 7, F)
    cos.requires_grad_()
    sin.requires_grad_()
    fast = rotate(x, cos, sin, pairing)
    ref = rotate_reference(x, cos, sin, pairing)
    tol = TOL[dtype]
    torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)
    grad = torch.randn(fast.shape, generator=g).to(dtype)
    fast_grads = torch.autograd.grad(fast, (x, cos, sin), grad)
    ref_grads = torch.autograd.grad(ref, (x, cos, sin), grad)
    for a, b in zip(fast_grads, ref_grads, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol * 10, atol=tol * 10)


def test_fast_path_gradcheck_float64():
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    sin = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    for pairing in PAIRINGS:
        assert torch.autograd.gradcheck(
            lambda a, b, c, p=pairing: rotate(a, b, c, p), (x, cos, sin)
        )


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 256,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ],
    ids=lambda p: p["rope_type"],
)
def test_half_pairing_matches_transformers_apply_rotary_pos_emb(rope_parameters, fraction):
    head_dim, base = 32, 5e5
    if fraction < 1 and rope_parameters["rope_type"] == "default":
        # Llama's default init ignores partial_rotary_factor; "linear" with factor 1 honours it
        # and is plain RoPE (tested in test_schedules).
        rope_parameters = {"rope_type": "linear", "factor": 1.0}
    config = tiny_config(
        "llama",
        {"rope_theta": base, "partial_rotary_factor": fraction, **rope_parameters},
        hidden_size=4 * head_dim,
        head_dim=head_dim,
        max_position_embeddings=1024,
    )
    spec = {
        "default": "rope",
        "linear": f"linear:factor={rope_parameters.get('factor', 1.0)}",
        "yarn": "yarn:factor=4,original_length=256",
        "llama3": "llama3:factor=8,original_length=256",
    }[rope_parameters["rope_type"]]
    enc = build(spec, n_heads=4, n_kv_heads=2, head_dim=head_dim, base=base, fraction=fraction)
    pos = torch.arange(300)[None] * 3
    q = torch.randn(1, 4, 300, head_dim, requires_grad=True)
    k = torch.randn(1, 2, 300, head_dim, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(config)(q, pos)
    rot = cos.shape[-1]
    hf_q, hf_k = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos, sin)
    hf_q = torch.cat((hf_q, q[..., rot:]), -1)
    hf_k = torch.cat((hf_k, k[..., rot:]), -1)
    our_q, our_k = enc.rotate_q(q, pos), enc.rotate_k(k, pos)
    # transformers forms angles in float32: up to ~900 * 2^-23 = 1e-4 rad of error at position
    # 897, times |x| up to ~4; ropekit forms them in float64. Hence 1e-3, not float32 eps.
    tol = {"rtol": 1e-3, "atol": 1e-3}
    torch.testing.assert_close(our_q, hf_q, **tol)
    torch.testing.assert_close(our_k, hf_k, **tol)
    g = torch.randn_like(our_q), torch.randn_like(our_k)
    ours = torch.autograd.grad((our_q, our_k), (q, k), g)
    theirs = torch.autograd.grad((hf_q, hf_k), (q, k), g)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_bf16_at_position_65536_is_within_bf16_tolerance_of_float64():
    enc = build("rope:base=500000", n_heads=2, head_dim=64)
    pos = torch.tensor([[65_536, 65_537, 100_000]])
    x = torch.randn(1, 2, 3, 64, dtype=torch.float64)
    exact = enc.rotate_k(x, pos)  # float64 all the way
    low = enc.rotate_k(x.to(torch.bfloat16), pos)
    # bf16 has 8 mantissa bits: relative error ~2^-8 per element on values of order 1.
    err = (low.double() - exact).abs().max() / exact.abs().max()
    assert err < 2e-2
    # A float32 angle would be off by up to 65,536 * 2^-24 = 4e-3 rad for theta = 1; ours is not.
    phi = angles(pos, torch.ones(1, dtype=torch.float64))
    assert (phi[0, :, 0] - pos[0].double()).abs().max() == 0


@pytest.mark.parametrize("pairing", PAIRINGS)
def test_the_stored_table_rotation_passes_gradcheck_in_float64(pairing):
    """Gradients to x and to both tables, in float64 throughout (the backward once summed the
    table gradients in float32, which a float64 check cannot pass)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    phi = torch.randn(1, 1, 5, 3, dtype=torch.float64, generator=g)
    cos, sin = phi.cos().requires_grad_(), phi.sin().requires_grad_()
    rotated = lambda a, c, s: rotate(a, c, s, pairing)  # noqa: E731
    # float32 sums are off by ~1e-7: within 1e-8 (the finite differences hold ~1e-10), only
    # a float64 backward passes
    assert torch.autograd.gradcheck(rotated, (x, cos, sin), atol=1e-8, rtol=0)


# ----------------------------------------------------------------------------- ROPEKIT_COMPILE
def test_a_bad_compile_mode_is_a_one_line_value_error_at_first_use(monkeypatch):
    """First use is building an encoding (a program stops when it makes its model) or, for
    code that calls the kernels directly, the first rotation."""
    enc = build("rope", **SHAPE)
    q = torch.randn(1, SHAPE["n_heads"], 3, SHAPE["head_dim"])
    cos, sin = enc.tables(torch.arange(3)[None])
    monkeypatch.setenv("ROPEKIT_COMPILE", "banana")
    monkeypatch.setitem(rotary._settings, "mode", None)  # as in a fresh process
    for first_use in (lambda: build("rope", **SHAPE), lambda: rotary.rotate(q, cos, sin)):
        with pytest.raises(ValueError, match="ROPEKIT_COMPILE='banana'") as info:
            first_use()
        message = str(info.value)
        assert "\n" not in message and "auto" in message and "never" in message
    monkeypatch.setenv("ROPEKIT_COMPILE", "never")
    assert torch.equal(enc.rotate_q(q), enc.rotate_q(q))  # read again once it is fixed
    assert rotary.compile_settings()["mode"] == "never"


def test_importing_with_a_bad_compile_mode_succeeds():
    env = {**os.environ, "ROPEKIT_COMPILE": "banana"}
    code = "import ropekit.encodings, ropekit.model; print('ok')"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-500:]
