"""The Hugging Face decoders ropekit can take over, as data: one row per ``model_type``.

A decoder in transformers 5.24 runs its own attention forward (projections, q/k norms, the
KV cache, logit softcap, attention sinks, sliding or chunked windows) and calls the attention
function its config names through ``ALL_ATTENTION_FUNCTIONS``. ropekit takes over only the
rotation (``ropekit.hf.attention``), so what differs between families is what this table
says: which layers rotate, how their channels pair, where each layer type's RoPE settings
live, which layer types a family's own long-context recipe extends, and the attention extras
a distance remap cannot reproduce. Adding a family is a row here and its parity test
(tests/hf/test_families.py); nothing else in ropekit names a model type.

Holds: Architecture, ARCHS (model_type -> Architecture), arch_for, unwrap, base_model,
LayerInfo, layer_infos, default_types, covered_types (what a spec's ``layers=`` names),
attention_modules, ModelDims, model_dims, layer_dims,
rope_parameters, original_length, rope_context, layer_types, rotating_types.

Everything here reads transformers 5.24 configs: RoPE settings live in ``config.rope_parameters``
(``rope_theta``, ``rope_type``, ``original_max_position_embeddings``, ``partial_rotary_factor``),
flat, or nested by layer type (Gemma 3/4, OLMo 3) as transformers' ``layer_types`` name them.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

FULL = "full_attention"  # transformers' name for a layer without a window
SLIDING = "sliding_attention"

# Which layers of a family rotate (the rule its attention forward applies):
#   "all"        every attention layer (Llama...)
#   "rope_flags" config.no_rope_layers[i] is 1 where layer i rotates (SmolLM3, Llama 4)
#   "sliding"    only sliding-window layers rotate, full layers are NoPE (Cohere 2; EXAONE 4
#                when it has sliding layers)
ROTATION_RULES = ("all", "rope_flags", "sliding")
# How stock vLLM 0.32 serves a family:
#   "native"       its own model file, RoPE from get_rope with the config's rope_parameters
#                  (per layer type where they nest: gemma3.py and gemma4.py read
#                  config.rope_parameters[layer_type])
#   "transformers" its Transformers backend (_TRANSFORMERS_SUPPORTED_MODELS): transformers' own
#                  modeling code, so transformers' RoPE
#   "none"         no entry in its registry for the family's architecture
VLLM_SERVES = ("native", "transformers", "none")


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One decoder family: what its attention forward does that ropekit must know."""

    model_type: str  # config.model_type
    package: str  # transformers.models.<package>.modeling_<package>
    attention: str  # the attention class of every rotating layer
    attention_attr: str = "self_attn"  # where a decoder layer holds it (GPT-NeoX: attention)
    stack: str | None = None  # the decoder stack's attribute when base_model is not it (Llama 4)
    pairing: str = "half"  # "half" (rotate_half) or "interleaved" (GLM, Cohere: x[0::2], x[1::2])
    rotation: str = "all"  # which layers rotate (ROTATION_RULES)
    # Layer types the family's own long-context recipe extends, when not every rotating one
    # (Gemma 3: only the global layers carry long-range attention, the local ones keep 10k).
    recipe: tuple[str, ...] | None = None
    # Attention extras a distance remap's banded kernel does not compute, as (what, the config
    # field that turns it on; None: always on). Remaps are refused where one is on.
    extras: tuple[tuple[str, str | None], ...] = ()
    # Llama 4: an L2 norm of q and k follows the rotation, in the attention modules that have
    # this attribute (config.use_qk_norm on rope layers). The patched attention applies it again
    # after rotating, so a scale the rotation carries is removed as in the model (the norm
    # commutes with a rotation, so the first application, before it, changes nothing else).
    norm_after_rotation: str | None = None
    per_layer_dims: bool = False  # Gemma 4: head dim and kv heads per layer (per_layer_config)
    # Gemma 4's shared-KV layers read the keys of an earlier layer (config.num_kv_shared_layers).
    shares_kv: bool = False
    # How stock vLLM 0.32 serves the family (VLLM_SERVES; its model registry,
    # vllm/model_executor/models/registry.py, read from the installed wheel).
    vllm: str = "native"
    # vLLM 0.32 takes the family's max_position_embeddings as already scaled and applies no
    # rope factor to its accepted length (vllm/config/model.py, _get_and_verify_max_len).
    vllm_length_scaled: bool = False
    # ropekit's own GGUF writer writes the family: llama.cpp's llama graph, no q/k norms and
    # no attention biases (``serve.gguf_file``); others go through llama.cpp's converter.
    gguf: bool = False

    def __post_init__(self) -> None:
        if self.rotation not in ROTATION_RULES:
            raise ValueError(f"{self.model_type}: rotation={self.rotation!r}; use {ROTATION_RULES}")
        if self.vllm not in VLLM_SERVES:
            raise ValueError(f"{self.model_type}: vllm={self.vllm!r}; use {VLLM_SERVES}")

    @property
    def modeling(self) -> str:
        return f"transformers.models.{self.package}.modeling_{self.package}"

    def attention_class(self) -> type[nn.Module]:
        return getattr(importlib.import_module(self.modeling), self.attention)

    def eager_attention(self) -> Callable[..., Any]:
        """The family's own eager attention (softcap, sinks...): what transformers calls when
        ``config._attn_implementation`` is "eager"."""
        return importlib.import_module(self.modeling).eager_attention_forward

    def active_extras(self, config: Any) -> list[str]:
        """The extras this config turns on (named in a remap's refusal)."""
        return [
            what for what, field in self.extras if field is None or getattr(config, field, None)
        ]


def _row(model_type: str, package: str, attention: str, **data: Any) -> Architecture:
    return Architecture(model_type, package, attention, **data)


_SOFTCAP = ("logit softcap", "attn_logit_softcapping")
ARCHS: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        _row("llama", "llama", "LlamaAttention", gguf=True),
        _row("mistral", "mistral", "MistralAttention", gguf=True),
        _row("ministral", "ministral", "MinistralAttention", vllm="none"),
        _row("mixtral", "mixtral", "MixtralAttention"),
        _row("qwen2", "qwen2", "Qwen2Attention"),
        _row("qwen3", "qwen3", "Qwen3Attention"),
        _row("qwen3_moe", "qwen3_moe", "Qwen3MoeAttention"),
        _row("qwen3_5_text", "qwen3_5", "Qwen3_5Attention"),  # linear-attention layers skipped
        _row("gemma", "gemma", "GemmaAttention"),
        _row("gemma2", "gemma2", "Gemma2Attention", extras=(_SOFTCAP,)),
        _row(
            "gemma3_text",
            "gemma3",
            "Gemma3Attention",
            recipe=(FULL,),
            extras=(_SOFTCAP,),
            vllm_length_scaled=True,
        ),
        _row(
            "gemma4_text",
            "gemma4",
            "Gemma4TextAttention",
            recipe=(FULL,),
            per_layer_dims=True,
            shares_kv=True,
        ),
        _row("phi3", "phi3", "Phi3Attention"),
        _row("phi", "phi", "PhiAttention", vllm="transformers"),
        _row("olmo", "olmo", "OlmoAttention", vllm="transformers"),
        _row("olmo2", "olmo2", "Olmo2Attention", vllm="transformers"),
        _row("olmo3", "olmo3", "Olmo3Attention", vllm="transformers"),
        _row("smollm3", "smollm3", "SmolLM3Attention", rotation="rope_flags", vllm="transformers"),
        _row("gpt_oss", "gpt_oss", "GptOssAttention", extras=(("attention sinks", None),)),
        _row(
            "llama4_text",
            "llama4",
            "Llama4TextAttention",
            pairing="interleaved",  # apply_rotary_emb: view_as_complex of adjacent channels
            stack="model",  # Llama4ForCausalLM's base_model_prefix names the multimodal wrapper's
            rotation="rope_flags",
            norm_after_rotation="qk_norm",
        ),
        _row("granite", "granite", "GraniteAttention"),
        _row("cohere", "cohere", "CohereAttention", pairing="interleaved"),
        _row("cohere2", "cohere2", "Cohere2Attention", pairing="interleaved", rotation="sliding"),
        _row("stablelm", "stablelm", "StableLmAttention"),
        _row(
            "gpt_neox",
            "gpt_neox",
            "GPTNeoXAttention",
            attention_attr="attention",
            vllm="transformers",
        ),
        _row("exaone4", "exaone4", "Exaone4Attention", rotation="sliding"),
        _row("glm", "glm", "GlmAttention", pairing="interleaved", vllm="transformers"),
        _row("glm4", "glm4", "Glm4Attention", pairing="interleaved"),
        _row("helium", "helium", "HeliumAttention", pairing="interleaved", vllm="none"),
        _row("starcoder2", "starcoder2", "Starcoder2Attention", vllm="transformers"),
    )
}

# Families ropekit knows and cannot take, with why (the refusal says it).
REFUSED: dict[str, str] = {
    "deepseek_v2": "multi-head latent attention rotates a separate low-rank key part",
    "deepseek_v3": "multi-head latent attention rotates a separate low-rank key part",
    "kimi_linear": "multi-head latent attention rotates a separate low-rank key part",
}


def arch_for(config: Any) -> Architecture:
    """The Architecture of a config, or ValueError naming why and what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type in ARCHS:
        return ARCHS[model_type]
    why = REFUSED.get(model_type, "it has no row in ropekit.hf.archs.ARCHS")
    raise ValueError(
        f"model_type={model_type!r} is not supported by ropekit.hf ({why}); supported: "
        f"{', '.join(sorted(ARCHS))}"
    )


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
    arch = ARCHS.get(getattr(getattr(model, "config", None), "model_type", None))
    stack = arch.stack if arch is not None else None
    base = getattr(model, stack) if stack else getattr(model, "base_model", model)
    if not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        raise ValueError(
            f"{type(model).__name__} has no decoder stack with .layers and .rotary_emb; "
            f"pass a transformers causal LM of a supported family ({', '.join(sorted(ARCHS))})"
        )
    return base


# ----------------------------------------------------------------------------- layers
def layer_types(config: Any) -> tuple[str, ...]:
    """Each layer's type as the config names it (``layer_types``; full attention when the
    config has none)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    return tuple(types) if types else (FULL,) * n


def _rotates(arch: Architecture, config: Any, layer: int, kind: str) -> bool:
    if arch.rotation == "rope_flags":
        return bool(config.no_rope_layers[layer])
    if arch.rotation == "sliding":
        # EXAONE 4 without sliding layers rotates everywhere; Cohere 2 always has them.
        windowed = getattr(config, "sliding_window", None) is not None
        return kind == SLIDING or (arch.model_type == "exaone4" and not windowed)
    return True


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """What one decoder layer is: its type, whether it has softmax attention ropekit reaches
    (Qwen3.5's linear-attention layers do not), and whether that attention rotates."""

    index: int
    kind: str  # the config's layer type ("full_attention", "sliding_attention", ...)
    attends: bool
    rotates: bool


def layer_infos(config: Any) -> tuple[LayerInfo, ...]:
    """Each layer's LayerInfo; ValueError where the config's per-layer lists do not cover
    its layers."""
    arch = arch_for(config)
    n = config.num_hidden_layers
    flags = getattr(config, "no_rope_layers", None)
    if arch.rotation == "rope_flags" and (flags is None or len(flags) != n):
        raise ValueError(
            f"config.no_rope_layers={flags!r} is not allowed for this {config.model_type} "
            f"config: it must hold one 0/1 flag per layer ({n})"
        )
    out = []
    for i, kind in enumerate(layer_types(config)):
        attends = kind in (FULL, SLIDING, "chunked_attention")
        out.append(LayerInfo(i, kind, attends, attends and _rotates(arch, config, i, kind)))
    return tuple(out)


def rotating_types(config: Any) -> tuple[str, ...]:
    """The layer types that rotate, in the order they first appear."""
    return tuple(dict.fromkeys(info.kind for info in layer_infos(config) if info.rotates))


def default_types(config: Any) -> tuple[str, ...]:
    """The rotating layer types a spec without ``layers=`` covers: the family's recipe (every
    rotating type where it names none, or where this model has none of its types)."""
    rotating = rotating_types(config)
    recipe = arch_for(config).recipe
    return tuple(k for k in rotating if recipe is None or k in recipe) or rotating


# ``layers=`` words that name groups of types rather than one type.
ALIASES = {"all": None, "rope": None, "global": (FULL,), "local": (SLIDING,)}


def covered_types(config: Any, layers: str | None) -> tuple[str, ...]:
    """The layer types a spec's ``layers=`` covers in this model (None: the family's recipe);
    ValueError naming what the model has."""
    rotating = rotating_types(config)
    if not rotating:
        raise ValueError(f"model_type={config.model_type!r}: no layer of this model rotates")
    if layers is None:
        return default_types(config)
    out: list[str] = []
    for word in layers.split("+"):
        named = ALIASES.get(word, (word,))
        for kind in rotating if named is None else named:
            if kind not in rotating:
                raise ValueError(
                    f"layers={layers!r}: this {config.model_type} model has no rotating layers "
                    f"of type {kind!r}; its rotating types are {', '.join(rotating)} (or all, "
                    "rope, global, local)"
                )
            if kind not in out:
                out.append(kind)
    return tuple(k for k in rotating if k in out)


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Each rotating layer's attention module, by layer index."""
    arch, base = arch_for(unwrap(model).config), base_model(model)
    return {
        info.index: getattr(base.layers[info.index], arch.attention_attr, None)
        for info in layer_infos(unwrap(model).config)
        if info.rotates
    }


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


def layer_dims(config: Any, layer: int) -> ModelDims:
    """The shape of one layer's attention: Gemma 4 sets head dim and kv heads per layer."""
    n_heads = config.num_attention_heads
    source = config.per_layer_config[layer] if arch_for(config).per_layer_dims else config
    # Same rule as LlamaAttention: head_dim if set, else hidden_size // heads.
    head_dim = getattr(source, "head_dim", None) or config.hidden_size // n_heads
    return ModelDims(
        n_heads=n_heads,
        n_kv_heads=getattr(source, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        n_layers=config.num_hidden_layers,
        d_model=config.hidden_size,
    )


def model_dims(config: Any, kind: str | None = None) -> ModelDims:
    """The shape of the layers of type ``kind`` (the first rotating type when None); refused
    where layers of one type differ in shape."""
    infos = [i for i in layer_infos(config) if i.attends]
    kind = kind or (default_types(config) or (infos[0].kind if infos else FULL,))[0]
    shapes = {layer_dims(config, i.index) for i in infos if i.kind == kind}
    if len(shapes) > 1:
        raise ValueError(f"layers of type {kind!r} differ in shape: {sorted(map(str, shapes))}")
    return shapes.pop() if shapes else layer_dims(config, 0)


# ----------------------------------------------------------------------------- RoPE settings
def nested_by_type(params: dict[str, Any]) -> bool:
    """Whether ``rope_parameters`` hold one dict per layer type (Gemma 3/4, OLMo 3)."""
    return any(isinstance(v, dict) for v in params.values())


def rope_parameters(config: Any, kind: str | None = None) -> dict[str, Any]:
    """The ``rope_parameters`` of layers of type ``kind`` (the config's nested dict for it, or
    its flat dict, which every type shares); None: the type a spec covers by default."""
    params = getattr(config, "rope_parameters", None) or {}
    if nested_by_type(params):
        kinds = [k for k, v in params.items() if isinstance(v, dict)]
        if kind is None:
            kind = (default_types(config) or kinds)[0]
        if kind not in params:
            raise ValueError(
                f"config.rope_parameters has no settings for layer type {kind!r}; it has "
                f"{', '.join(kinds)}"
            )
        params = params[kind]
    if "rope_theta" not in params:
        raise ValueError(f"config.rope_parameters has no rope_theta: {params!r}")
    return dict(params)


def original_length(config: Any, kind: str | None = None) -> int:
    """L0: ``original_max_position_embeddings`` when the config already scales RoPE (yarn,
    llama3, longrope), else ``max_position_embeddings``."""
    params = rope_parameters(config, kind)
    value = params.get("original_max_position_embeddings") or config.max_position_embeddings
    return int(value)


def rope_context(config: Any, kind: str | None = None) -> dict[str, Any]:
    """Options a spec may omit, filled from the model for layers of type ``kind``: ``base``,
    ``original_length``, ``fraction``, ``proportion`` and ``pairing``. transformers spells
    both partial RoPE and p-RoPE's share ``partial_rotary_factor``; the rope type says which."""
    params = rope_parameters(config, kind)
    share = float(params.get("partial_rotary_factor") or 1.0)
    proportional = params.get("rope_type") == "proportional"
    return {
        "base": float(params["rope_theta"]),
        "original_length": original_length(config, kind),
        "fraction": 1.0 if proportional else share,
        "proportion": share if proportional else 1.0,
        "pairing": arch_for(config).pairing,
    }
