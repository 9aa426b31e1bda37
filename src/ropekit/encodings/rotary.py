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

Holds: PAIRINGS, angles, tables, rotate, rotate_reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

PAIRINGS = ("half", "interleaved")


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


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, pairing: str) -> Tensor:
        n = cos.shape[-1]
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        _apply(out, x, c, s, n, pairing)
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
            grad_x = torch.empty_like(grad, memory_format=torch.contiguous_format)
            _apply(grad_x, grad, c, -s, n, pairing)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            g1, g2 = _pairs(grad.float(), n, pairing)
            x1, x2 = _pairs(x.float(), n, pairing)
            if ctx.needs_input_grad[1]:
                grad_cos = _sum_to(g1 * x1 + g2 * x2, c.shape).to(ctx.table_dtype)
            if ctx.needs_input_grad[2]:
                grad_sin = _sum_to(g2 * x1 - g1 * x2, s.shape).to(ctx.table_dtype)
        return grad_x, grad_cos, grad_sin, None


def rotate(x: Tensor, cos: Tensor, sin: Tensor, pairing: str = "half") -> Tensor:
    """Rotate the first 2F channels of x (B, H, T, D) by the tables (B|1, H|1, T, F).

    Computes in x's dtype with the float32 tables cast to it, as transformers does; gradients
    flow to x and, when they require grad, to cos and sin.
    """
    _check(x, cos, sin, pairing)
    if cos.dim() != x.dim():
        raise ValueError(f"tables {tuple(cos.shape)} must have as many dims as x {tuple(x.shape)}")
    return _Rotate.apply(x, cos, sin, pairing)
