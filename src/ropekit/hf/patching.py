"""Patch a Hugging Face decoder so its rotating layers use a ropekit encoding.

One mechanism for every family in ``archs.ARCHS`` (``attention.py`` says how: neutral rotary
tables, and an attention function registered with transformers that rotates). What a patch
decides is which encoding each layer rotates with:

- the layer types a spec covers (``layers=``: type names joined by '+', or ``all``/``rope``
  = every rotating type, ``global`` = full attention, ``local`` = sliding; by default the
  family's long-context recipe, ``Architecture.recipe``) rotate with the spec's encoding,
  built for their shape and RoPE settings (base, L0, partial or proportional width, pairing);
- the other rotating types keep the model's own RoPE (``spec_from_config`` of their settings),
  computed by ropekit too, since the tables are neutral for the whole model;
- NoPE layers (SmolLM3, Llama 4, Cohere 2's and EXAONE 4's global layers) and layers without
  softmax attention (Qwen3.5's linear attention) are not touched.

The encoding is a registered submodule, ``base.ropekit_encoding``: its parameters appear in
``named_parameters()`` (so they train with the model) and in ``state_dict()``. A dtype guard
keeps them in the dtype they were built in when the model is cast (``model.to(bfloat16)``
would otherwise round learned frequency offsets and temperatures to 8-bit mantissas, a
visible angle error at long positions); device moves pass through.

Holds: patch, unpatch, is_patched, encoding_of, encoded_layers, build_for_model, covered_types,
ENCODING_ATTR.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ropekit.encodings import PositionEncoding, Spec, build

from .archs import (
    arch_for,
    attention_modules,
    base_model,
    covered_types,
    layer_infos,
    model_dims,
    rope_context,
    unwrap,
)
from .attention import LayerPatch, PatchState, RoutedConfig, before_attention, neutral_tables
from .rope_config import spec_from_config

ENCODING_ATTR = "ropekit_encoding"  # submodule name on the decoder stack: base.ropekit_encoding
OWN_ATTR = "ropekit_own_rope"  # the model's own RoPE for the layer types a patch leaves
_STATE_ATTR = "_ropekit_patch"  # plain attribute on the decoder stack (not a submodule)
_DTYPES_ATTR = "_ropekit_dtypes"  # on the encoding: the dtypes the guard restores


@dataclasses.dataclass(eq=False)
class _Patched:
    """What unpatch restores: the routed attention modules and their pre-hooks."""

    encoding: PositionEncoding
    layers: list[LayerPatch]
    attention: list[nn.Module]
    handles: list[RemovableHandle]


def _canonical_layers(config: Any, kinds: tuple[str, ...]) -> str | None:
    """What a spec records: None where the types are the family's default, else their names."""
    return None if kinds == covered_types(config, None) else "+".join(kinds)


def _context(config: Any, kinds: tuple[str, ...]) -> dict[str, Any]:
    """The RoPE settings a spec may omit, shared by every covered type (refused where types
    differ: one encoding cannot have two bases)."""
    per_type = {k: (rope_context(config, k), model_dims(config, k)) for k in kinds}
    first = per_type[kinds[0]]
    for kind, settings in per_type.items():
        if settings != first:
            raise ValueError(
                f"layer types {kinds[0]!r} and {kind!r} of this {config.model_type} model rotate "
                f"differently ({first[0]} vs {settings[0]}); one encoding covers types that "
                f"rotate alike: name one, e.g. layers={kinds[-1]}"
            )
    return first[0]


def build_for_model(config: Any, spec: Spec | str, **context: Any) -> PositionEncoding:
    """The encoding named by ``spec`` for the layer types it covers in a model with this config.

    Options the spec omits come from ``context``, then from those layers' RoPE settings
    (``rope_context``: base = rope_theta, original_length, fraction or proportion =
    partial_rotary_factor, the family's pairing). The model also offers ``l_ref`` = its
    original length: AdaRoPE takes it when the spec names neither ``l_ref`` nor an init
    schedule that carries one, because a pretrained model is being extended and the paper's
    extension setting uses L_ref = the training length (its pretraining value, 64, is what the
    encodings library falls back to).
    """
    spec = Spec.parse(spec)
    kinds = covered_types(config, spec.layers)
    merged = {**_context(config, kinds), **context}
    merged.setdefault("l_ref", merged["original_length"])
    encoding = build(spec.without("layers"), **model_dims(config, kinds[0]).as_kwargs(), **merged)
    encoding.layers = _canonical_layers(config, kinds)
    return encoding


def _check_wirable(encoding: PositionEncoding) -> None:
    # Only rotate_q/rotate_k are wired into transformers' attention; an encoding that adds to
    # the embeddings or to the attention logits would silently lose that part.
    if encoding.adds_to_embeddings or encoding.has_score_bias:
        raise ValueError(
            f"encoding {encoding.spec!r} adds to token embeddings or attention logits; "
            "ropekit.hf wires only rotary encodings (rotate_q/rotate_k, or nope) into "
            "Hugging Face attention"
        )


def _check_dims(encoding: PositionEncoding, config: Any, kind: str) -> None:
    dims = model_dims(config, kind)
    pairs = {
        "n_heads": (encoding.n_heads, dims.n_heads),
        "n_kv_heads": (encoding.n_kv_heads, dims.n_kv_heads),
        "head_dim": (encoding.head_dim, dims.head_dim),
        "n_layers": (encoding.n_layers, dims.n_layers),
    }
    for field, (got, expected) in pairs.items():
        if got != expected:
            raise ValueError(
                f"encoding {encoding.spec!r} was built for {field}={got}; this model's "
                f"{kind} layers have {expected}"
            )


def _guarded_apply(self: PositionEncoding, fn: Any, recurse: bool = True) -> PositionEncoding:
    """``nn.Module._apply`` that lets device moves through but restores each tensor's dtype."""
    type(self)._apply(self, fn, recurse)
    dtypes: dict[str, torch.dtype] = getattr(self, _DTYPES_ATTR)
    with torch.no_grad():
        for name, p in self.named_parameters():
            if name in dtypes and p.dtype != dtypes[name]:
                p.data = p.data.to(dtypes[name])
        for prefix, module in self.named_modules():
            for bname, b in module._buffers.items():
                key = f"{prefix}.{bname}" if prefix else bname
                if b is not None and key in dtypes and b.dtype != dtypes[key]:
                    module._buffers[bname] = b.to(dtypes[key])
    return self


def _install_dtype_guard(encoding: PositionEncoding) -> None:
    dtypes = {n: t.dtype for n, t in [*encoding.named_parameters(), *encoding.named_buffers()]}
    object.__setattr__(encoding, _DTYPES_ATTR, dtypes)
    # Bound to the instance (not a closure) so copy.deepcopy rebinds it to the copy.
    object.__setattr__(encoding, "_apply", types.MethodType(_guarded_apply, encoding))


def _remove_dtype_guard(encoding: PositionEncoding) -> None:
    encoding.__dict__.pop("_apply", None)
    encoding.__dict__.pop(_DTYPES_ATTR, None)


def _kv_source(config: Any, layer: int) -> int | None:
    """Gemma 4: a layer that reuses keys reads those of the last earlier layer of its type
    that stores them (``kv_sharing_modes``); None for a layer with its own keys."""
    modes = getattr(config, "kv_sharing_modes", None)
    if not arch_for(config).shares_kv or not modes or modes[layer] != "reuse":
        return None
    kinds = config.layer_types
    return max(j for j in range(layer) if modes[j] == "store" and kinds[j] == kinds[layer])


def _own_ropes(config: Any, kinds: list[str], device: torch.device) -> nn.ModuleDict:
    """The model's own RoPE for each rotating layer type a patch leaves (the tables are
    neutral for the whole model, so ropekit rotates those layers too)."""
    return nn.ModuleDict(
        {
            kind: build_for_model(
                config, spec_from_config(config, kind).with_options(layers=kind)
            ).to(device=device)
            for kind in dict.fromkeys(kinds)
        }
    )


def _state(model: nn.Module) -> _Patched | None:
    return getattr(base_model(model), _STATE_ATTR, None)


def is_patched(model: nn.Module) -> bool:
    return _state(model) is not None


def encoding_of(model: nn.Module) -> PositionEncoding | None:
    """The encoding a patched model uses, or None when it is not patched."""
    state = _state(model)
    return None if state is None else state.encoding


def encoded_layers(model: nn.Module) -> tuple[int, ...] | None:
    """The indices of the layers that rotate with the patch's encoding (not those left to the
    model's own RoPE, nor NoPE layers), or None when the model is not patched."""
    state = _state(model)
    if state is None:
        return None
    return tuple(layer.index for layer in state.layers if layer.encoding is state.encoding)


def patch(
    model: nn.Module, spec: Spec | str | PositionEncoding, **context: Any
) -> PositionEncoding:
    """Make the rotating layers of ``model`` use a ropekit encoding; returns the encoding.

    ``spec`` is a spec string (``"yarn:factor=4"``, ``"adarope:init=yarn,factor=2"``,
    ``"yarn:factor=4,layers=global"``) or an encoding already built for this model's shape.
    Options the spec omits come from ``context`` and then from the model's config
    (``build_for_model``). Patching a patched model replaces its encoding. The model is
    changed in place; ``unpatch`` reverts it.
    """
    config = unwrap(model).config
    arch = arch_for(config)
    base = base_model(model)
    attention_cls = arch.attention_class()
    infos = [info for info in layer_infos(config) if info.rotates]
    modules = attention_modules(model)
    for info in infos:
        attn = modules[info.index]
        if not isinstance(attn, attention_cls):
            raise ValueError(
                f"layer {info.index} attention is {type(attn).__name__}; ropekit.hf patches "
                f"{attention_cls.__name__} for model_type={arch.model_type!r}"
            )
    if isinstance(spec, PositionEncoding):
        encoding = spec
        if context:
            raise ValueError("context options apply to spec strings, not to a built encoding")
    else:
        encoding = build_for_model(config, spec, **context)
    kinds = covered_types(config, encoding.layers)
    _check_dims(encoding, config, kinds[0])
    _check_wirable(encoding)
    renorm = {
        i: arch.norm_after_rotation is not None and hasattr(m, arch.norm_after_rotation)
        for i, m in modules.items()
    }
    extras = arch.active_extras(config)
    extras += ["a q/k norm after the rotation"] if any(renorm.values()) else []
    if encoding.remaps_distance and extras:
        raise ValueError(
            f"{encoding.spec!r} attends in bands, which do not compute {config.model_type}'s "
            f"{' and '.join(extras)}; use a schedule (yarn, dynamic-ntk...) for this model"
        )

    unpatch(model)
    weight = next(modules[infos[0].index].parameters())
    encoding.to(device=weight.device)  # dtype stays: positions and frequencies are never bf16
    setattr(base, ENCODING_ATTR, encoding)
    _install_dtype_guard(encoding)
    own = _own_ropes(config, [i.kind for i in infos if i.kind not in kinds], weight.device)
    if own:
        setattr(base, OWN_ATTR, own)
    state = PatchState(arch=arch)
    patched = _Patched(encoding, [], [], [])
    for info in infos:
        attn = modules[info.index]
        layer = LayerPatch(
            index=info.index,
            encoding=encoding if info.kind in kinds else own[info.kind],
            state=state,
            renorm=renorm[info.index],
            source=_kv_source(config, info.index),
        )
        attn.config = RoutedConfig(config, layer)
        patched.layers.append(layer)
        patched.attention.append(attn)
        patched.handles.append(attn.register_forward_pre_hook(before_attention, with_kwargs=True))
    # Bound to the instance (not a closure) so copy.deepcopy rebinds it to the copy.
    object.__setattr__(
        base.rotary_emb, "forward", types.MethodType(neutral_tables, base.rotary_emb)
    )
    patched.handles.append(base.register_forward_pre_hook(state.read_positions, with_kwargs=True))
    object.__setattr__(base, _STATE_ATTR, patched)
    return encoding


def unpatch(model: nn.Module) -> PositionEncoding | None:
    """Restore the model's own attention and RoPE; returns the removed encoding (None if the
    model was not patched). A patched model's cache holds unrotated keys: do not reuse it
    after unpatching."""
    base = base_model(model)
    state: _Patched | None = getattr(base, _STATE_ATTR, None)
    if state is None:
        return None
    for handle in state.handles:
        handle.remove()
    for attn in state.attention:
        attn.config = attn.config._config
    base.rotary_emb.__dict__.pop("forward", None)
    for name in (ENCODING_ATTR, OWN_ATTR):
        if name in base._modules:
            delattr(base, name)
    base.__dict__.pop(_STATE_ATTR, None)
    _remove_dtype_guard(state.encoding)
    return state.encoding
