"""Write a patched Llama-family model as a GGUF file that llama.cpp serves with its encoding.

llama.cpp reads a model's RoPE from GGUF metadata and one optional tensor (llama.cpp,
``src/llama-model.cpp: llama_model::load_hparams`` and ``models/llama.cpp``):

    llama.rope.freq_base                     b
    llama.rope.dimension_count               rotated channels d
    llama.rope.scaling.type                  none | linear | yarn   (default "linear")
    llama.rope.scaling.factor                s (freq_scale = 1/s)
    llama.rope.scaling.original_context_length  L0 (YaRN's correction range)
    llama.rope.scaling.attn_factor           a multiplier of cos/sin (rope_attn_factor)
    llama.context_length                     the context it was trained for (n_ctx_train)
    rope_freqs.weight  (F,) float32          per-pair divisors: theta_f = b^(-2f/d) / rope_freqs_f

The angle is formed in ggml (``ggml-cpu/ops.cpp: rope_yarn, ggml_rope_cache_init``) as
``theta = s^-1 theta_f (1 - r_f) + theta_f r_f`` with the YaRN ramp ``r_f`` (only for type
yarn; r = 0 otherwise) and cos/sin multiplied by ``mscale``, where for yarn
``mscale = attn_factor (1 + 0.1 ln s)``: ``llama-context.cpp`` divides its own default
``get_mscale(s)`` back out and multiplies by ``rope.scaling.attn_factor``, then ``rope_yarn``
multiplies by ``1 + 0.1 ln s``. So a transformers YaRN attention factor ``a`` is written as
``attn_factor = a / (1 + 0.1 ln s)``, and any other type writes ``a`` itself.

Mapping from transformers ``rope_parameters`` (``gguf_rope``): default -> none; linear ->
linear; yarn -> yarn (refused when beta_fast/beta_slow are not 32/1 or truncate is false: the
llama architecture reads no yarn_beta keys, only grok does, and ggml always rounds the ramp
ends); llama3 and longrope (one factor set) -> rope_freqs with the factors transformers
divides by, type none, attention factor carried; dynamic is refused (llama.cpp has no
length-following schedule); longrope with different short and long factors is refused
(llama.cpp picks one set per context, ``get_rope_factors``, and only for phi3's tensors).

llama.cpp's llama architecture rotates interleaved pairs (rope type NORM), transformers'
Llama rotates halves (``rotate_half``), so the q and k projection rows of each head are
reordered from ``[x_0..x_{D/2-1}, y_0..y_{D/2-1}]`` to ``[x_0, y_0, x_1, y_1, ...]``: the same
rotation of the same pairs, which is why llama.cpp's converter permutes them too.

Weights are written in float32 (the installed SmolLM2 is a dequantized Q4_1 GGUF, so the
numbers are the ones transformers computes with). The tokenizer is copied key for key from
the GGUF a model was installed from (``ropekit_model.json``'s source), else built from a
byte-level BPE ``tokenizer.json``.

Reading (``read_gguf``) takes the same keys with llama.cpp's defaults where one is missing
(``load_hparams``: base 10000, scaling type linear, factor 0 or missing = 1, attn_factor 1,
original context = the context length, rope dimension = the key length).

Holds: write_gguf, read_gguf, gguf_rope, GgufRope, GgufModel, interleave_rows, GGUF_NAME.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ropekit.encodings import schedules
from ropekit.hf.archs import ARCHS, base_model, original_length
from ropekit.hf.models import INSTALL_RECORD, resolve_model
from ropekit.hf.rope_config import ExportRefused

GGUF_NAME = "model.gguf"
ARCH = "llama"


@dataclasses.dataclass(frozen=True)
class GgufRope:
    """What the GGUF file says about RoPE."""

    freq_base: float
    scaling_type: str  # none | linear | yarn
    factor: float  # rope.scaling.factor (1: none)
    original_length: int  # rope.scaling.original_context_length
    attn_factor: float  # rope.scaling.attn_factor, as llama.cpp reads it
    rope_freqs: np.ndarray | None  # (F,) float32 divisors, or None
    context_length: int  # llama.context_length


@dataclasses.dataclass(frozen=True)
class GgufModel:
    """What ``read_gguf`` finds in a GGUF file: its RoPE and the shapes the rope depends on."""

    architecture: str
    rope: GgufRope
    rope_dim: int  # rotated channels of one head (llama.rope.dimension_count)
    head_dim: int  # attention.key_length
    n_heads: int
    n_kv_heads: int
    n_layers: int


def read_gguf(path: str | os.PathLike[str]) -> GgufModel:
    """The RoPE llama.cpp reads from the GGUF file at ``path``; a ValueError naming the file
    when it is not a GGUF file or has no attention heads."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a GGUF file llama.cpp can read: {e}") from None

    def value(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = str(value("general.architecture", ""))
    n_heads = value(f"{arch}.attention.head_count")
    if not arch or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"{path}: no general.architecture or attention.head_count in the GGUF")
    context = int(value(f"{arch}.context_length", 0))
    width = int(value(f"{arch}.embedding_length", 0))
    head_dim = int(value(f"{arch}.attention.key_length", width // n_heads))
    factor = float(value(f"{arch}.rope.scaling.factor", 0.0)) or 1.0
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    rope = GgufRope(
        freq_base=float(value(f"{arch}.rope.freq_base", 10000.0)),
        scaling_type=str(value(f"{arch}.rope.scaling.type", "linear")),
        factor=factor,
        original_length=int(value(f"{arch}.rope.scaling.original_context_length", context)),
        attn_factor=float(value(f"{arch}.rope.scaling.attn_factor", 1.0)),
        rope_freqs=None if freqs is None else np.array(freqs.data, dtype=np.float32).ravel(),
        context_length=context,
    )
    return GgufModel(
        architecture=arch,
        rope=rope,
        rope_dim=int(value(f"{arch}.rope.dimension_count", head_dim)),
        head_dim=head_dim,
        n_heads=n_heads,
        n_kv_heads=int(value(f"{arch}.attention.head_count_kv", n_heads)),
        n_layers=int(value(f"{arch}.block_count", 0)),
    )


def _yarn_attention(params: dict[str, Any], factor: float) -> float:
    return schedules.yarn_attention_factor(
        factor, params.get("mscale"), params.get("mscale_all_dim"), params.get("attention_factor")
    )


def gguf_rope(params: dict[str, Any], config: Any, target: int) -> GgufRope:
    """The GGUF RoPE metadata that makes llama.cpp compute what transformers computes from
    ``params`` (see the module docstring); ExportRefused when llama.cpp cannot."""
    kind = params.get("rope_type", "default")
    base = float(params["rope_theta"])
    fraction = float(params.get("partial_rotary_factor") or 1.0)
    head_dim = int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    dim = int(head_dim * fraction)
    l0 = int(params.get("original_max_position_embeddings") or original_length(config))
    common = {"freq_base": base, "original_length": l0, "context_length": int(target)}
    if kind == "default":
        return GgufRope(scaling_type="none", factor=1.0, attn_factor=1.0, rope_freqs=None, **common)
    if kind == "linear":
        # The HF export keeps max_position_embeddings at L0 for linear (vLLM multiplies it by
        # s); llama.cpp's context_length is the scaled length.
        factor = float(params["factor"])
        common["context_length"] = max(int(target), round(l0 * factor))
        return GgufRope(
            scaling_type="linear", factor=factor, attn_factor=1.0, rope_freqs=None, **common
        )
    if kind == "yarn":
        return _yarn(params, common)
    if kind in ("llama3", "longrope"):
        return _per_pair(kind, params, config, dim, base, l0, common)
    if kind == "dynamic":
        raise ExportRefused(
            "dynamic NTK: llama.cpp has no length-following schedule (rope.scaling.type is "
            "none, linear, yarn or longrope: llama-model.cpp LLAMA_ROPE_SCALING_TYPES); export "
            "a fixed one (yarn, or ntk at the target length) for llama.cpp"
        )
    raise ExportRefused(f"rope_type={kind!r} has no llama.cpp equivalent")


def _yarn(params: dict[str, Any], common: dict[str, Any]) -> GgufRope:
    """YaRN in llama.cpp's own terms (its betas are fixed; its ramp ends are rounded)."""
    factor = float(params["factor"])
    betas = (float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1))
    if betas != (32.0, 1.0):
        raise ExportRefused(
            f"yarn with beta_fast={betas[0]:g}, beta_slow={betas[1]:g}: llama.cpp's llama "
            "architecture reads no yarn_beta keys from GGUF (llama-model.cpp reads them for "
            "grok only) and uses 32 and 1; pass yarn_beta_fast/yarn_beta_slow in the "
            "context parameters at run time, or export with the defaults"
        )
    if params.get("truncate") is False:
        raise ExportRefused(
            "yarn with truncate=false: ggml rounds YaRN's ramp ends to whole pairs "
            "(ggml.c: ggml_rope_yarn_corr_dims uses floorf/ceilf) and has no switch"
        )
    attention = _yarn_attention(params, factor)
    return GgufRope(
        scaling_type="yarn",
        factor=factor,
        # llama.cpp multiplies cos/sin by attn_factor * (1 + 0.1 ln s) (module docstring).
        attn_factor=attention / (1.0 + 0.1 * math.log(factor)),
        rope_freqs=None,
        **common,
    )


def _per_pair(
    kind: str, params: dict[str, Any], config: Any, dim: int, base: float, l0: int,
    common: dict[str, Any],
) -> GgufRope:  # fmt: skip
    """llama3 and longrope as per-pair frequency factors (llama.cpp's rope_freqs tensor)."""
    if kind == "llama3":
        theta, attention = schedules.llama3(
            dim,
            base,
            float(params["factor"]),
            l0,
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
        )
    else:
        short, long = list(params["short_factor"]), list(params["long_factor"])
        if [float(x) for x in short] != [float(x) for x in long]:
            raise ExportRefused(
                "longrope with different short and long factors: transformers switches "
                "between them by sequence length, llama.cpp's llama architecture has one "
                "rope_freqs tensor for every length (phi3's rope_long/rope_short are picked "
                "once per context, llama-model.cpp: get_rope_factors)"
            )
        factor = params.get("factor") or config.max_position_embeddings / l0
        theta, attention = schedules.longrope(
            dim, base, short, long, l0, float(factor), params.get("attention_factor")
        )
    rope, _ = schedules.rope(dim, base)
    return GgufRope(
        scaling_type="none",
        factor=1.0,
        attn_factor=float(attention),
        rope_freqs=(rope / theta).to(torch.float32).numpy(),
        **common,
    )


def interleave_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q/k projection rows of each head from rotate_half order to interleaved pairs:
    (n_heads * D, in) -> same shape, row h*D + 2i <- h*D + i, row h*D + 2i + 1 <- h*D + D/2 + i."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    if rows % n_heads or head_dim % 2:
        raise ValueError(f"cannot split {rows} rows into {n_heads} heads of even size")
    halves = weight.reshape(n_heads, 2, head_dim // 2, cols)  # (H, 2, D/2, in): x rows, y rows
    return halves.transpose(1, 2).reshape(rows, cols)  # (H, D/2, 2, in) -> (H*D, in)


def _tensors(model: nn.Module) -> dict[str, np.ndarray]:
    core = base_model(model)
    config = model.config
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads

    def f32(t: torch.Tensor) -> np.ndarray:
        return t.detach().to("cpu", torch.float32).contiguous().numpy()

    out = {
        "token_embd.weight": f32(core.embed_tokens.weight),
        "output_norm.weight": f32(core.norm.weight),
    }
    if not getattr(config, "tie_word_embeddings", False):
        out["output.weight"] = f32(model.lm_head.weight)
    for i, layer in enumerate(core.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if getattr(getattr(attn, proj), "bias", None) is not None:
                raise ExportRefused(
                    f"{config.model_type}: attention biases have no llama GGUF tensor"
                )
        out |= {
            f"blk.{i}.attn_norm.weight": f32(layer.input_layernorm.weight),
            f"blk.{i}.attn_q.weight": f32(interleave_rows(attn.q_proj.weight, n_heads)),
            f"blk.{i}.attn_k.weight": f32(interleave_rows(attn.k_proj.weight, n_kv)),
            f"blk.{i}.attn_v.weight": f32(attn.v_proj.weight),
            f"blk.{i}.attn_output.weight": f32(attn.o_proj.weight),
            f"blk.{i}.ffn_norm.weight": f32(layer.post_attention_layernorm.weight),
            f"blk.{i}.ffn_gate.weight": f32(mlp.gate_proj.weight),
            f"blk.{i}.ffn_up.weight": f32(mlp.up_proj.weight),
            f"blk.{i}.ffn_down.weight": f32(mlp.down_proj.weight),
        }
    return out


def _source_gguf(source: Any) -> Path | None:
    """The GGUF a ropekit-installed model came from (its install record), if any."""
    if isinstance(source, nn.Module):
        source = getattr(source.config, "name_or_path", None) or None
    if source is None:
        return None
    try:
        folder = resolve_model(source)
    except (FileNotFoundError, ValueError):
        return None
    record = folder / INSTALL_RECORD
    if not record.is_file():
        return None
    path = Path(json.loads(record.read_text(encoding="utf-8")).get("source", ""))
    return path if path.suffix == ".gguf" and path.is_file() else None


def _copy_tokenizer(writer: Any, source: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)


def _bpe_tokenizer(writer: Any, tokenizer: Any, config: Any) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's gpt2 vocabulary."""
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    model = data["model"]
    if model.get("type") != "BPE":
        raise ExportRefused(
            f"tokenizer type {model.get('type')!r}: the GGUF writer builds BPE only"
        )
    size = max(config.vocab_size, len(tokenizer))
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # unused
    for token, index in model["vocab"].items():
        tokens[index], types[index] = token, 1  # normal
    for added in data.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added.get("special") else 4  # control / user-defined
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name, value in (
        ("bos", config.bos_token_id),
        ("eos", config.eos_token_id),
        ("pad", getattr(config, "pad_token_id", None)),
    ):
        if isinstance(value, int):
            getattr(writer, f"add_{name}_token_id")(value)


def writable(model_type: str | None) -> bool:
    """Whether ropekit's writer writes this family (llama.cpp's llama graph: the registry's
    ``Architecture.gguf``)."""
    arch = ARCHS.get(model_type) if model_type is not None else None
    return arch is not None and arch.gguf


def check_writable(config: Any) -> None:
    """ExportRefused for a family ropekit's writer cannot write, naming llama.cpp's converter."""
    if not writable(config.model_type):
        raise ExportRefused(
            f"model_type={config.model_type!r}: ropekit's GGUF writer handles "
            f"{', '.join(a.model_type for a in ARCHS.values() if a.gguf)} (llama.cpp's llama "
            "graph: no q/k norms, no attention biases); export --format hf and convert that "
            "folder with llama.cpp's own "
            "convert_hf_to_gguf.py, which knows this family's graph"
        )


def write_gguf(
    model: nn.Module,
    config: Any,
    path: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    source: Any = None,
) -> list[str]:
    """Write ``model`` with the rope settings of ``config`` (an exported config: rope_parameters
    and length fields already set) to ``path``; returns notes for the export record."""
    import gguf

    check_writable(config)
    params = dict(config.rope_parameters)
    rope = gguf_rope(params, config, int(config.max_position_embeddings))
    head_dim = int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    writer = gguf.GGUFWriter(path, ARCH)
    writer.add_name(str(getattr(config, "_name_or_path", "") or "ropekit export"))
    writer.add_context_length(rope.context_length)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_rope_dimension_count(
        int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
    )
    writer.add_rope_freq_base(rope.freq_base)
    writer.add_rope_scaling_type(gguf.RopeScalingType(rope.scaling_type))
    writer.add_rope_scaling_factor(rope.factor)
    writer.add_rope_scaling_orig_ctx_len(rope.original_length)
    writer.add_rope_scaling_attn_factors(rope.attn_factor)
    notes: list[str] = []
    gguf_source = _source_gguf(source)
    if gguf_source is not None:
        _copy_tokenizer(writer, gguf_source)
        notes.append(f"tokenizer copied from {gguf_source.name}")
    elif tokenizer is not None:
        _bpe_tokenizer(writer, tokenizer, config)
        notes.append(
            "tokenizer built from tokenizer.json (no tokenizer.ggml.pre: llama.cpp "
            "uses its default pre-tokenizer)"
        )
    else:
        writer.add_tokenizer_model("none")
        notes.append("no tokenizer: llama.cpp loads it as a vocabulary-free model")
    for name, array in _tensors(model).items():
        writer.add_tensor(name, array)
    if rope.rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope.rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return notes
