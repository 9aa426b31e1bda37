"""The fast rotation against the plain reference and against transformers, forward and
backward; precision at long positions."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import types
import warnings

import pytest
import torch
from torch._dynamo.exc import FailOnRecompileLimitHit
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from ropekit.encodings import build, rotary
from ropekit.encodings.rotary import (
    PAIRINGS,
    angles,
    compile_settings,
    rotate,
    rotate_reference,
    rotate_tensor,
    set_compile,
    tables,
)

from ..tiny import tiny_config
from .conftest import SHAPE

# Tolerances tied to dtype: measured float noise of one multiply-add chain.
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float64: 1e-12}
TOL64 = {"rtol": 1e-12, "atol": 1e-12}


def rotation_by_pairs(x, cos, sin, pairing):
    """The RoPE rotation (eq. 13) written pair by pair with explicit channel indices: pair f is
    (f, f + F) for ``half``, (2f, 2f + 1) for ``interleaved``; channels past 2F pass through.
    Plain autograd ops, in x's dtype."""
    n = cos.shape[-1]
    out = x.clone()
    for f in range(n):
        i, j = (f, f + n) if pairing == "half" else (2 * f, 2 * f + 1)
        c, s = cos[..., f], sin[..., f]
        out[..., i] = x[..., i] * c - x[..., j] * s
        out[..., j] = x[..., j] * c + x[..., i] * s
    return out


def _case(x_shape, rot_pairs, seed=0, dtype=torch.float64):
    """x (a transposed view, as attention hands q and k over) and tables (1, 1, T, F) with
    random angles."""
    g = torch.Generator().manual_seed(seed)
    *lead, t, d = x_shape
    x = torch.randn(*lead[:-1], t, lead[-1], d, generator=g, dtype=dtype).transpose(-3, -2)
    phi = 10 * torch.rand(*[1] * len(lead), t, rot_pairs, generator=g, dtype=torch.float64)
    return x, phi.cos().to(dtype), phi.sin().to(dtype)


@pytest.mark.parametrize("factor", [1, 1.0, 2, 2.0, 0.5, torch.tensor(2.0, dtype=torch.float64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_tables_are_cos_and_sin_times_the_attention_factor_in_the_dtype_asked(factor, dtype):
    """Whatever the factor (1 skips the product, as a number only) and in every dtype: cos
    and sin times the factor, formed in float64 and cast once."""
    phi = torch.linspace(-7, 7, 30, dtype=torch.float64).view(5, 6)
    cos, sin = tables(phi, factor, dtype)
    assert cos.dtype == sin.dtype == dtype
    f = float(factor)
    torch.testing.assert_close(cos, (f * phi.cos()).to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(sin, (f * phi.sin()).to(dtype), rtol=0, atol=0)


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


def test_the_reference_rotation_pairs_halves_by_default():
    x, cos, sin = _case((2, 3, 4, 16), 6, dtype=torch.float32)
    torch.testing.assert_close(
        rotate_reference(x, cos, sin), rotation_by_pairs(x, cos, sin, "half"), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("pairing", PAIRINGS)
@pytest.mark.parametrize("rot_pairs", [8, 6, 5])  # of D = 16: full; 2F < D <= 3F; partial
def test_the_fused_expression_is_the_pairwise_rotation(pairing, rot_pairs):
    """``_fused``, the expression the compiled kernel is made of, run as plain eager code on
    tables that broadcast over batch and heads (B=2, H=3, T=4: no length equals F or D)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, 16, generator=g, dtype=torch.float64).transpose(1, 2)
    phi = 10 * torch.rand(2, 1, 4, rot_pairs, generator=g, dtype=torch.float64)
    cos, sin = phi.cos(), phi.sin()
    got = rotary._fused(x, cos, sin, pairing)
    torch.testing.assert_close(got, rotation_by_pairs(x, cos, sin, pairing), **TOL64)


def test_table_gradients_are_summed_over_broadcast_dims_before_rounding_to_table_dtype():
    """A table shared by the batch gets the batch's summed gradient, summed in x's precision
    (float64 here) and then rounded to the float32 table: two rows contributing 1 + 1e-9 and
    -1 leave 1e-9, which rounding each row to float32 before summing would turn into 0."""
    x = torch.tensor([1 + 1e-9, 0.0, -1.0, 0.0], dtype=torch.float64).reshape(2, 1, 1, 2)
    cos = torch.ones(1, 1, 1, 1, requires_grad=True)
    sin = torch.zeros(1, 1, 1, 1, requires_grad=True)
    out = rotate(x, cos, sin)
    grad_cos, grad_sin = torch.autograd.grad(out, (cos, sin), torch.ones_like(out))
    # eq. 13 differentiated: dL/dcos = sum g1 x1 + g2 x2, dL/dsin = sum g2 x1 - g1 x2
    exact = (1 + 1e-9) - 1.0
    for grad in (grad_cos, grad_sin):
        assert grad.shape == cos.shape and grad.dtype == torch.float32
        assert grad.item() == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("wanted", ["cos", "sin"])
def test_one_table_alone_gets_its_gradient(wanted):
    """Only cos, or only sin, requiring grad: that table still gets dL/dcos = sum g1 x1 + g2 x2
    or dL/dsin = sum g2 x1 - g1 x2 (eq. 13 differentiated), the other none."""
    x, cos, sin = _case((1, 2, 4, 8), 4)
    table = {"cos": cos, "sin": sin}[wanted].requires_grad_()
    out = rotate(x, cos, sin)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    (got,) = torch.autograd.grad(out, table, w)
    expected = torch.autograd.grad(rotation_by_pairs(x, cos, sin, "half"), table, w)[0]
    torch.testing.assert_close(got, expected, **TOL64)


def test_bf16_table_gradients_form_products_in_float32():
    """bf16 activations: each product g x is exact in float32, so the table gradient equals its
    float64 sum to float32 round-off; products rounded to bf16 would be off by ~1e-3 of it."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 8, 4, 8, generator=g).bfloat16()
    phi = 10 * torch.rand(1, 1, 4, 4, generator=g, dtype=torch.float64)
    cos, sin = phi.cos().float().requires_grad_(), phi.sin().float().requires_grad_()
    out = rotate(x, cos, sin)
    w = torch.randn(out.shape, generator=g).bfloat16()
    grad_cos, grad_sin = torch.autograd.grad(out, (cos, sin), w)
    x1, x2, g1, g2 = (t[..., i : i + 4].double() for t in (x, w) for i in (0, 4))
    for got, a, b in ((grad_cos, g1 * x1, g2 * x2), (grad_sin, g2 * x1, -g1 * x2)):
        expected, scale = (a + b).sum(1, keepdim=True), (a.abs() + b.abs()).sum(1, keepdim=True)
        assert ((got.double() - expected).abs() <= 1e-6 * scale).all()


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


# ------------------------------------------------------------------ the compiled kernel's logic
# Compiling takes seconds, so these tests replace torch.compile by a recorder whose "compiled"
# kernel runs the copied function as it is: what they check is which kernels are made, when they
# are used and what happens when they fail (test_recompute.py has the real compiled kernel).
@pytest.fixture
def fake_compile(monkeypatch):
    """torch.compile recorded (``compiled``: the functions and options it got; ``ran``: the
    index of the kernel each call ran; ``error``: raised by every kernel call when set), with
    an empty kernel cache and mode ``always``."""
    recorder = types.SimpleNamespace(compiled=[], ran=[], error=None)

    def compile_(fn, **options):
        index = len(recorder.compiled)
        recorder.compiled.append((fn, options))

        def kernel(*args):
            recorder.ran.append(index)
            if recorder.error is not None:
                raise recorder.error
            return fn(*args)

        return kernel

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(rotary, "_kernels", {})
    monkeypatch.setattr(rotary, "_settings", {**rotary._settings, "mode": "always", "failed": None})
    # mutmut wraps functions in trampolines; the kernel copies the code of the plain function
    monkeypatch.setattr(rotary, "_fused", inspect.unwrap(rotary._fused))
    return recorder


def _rotate_checked(x, cos, sin, pairing="half"):
    """rotate_tensor in training, checked against the pairwise rotation."""
    out = rotate_tensor(x, cos, sin, pairing, training=True)
    torch.testing.assert_close(out, rotation_by_pairs(x, cos, sin, pairing), **TOL64)
    return out


def test_each_kernel_variant_is_compiled_once_and_reused_across_lengths(fake_compile):
    """One kernel per (pairing, full or partial rotation, rank), whatever the length: each
    variant's calls at T = 3 and T = 20 run the same kernel, and no two variants share one."""
    variants = [(p, f, r) for p in PAIRINGS for f in (8, 6) for r in (4, 5)]  # D = 16
    used: dict[tuple, set[int]] = {v: set() for v in variants}
    for t in (3, 20):
        for pairing, rot_pairs, rank in variants:
            shape = (1, 2, t, 16) if rank == 4 else (1, 2, 2, t, 16)
            _rotate_checked(*_case(shape, rot_pairs), pairing)
            used[(pairing, rot_pairs, rank)].add(fake_compile.ran[-1])
    assert len(fake_compile.ran) == 2 * len(variants)  # every call ran a compiled kernel
    assert all(len(kernels) == 1 for kernels in used.values())
    assert len(set.union(*used.values())) == len(variants) == len(fake_compile.compiled)


def test_a_kernel_is_a_renamed_copy_of_the_fused_rotation_compiled_as_one_graph(fake_compile):
    """Each variant compiles its own copy of ``_fused``'s code (its own recompile budget),
    with fullgraph=True: a graph break is a compile failure (eager, with a warning) rather than
    a kernel silently split in pieces."""
    _rotate_checked(*_case((1, 2, 3, 16), 8), "half")
    _rotate_checked(*_case((1, 2, 3, 16), 8), "interleaved")
    fused = rotary._fused
    for index, (fn, options) in enumerate(fake_compile.compiled):
        assert options == {"fullgraph": True}
        assert fn is not fused and fn.__code__ is not fused.__code__
        assert fn.__code__.co_code == fused.__code__.co_code
        assert fn.__name__ == fn.__code__.co_name == f"_fused_{index}"


def test_a_variant_past_its_recompile_limit_turns_eager_quietly_until_set_compile(fake_compile):
    """Too many shapes for one variant: that variant runs eagerly from then on, with no
    warning and no recorded failure; other variants keep compiling; ``set_compile`` forgets
    the mark (and keeps the kernels that work)."""
    half, interleaved = _case((1, 2, 3, 16), 8), _case((1, 2, 3, 16), 8, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fake_compile.error = FailOnRecompileLimitHit("recompile_limit reached")
        _rotate_checked(*half)
        assert compile_settings()["failed"] is None
        _rotate_checked(*half)
        assert fake_compile.ran == [0]  # the second call did not try the kernel again
        fake_compile.error = None
        _rotate_checked(*interleaved, "interleaved")
        assert fake_compile.ran == [0, 1]
        set_compile("always")
        _rotate_checked(*half)
        _rotate_checked(*interleaved, "interleaved")
    assert fake_compile.ran == [0, 1, 2, 1] and len(fake_compile.compiled) == 3


def test_a_compile_failure_warns_once_and_keeps_the_eager_kernel_until_set_compile(fake_compile):
    """Any other compiler error: one RuntimeWarning (one line naming the error, its first 200
    characters, attributed to the caller rather than the kernel code), ``failed`` records it,
    and every rotation runs eagerly, silently, until ``set_compile`` forgets it."""
    message = "no working C compiler: " + "x" * 300
    fake_compile.error = RuntimeError(message)
    with pytest.warns(RuntimeWarning) as record:
        _rotate_checked(*_case((1, 2, 3, 16), 8))
    failed = f"RuntimeError: {message}"
    assert compile_settings()["failed"] == failed
    assert len(record) == 1 and record[0].category is RuntimeWarning
    text = str(record[0].message)
    assert f"({failed[:200]});" in text and "\n" not in text
    assert "torch.compile" in text
    assert text.endswith("); using the eager kernel for the rest of this process")
    assert record[0].filename != rotary.__file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _rotate_checked(*_case((1, 2, 3, 16), 8, seed=1))
        _rotate_checked(*_case((1, 2, 3, 16), 5, seed=2), "interleaved")
    assert fake_compile.ran == [0]  # nothing compiled or ran after the failure
    fake_compile.error = None
    set_compile("always")
    assert compile_settings()["failed"] is None
    _rotate_checked(*_case((1, 2, 3, 16), 8, seed=3))
    assert fake_compile.ran == [0, 0]


def test_set_compile_defaults_to_auto_and_refuses_a_negative_threshold(monkeypatch):
    monkeypatch.setattr(rotary, "_settings", {**rotary._settings})
    set_compile("never", min_numel=5)
    set_compile()
    assert compile_settings() == {"mode": "auto", "min_numel": 5, "failed": None}
    with pytest.raises(ValueError, match=r"^min_numel=-1 is not allowed; it must be >= 0$"):
        set_compile("never", min_numel=-1)
    assert compile_settings()["mode"] == "auto"
    set_compile("auto", min_numel=0)
    assert compile_settings()["min_numel"] == 0


# ----------------------------------------------------------------------------- refused inputs
def _tables(shape):
    phi = torch.rand(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return phi.cos().float(), phi.sin().float()


@pytest.mark.parametrize("fn", [rotate, rotate_reference])
def test_rotate_refuses_bad_tables_naming_the_shapes(fn):
    x = torch.randn(1, 2, 3, 8)
    cos, sin = _tables((1, 1, 3, 4))
    cases = [
        (
            (x, cos, sin, "diagonal"),
            "pairing='diagonal' is not allowed; use one of ('half', 'interleaved')",
        ),
        ((x, cos, sin[..., :3], "half"), "cos (1, 1, 3, 4) and sin (1, 1, 3, 3) differ in shape"),
        ((x[..., :7], cos, sin, "half"), "4 rotary pairs need head dim >= 8, got x (1, 2, 3, 7)"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            fn(*args)
    torch.testing.assert_close(fn(x, cos, sin, "half"), rotation_by_pairs(x, cos, sin, "half"))


def test_rotate_refuses_tables_of_another_rank():
    x = torch.randn(1, 2, 3, 8)
    cos, sin = _tables((3, 4))
    message = "tables (3, 4) must have as many dims as x (1, 2, 3, 8)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        rotate(x, cos, sin)


def test_rotate_angles_refuses_bad_inputs_naming_what_is_wrong():
    x = torch.randn(2, 2, 3, 8)  # B = 2, K = 2, T = 3, D = 8
    pos = torch.arange(3)[None]
    theta = torch.rand(2, 4, dtype=torch.float64)
    cases = [
        (
            (x, pos, theta, 1.0, "diagonal"),
            "pairing='diagonal' is not allowed; use one of ('half', 'interleaved')",
        ),
        ((x[0], pos, theta), "x (2, 3, 8) must be (B, K, T, D) or (B, K, g, T, D)"),
        (
            (x[None, None], pos, theta),
            "x (1, 1, 2, 2, 3, 8) must be (B, K, T, D) or (B, K, g, T, D)",
        ),
        ((x, pos[0], theta), "positions (3,) must be (B|1, T) with T = 3"),
        ((x, torch.arange(4)[None], theta), "positions (1, 4) must be (B|1, T) with T = 3"),
        ((x, pos.expand(3, 3), theta), "positions (3, 3) do not match batch 2"),
        ((x, pos, theta[0]), "theta (4,) must be (K|1, F) with K = 2"),
        ((x, pos, theta[:1].expand(3, 4)), "theta (3, 4) must be (K|1, F) with K = 2"),
        ((x, pos, torch.rand(2, 5, dtype=torch.float64)), "5 rotary pairs need head dim >= 10"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            rotary.rotate_angles(*args)


def test_rotate_angles_names_the_length_and_the_batch_of_grouped_queries():
    """For grouped queries (B, K, g, T, D) the messages name T (the next-to-last dim) and B
    (the first), not g or K: here B = 3, K = 2, g = 4, T = 5."""
    x = torch.randn(3, 2, 4, 5, 8)
    theta = torch.rand(2, 4, dtype=torch.float64)
    cases = [
        (torch.arange(4)[None], "positions (1, 4) must be (B|1, T) with T = 5"),
        (torch.arange(5)[None].expand(2, 5), "positions (2, 5) do not match batch 3"),
    ]
    for pos, message in cases:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            rotary.rotate_angles(x, pos, theta)


@pytest.mark.parametrize("learnable", ["x", "theta", "factor", None])
def test_rotate_angles_takes_the_training_kernel_when_any_input_needs_a_gradient(
    fake_compile, learnable
):
    """``auto`` compiles what autograd records: a rotation of x, of theta or of a tensor
    factor that needs a gradient (each alone), not one where none does or under no_grad."""
    set_compile("auto", min_numel=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 3, 8, generator=g, dtype=torch.float64)
    pos = torch.arange(3)[None]
    theta = torch.rand(2, 4, generator=g, dtype=torch.float64)
    factor = torch.tensor(1.25, dtype=torch.float64)
    {"x": x, "theta": theta, "factor": factor}.get(learnable, torch.empty(0)).requires_grad_()
    with torch.no_grad():
        rotary.rotate_angles(x, pos, theta, factor, "half", torch.float64)
    assert fake_compile.ran == []
    out = rotary.rotate_angles(x, pos, theta, factor, "half", torch.float64)
    assert fake_compile.ran == ([] if learnable is None else [0])
    phi = pos.double()[:, None, :, None] * theta.detach()[None, :, None, :]
    expected = rotation_by_pairs(x.detach(), 1.25 * phi.cos(), 1.25 * phi.sin(), "half")
    torch.testing.assert_close(out.detach(), expected, **TOL64)


@pytest.mark.parametrize(
    ("x_shape", "pos_rows", "theta_rows"),
    [((2, 2, 3, 8), 1, 1), ((2, 2, 3, 8), 2, 2), ((2, 2, 2, 3, 8), 2, 1)],
)
def test_rotate_angles_accepts_shared_or_per_row_positions_and_theta(x_shape, pos_rows, theta_rows):
    """The edges of what is allowed: positions of 1 or B rows, theta of 1 or K rows, as many
    pairs as the head dim holds (2F = D), 4-dim keys and 5-dim grouped queries."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 100, (pos_rows, 3), generator=g)
    theta = torch.rand(theta_rows, 4, generator=g, dtype=torch.float64)
    phi = pos.double()[:, None, :, None] * theta[None, :, None, :]
    if x.dim() == 5:
        phi = phi[:, :, None]
    expected = rotation_by_pairs(x, phi.cos(), phi.sin(), "half")
    got = rotary.rotate_angles(x, pos, theta, 1.0, "half", torch.float64)
    torch.testing.assert_close(got, expected, **TOL64)


# ----------------------------------------------------------------------------- kernel choice
def test_compile_mode_defaults_to_auto_and_names_the_allowed_modes(monkeypatch):
    monkeypatch.setattr(rotary, "_settings", {**rotary._settings, "mode": None})
    monkeypatch.delenv("ROPEKIT_COMPILE", raising=False)
    assert compile_settings()["mode"] == "auto"
    monkeypatch.setitem(rotary._settings, "mode", None)
    monkeypatch.setenv("ROPEKIT_COMPILE", "fast")
    message = "ROPEKIT_COMPILE='fast' is not allowed; use one of auto, always, never"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        rotary.check_environment()
    assert rotary._settings["mode"] is None  # read again next time
    monkeypatch.setenv("ROPEKIT_COMPILE", "always")
    rotary.check_environment()
    assert compile_settings()["mode"] == "always"


def test_the_compiled_kernel_is_chosen_from_min_numel_elements_on_cpu_or_cuda(monkeypatch):
    """``auto``: recorded rotations of at least ``min_numel`` elements; never on other devices
    or after a compile failure."""
    monkeypatch.setattr(rotary, "_settings", {**rotary._settings, "failed": None})
    x = torch.empty(2, 2, 2, 2)  # 16 elements
    set_compile("auto", min_numel=16)
    assert rotary._use_compiled(x, training=True)
    set_compile("auto", min_numel=17)
    assert not rotary._use_compiled(x, training=True)
    set_compile("always")
    assert rotary._use_compiled(x, training=False)
    assert not rotary._use_compiled(torch.empty(2, 2, 2, 2, device="meta"), training=True)
    rotary._settings["failed"] = "RuntimeError: no compiler"
    assert not rotary._use_compiled(x, training=True)


def _half_rotation(x, cos, sin):
    """The half pairing written out: channel f pairs with f + F, rotated by its angle."""
    F_ = cos.shape[-1]
    x1, x2 = x[..., :F_], x[..., F_ : 2 * F_]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * F_ :]], -1)


@pytest.mark.parametrize("which", ["cos", "sin"])
def test_a_table_that_alone_needs_a_gradient_gets_the_definitions(which):
    """Only cos (or only sin) requires grad, x does not: the rotation is still recorded for
    autograd and that table's gradient is the written-out rotation's."""
    from ropekit.encodings.rotary import rotate

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
    w = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
    grads = []
    for fn in (rotate, _half_rotation):
        t = torch.Generator().manual_seed(1)
        tables = {
            n: torch.randn(1, 1, 5, 4, generator=t, dtype=torch.float64) for n in ("cos", "sin")
        }
        tables[which].requires_grad_()
        (fn(x, tables["cos"], tables["sin"]) * w).sum().backward()
        grads.append(tables[which].grad)
    assert grads[0] is not None
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_rotation_keeps_x_for_backward_only_when_a_table_needs_a_gradient():
    """x is saved for the tables' gradients only: with fixed tables the backward needs cos and
    sin alone, so x's memory is not held by the graph."""
    from ropekit.encodings.rotary import rotate

    x = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = (
        torch.randn(1, 1, 5, 4, dtype=torch.float64),
        torch.randn(1, 1, 5, 4, dtype=torch.float64),
    )
    for tables_need_grad in (False, True):
        saved: list[torch.Tensor] = []
        c, s = cos.clone().requires_grad_(tables_need_grad), sin.clone()
        with torch.autograd.graph.saved_tensors_hooks(saved.append, lambda t: t):
            rotate(x, c, s)
        assert any(t.data_ptr() == x.data_ptr() for t in saved) == tables_need_grad
