"""What each serving engine computes from a rope config: the per-pair frequencies, the cos/sin
attention factor and the longest length it accepts, written from each engine's source.

F = rotary pairs (d/2). Every function returns an ``EngineRoPE`` at one sequence length
``length`` (dynamic and longrope depend on it), with ``inv_freq`` (F,) float64 theta_f in
radians per token, computed with ropekit's pure schedules (``ropekit.encodings.schedules``,
tested against transformers' own functions).

Rules, by engine and source:

- transformers 5.24 (``transformers/modeling_rope_utils.py``: ``ROPE_INIT_FUNCTIONS`` and
  ``dynamic_rope_update``): the reference meaning of ``rope_parameters``. dynamic measures its
  stretch against ``max_position_embeddings`` with L = max(positions) + 1; longrope switches
  short -> long factors once L > ``original_max_position_embeddings``; yarn and longrope take a
  missing ``factor`` as max_position_embeddings / original. No length limit is enforced.
- vLLM 0.32 (``vllm/model_executor/layers/rotary_embedding/__init__.py: get_rope`` and the
  class of each type; ``vllm/config/model.py: _get_and_verify_max_len``):
    * accepted length: the smallest of ``max_position_embeddings`` (and the other length keys)
      and the tokenizer's ``model_max_length``, times ``factor`` for every type but yarn,
      llama3, longrope (``deepseek_yarn``...); a longer ``--max-model-len`` is refused.
    * default, linear, yarn, llama3: as transformers (YaRN: ``YaRNScalingRotaryEmbedding``
      honours attention_factor, mscale/mscale_all_dim and truncate).
    * dynamic (``DynamicNTKScalingRotaryEmbedding``): static: one base
      b (s M / M_t - (s - 1))^(d/(d-2)) for every length, M = max_position_embeddings,
      M_t = rope_parameters.max_trained_positions (default M, which gives plain RoPE), and a
      cos/sin cache of M rows while M x s tokens are accepted.
    * longrope (``Phi3LongRoPEScaledRotaryEmbedding``): long factors at every length once
      max_model_len > original, short ones otherwise; cos/sin scaled by
      ``long_mscale``/``short_mscale``, default sqrt(1 + ln(M/L0)/ln L0): it never reads
      ``attention_factor`` or ``factor``.
- llama.cpp (llama-cpp-python 0.3.36's vendored tree: ``src/llama-model.cpp: load_hparams``,
  ``src/llama-context.cpp: llama_context``, ``ggml/src/ggml-cpu/ops.cpp: rope_yarn``,
  ``ggml/src/ggml.c: ggml_rope_yarn_corr_dims``): theta_f = b^(-2f/d) / rope_freqs_f; type
  linear divides by s; type yarn blends theta/s and theta with the ramp between
  floor/ceil correction dims for beta 32 and 1 over original_context_length, and scales
  cos/sin by attn_factor (1 + 0.1 ln s); other types by attn_factor. The default context is
  ``context_length`` (a larger n_ctx is accepted with a warning). An HF folder reaches
  llama.cpp through a GGUF conversion: here ropekit's (``ropekit.serve.gguf_file.gguf_rope``).

Holds: EngineRoPE, transformers_rope, vllm_rope, vllm_max_length, llamacpp_rope,
llamacpp_from_config, ENGINES.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ropekit.encodings import schedules

ENGINES = ("transformers", "vllm", "llama.cpp")
_VLLM_UNSCALED = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


@dataclasses.dataclass(frozen=True)
class EngineRoPE:
    """One engine's RoPE for one config at one sequence length."""

    engine: str
    source: str  # the engine file and function the rule comes from
    inv_freq: torch.Tensor | None  # (F,) float64, None when the engine refuses the config
    attention_factor: float | None  # multiplies cos and sin (q.k by its square)
    max_length: int | None  # longest accepted sequence; None: the engine enforces none
    error: str | None = None
    notes: tuple[str, ...] = ()


def _dims(config: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    params = dict(config.get("rope_parameters") or {})
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
    return dim, params


def _original(params: dict[str, Any], config: dict[str, Any]) -> int:
    return int(params.get("original_max_position_embeddings") or config["max_position_embeddings"])


def transformers_rope(config: dict[str, Any], length: int) -> EngineRoPE:
    """transformers' RoPE for ``config`` (a config.json dict) at ``length`` tokens."""
    dim, p = _dims(config)
    kind = p.get("rope_type", "default")
    base = float(p["rope_theta"])
    source = "transformers/modeling_rope_utils.py: ROPE_INIT_FUNCTIONS[" + repr(kind) + "]"
    max_pos = int(config["max_position_embeddings"])
    if kind == "default":
        theta, af = schedules.rope(dim, base)
    elif kind == "linear":
        theta, af = schedules.linear(dim, base, float(p["factor"]))
    elif kind == "dynamic":
        source += ", dynamic_rope_update"
        theta, af = schedules.dynamic_ntk(dim, base, float(p["factor"]), max_pos, length)
    elif kind == "yarn":
        l0 = _original(p, config)
        theta, af = schedules.yarn(
            dim,
            base,
            float(p.get("factor") or max_pos / l0),
            l0,
            float(p.get("beta_fast") or 32),
            float(p.get("beta_slow") or 1),
            p.get("mscale"),
            p.get("mscale_all_dim"),
            p.get("attention_factor"),
            bool(p.get("truncate", True)),
        )
    elif kind == "llama3":
        theta, af = schedules.llama3(
            dim,
            base,
            float(p["factor"]),
            _original(p, config),
            float(p["low_freq_factor"]),
            float(p["high_freq_factor"]),
        )
    elif kind == "longrope":
        source += ", dynamic_rope_update (longrope_frequency_update)"
        l0 = _original(p, config)
        theta, af = schedules.longrope(
            dim,
            base,
            p["short_factor"],
            p["long_factor"],
            l0,
            float(p.get("factor") or max_pos / l0),
            p.get("attention_factor"),
            length,
        )
    else:
        return EngineRoPE("transformers", source, None, None, None, f"rope_type={kind!r} unknown")
    return EngineRoPE("transformers", source, theta, float(af), None)


def vllm_max_length(
    config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None
) -> tuple[int, str]:
    """vLLM 0.32's derived longest length and the field it came from
    (``_get_and_verify_max_len``)."""
    _, p = _dims(config)
    derived, key = float(config["max_position_embeddings"]), "max_position_embeddings"
    limit = (tokenizer_config or {}).get("model_max_length")
    if isinstance(limit, (int, float)) and limit < derived:
        derived, key = float(limit), "tokenizer model_max_length"
    kind = p.get("rope_type", "default")
    if kind not in _VLLM_UNSCALED:
        factor = p.get("factor")
        derived *= float(factor) if factor is not None else 1.0
        if factor is not None and float(factor) != 1.0:
            key += f" x factor {float(factor):g}"
    return int(derived), key


def vllm_rope(
    config: dict[str, Any],
    length: int,
    *,
    tokenizer_config: dict[str, Any] | None = None,
    max_model_len: int | None = None,
) -> EngineRoPE:
    """vLLM 0.32's RoPE for ``config`` at ``length`` tokens, served with ``max_model_len``
    (default: the length vLLM derives)."""
    dim, p = _dims(config)
    kind = p.get("rope_type", "default")
    limit, key = vllm_max_length(config, tokenizer_config)
    served = max_model_len or limit
    notes: list[str] = [f"accepts {limit} tokens ({key}; vllm/config/model.py)"]
    if served > limit:
        error = (
            f"max_model_len={served} is above the derived {limit} ({key}); vLLM refuses it "
            "without VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
        )
        return EngineRoPE(
            "vllm", "vllm/config/model.py: _get_and_verify_max_len", None, None, limit, error
        )
    args = (config, p, length, limit, notes, served, dim)
    if kind in ("default", "linear", "yarn", "llama3"):
        return _vllm_static(kind, *args)
    if kind == "dynamic":
        return _vllm_dynamic(*args)
    if kind == "longrope":
        return _vllm_longrope(*args)
    return EngineRoPE(
        "vllm",
        _ROTARY + "__init__.py: get_rope",
        None,
        None,
        limit,
        f"rope_type={kind!r} is not handled here",
    )


_ROTARY = "vllm/model_executor/layers/rotary_embedding/"


def _vllm_static(
    kind: str, config: dict, p: dict, length: int, limit: int, notes: list, served: int, dim: int
) -> EngineRoPE:
    """default, linear, yarn, llama3: transformers' frequencies, in a cos/sin cache of fixed
    size."""
    view = transformers_rope(config, length)
    source = {
        "default": _ROTARY + "base.py: RotaryEmbedding",
        "linear": _ROTARY + "linear_scaling_rope.py: LinearScalingRotaryEmbedding",
        "yarn": _ROTARY + "yarn_scaling_rope.py: YaRNScalingRotaryEmbedding",
        "llama3": _ROTARY + "llama3_rope.py: Llama3RotaryEmbedding",
    }[kind]
    if kind == "yarn" and p.get("factor") is None:
        return EngineRoPE(
            "vllm",
            source,
            None,
            None,
            limit,
            "yarn without factor: get_rope reads rope_parameters['factor'] (KeyError)",
        )
    max_pos = int(config["max_position_embeddings"])
    cache = max_pos * (float(p["factor"]) if kind == "linear" else 1.0)
    if kind == "yarn":
        cache = _original(p, config) * float(p["factor"])
    if length > cache:
        notes.append(f"positions >= {int(cache)} fall outside its cos/sin cache")
    return EngineRoPE(
        "vllm", source, view.inv_freq, view.attention_factor, limit, notes=tuple(notes)
    )


def _vllm_dynamic(
    config: dict, p: dict, length: int, limit: int, notes: list, served: int, dim: int
) -> EngineRoPE:
    """dynamic: one NTK base computed once for max_position_embeddings, at every length."""
    source = _ROTARY + "dynamic_ntk_scaling_rope.py: DynamicNTKScalingRotaryEmbedding"
    if "alpha" in p:
        return EngineRoPE(
            "vllm",
            source,
            None,
            None,
            limit,
            "dynamic with alpha: DynamicNTKAlphaRotaryEmbedding (no transformers equivalent)",
        )
    max_pos, base = int(config["max_position_embeddings"]), float(p["rope_theta"])
    s = float(p["factor"])
    trained = int(p.get("max_trained_positions") or max_pos)
    scaled = base * (s * max_pos / trained - (s - 1)) ** (dim / (dim - 2))
    theta, _ = schedules.rope(dim, scaled)
    notes.append(
        f"static: one base {scaled:.6g} for every length (M={max_pos}, "
        f"max_trained_positions={trained})"
    )
    if limit > max_pos:
        notes.append(f"its cos/sin cache holds {max_pos} positions but it accepts {limit}")
    return EngineRoPE("vllm", source, theta, 1.0, limit, notes=tuple(notes))


def _vllm_longrope(
    config: dict, p: dict, length: int, limit: int, notes: list, served: int, dim: int
) -> EngineRoPE:
    """longrope: the short or the long factors for the whole run, chosen by max_model_len."""
    source = _ROTARY + "phi3_long_rope_scaled_rope.py: Phi3LongRoPEScaledRotaryEmbedding"
    max_pos, base = int(config["max_position_embeddings"]), float(p["rope_theta"])
    l0 = _original(p, config)
    use_long = served > l0
    factors = torch.tensor(
        [float(x) for x in (p["long_factor"] if use_long else p["short_factor"])],
        dtype=torch.float64,
    )
    rope, _ = schedules.rope(dim, base)
    scale = max_pos / l0
    default = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(l0))
    mscale = p.get("long_mscale" if use_long else "short_mscale")
    af = float(default if mscale is None else mscale)
    notes.append(
        f"{'long' if use_long else 'short'} factors at every length "
        f"(max_model_len {served} {'>' if use_long else '<='} {l0})"
    )
    return EngineRoPE("vllm", source, rope / factors, af, limit, notes=tuple(notes))


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

    from .gguf_file import gguf_rope

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
