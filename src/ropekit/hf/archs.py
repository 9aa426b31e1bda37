"""The Hugging Face architectures ropekit can patch, and what it reads from their configs.

Holds: ArchSpec (how one architecture's attention differs from Llama's), ARCHS (model_type ->
ArchSpec, chosen by name, never by which attributes a module happens to have), arch_for,
unwrap (the model inside a PEFT wrapper), base_model (the decoder stack inside a
``*ForCausalLM``), ModelDims and model_dims (heads, layers, head dim from a config),
rope_parameters, original_length, rope_context (the ``base=``, ``original_length=``,
``fraction=``, ``pairing=`` a spec may omit).

Everything here reads transformers 5.24 configs: RoPE settings live in ``config.rope_parameters``
(``rope_theta``, ``rope_type``, ``original_max_position_embeddings``, ``partial_rotary_factor``),
standardised by ``RotaryEmbeddingConfigMixin.standardize_rope_params``.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from typing import Any

from torch import nn


def _config_window(module: nn.Module) -> int | None:
    # MistralAttention.forward passes getattr(self.config, "sliding_window", None).
    return getattr(module.config, "sliding_window", None)


def _module_window(module: nn.Module) -> int | None:
    # Qwen2/Qwen3 attention set self.sliding_window per layer from config.layer_types.
    return module.sliding_window


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """How one architecture's attention forward differs from Llama's (transformers 5.24)."""

    model_type: str  # config.model_type
    modeling: str  # module holding the attention class and its eager_attention_forward
    attention: str  # attention class name; every layer's self_attn must be one
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k before the rotation
    # The sliding_window the model's forward passes to its attention function; None for
    # architectures whose forward passes none (Llama).
    sliding_window: Callable[[nn.Module], int | None] | None

    def attention_class(self) -> type[nn.Module]:
        return getattr(importlib.import_module(self.modeling), self.attention)

    def eager_attention(self) -> Callable[..., Any]:
        """The architecture's own eager attention, the fallback transformers uses when
        ``config._attn_implementation`` is "eager"."""
        return importlib.import_module(self.modeling).eager_attention_forward


_MODELS = "transformers.models"
ARCHS: dict[str, ArchSpec] = {
    a.model_type: a
    for a in (
        ArchSpec("llama", f"{_MODELS}.llama.modeling_llama", "LlamaAttention", False, None),
        ArchSpec(
            "mistral",
            f"{_MODELS}.mistral.modeling_mistral",
            "MistralAttention",
            False,
            _config_window,
        ),
        ArchSpec(
            "qwen2", f"{_MODELS}.qwen2.modeling_qwen2", "Qwen2Attention", False, _module_window
        ),
        ArchSpec(
            "qwen3", f"{_MODELS}.qwen3.modeling_qwen3", "Qwen3Attention", True, _module_window
        ),
    )
}


def arch_for(config: Any) -> ArchSpec:
    """The ArchSpec for a config, or ValueError naming the supported model types."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHS:
        raise ValueError(
            f"model_type={model_type!r} is not supported by ropekit.hf; supported: "
            f"{', '.join(ARCHS)} (their attention forwards are the ones ropekit replaces)"
        )
    return ARCHS[model_type]


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (``PeftModel.get_base_model``), else the
    model itself. A model can only be a PeftModel if peft is already imported."""
    peft = sys.modules.get("peft")
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack (``LlamaModel`` & co.) of a model, of its ``*ForCausalLM`` wrapper or
    of a PEFT wrapper around either: transformers' ``PreTrainedModel.base_model`` follows
    ``base_model_prefix`` ("model")."""
    model = unwrap(model)
    base = getattr(model, "base_model", model)
    if not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        raise ValueError(
            f"{type(model).__name__} has no decoder stack with .layers and .rotary_emb; "
            "pass a transformers causal LM (Llama, Mistral, Qwen2, Qwen3)"
        )
    return base


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The shape an encoding is built for."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_layers: int
    d_model: int

    def as_kwargs(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def model_dims(config: Any) -> ModelDims:
    n_heads = config.num_attention_heads
    # Same rule as LlamaAttention: head_dim if set, else hidden_size // heads.
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return ModelDims(
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        n_layers=config.num_hidden_layers,
        d_model=config.hidden_size,
    )


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's flat ``rope_parameters`` dict (refusing per-layer-type dicts, which these
    architectures do not use)."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = [k for k in params if isinstance(params[k], dict)]
    if nested:
        raise ValueError(
            f"rope_parameters is nested by layer type ({', '.join(nested)}); ropekit.hf supports "
            "one RoPE setting for all layers"
        )
    if "rope_theta" not in params:
        raise ValueError(f"config.rope_parameters has no rope_theta: {params!r}")
    return dict(params)


def original_length(config: Any) -> int:
    """L0: ``original_max_position_embeddings`` when the config already scales RoPE (yarn,
    llama3, longrope), else ``max_position_embeddings``."""
    params = rope_parameters(config)
    value = params.get("original_max_position_embeddings") or config.max_position_embeddings
    return int(value)


def rope_context(config: Any) -> dict[str, Any]:
    """Options a spec may omit, filled from the model: ``base``, ``original_length``,
    ``fraction`` and ``pairing`` (these architectures use ``rotate_half``)."""
    params = rope_parameters(config)
    return {
        "base": float(params["rope_theta"]),
        "original_length": original_length(config),
        "fraction": float(params.get("partial_rotary_factor") or 1.0),
        "pairing": "half",
    }
