"""Rotary apply: ropekit's fast path vs transformers' ``apply_rotary_pos_emb`` on the same
tensors (fp32 and bf16; forward, and forward+backward), and vs a plain copy of q and k (the
memory-bound floor). Shape 1x16x4096x64 as in DESIGN.md's known figures.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ropekit.encodings import build

from .common import Result, best_time


def run(device: str = "cpu", T: int = 4096) -> list[Result]:
    torch.manual_seed(0)
    results = []
    enc = build("rope", n_heads=16, head_dim=64)
    pos = torch.arange(T, device=device)[None]
    cos_half, sin_half = enc.tables(pos)  # (1, 1, T, 32): ropekit's tables
    # transformers' tables: (1, T, 64), the two halves repeated (LlamaRotaryEmbedding layout).
    cos_hf = torch.cat((cos_half, cos_half), -1)[:, 0]
    sin_hf = torch.cat((sin_half, sin_half), -1)[:, 0]
    for dtype in (torch.float32, torch.bfloat16):
        results += _compare(enc, pos, cos_hf, sin_hf, dtype, device, T)
    return results


def _compare(enc, pos, cos_hf, sin_hf, dtype, device, T) -> list[Result]:
    results = []
    q = torch.randn(1, 16, T, 64, device=device, dtype=dtype)
    k = torch.randn(1, 16, T, 64, device=device, dtype=dtype)
    c_hf, s_hf = cos_hf.to(dtype), sin_hf.to(dtype)
    name = str(dtype).replace("torch.", "")

    def ours():
        return enc.rotate_q(q, pos), enc.rotate_k(k, pos)

    def theirs():
        return apply_rotary_pos_emb(q, k, c_hf, s_hf)

    def copy():
        return q.clone(), k.clone()

    t_ours, t_theirs, t_copy = best_time(ours), best_time(theirs), best_time(copy)
    note = f"{t_ours * 1e3:.1f} ms vs {t_theirs * 1e3:.1f} ms; copy {t_copy * 1e3:.1f} ms"
    results.append(Result(f"rotary apply fwd {name} vs transformers", t_ours / t_theirs, 0.5, note))
    results.append(Result(f"rotary apply fwd {name} vs copy of q,k", t_ours / t_copy, 1.5, note))

    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    grads = torch.randn_like(q), torch.randn_like(k)

    def ours_bwd():
        out = enc.rotate_q(qg, pos), enc.rotate_k(kg, pos)
        torch.autograd.backward(out, grads)

    def theirs_bwd():
        out = apply_rotary_pos_emb(qg, kg, c_hf, s_hf)
        torch.autograd.backward(out, grads)

    t_ours, t_theirs = best_time(ours_bwd), best_time(theirs_bwd)
    note = f"{t_ours * 1e3:.1f} ms vs {t_theirs * 1e3:.1f} ms"
    results.append(
        Result(f"rotary apply fwd+bwd {name} vs transformers", t_ours / t_theirs, 0.5, note)
    )
    return results
