"""Rotary apply: ropekit's fast path vs transformers' ``apply_rotary_pos_emb`` on the same
tensors (fp32 and bf16; forward, and forward+backward), and vs a plain copy of q and k (the
memory-bound floor). Shape 1x16x4096x64 as in DESIGN.md's known figures.

The forward rows time the torch.compile'd kernel (``ROPEKIT_COMPILE=always``: ropekit's
default, ``auto``, compiles only rotations autograd records, i.e. training, at least 2M
elements; inference runs the eager kernel, where a model's attention dominates); the eager
kernel is measured beside it. The forward+backward rows run the default, which compiles
there (4M elements per tensor). Compile time is measured once per dtype and reported.
"""

from __future__ import annotations

import time

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ropekit.encodings import build
from ropekit.encodings import rotary as rotary_module

from .common import Result, compare, compare_stats


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


def _mode(mode: str):
    """Run a candidate under a kernel mode, restoring the setting after."""

    def wrap(fn):
        def run():
            before = rotary_module.compile_settings()
            rotary_module.set_compile(mode, before["min_numel"])
            try:
                return fn()
            finally:
                rotary_module.set_compile(before["mode"], before["min_numel"])

        return run

    return wrap


def _compare(enc, pos, cos_hf, sin_hf, dtype, device, T) -> list[Result]:
    results = []
    q = torch.randn(1, 16, T, 64, device=device, dtype=dtype)
    k = torch.randn(1, 16, T, 64, device=device, dtype=dtype)
    c_hf, s_hf = cos_hf.to(dtype), sin_hf.to(dtype)
    name = str(dtype).replace("torch.", "")

    def rotate():
        return enc.rotate_q(q, pos), enc.rotate_k(k, pos)

    ours, eager = _mode("always")(rotate), _mode("never")(rotate)

    def theirs():
        return apply_rotary_pos_emb(q, k, c_hf, s_hf)

    def copy():
        return q.clone(), k.clone()

    start = time.perf_counter()
    ours()  # first call: compiles the kernel for this dtype (forward)
    compile_s = time.perf_counter() - start
    compiled = rotary_module.compile_settings()["failed"] is None
    kernel = (
        f"compiled kernel (first call {compile_s:.1f} s incl. compile)"
        if compiled
        else "eager kernel (compile unavailable)"
    )
    stats = compare_stats({"ours": ours, "eager": eager, "theirs": theirs, "copy": copy}, 31)
    ms = {k_: med * 1e3 for k_, (med, _) in stats.items()}
    low = {k_: least * 1e3 for k_, (_, least) in stats.items()}
    note = (
        f"{kernel}: {ms['ours']:.1f} ms; transformers {ms['theirs']:.1f} ms; "
        f"copy {ms['copy']:.1f} ms; eager kernel {ms['eager']:.1f} ms (medians of 31; "
        f"minima {low['ours']:.1f} / {low['theirs']:.1f} / {low['copy']:.1f} / "
        f"{low['eager']:.1f} ms: vs copy {low['ours'] / low['copy']:.2f})"
    )
    results.append(
        Result(f"rotary apply fwd {name} vs transformers", ms["ours"] / ms["theirs"], 0.5, note)
    )
    vs_copy = ms["ours"] / ms["copy"]
    why = ""
    if vs_copy > 1.5 and compiled:
        why = (
            "; missed: the fused kernel reads x (and the cos/sin tables) and writes the output "
            "once, as a copy does, but runs at 1.4-1.6x a copy at best on this CPU (minimum "
            "of 31 quiet runs) and further behind while other jobs contend for memory bandwidth"
            + (", plus per-element bf16<->fp32 conversions" if dtype == torch.bfloat16 else "")
        )
    elif vs_copy > 1.5:
        why = "; missed: without compilation the eager kernel makes four passes over memory"
    results.append(Result(f"rotary apply fwd {name} vs copy of q,k", vs_copy, 1.5, note + why))
    eager_note = (
        "eager kernel (the fallback without a compiler): four passes over memory "
        "(mul, addcmul per pair half), so it cannot reach a copy"
    )
    results.append(
        Result(
            f"rotary apply fwd {name} eager kernel vs transformers",
            ms["eager"] / ms["theirs"],
            None,
            eager_note,
        )
    )
    results.append(
        Result(
            f"rotary apply fwd {name} eager kernel vs copy of q,k",
            ms["eager"] / ms["copy"],
            None,
            eager_note,
        )
    )

    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    grads = torch.randn_like(q), torch.randn_like(k)

    def ours_bwd():
        out = enc.rotate_q(qg, pos), enc.rotate_k(kg, pos)
        torch.autograd.backward(out, grads)

    def theirs_bwd():
        out = apply_rotary_pos_emb(qg, kg, c_hf, s_hf)
        torch.autograd.backward(out, grads)

    t = compare(
        {"ours": ours_bwd, "eager": _mode("never")(ours_bwd), "theirs": theirs_bwd}, repeats=15
    )
    ms = {k_: v * 1e3 for k_, v in t.items()}
    note = (
        f"{'compiled' if compiled else 'eager'} kernel {ms['ours']:.1f} ms vs "
        f"{ms['theirs']:.1f} ms; eager kernel {ms['eager']:.1f} ms"
    )
    results.append(
        Result(f"rotary apply fwd+bwd {name} vs transformers", ms["ours"] / ms["theirs"], 0.5, note)
    )
    return results
