"""llama.cpp (llama-cpp-python 0.3.36's vendored tree: ``src/llama-model.cpp: load_hparams``,
``src/llama-context.cpp: llama_context``, ``ggml/src/ggml-cpu/ops.cpp: rope_yarn``,
``ggml/src/ggml.c: ggml_rope_yarn_corr_dims``).

theta_f = b^(-2f/d) / rope_freqs_f; type linear divides by s; type yarn blends theta/s and
theta with the ramp between floor/ceil correction dims for beta 32 and 1 over
original_context_length, and scales cos/sin by attn_factor (1 + 0.1 ln s); other types by
attn_factor. The default context is ``context_length`` (a larger n_ctx is accepted with a
warning). An HF folder reaches llama.cpp through a GGUF conversion: here ropekit's
(``ropekit.serve.gguf_file.gguf_rope``).

Holds: LlamaCpp, llamacpp_rope, llamacpp_from_config.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ropekit.encodings import schedules

from .base import Engine, EngineRoPE, ServedFolder


class LlamaCpp(Engine):
    """llama.cpp, reading a GGUF file: ropekit's own conversion of an HF folder."""

    name = "llama.cpp"
    label = "llama.cpp (llama-cpp-python 0.3.36)"
    export_format = "gguf"
    floor: ClassVar = {
        1024: {"max": 5.574122902807233e-04, "mean": 2.8531114715663003e-05},
        9216: {"max": 1.3092417862958783e-02, "mean": 2.896059069503686e-04},
    }

    def rope(self, folder: ServedFolder, length: int) -> EngineRoPE:
        """From the GGUF file itself, else from ropekit's conversion of the HF folder."""
        if folder.gguf is not None:
            return llamacpp_rope(folder.gguf.rope, folder.gguf.rope_dim, length)
        return llamacpp_from_config(folder.hf_config, length, folder.target)

    def refusal_fix(self, folder: ServedFolder) -> str:
        if folder.rope_type == "longrope":
            # One rope_freqs tensor for every length (llama-model.cpp: get_rope_factors).
            return (
                "set short_factor = long_factor (llama.cpp applies one set of factors at every "
                "length; the GGUF export then writes them as rope_freqs)"
            )
        return "export a schedule llama.cpp has (linear, yarn with default betas, rope_freqs)"

    def attention_fix(self, folder: ServedFolder, value: float) -> str:
        if folder.rope_type == "yarn":
            return "write rope.scaling.attn_factor = transformers' factor / (1 + 0.1 ln s)"
        return super().attention_fix(folder, value)

    def length_fix(self, folder: ServedFolder) -> str:
        return (
            f"set llama.context_length = {folder.target} in the GGUF (or pass "
            f"n_ctx={folder.target})"
        )


def llamacpp_rope(rope: Any, dim: int, length: int) -> EngineRoPE:
    """llama.cpp's RoPE for GGUF metadata ``rope`` (a ``gguf_file.GgufRope``) with ``dim``
    rotated channels."""
    source = "llama.cpp ggml/src/ggml-cpu/ops.cpp: rope_yarn; src/llama-context.cpp"
    theta, _ = schedules.rope(dim, float(rope.freq_base))
    if rope.rope_freqs is not None:
        theta = theta / torch.as_tensor(rope.rope_freqs, dtype=torch.float64)
    s = float(rope.factor) or 1.0
    af = float(rope.attn_factor)
    notes = [f"default context {rope.context_length} (llama.context_length)"]
    if rope.scaling_type == "linear":
        theta = theta / s
    elif rope.scaling_type == "yarn":
        corr = [
            schedules.yarn_correction_dim(b, dim, float(rope.freq_base), rope.original_length)
            for b in (32.0, 1.0)
        ]
        low, high = max(math.floor(corr[0]), 0), min(math.ceil(corr[1]), dim - 1)
        pairs = torch.arange(theta.shape[0], dtype=torch.float64)
        ramp = 1 - ((pairs - low) / max(0.001, high - low)).clamp(0, 1)  # 1: extrapolate
        theta = theta / s * (1 - ramp) + theta * ramp
        af = af * (1 + 0.1 * math.log(s))
    if length > rope.context_length:
        notes.append(f"{length} > context_length: llama.cpp warns (n_ctx_seq > n_ctx_train)")
    return EngineRoPE("llama.cpp", source, theta, af, rope.context_length, notes=tuple(notes))


def llamacpp_from_config(config: Any, length: int, target: int) -> EngineRoPE:
    """llama.cpp's RoPE for an HF config, through ropekit's GGUF conversion (or its refusal)."""
    from ropekit.hf.rope_config import ExportRefused

    from ..gguf_file import gguf_rope

    params = dict(config.rope_parameters)
    try:
        rope = gguf_rope(params, config, target)
    except ExportRefused as e:
        return EngineRoPE(
            "llama.cpp", "ropekit.serve.gguf_file: gguf_rope", None, None, None, str(e)
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
    return llamacpp_rope(rope, dim, length)
