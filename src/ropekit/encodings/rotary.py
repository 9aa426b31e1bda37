"""Rotation of query/key channel pairs: angle tables and the rotation itself.

Shape legend: B batch · H heads · T length · D head dim · F rotary pairs (D/2, fewer for
partial RoPE). Tables ``cos``/``sin`` are (B|1, H|1, T, F) and broadcast against x (B, H, T, D).

For each pair (x1, x2) at angle phi (RoPE paper, eq. 13):
    out1 = x1 cos(phi) - x2 sin(phi)
    out2 = x2 cos(phi) + x1 sin(phi)
Channels past the first 2F pass through unchanged (partial RoPE).

Pairings: ``half`` pairs channel f with f + F (GPT-NeoX / Llama ``rotate_half``);
``interleaved`` pairs 2f with 2f + 1 (GPT-J, the RoPE paper).

Two paths compute the same thing: ``rotate_reference`` (plain autograd ops, the oracle) and
``rotate`` (an autograd Function writing into one output buffer; backward is the inverse
rotation, plus gradients for cos/sin when they require grad, as AdaRoPE's learnable
frequencies do). Tests hold them together forward and backward.

The fast path has two kernels for the rotation itself (``rotate_tensor``):
- eager: four multiply/multiply-add ops on the pair halves, written into one output buffer
  (four passes over memory);
- compiled: the same formula through ``torch.compile`` (inductor emits one fused loop, a
  single read of x and write of the output: the speed of a copy). Compilation costs seconds
  (about 5-15 s on this 2-core CPU, once per new shape class, cached on disk by inductor) and
  keeps the compiler resident (30-50 MiB of the process, whatever the length), so ``auto``
  uses it only where it pays: in training, i.e. for a rotation autograd records (a forward
  and its backward on every step of the same shapes), on tensors of at least ``min_numel``
  elements (2^21 by default, where one call saves ~10 ms here and the compile pays for itself
  within about a thousand calls), and only where compilation works. Inference runs the eager
  kernel: there a model's attention and matmuls dominate (SmolLM2-135M, a 4,096-token
  forward patched with YaRN: 22.5 s eager against 23.3 s compiled, one thread), and the
  compiler's memory was the whole of a patched model's extra resident peak (+32 MiB at 16k;
  with the eager kernel patched and unpatched peaks are equal). Any compile failure falls back
  to eager for the rest of the process, with one warning. ``ROPEKIT_COMPILE=auto|always|never``
  (read when the first encoding is built or the first rotation runs, not at import; a bad
  value is a one-line ValueError there) or ``set_compile`` choose; ``always`` compiles
  inference too, ``never`` is the eager path everywhere.

Learnable frequencies (AdaRoPE, tuned-yarn) rotate through ``rotate_angles``: it takes the
positions and the frequencies theta instead of tables, forms cos/sin inside, and in backward
forms them again rather than keeping them. The gradient for theta needs no stored input either:
out = a R(phi) x gives d out / d phi = J out (J turns each pair (o1, o2) into (-o2, o1)), so
it is computed from the output, which the next op (AdaScale, attention) keeps anyway. Per call
this drops the saved float64 angles plus float32 cos and sin (16 bytes per table element,
for q and again for k in every layer) and the saved unrotated input.

Holds: PAIRINGS, angles, tables, rotate, rotate_reference, rotate_tensor, rotate_angles,
set_compile, compile_settings, check_environment.
"""

from __future__ import annotations

import os
import types
import warnings
from typing import Any

import torch
from torch import Tensor

PAIRINGS = ("half", "interleaved")
COMPILE_MODES = ("auto", "always", "never")


def angles(positions: Tensor, inv_freq: Tensor) -> Tensor:
    """phi = position * theta in float64: (..., T) x (..., F) -> (..., T, F).

    Precision trap: in float32 the angle at position 65,536 for theta = 1 carries an error of
    about 65,536 * 6e-8 = 4e-3 rad; float64 keeps it below 1e-11. Positions are never bf16.
    """
    with torch.autocast(device_type=positions.device.type, enabled=False):
        return positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)[..., None, :]


def tables(
    phi: Tensor, attention_factor: float | Tensor = 1.0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles, times the attention factor (YaRN's mscale), in ``dtype``
    (float32 by default; float64 for gradient checks)."""
    if isinstance(attention_factor, float | int) and attention_factor == 1:
        return phi.cos().to(dtype), phi.sin().to(dtype)  # x * 1 == x: skip a pass
    cos = (phi.cos() * attention_factor).to(dtype)
    sin = (phi.sin() * attention_factor).to(dtype)
    return cos, sin


def _pairs(x: Tensor, n: int, pairing: str) -> tuple[Tensor, Tensor]:
    """Views of the two members of each of the n pairs."""
    if pairing == "half":
        return x[..., :n], x[..., n : 2 * n]
    return x[..., 0 : 2 * n : 2], x[..., 1 : 2 * n : 2]


def _check(x: Tensor, cos: Tensor, sin: Tensor, pairing: str) -> int:
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing={pairing!r} is not allowed; use one of {PAIRINGS}")
    n = cos.shape[-1]
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    if 2 * n > x.shape[-1]:
        raise ValueError(f"{n} rotary pairs need head dim >= {2 * n}, got x {tuple(x.shape)}")
    return n


def rotate_reference(x: Tensor, cos: Tensor, sin: Tensor, pairing: str = "half") -> Tensor:
    """The oracle: the rotation written with plain autograd ops, computed in float32."""
    n = _check(x, cos, sin, pairing)
    x1, x2 = _pairs(x.float(), n, pairing)
    out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if pairing == "half":
        rotated = torch.cat((out1, out2), dim=-1)
    else:
        rotated = torch.stack((out1, out2), dim=-1).flatten(-2)  # (..., F, 2) -> (..., 2F)
    return torch.cat((rotated, x[..., 2 * n :].float()), dim=-1).to(x.dtype)


def _sum_to(t: Tensor, shape: torch.Size) -> Tensor:
    """Reduce a broadcast gradient back to ``shape`` (the table's broadcast dims)."""
    dims = tuple(
        i for i, (a, b) in enumerate(zip(t.shape, shape, strict=True)) if b == 1 and a != 1
    )
    return t.sum(dim=dims, keepdim=True) if dims else t


def _apply(out: Tensor, x: Tensor, cos: Tensor, sin: Tensor, n: int, pairing: str) -> None:
    """out = R(phi) x, written pair-half by pair-half with no full-size temporaries."""
    x1, x2 = _pairs(x, n, pairing)
    o1, o2 = _pairs(out, n, pairing)
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    if 2 * n < x.shape[-1]:
        out[..., 2 * n :] = x[..., 2 * n :]


def _fused(x: Tensor, cos: Tensor, sin: Tensor, pairing: str) -> Tensor:
    """The rotation as one expression, for torch.compile to fuse into a single loop."""
    n = cos.shape[-1]
    x1, x2 = _pairs(x, n, pairing)
    out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if pairing == "half":
        rotated = torch.cat((out1, out2), dim=-1)
    else:
        rotated = torch.stack((out1, out2), dim=-1).flatten(-2)  # (..., F, 2) -> (..., 2F)
    if 2 * n < x.shape[-1]:
        rotated = torch.cat((rotated, x[..., 2 * n :]), dim=-1)
    return rotated


_settings: dict[str, Any] = {
    # None until first use: ``ROPEKIT_COMPILE`` is read (and checked) then, not at import, so a
    # bad value cannot break ``import ropekit`` and is reported where it matters.
    "mode": None,
    "min_numel": 1 << 21,
    "failed": None,  # why compilation failed (then eager for the rest of the process)
}


def check_environment() -> None:
    """Read and check ``ROPEKIT_COMPILE`` now: a one-line ValueError naming the value and the
    allowed modes when it is bad. Encodings call it when they are built, so a bad value stops
    a program when it makes its model, before it writes or computes anything."""
    _mode()


def _mode() -> str:
    """The kernel mode: set by ``set_compile``, else ``ROPEKIT_COMPILE`` (default auto), read
    on first use; a bad value raises a one-line ValueError (and is read again next time)."""
    if _settings["mode"] is None:
        mode = os.environ.get("ROPEKIT_COMPILE", "auto")
        if mode not in COMPILE_MODES:
            raise ValueError(
                f"ROPEKIT_COMPILE={mode!r} is not allowed; use one of {', '.join(COMPILE_MODES)}"
            )
        _settings["mode"] = mode
    return _settings["mode"]


# One compiled kernel per (device type, dtype, rank, pairing, partial): each wraps its own copy
# of _fused's code object, so every variant gets dynamo's full recompile budget (shape and
# stride changes) instead of all variants sharing one. None marks a variant that ran out of it.
_kernels: dict[tuple, Any] = {}


def set_compile(mode: str = "auto", min_numel: int | None = None) -> None:
    """Choose the rotation kernel: ``auto`` (compiled in training, for tensors of at least
    ``min_numel`` elements, where compilation works), ``always`` (compiled wherever it works,
    inference included) or ``never`` (eager everywhere). Also forgets recorded compile
    failures, so the next call tries again."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode={mode!r} is not allowed; use one of {COMPILE_MODES}")
    if min_numel is not None and min_numel < 0:
        raise ValueError(f"min_numel={min_numel} is not allowed; it must be >= 0")
    _settings["mode"] = mode
    if min_numel is not None:
        _settings["min_numel"] = int(min_numel)
    _settings["failed"] = None
    for key in [k for k, v in _kernels.items() if v is None]:
        del _kernels[key]


def compile_settings() -> dict[str, Any]:
    """The current mode, threshold and compile failure (None when none happened)."""
    _mode()
    return {k: _settings[k] for k in ("mode", "min_numel", "failed")}


def _use_compiled(x: Tensor, training: bool) -> bool:
    """Whether this rotation takes the compiled kernel; ``training``: autograd records it."""
    mode = _mode()
    if mode == "never" or _settings["failed"] is not None:
        return False
    if mode == "auto" and (not training or x.numel() < _settings["min_numel"]):
        return False
    # Inside someone else's torch.compile trace the caller's compiler fuses the eager ops.
    return x.device.type in ("cpu", "cuda") and not torch.compiler.is_compiling()


def _kernel(key: tuple) -> Any:
    if key not in _kernels:
        code = _fused.__code__.replace(co_name=f"_fused_{len(_kernels)}")
        fn = types.FunctionType(code, _fused.__globals__, code.co_name, _fused.__defaults__)
        _kernels[key] = torch.compile(fn, fullgraph=True)
    return _kernels[key]


def _compiled(x: Tensor, cos: Tensor, sin: Tensor, pairing: str) -> Tensor | None:
    """The compiled kernel's output, or None: this variant or every compile failed."""
    key = (x.device.type, x.dtype, x.dim(), pairing, 2 * cos.shape[-1] < x.shape[-1])
    kernel = _kernel(key)
    if kernel is None:
        return None
    try:
        return kernel(x, cos, sin, pairing)
    except Exception as e:  # any compiler failure means: use the eager kernel
        if "RecompileLimit" in type(e).__name__:
            _kernels[key] = None  # too many shapes for this variant: eager for it from now on
            return None
        _settings["failed"] = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"ropekit: torch.compile of the rotary kernel failed ({_settings['failed'][:200]}); "
            "using the eager kernel for the rest of this process",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def rotate_tensor(
    x: Tensor, cos: Tensor, sin: Tensor, pairing: str, *, training: bool = False
) -> Tensor:
    """R(phi) x as a new contiguous tensor, no autograd: tables already in x's dtype and
    broadcastable to x's leading dims. ``training``: the call is part of a step autograd
    records (a forward whose backward will run, or that backward). The compiled kernel where
    it pays (module docstring), else the eager one."""
    if _use_compiled(x, training):
        out = _compiled(x, cos, sin, pairing)
        if out is not None:
            return out
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _apply(out, x, cos, sin, cos.shape[-1], pairing)
    return out


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, pairing: str, training: bool) -> Tensor:
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        out = rotate_tensor(x, c, s, pairing, training=training)
        ctx.pairing = pairing
        ctx.save_for_backward(
            x if ctx.needs_input_grad[1] or ctx.needs_input_grad[2] else None, c, s
        )
        ctx.table_dtype = cos.dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, c, s = ctx.saved_tensors
        n, pairing = c.shape[-1], ctx.pairing
        grad_x = grad_cos = grad_sin = None
        if ctx.needs_input_grad[0]:
            # R(phi)^T = R(-phi): the inverse rotation carries the gradient back.
            grad_x = rotate_tensor(grad, c, -s, pairing, training=True)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            # At least float32 (a bf16 table gradient summed over positions loses digits),
            # float64 when the activations are: a float64 check must see float64 throughout.
            acc = torch.promote_types(x.dtype, torch.float32)
            g1, g2 = _pairs(grad.to(acc), n, pairing)
            x1, x2 = _pairs(x.to(acc), n, pairing)
            if ctx.needs_input_grad[1]:
                grad_cos = _sum_to(g1 * x1 + g2 * x2, c.shape).to(ctx.table_dtype)
            if ctx.needs_input_grad[2]:
                grad_sin = _sum_to(g2 * x1 - g1 * x2, s.shape).to(ctx.table_dtype)
        return grad_x, grad_cos, grad_sin, None, None


def _recorded(*inputs: Tensor) -> bool:
    """Whether autograd records a rotation of these inputs (its backward may run): decided
    before ``Function.apply``, since grad mode is off inside ``forward`` and
    ``ctx.needs_input_grad`` is set under ``torch.no_grad`` too."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, pairing: str = "half") -> Tensor:
    """Rotate the first 2F channels of x (B, H, T, D) by the tables (B|1, H|1, T, F).

    Computes in x's dtype with the float32 tables cast to it, as transformers does; gradients
    flow to x and, when they require grad, to cos and sin.
    """
    _check(x, cos, sin, pairing)
    if cos.dim() != x.dim():
        raise ValueError(f"tables {tuple(cos.shape)} must have as many dims as x {tuple(x.shape)}")
    return _Rotate.apply(x, cos, sin, pairing, _recorded(x, cos, sin))


def _angle_tables(
    positions: Tensor,
    theta: Tensor,
    factor: float | Tensor,
    table_dtype: torch.dtype,
    x: Tensor,
) -> tuple[Tensor, Tensor]:
    """cos, sin in x's dtype, shaped (B|1, K|1, [1,] T, F) to broadcast against x."""
    phi = angles(positions[:, None, :], theta[None])  # (B|1, K|1, T, F) float64
    if x.dim() == 5:
        phi = phi[:, :, None]  # (B|1, K|1, 1, T, F): one table for the g heads of a group
    cos, sin = tables(phi, factor, table_dtype)
    return cos.to(x.dtype), sin.to(x.dtype)


class _RotateAngles(torch.autograd.Function):
    """R(positions * theta) x, tables formed in forward and again in backward, never saved."""

    @staticmethod
    def forward(ctx, x, positions, theta, factor, pairing, table_dtype, training):
        with torch.no_grad():
            cos, sin = _angle_tables(positions, theta, factor, table_dtype, x)
        out = rotate_tensor(x, cos, sin, pairing, training=training)
        tensor_factor = isinstance(factor, Tensor)
        need_out = ctx.needs_input_grad[2] or (tensor_factor and ctx.needs_input_grad[3])
        ctx.save_for_backward(
            out if need_out else None, positions, theta, factor if tensor_factor else None
        )
        ctx.factor = None if tensor_factor else factor
        ctx.pairing, ctx.table_dtype = pairing, table_dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        out, positions, theta, factor_tensor = ctx.saved_tensors
        factor = ctx.factor if factor_tensor is None else factor_tensor
        grad_x = grad_theta = grad_factor = None
        cos, sin = _angle_tables(positions, theta, factor, ctx.table_dtype, grad)
        if ctx.needs_input_grad[0]:
            grad_x = rotate_tensor(grad, cos, -sin, ctx.pairing, training=True)  # R^T = R(-phi)
        del cos, sin
        want_theta = ctx.needs_input_grad[2]
        want_factor = factor_tensor is not None and ctx.needs_input_grad[3]
        if want_theta or want_factor:
            acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
            n = theta.shape[-1]
            g1, g2 = _pairs(grad.to(acc), n, ctx.pairing)
            o1, o2 = _pairs(out.to(acc), n, ctx.pairing)
            if want_theta:
                # dL/dphi = g . J out = g2 o1 - g1 o2, summed over what shares one angle: the g
                # query heads of a group, the rows sharing positions (B|1), the heads sharing
                # theta (K|1).
                gphi = torch.mul(g2, o1).addcmul_(g1, o2, value=-1)  # (B, K, [g,] T, F)
                if gphi.dim() == 5:
                    gphi = gphi.sum(2) if gphi.shape[2] > 1 else gphi.squeeze(2)
                if positions.shape[0] == 1 and gphi.shape[0] > 1:
                    gphi = gphi.sum(0, keepdim=True)
                if theta.shape[0] == 1 and gphi.shape[1] > 1:
                    gphi = gphi.sum(1, keepdim=True)  # (B|1, K|1, T, F)
                # dphi/dtheta = position: summed over rows and time in float64, as the angles.
                pos = positions.to(torch.float64)[:, None, :, None]  # (B|1, 1, T, 1)
                grad_theta = (gphi.to(torch.float64) * pos).sum(dim=(0, 2))  # (K|1, F)
                grad_theta = grad_theta.to(theta.dtype)
                del gphi
            if want_factor:
                # out is linear in the factor: dL/da = sum(g . out) / a over the rotated pairs.
                dot = (g1 * o1).sum(dtype=torch.float64) + (g2 * o2).sum(dtype=torch.float64)
                grad_factor = (dot / factor).to(factor_tensor.dtype).reshape(factor_tensor.shape)
        return grad_x, None, grad_theta, grad_factor, None, None, None


def rotate_angles(
    x: Tensor,
    positions: Tensor,
    theta: Tensor,
    factor: float | Tensor = 1.0,
    pairing: str = "half",
    table_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Rotate x by phi = positions * theta without keeping angle tables for backward.

    x (B, K, T, D), or (B, K, g, T, D) for g query heads that share the tables of key head k;
    positions (B|1, T) integers; theta (K|1, F) frequencies (float64, learnable); factor the
    cos/sin scale (YaRN's attention factor; a float or a learnable 0-dim tensor). Equals
    ``rotate(x, *tables(angles(...), factor, table_dtype), pairing)`` forward and backward
    (gradients for x, theta and a tensor factor), with cos/sin recomputed in backward.
    """
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing={pairing!r} is not allowed; use one of {PAIRINGS}")
    if x.dim() not in (4, 5):
        raise ValueError(f"x {tuple(x.shape)} must be (B, K, T, D) or (B, K, g, T, D)")
    if positions.dim() != 2 or positions.shape[-1] != x.shape[-2]:
        raise ValueError(
            f"positions {tuple(positions.shape)} must be (B|1, T) with T = {x.shape[-2]}"
        )
    if positions.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"positions {tuple(positions.shape)} do not match batch {x.shape[0]}")
    if theta.dim() != 2 or theta.shape[0] not in (1, x.shape[1]):
        raise ValueError(f"theta {tuple(theta.shape)} must be (K|1, F) with K = {x.shape[1]}")
    if 2 * theta.shape[-1] > x.shape[-1]:
        raise ValueError(f"{theta.shape[-1]} rotary pairs need head dim >= {2 * theta.shape[-1]}")
    training = _recorded(x, theta, *([factor] if isinstance(factor, Tensor) else []))
    return _RotateAngles.apply(x, positions, theta, factor, pairing, table_dtype, training)
