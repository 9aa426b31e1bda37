"""vLLM 0.32 (``vllm/model_executor/layers/rotary_embedding/__init__.py: get_rope`` and the
class of each type; ``vllm/config/model.py: _get_and_verify_max_len``).

- accepted length: the smallest of ``max_position_embeddings`` (and the other length keys) and
  the tokenizer's ``model_max_length``, times ``factor`` for every type but yarn, llama3,
  longrope (``deepseek_yarn``...); a longer ``--max-model-len`` is refused.
- default, linear, yarn, llama3: as transformers (YaRN: ``YaRNScalingRotaryEmbedding`` honours
  attention_factor, mscale/mscale_all_dim and truncate).
- dynamic (``DynamicNTKScalingRotaryEmbedding``): static: one base
  b (s M / M_t - (s - 1))^(d/(d-2)) for every length, M = max_position_embeddings,
  M_t = rope_parameters.max_trained_positions (default M, which gives plain RoPE), and a
  cos/sin cache of M rows while M x s tokens are accepted.
- proportional (``gemma4_rope.py: Gemma4RotaryEmbedding``, Gemma 4's p-RoPE): transformers'
  frequencies, but ``factor`` is never read: a scaled p-RoPE is served unscaled.
- longrope (``Phi3LongRoPEScaledRotaryEmbedding``): long factors at every length once
  max_model_len > original, short ones otherwise; cos/sin scaled by
  ``long_mscale``/``short_mscale``, default sqrt(1 + ln(M/L0)/ln L0): it never reads
  ``attention_factor`` or ``factor``.

Holds: Vllm, vllm_rope, vllm_max_length.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from ropekit.encodings import schedules
from ropekit.hf.archs import ARCHS

from .base import Engine, EngineRoPE, ServedFolder, original_length, rotary_dims
from .transformers import transformers_rope

_VLLM_UNSCALED = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


class Vllm(Engine):
    """Stock vLLM: reads config.json's rope_parameters and length fields."""

    name = "vllm"
    label = "vLLM 0.32"
    export_format = "hf"
    floor: ClassVar = {
        1024: {"max": 3.549731377994192e-04, "mean": 5.1532243186848386e-05},
        9216: {"max": 6.824548629451588e-03, "mean": 1.6846919475156655e-04},
    }

    def rope(self, folder: ServedFolder, length: int) -> EngineRoPE | None:
        """None for a GGUF file (ropekit exports HF folders for vLLM); a refusal for a folder
        written for ropekit's plugin (``--format vllm``), whose architecture stock vLLM does
        not know."""
        if folder.gguf is not None:
            return None
        from ropekit.serve.vllm_plugin import ARCHITECTURE

        if ARCHITECTURE in (folder.config.get("architectures") or ()):
            # vLLM 0.32 resolves config.json's architectures in its ModelRegistry and raises
            # on a name it lacks (vllm/model_executor/models/registry.py:
            # _raise_for_unsupported); only the plugin's entry point registers this one.
            return EngineRoPE(
                "vllm", "vllm/model_executor/models/registry.py: _raise_for_unsupported",
                None, None, None,
                f"architecture {ARCHITECTURE} is not supported (only ropekit's plugin "
                "registers it)",
            )  # fmt: skip
        return _as_family_is_served(folder, self.config_rope(folder, length), length)

    def config_rope(self, folder: ServedFolder, length: int) -> EngineRoPE:
        """What vLLM computes from the folder's rope_parameters and length fields at
        ``length`` tokens (served at the folder's target where vLLM accepts it)."""
        view = vllm_rope(
            folder.config, length, tokenizer_config=folder.tokenizer_config,
            max_model_len=folder.target,
        )  # fmt: skip
        if view.error is not None and view.max_length is not None:
            # What vLLM does when the target is not asked for: serve its derived length.
            shorter = vllm_rope(folder.config, length, tokenizer_config=folder.tokenizer_config)
            return dataclasses.replace(shorter, target_refused=view.error)
        return view

    def refusal_fix(self, folder: ServedFolder) -> str:
        arch = ARCHS.get(folder.config.get("model_type"))
        if arch is not None and arch.vllm == "none":
            return "serve it with transformers (or ropekit.hf), or a vLLM whose registry has it"
        from ropekit.serve.vllm_plugin import ARCHITECTURE

        if ARCHITECTURE not in (folder.config.get("architectures") or ()):
            return super().refusal_fix(folder)
        if (folder.record or {}).get("serve_with") is not None:
            return (
                "install ropekit in vLLM's environment (pip install --no-deps ropekit): no "
                "stock engine computes a distance remap"
            )
        return (
            "install ropekit in vLLM's environment (pip install --no-deps ropekit), or export "
            "with --nearest (default --format hf) for stock vLLM: the nearest shared schedule, "
            "approximate"
        )

    def length_fix(self, folder: ServedFolder) -> str:
        p, target = folder.rope_parameters, folder.target
        if folder.rope_type in ("linear", "dynamic"):
            dynamic = (
                " (dynamic: transformers measures its stretch against it, so exact dynamic "
                "serving in both is impossible)"
            )
            return (
                f"vLLM accepts max_position_embeddings x factor: set max_position_embeddings "
                f"so that it times factor {p.get('factor')} is >= {target}"
                + (dynamic if folder.rope_type == "dynamic" else "")
            )
        return (
            f"set max_position_embeddings = {target} (and a tokenizer model_max_length >= "
            f"{target}); vLLM takes {folder.rope_type}'s length from it unscaled"
        )

    def frequencies_fix(self, folder: ServedFolder) -> str:
        if folder.rope_type == "dynamic":
            return (
                "none in the config: vLLM's dynamic NTK is one fixed base (plain RoPE unless "
                "max_trained_positions < max_position_embeddings); export a fixed schedule "
                "(yarn, or ntk at the target) or serve with transformers/ropekit"
            )
        if folder.rope_type == "longrope":
            return (
                "set short_factor = long_factor (vLLM picks one set for every length from "
                "max_model_len, transformers switches by sequence length), or serve with "
                "--max-model-len <= original_max_position_embeddings for short prompts"
            )
        if folder.rope_type == "proportional":
            return (
                "none in the config: vLLM's p-RoPE reads no factor; keep factor 1 in these "
                "layers (extend them with ropekit.hf), or serve with transformers"
            )
        return super().frequencies_fix(folder)

    def attention_fix(self, folder: ServedFolder, value: float) -> str:
        if folder.rope_type == "longrope":
            return f"add short_mscale = long_mscale = {value:.6f} to rope_parameters"
        return super().attention_fix(folder, value)


def _as_family_is_served(folder: ServedFolder, view: EngineRoPE, length: int) -> EngineRoPE:
    """``view`` (get_rope's rule) as stock vLLM serves the folder's family
    (``ropekit.hf.archs.VLLM_SERVES``): its own model file (the rule), its Transformers backend
    (transformers' RoPE, vLLM's accepted length), or a refusal where its registry has none."""
    arch = ARCHS.get(folder.config.get("model_type"))
    if arch is None or arch.vllm == "native":
        return view
    registry = "vllm/model_executor/models/registry.py"
    if arch.vllm == "none":
        return EngineRoPE(
            "vllm", registry, None, None, None,
            f"vLLM 0.32's registry has no model for {arch.model_type} "
            f"({', '.join(folder.config.get('architectures') or ()) or 'its architecture'})",
        )  # fmt: skip
    if view.error is not None:  # a length vLLM refuses, whichever model code runs
        return view
    theirs = transformers_rope(folder.config, length)
    return dataclasses.replace(
        view,
        source=f"{registry}: _TRANSFORMERS_SUPPORTED_MODELS (transformers' modeling code)",
        inv_freq=theirs.inv_freq,
        attention_factor=theirs.attention_factor,
        error=theirs.error,
    )


def vllm_max_length(
    config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None
) -> tuple[int, str]:
    """vLLM 0.32's derived longest length and the field it came from
    (``_get_and_verify_max_len`` with ``iter_rope_parameters``: every layer type's
    rope_parameters, which ``inspection.layer_type_folders`` keeps as ``ropekit_rope_by_type``
    in each type's flat config)."""
    derived, key = float(config["max_position_embeddings"]), "max_position_embeddings"
    limit = (tokenizer_config or {}).get("model_max_length")
    if isinstance(limit, (int, float)) and limit < derived:
        derived, key = float(limit), "tokenizer model_max_length"
    # One factor for the whole model, from every layer type's rope_parameters (the last
    # type's that is not yarn-like wins; a family's length may count as already scaled:
    # Architecture.vllm_length_scaled).
    factor = 1.0
    arch = ARCHS.get(config.get("model_type"))
    if arch is None or not arch.vllm_length_scaled:
        for p in config.get("ropekit_rope_by_type") or [config.get("rope_parameters") or {}]:
            if p.get("rope_type", "default") not in _VLLM_UNSCALED:
                factor = float(p.get("factor") or factor)
    derived *= factor
    if factor != 1.0:
        key += f" x factor {factor:g}"
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
    dim, p = rotary_dims(config)
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
    if kind == "proportional":
        return _vllm_proportional(*args)
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
        cache = original_length(p, config) * float(p["factor"])
    if length > cache:
        notes.append(f"positions >= {int(cache)} fall outside its cos/sin cache")
    return EngineRoPE(
        "vllm", source, view.inv_freq, view.attention_factor, limit, notes=tuple(notes)
    )


def _vllm_proportional(
    config: dict, p: dict, length: int, limit: int, notes: list, served: int, dim: int
) -> EngineRoPE:
    """p-RoPE (gemma4_rope.py: Gemma4RotaryEmbedding): transformers' frequencies over the
    whole head with the pairs past ``dim`` / 2 zeroed, but ``factor`` is never read (get_rope
    passes it no scaling), so a scaled p-RoPE is served unscaled."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    theta, _ = schedules.rope(head_dim, float(p["rope_theta"]))
    theta = schedules.proportional(theta, dim // 2)
    if float(p.get("factor") or 1.0) != 1.0:
        notes.append(f"ignores factor={float(p['factor']):g} (Gemma4RotaryEmbedding has none)")
    source = _ROTARY + "gemma4_rope.py: Gemma4RotaryEmbedding"
    return EngineRoPE("vllm", source, theta, 1.0, limit, notes=tuple(notes))


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
    l0 = original_length(p, config)
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
