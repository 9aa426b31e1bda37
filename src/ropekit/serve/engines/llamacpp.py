"""llama.cpp (llama-cpp-python 0.3.36's vendored tree: ``src/llama-model.cpp: load_hparams``,
``src/llama-context.cpp: llama_context``, ``ggml/src/ggml-cpu/ops.cpp: rope_yarn``,
``ggml/src/ggml.c: ggml_rope_yarn_corr_dims``).

theta_f = b^(-2f/d) / rope_freqs_f; type linear divides by s; type yarn blends theta/s and
theta with the ramp between floor/ceil correction dims for beta 32 and 1 over
original_context_length, and scales cos/sin by attn_factor (1 + 0.1 ln s); other types by
attn_factor. The default context is ``context_length`` (a larger n_ctx is accepted with a
warning). An HF folder reaches llama.cpp through a GGUF conversion: here ropekit's
(``ropekit.serve.gguf_file.gguf_rope``).

Self-Extend (``self-extend:mode=llama.cpp``) is llama.cpp's group attention: no rope key
expresses it, but llama.cpp computes it when the caller moves cached keys between blocks
(``ropekit.serve.llamacpp_self_extend``, a recipe on llama-cpp-python that needs no ropekit at
run time). ``llamacpp_recipe`` says which encodings that recipe serves and why it serves no
other; the GGUF export of such an encoding is its base schedule, its record names the recipe,
and ``inspect`` prints the command.

Holds: LlamaCpp, llamacpp_rope, llamacpp_from_config, llamacpp_recipe, self_extend_reach,
RECIPE.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from ropekit.encodings import schedules

from .base import Engine, EngineRoPE, ServedFolder

RECIPE = "ropekit.serve.llamacpp_self_extend"  # the module a user copies (llama_cpp + numpy)


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
        """From the GGUF file itself, else from ropekit's conversion of the HF folder; for an
        export that names the Self-Extend recipe, the base schedule plus how to run it."""
        if folder.gguf is not None:
            view = llamacpp_rope(folder.gguf.rope, folder.gguf.rope_dim, length)
        else:
            view = llamacpp_from_config(folder.hf_config, length, folder.target)
        recipe = (folder.record or {}).get("serve_with")
        if recipe is not None and recipe["engine"] == self.name and view.error is None:
            note = (
                f"Self-Extend (group {recipe['group']}, window {recipe['window']}) only through "
                f"{recipe['recipe']} (the export record says how and why)"
            )
            view = dataclasses.replace(view, notes=(*view.notes, note))
        return view

    def refusal_fix(self, folder: ServedFolder) -> str:
        from ..gguf_file import writable

        if folder.gguf is None and not writable(folder.config.get("model_type")):
            return (
                "convert the HF export with llama.cpp's convert_hf_to_gguf.py; the rope keys it "
                "writes for this family are not checked here"
            )
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

    from ..gguf_file import check_writable, gguf_rope

    params = dict(config.rope_parameters)
    try:
        check_writable(config)  # llama.cpp's own converter decides the rest: not checked here
        rope = gguf_rope(params, config, target)
    except ExportRefused as e:
        return EngineRoPE(
            "llama.cpp", "ropekit.serve.gguf_file: gguf_rope", None, None, None, str(e)
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
    return llamacpp_rope(rope, dim, length)


def self_extend_reach(group: int, window: int, original_length: int) -> int:
    """The longest prompt of whole W-token blocks whose every query-key distance stays below
    L0 under Self-Extend in llama.cpp's blocks (a few tokens into the next block may still
    stay below it; the reach is counted in blocks, as the recipe shifts them): the query at
    true position i (block b) sits at b W / G + (i mod W) and key 0 at 0, so the largest
    distance, b W / G + W - 1 at the end of block b, is < L0 while b W / G <= L0 - W, i.e.
    T = (floor((L0 - W) G / W) + 1) W tokens."""
    if window >= original_length:
        return original_length
    return ((original_length - window) * group // window + 1) * window


def llamacpp_recipe(encoding: Any, format: str) -> dict[str, Any]:
    """How llama.cpp serves a distance remap: the record ``export --format gguf`` writes
    (``serve_with``), or ExportRefused saying why no engine serves it. Only Self-Extend in
    llama.cpp's own blocks (``mode=llama.cpp``) on a base schedule whose cos/sin are unscaled
    has a route: the recipe's K-shift re-rotates cached keys by a position change, and
    ``build_rope_shift`` (src/llama-kv-cache.cpp) passes the context's ``yarn_attn_factor`` to
    the rope, which would scale a shifted key once more (ggml-cpu/ops.cpp: rope_yarn)."""
    from ropekit.hf.rope_config import ExportRefused

    c = encoding.config
    if c.name != "self-extend":
        raise ExportRefused(
            f"{encoding.spec!r} remaps query-key distances in attention; no serving engine's "
            "rope config can express it (transformers, vLLM and llama.cpp rotate q and k "
            "once), and only Self-Extend has a llama.cpp route (its group attention): export "
            "--format vllm, which vLLM serves with ropekit's plugin"
        )
    if c.mode != "llama.cpp":
        raise ExportRefused(
            f"{encoding.spec!r} is the paper's Self-Extend (a sliding neighbour window); "
            "llama.cpp's group attention groups whole blocks of W tokens: export "
            "self-extend:mode=llama.cpp with the same group and window, which llama.cpp serves "
            f"through {RECIPE}, or export --format vllm (vLLM with ropekit's plugin)"
        )
    if format != "gguf":
        raise ExportRefused(
            f"{encoding.spec!r} remaps query-key distances; transformers and vLLM rotate q and "
            f"k once and cannot serve it: export --format gguf, which llama.cpp serves through "
            f"{RECIPE} (llama-cpp-python and numpy only), or --format vllm (vLLM with "
            "ropekit's plugin)"
        )
    _, af = encoding.inner.inv_freq()
    if abs(float(af) - 1.0) > 1e-12:
        raise ExportRefused(
            f"{encoding.spec!r}: its base schedule scales cos/sin by {float(af):.6f}; "
            "llama.cpp's K-shift (src/llama-kv-cache.cpp: build_rope_shift) applies that scale "
            "again to every key it moves, so the recipe is exact only on an unscaled base "
            "(init=rope, linear, ntk, llama3)"
        )
    return {
        "engine": "llama.cpp",
        "recipe": RECIPE,
        "group": int(c.group),
        "window": int(c.window),
        "command": f"python -m {RECIPE} model.gguf --group {c.group} --window {c.window}",
    }


def recipe_notes(recipe: dict[str, Any]) -> list[str]:
    """What the export record and ``inspect`` say about a recipe route."""
    return [
        f"Self-Extend (group {recipe['group']}, window {recipe['window']}): the rope keys are "
        "the base schedule; llama.cpp computes the remap only when driven by "
        f"{recipe['recipe']} (llama-cpp-python + numpy, no ropekit at run time; copy "
        f"src/ropekit/serve/llamacpp_self_extend.py): {recipe['command']} "
        "--prompt-file FILE (or --score IDS.npy:OUT.npy); float32 KV cache",
        "not through llama.cpp's own --grp-attn-n/--grp-attn-w or llama_memory_seq_div in "
        "llama-cpp-python 0.3.36: its pos_div (src/llama-kv-cells.h) records the K-shift with "
        "the wrong sign, so grouped keys are rotated at 2 p_old - p_new (docs/serving/serving.md)",
    ]
