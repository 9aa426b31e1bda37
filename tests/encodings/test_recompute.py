"""Learnable rotary encodings recompute cos/sin in backward (``rotate_angles``): the same
numbers as the stored-table path, forward and backward, with less saved for backward; and the
compiled rotation kernel against the eager one."""

from __future__ import annotations

import pytest
import torch

from ropekit.encodings import build
from ropekit.encodings.rotary import (
    PAIRINGS,
    angles,
    compile_settings,
    rotate,
    rotate_angles,
    rotate_reference,
    set_compile,
    tables,
)

from .conftest import SHAPE, perturb
from .test_rotary import rotation_by_pairs

LEARNED_SPECS = [
    "adarope",
    "adarope:init=yarn,factor=8,original_length=64",
    "adarope:share_heads=true,share_layers=true,pairing=interleaved",
    "adarope:scale=false,fraction=0.5",
    "adarope:freq=false",
    "tuned-yarn:factor=8,original_length=64",
]


def _run(enc, q, k, pos, layer, stored):
    """Rotated q, k and the gradients of a fixed random projection w.r.t. q, k and every
    encoding parameter."""
    enc.stored_tables = stored
    q, k = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    out_q, out_k = enc.rotate_q(q, pos, layer), enc.rotate_k(k, pos, layer)
    g = torch.Generator().manual_seed(5)
    wq = torch.randn(out_q.shape, generator=g, dtype=torch.float64).to(q.dtype)
    wk = torch.randn(out_k.shape, generator=g, dtype=torch.float64).to(k.dtype)
    loss = (out_q * wq).double().sum() + (out_k * wk).double().sum()
    params = dict(enc.named_parameters())
    grads = torch.autograd.grad(loss, [q, k, *params.values()])
    return out_q, out_k, dict(zip(["q", "k", *params], grads, strict=True))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", LEARNED_SPECS)
def test_recomputed_tables_equal_stored_tables_forward_and_backward(spec, dtype):
    enc = perturb(build(spec, **SHAPE))
    if dtype == torch.float64:
        enc = enc.double()
    g = torch.Generator().manual_seed(0)
    B, T, D = 2, 9, SHAPE["head_dim"]
    q = torch.randn(B, SHAPE["n_heads"], T, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, SHAPE["n_kv_heads"], T, D, generator=g, dtype=torch.float64).to(dtype)
    # Packed rows with large offsets: the frequency gradient is weighted by the position.
    pos = torch.tensor(
        [[0, 1, 2, 3, 0, 1, 2, 3, 4], [500, 501, 502, 503, 504, 9000, 9001, 9002, 9003]]
    )
    stored_q, stored_k, stored = _run(enc, q, k, pos, 1, stored=True)
    new_q, new_k, new = _run(enc, q, k, pos, 1, stored=False)
    # Forward: the same tables through the same kernel, bit for bit.
    assert torch.equal(new_q, stored_q) and torch.equal(new_k, stored_k)
    # Backward: the stored path forms table gradients in float32 (even for float64 inputs) and
    # chains them through cos/sin; the recomputed one uses the output (d out/d phi = J out) in
    # the input's precision. They agree to the stored path's float32 rounding.
    rel = {torch.float64: 1e-5, torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    assert new.keys() == stored.keys()
    for name, a in new.items():
        b = stored[name]
        scale = b.abs().max().item() or 1.0
        torch.testing.assert_close(
            a.double(), b.double(), rtol=rel, atol=rel * scale, msg=f"{spec} {dtype}: {name}"
        )


def test_recomputed_gradients_pass_gradcheck_in_float64():
    """Against finite differences, not just against the stored path: x, theta and a factor."""
    g = torch.Generator().manual_seed(1)
    pos = torch.tensor([[0, 3, 9, 17, 40]])
    for pairing in PAIRINGS:
        for grouped in (False, True):
            shape = (1, 2, 3, 5, 8) if grouped else (1, 2, 5, 8)
            x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
            theta = (0.1 * torch.rand(2, 3, generator=g, dtype=torch.float64)).requires_grad_()
            factor = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)

            def f(a, t, c, p=pairing):
                return rotate_angles(a, pos, t, c, p, torch.float64)

            assert torch.autograd.gradcheck(f, (x, theta, factor))


def test_shared_table_gradient_sums_over_heads_and_batch():
    """theta (1, F) serving K heads and positions (1, T) serving B rows: gradients reduce."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 6, 8, generator=g, dtype=torch.float64)
    theta = torch.rand(1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(6)[None] * 7
    w = torch.randn(3, 2, 6, 8, generator=g, dtype=torch.float64)
    (rotate_angles(x, pos, theta, 1.0, "half", torch.float64) * w).sum().backward()
    ours = theta.grad.clone()
    theta.grad = None
    cos, sin = tables(angles(pos[:, None], theta[None]), 1.0, torch.float64)  # (1, 1, T, F)
    x1, x2 = x[..., :4], x[..., 4:]  # plain float64 autograd ops (rotate_reference is float32)
    (torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1) * w).sum().backward()
    torch.testing.assert_close(ours, theta.grad, rtol=1e-10, atol=1e-10)


# (x shape, rows of positions, rows of theta, rotary pairs F, pairing): the ways rotate_angles
# shares one angle between elements, each of which its theta gradient must sum over.
GEOMETRIES = [
    ((2, 2, 2, 1, 6), 2, 2, 3, "half"),  # a decode step (T = 1), g = 2 query heads per key
    ((1, 2, 1, 3, 6), 1, 2, 3, "interleaved"),  # g = 1: as many query heads as key heads
    ((2, 2, 3, 5), 1, 2, 2, "half"),  # positions shared by a batch of 2; partial rotation
    ((3, 2, 1, 4), 3, 1, 2, "interleaved"),  # one position per row (T = 1), theta shared
    ((1, 2, 3, 2), 1, 2, 1, "half"),  # one pair per head
    ((2, 3, 2, 2, 4), 1, 1, 2, "interleaved"),  # everything shared
]


@pytest.mark.parametrize("learnable_factor", [False, True])
@pytest.mark.parametrize(("x_shape", "pos_rows", "theta_rows", "n", "pairing"), GEOMETRIES)
def test_rotate_angles_gradients_are_autograds_through_the_pairwise_rotation(
    x_shape, pos_rows, theta_rows, n, pairing, learnable_factor
):
    """Gradients for x, theta and a tensor factor against autograd through the plain
    definition: phi = position * theta, cos/sin times the factor, the pairwise rotation; in
    float64, to round-off."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(x_shape, generator=g, dtype=torch.float64, requires_grad=True)
    positions = torch.randint(0, 1000, (pos_rows, x_shape[-2]), generator=g)
    theta = torch.rand(theta_rows, n, generator=g, dtype=torch.float64).requires_grad_()
    factor = torch.tensor(1.3, dtype=torch.float64, requires_grad=True) if learnable_factor else 1.3
    phi = positions.double()[:, None, :, None] * theta[None, :, None, :]  # (B|1, K|1, T, F)
    if x.dim() == 5:
        phi = phi[:, :, None]  # one angle for the g query heads of a key head
    expected = rotation_by_pairs(x, phi.cos() * factor, phi.sin() * factor, pairing)
    got = rotate_angles(x, positions, theta, factor, pairing, torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    w = torch.randn(got.shape, generator=g, dtype=torch.float64)
    inputs = [x, theta, *([factor] if learnable_factor else [])]
    for a, b in zip(
        torch.autograd.grad(got, inputs, w), torch.autograd.grad(expected, inputs, w), strict=True
    ):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_rotate_angles_with_a_frozen_theta_and_factor_back_propagates_to_x_only():
    """A frozen schedule (theta and a tensor factor that need no gradient): x still gets its
    gradient, the factor times the inverse rotation, without the output being kept."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(5)[None] * 7
    theta = torch.rand(2, 4, generator=g, dtype=torch.float64)
    factor = torch.tensor(1.3, dtype=torch.float64)
    out = rotate_angles(x, positions, theta, factor, "half", torch.float64)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (grad_x,) = torch.autograd.grad(out, x, w)
    phi = positions.double()[:, None, :, None] * theta[None, :, None, :]
    expected = 1.3 * rotation_by_pairs(w, phi.cos(), -phi.sin(), "half")  # R(phi)^T = R(-phi)
    torch.testing.assert_close(grad_x, expected, rtol=1e-12, atol=1e-12)


def test_rotate_angles_backward_uses_tables_rounded_to_table_dtype_as_forward_does():
    """Float64 activations with float32 tables (the default table dtype): the backward is the
    transpose of the rotation forward applied, by float32-rounded tables, so it equals the
    stored-table path to the last bit; float64 tables in backward would be off by ~1e-8."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(6)[None] * 9_973
    theta = torch.rand(2, 4, generator=g, dtype=torch.float64)
    out = rotate_angles(x, positions, theta)
    cos, sin = tables(angles(positions[:, None], theta[None]))  # float32
    stored = rotate(x, cos, sin)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (grad_recomputed,) = torch.autograd.grad(out, x, w)
    (grad_stored,) = torch.autograd.grad(stored, x, w)
    torch.testing.assert_close(out, stored, rtol=0, atol=1e-15)
    torch.testing.assert_close(grad_recomputed, grad_stored, rtol=0, atol=1e-15)


def test_rotate_angles_theta_gradient_forms_bf16_products_in_float32():
    """dL/dtheta_f = sum over rows, heads and time of position * (g2 o1 - g1 o2) (g . J out, J
    turning (o1, o2) into (-o2, o1)). With bf16 activations each product is formed in float32
    (exact for bf16 factors) and the sum taken in float64, so the gradient equals the float64
    sum to float32 round-off; products rounded to bf16 would be off by ~1e-3 of it."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 2, 64, 8, generator=g).bfloat16()
    positions = torch.arange(64)[None] * 37
    theta = (0.1 * torch.rand(2, 4, generator=g, dtype=torch.float64)).requires_grad_()
    out = rotate_angles(x, positions, theta)
    w = torch.randn(out.shape, generator=g).bfloat16()
    (grad_theta,) = torch.autograd.grad(out, theta, w)
    o1, o2, g1, g2 = (t[..., i : i + 4].double() for t in (out, w) for i in (0, 4))
    pos = positions.double()[:, None, :, None]
    expected = (pos * (g2 * o1 - g1 * o2)).sum(dim=(0, 2))  # (K, F)
    scale = (pos * ((g2 * o1).abs() + (g1 * o2).abs())).sum(dim=(0, 2))
    assert ((grad_theta - expected).abs() <= 1e-6 * scale).all()


def test_rotate_angles_factor_gradient_is_summed_in_float64():
    """dL/da = sum(g . out) / a (out is linear in the factor a), summed in float64: float32
    activations contributing 1 and 2^-30 to each half of the sum give 2 (1 + 2^-30); a float32
    sum would round each half to 1."""
    x = torch.tensor([1.0, 1.0, 2**-15, 2**-15]).reshape(1, 1, 2, 2)  # two positions, one pair
    factor = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    theta = torch.tensor([[0.7]], dtype=torch.float64)
    out = rotate_angles(x, torch.zeros(1, 2, dtype=torch.long), theta, factor)  # phi = 0
    assert torch.equal(out, x)
    (grad_factor,) = torch.autograd.grad(out, factor, x)  # g = x
    assert grad_factor.dtype == torch.float64 and grad_factor.item() == 2 * (1 + 2**-30)


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while fn runs (each storage counted once)."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_recompute_keeps_no_tables_for_backward():
    enc = perturb(build("adarope", n_heads=4, n_kv_heads=2, head_dim=32, n_layers=2))
    q = torch.randn(1, 4, 512, 32, requires_grad=True)
    k = torch.randn(1, 2, 512, 32, requires_grad=True)
    pos = torch.arange(512)[None]

    def layer(stored):
        enc.stored_tables = stored

        def fn():
            out_q = enc.rotate_q(q, pos, 1)  # rotation then AdaScale, which keeps its input
            out_k = enc.rotate_k(k, pos, 1)
            return out_q, out_k

        return fn

    stored, recomputed = _saved_bytes(layer(True)), _saved_bytes(layer(False))
    table = 2 * 512 * 16  # (1, K, T, F) elements of one table
    # Stored: float64 angles + float32 cos and sin (16 bytes per table element), for q and k,
    # plus the unrotated q and k. Recomputed: the rotated q and k (which AdaScale and attention
    # keep anyway in a model), positions, theta and AdaScale's temperature.
    assert stored - recomputed >= 2 * 16 * table
    assert recomputed <= (q.numel() + k.numel()) * 4 + 64 * 1024
    # The output is kept only for theta's or a learnable factor's gradient (d out / d phi =
    # J out); x's alone (a frozen schedule, float or tensor factor) needs nothing x-sized.
    theta = enc.inv_freq(1)[0].detach()
    for factor in (1.3, torch.tensor(1.3, dtype=torch.float64)):
        assert _saved_bytes(lambda f=factor: rotate_angles(k, pos, theta, f)) < k.numel() * 4


@pytest.fixture
def compiled():
    before = compile_settings()
    set_compile("always")
    yield
    set_compile(before["mode"], before["min_numel"])


def test_auto_mode_keeps_small_tensors_and_inference_on_the_eager_kernel():
    from ropekit.encodings import rotary

    x = torch.empty(4, 4, 4, 4)
    before = compile_settings()
    try:
        set_compile("auto", min_numel=1 << 30)
        assert not rotary._use_compiled(x, training=True)
        set_compile("never", min_numel=0)
        assert not rotary._use_compiled(x, training=True)
        set_compile("auto", min_numel=0)
        assert rotary._use_compiled(x, training=True)
        assert not rotary._use_compiled(x, training=False)
        set_compile("always", min_numel=1 << 30)
        assert rotary._use_compiled(x, training=False)
        with pytest.raises(ValueError, match="mode='fast'"):
            set_compile("fast")
    finally:
        set_compile(before["mode"], before["min_numel"])


@pytest.mark.parametrize("learnable", [False, True])
def test_auto_mode_compiles_what_autograd_records_and_nothing_else(monkeypatch, learnable):
    """Training (a recorded rotation and its backward) takes the compiled kernel; inference,
    under no_grad or on tensors that need no gradient, stays eager even when its inputs are
    parameters (AdaRoPE's theta evaluated under no_grad)."""
    from ropekit.encodings import rotary

    calls: list[bool] = []

    def spy(x, cos, sin, pairing):
        calls.append(True)
        return None  # as if this variant could not compile: the eager kernel runs

    monkeypatch.setattr(rotary, "_compiled", spy)
    before = compile_settings()
    set_compile("auto", min_numel=0)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 2, 5, 8, generator=g)
        pos = torch.arange(5)[None]
        theta = torch.rand(2, 4, dtype=torch.float64, generator=g).requires_grad_(learnable)

        def run(x: torch.Tensor) -> torch.Tensor:
            if learnable:
                return rotary.rotate_angles(x, pos, theta)
            cos, sin = tables(angles(pos[:, None], theta.detach()[:1]))
            return rotate(x, cos, sin)

        with torch.no_grad():
            run(x.requires_grad_(True))
        assert calls == []
        if not learnable:
            run(x.detach())
            assert calls == []
        out = run(x.detach().requires_grad_(True))
        assert len(calls) == 1
        out.sum().backward()
        assert len(calls) == 2  # the backward's inverse rotation
    finally:
        set_compile(before["mode"], before["min_numel"])


@pytest.mark.slow
@pytest.mark.parametrize("pairing", PAIRINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_pairs", [8, 5])
def test_compiled_kernel_matches_reference_forward_and_backward(
    compiled, pairing, dtype, rot_pairs
):
    g = torch.Generator().manual_seed(0)
    # A transposed view, as attention hands q and k over.
    x = torch.randn(2, 7, 3, 16, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    phi = angles(torch.randint(0, 50_000, (2, 7), generator=g), torch.rand(rot_pairs, generator=g))
    cos, sin = tables(phi[:, None])
    cos.requires_grad_()
    sin.requires_grad_()
    fast = rotate(x, cos, sin, pairing)
    assert compile_settings()["failed"] is None
    ref = rotate_reference(x, cos, sin, pairing)
    tol = {torch.float32: 2e-6, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)
    grad = torch.randn(fast.shape, generator=g).to(dtype)
    fast_grads = torch.autograd.grad(fast, (x, cos, sin), grad)
    ref_grads = torch.autograd.grad(ref, (x, cos, sin), grad)
    for a, b in zip(fast_grads, ref_grads, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol * 10, atol=tol * 10)
