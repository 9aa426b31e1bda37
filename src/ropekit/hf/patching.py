"""Patch a Hugging Face decoder so every attention layer uses a ropekit encoding.

Shape legend: B batch · H query heads · K key/value heads · T query length · S key length
(cached + new) · D head dim.

How the patch hooks into transformers 5.24 (Llama, Mistral, Qwen2, Qwen3):

- Each layer's attention module gets an instance-level ``forward`` (the class is untouched, so
  other models in the process are not affected). It repeats the model's own steps, q/k/v
  projections, Qwen3's per-head q/k RMSNorm, ``cache.update``, the attention function chosen by
  ``config._attn_implementation`` (sdpa, eager, flash...) with the layer's sliding window, and
  ``o_proj``, but rotates with ``encoding.rotate_q`` / ``rotate_k`` instead of
  ``apply_rotary_pos_emb``. Positions are the ``position_ids`` the decoder layer forwards to its
  attention (``LlamaModel.forward`` makes them ``arange + past_seen_tokens`` when the caller
  gives none; ``generate`` makes them ``cumsum(attention_mask) - 1``), so cached decoding and
  left padding see the positions transformers would use.
- ``base.rotary_emb.forward`` returns None: the patched attention ignores
  ``position_embeddings``, so the model-wide cos/sin tables are not computed at all (and
  transformers' "dynamic" ``inv_freq`` buffer, which depends on the longest sequence seen so
  far, is never consulted).
- The encoding is a registered submodule, ``base.ropekit_encoding``: its parameters appear in
  ``named_parameters()`` (so they train with the model) and in ``state_dict()``. A dtype guard
  keeps them in the dtype they were built in when the model is cast (``model.to(bfloat16)``
  would otherwise round learned frequency offsets and temperatures to 8-bit mantissas, a
  visible angle error at long positions); device moves pass through.

Dynamic schedules and the KV cache (``encoding.dynamic``: dynamic-ntk, longrope): the
frequencies depend on the current length L = max(position) + 1. Other stacks cache keys
rotated at the length of their own step, so once L grows past the original length a query at
the new frequencies meets keys at old ones and relative positions no longer line up. Here the
cache holds *unrotated* keys; every step rotates all S keys again at the current L, with their
positions kept beside the cache (an attribute of transformers' cache layer, trimmed the same way
for sliding-window layers). The attention of the newest query in every layer is then (to round-off)
what a full forward at the final length computes from the same layer inputs. What a cache
cannot change is the past tokens' hidden states: in layers > 0 the keys and values of an earlier
token were computed (in the layers below) at the length of its own step, as in any cached
decoder; only recomputing the prefix removes that (measured on ``tests/tiny.py``'s 2-layer
Llama, 24 prompt + 24 new tokens past L0 = 32: max |cached - full| logit 0.035 for
dynamic-ntk x4, 0.11 for longrope, against a logit std of 0.65; one layer: 1e-7).
``cache.crop`` (assisted decoding) drops the newest positions with the newest keys; beam
search reorders beams of one prompt, which share their positions; a cache this patched model
did not fill is refused (its keys are rotated or their positions unknown); static caches are
refused (unfilled slots have no position). Static schedules cache rotated keys exactly as
transformers does, in any cache.

Distance remaps (``encoding.remaps_distance``: rerope, self-extend, dca, string) replace the
attention function: q, k and v go unrotated to ``ropekit.encodings.banded_attention``, which
computes each band (its own rotations of q and k, its own keys) and merges them (to round-off),
block by block over query rows, with transformers' mask (sdpa's boolean one, or None for
``is_causal``; eager's additive one) applied on top, so padding, GQA and sliding windows keep
their meaning and no (T, S) logit tensor per head is built. The cache holds unrotated keys
with their positions, as for dynamic schedules; decoding is exact at every step.

Holds: patch, unpatch, is_patched, encoding_of, build_for_model, ENCODING_ATTR.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ropekit.encodings import PositionEncoding, Spec, banded_attention, build
from ropekit.encodings.bands import RotatedKeys

from .archs import ArchSpec, arch_for, base_model, model_dims, rope_context, unwrap

ENCODING_ATTR = "ropekit_encoding"  # submodule name on the decoder stack: base.ropekit_encoding
_STATE_ATTR = "_ropekit_patch"  # plain attribute on the decoder stack (not a submodule)
_POSITIONS_ATTR = "_ropekit_key_positions"  # on a transformers cache layer: (B, S_stored)
_ROTATED_ATTR = "_ropekit_rotated_keys"  # on a transformers cache layer: a remap's RotatedKeys
_DTYPES_ATTR = "_ropekit_dtypes"  # on the encoding: the dtypes the guard restores


@dataclasses.dataclass(eq=False)
class _PatchState:
    """What the replaced forwards share: the encoding, the architecture, and the key positions
    of the last dynamic step. Every layer builds its own (B, S) key positions; handing each the
    one tensor of equal *values* lets the encoding's table cache (keyed on a tensor and its
    version counter) compute cos/sin once per step. The comparison is by value, so a cache
    grown, cropped or refilled in between never gets another step's positions."""

    encoding: PositionEncoding
    arch: ArchSpec
    attention: list[nn.Module]
    key_positions: Tensor | None = None

    def shared_positions(self, positions: Tensor) -> Tensor:
        last = self.key_positions
        if (
            last is not None
            and last.shape == positions.shape
            and last.device == positions.device
            and torch.equal(last, positions)
        ):
            return last
        self.key_positions = positions
        return positions


def build_for_model(config: Any, spec: Spec | str, **context: Any) -> PositionEncoding:
    """The encoding named by ``spec`` for a model with this config.

    Options the spec omits come from ``context``, then from the model (``rope_context``:
    base = rope_theta, original_length, fraction = partial_rotary_factor, pairing = half).
    The model also offers ``l_ref`` = its original length: AdaRoPE takes it when the spec names
    neither ``l_ref`` nor an init schedule that carries one, because a pretrained model is
    being extended and the paper's extension setting uses L_ref = the training length (its
    pretraining value, 64, is what the encodings library falls back to).
    """
    merged = {**rope_context(config), **context}
    merged.setdefault("l_ref", merged["original_length"])
    return build(spec, **model_dims(config).as_kwargs(), **merged)


def _check_wirable(encoding: PositionEncoding) -> None:
    # Only rotate_q/rotate_k are wired into transformers' attention; an encoding that adds to
    # the embeddings or to the attention logits would silently lose that part.
    if encoding.adds_to_embeddings or encoding.has_score_bias:
        raise ValueError(
            f"encoding {encoding.spec!r} adds to token embeddings or attention logits; "
            "ropekit.hf wires only rotary encodings (rotate_q/rotate_k, or nope) into "
            "Hugging Face attention"
        )


def _check_dims(encoding: PositionEncoding, config: Any) -> None:
    dims = model_dims(config)
    pairs = {
        "n_heads": (encoding.n_heads, dims.n_heads),
        "n_kv_heads": (encoding.n_kv_heads, dims.n_kv_heads),
        "head_dim": (encoding.head_dim, dims.head_dim),
        "n_layers": (encoding.n_layers, dims.n_layers),
    }
    for field, (got, expected) in pairs.items():
        if got != expected:
            raise ValueError(
                f"encoding {encoding.spec!r} was built for {field}={got}; this model has {expected}"
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


def _no_tables(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``rotary_emb.forward``: the patched attention makes its own tables."""
    return None


def _held_positions(layer_cache: Any, layer_idx: int, batch: int, device: torch.device) -> Tensor:
    """Positions (B, S_stored) of the unrotated keys a cache layer holds before this update."""
    keys = getattr(layer_cache, "keys", None) if layer_cache is not None else None
    # DynamicLayer starts with a 1-D empty tensor (lazy_initialization): nothing held yet.
    n_held = keys.shape[-2] if keys is not None and keys.dim() == 4 else 0
    if n_held == 0:
        return torch.zeros(batch, 0, dtype=torch.long, device=device)
    held = getattr(layer_cache, _POSITIONS_ATTR, None)
    if held is None or held.shape[-1] < n_held or held.shape[0] != batch:
        raise RuntimeError(
            f"the cache of layer {layer_idx} holds {n_held} keys that this patched model did not "
            "write (a cache filled before patching, by another model, or reshaped after the "
            "fact); a dynamic schedule caches unrotated keys with their positions, so start "
            "from a fresh DynamicCache"
        )
    # DynamicLayer.crop drops the newest tokens: keep the positions of the oldest n_held.
    return held[:, :n_held]


def _cache_unrotated(
    state: _PatchState,
    cache: Any,
    layer_idx: int,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    kwargs: dict[str, Any],
) -> tuple[Tensor, Tensor, Tensor]:
    """Cache unrotated keys with their positions; return every stored key, value (B, K, S, D)
    and the keys' positions (B, S)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RuntimeError(
            f"{type(cache).__name__} has no per-layer storage; dynamic schedules and distance "
            "remaps need transformers' DynamicCache"
        )
    batch = k.shape[0]
    before = layers[layer_idx] if layer_idx < len(layers) else None
    held = _held_positions(before, layer_idx, batch, k.device)
    keys, values = cache.update(k, v, layer_idx, kwargs=kwargs)  # (B, K, S, D) unrotated
    layer_cache = cache.layers[layer_idx]
    seen = torch.cat([held, positions.expand(batch, -1)], dim=-1)  # (B, S)
    if seen.shape[-1] != keys.shape[-2]:
        raise RuntimeError(
            f"{type(layer_cache).__name__} returned {keys.shape[-2]} keys for {seen.shape[-1]} "
            "known positions; dynamic schedules and distance remaps need a DynamicCache "
            "(static caches return unfilled slots whose positions are unknown)"
        )
    # Keep the positions of exactly the keys the layer stores (sliding-window layers keep the
    # last window - 1 of them, DynamicSlidingWindowLayer.update).
    stored = layer_cache.keys.shape[-2]
    setattr(layer_cache, _POSITIONS_ATTR, seen[:, seen.shape[-1] - stored :])
    return keys, values, state.shared_positions(seen)


def _rotated_keys(layer_cache: Any) -> RotatedKeys:
    """The remap's rotated keys kept on a transformers cache layer, told what the layer holds
    now (before this step's update): its key tensor replaced by anything but a prefix view of
    the one last seen (crop) means reordered or refilled keys, and starts it again."""
    memo = getattr(layer_cache, _ROTATED_ATTR, None) if layer_cache is not None else None
    memo = memo if memo is not None else RotatedKeys()
    keys = getattr(layer_cache, "keys", None) if layer_cache is not None else None
    memo.follow(keys)
    return memo


def _banded(
    module: nn.Module,
    state: _PatchState,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    key_positions: Tensor,
    attention_mask: Tensor | None,
    rotated_keys: RotatedKeys | None = None,
) -> Tensor:
    """A distance remap's attention (``ropekit.encodings.bands``): (B, T, H, D).

    transformers hands sdpa a boolean mask (True = attend) or None when ``is_causal`` suffices,
    and eager an additive float mask; both mean the same causal, padding and sliding-window
    pattern, which the banded kernel applies block by block on top of the bands."""
    if module.training and module.attention_dropout:
        raise ValueError(
            f"{state.encoding.spec!r} attends in bands, which have no attention dropout; "
            f"set attention_dropout=0 (it is {module.attention_dropout})"
        )
    S, T = k.shape[-2], q.shape[-2]
    mask_rows = None
    if attention_mask is not None:
        if attention_mask.dim() != 4:
            raise ValueError(
                f"{state.encoding.spec!r} attends in bands and reads 4-D attention masks (sdpa "
                f"and eager attention); attn_implementation="
                f"{module.config._attn_implementation!r} passed a {attention_mask.dim()}-D one"
            )
        full = attention_mask[..., -T:, -S:]  # (B, 1, T, S); static masks may be longer

        def mask_rows(start: int, stop: int, n: int) -> Tensor:
            return full[..., start:stop, :n]

    out = banded_attention(
        q,
        k,
        v,
        state.encoding.bands(positions, key_positions, module.layer_idx),
        key_positions,
        functools.partial(state.encoding.rotate_band, layer=module.layer_idx),
        scale=module.scaling,
        causal_offset=S - T,  # these decoders are causal; the mask adds padding and windows
        mask=mask_rows,
        rotated_keys=rotated_keys,
    )  # (B, H, T, D)
    return out.transpose(1, 2)  # (B, T, H, D)


def _attention_forward(
    module: nn.Module,
    state: _PatchState,
    hidden_states: Tensor,
    position_embeddings: Any = None,
    attention_mask: Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """The attention forward of a patched layer (see the module docstring)."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    positions = kwargs.get("position_ids")
    if positions is None:
        raise ValueError(
            "a patched attention layer needs position_ids; the decoder model passes them to "
            "every layer, so call the model rather than a layer on its own"
        )
    encoding, layer = state.encoding, module.layer_idx
    input_shape = hidden_states.shape[:-1]  # (B, T)
    hidden_shape = (*input_shape, -1, module.head_dim)
    q = module.q_proj(hidden_states).view(hidden_shape)  # (B, T, H, D)
    k = module.k_proj(hidden_states).view(hidden_shape)  # (B, T, K, D)
    if state.arch.qk_norm:
        # Qwen3Attention normalises each head's q and k before rotating them.
        q, k = module.q_norm(q), module.k_norm(k)
    q = q.transpose(1, 2)  # (B, H, T, D)
    k = k.transpose(1, 2)  # (B, K, T, D)
    v = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, K, T, D)

    if encoding.remaps_distance:
        key_positions, memo = positions, None
        if cache is not None:
            layers = getattr(cache, "layers", None) or []
            memo = _rotated_keys(layers[layer] if layer < len(layers) else None)
            k, v, key_positions = _cache_unrotated(state, cache, layer, k, v, positions, kwargs)
            setattr(cache.layers[layer], _ROTATED_ATTR, memo)
            memo.seen(cache.layers[layer].keys)
        out = _banded(module, state, q, k, v, positions, key_positions, attention_mask, memo)
        return module.o_proj(out.reshape(*input_shape, -1).contiguous()), None

    q = encoding.rotate_q(q, positions, layer)  # (B, H, T, D)
    if cache is not None and encoding.dynamic:
        # The schedule follows the current length: every key is kept unrotated and rotated
        # again at this step's length, as a full forward would.
        k, v, key_positions = _cache_unrotated(state, cache, layer, k, v, positions, kwargs)
        k = encoding.rotate_k(k, key_positions, layer)  # (B, K, S, D)
    else:
        k = encoding.rotate_k(k, positions, layer)
        if cache is not None:
            k, v = cache.update(k, v, layer, kwargs=kwargs)  # (B, K, S, D)

    attention = ALL_ATTENTION_FUNCTIONS.get_interface(
        module.config._attn_implementation, state.arch.eager_attention()
    )
    extra = {}
    if state.arch.sliding_window is not None:
        extra["sliding_window"] = state.arch.sliding_window(module)
    out, weights = attention(
        module,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling,
        **extra,
        **kwargs,
    )  # out (B, T, H, D)
    out = out.reshape(*input_shape, -1).contiguous()  # (B, T, H*D)
    return module.o_proj(out), weights


def _state(model: nn.Module) -> _PatchState | None:
    return getattr(base_model(model), _STATE_ATTR, None)


def is_patched(model: nn.Module) -> bool:
    return _state(model) is not None


def encoding_of(model: nn.Module) -> PositionEncoding | None:
    """The encoding a patched model uses, or None when it is not patched."""
    state = _state(model)
    return None if state is None else state.encoding


def patch(
    model: nn.Module, spec: Spec | str | PositionEncoding, **context: Any
) -> PositionEncoding:
    """Make every attention layer of ``model`` use a ropekit encoding; returns the encoding.

    ``spec`` is a spec string (``"yarn:factor=4"``, ``"adarope:init=yarn,factor=2"``) or an
    encoding already built for this model's shape. Options the spec omits come from
    ``context`` and then from the model's config (``build_for_model``). Patching a patched
    model replaces its encoding. The model is changed in place; ``unpatch`` reverts it.
    """
    config = unwrap(model).config
    arch = arch_for(config)
    base = base_model(model)
    attention_cls = arch.attention_class()
    attention = [layer.self_attn for layer in base.layers]
    for i, attn in enumerate(attention):
        if not isinstance(attn, attention_cls):
            raise ValueError(
                f"layer {i} attention is {type(attn).__name__}; ropekit.hf patches "
                f"{attention_cls.__name__} for model_type={arch.model_type!r}"
            )
    if isinstance(spec, PositionEncoding):
        encoding = spec
        if context:
            raise ValueError("context options apply to spec strings, not to a built encoding")
    else:
        encoding = build_for_model(config, spec, **context)
    _check_dims(encoding, config)
    _check_wirable(encoding)

    unpatch(model)
    weight = attention[0].q_proj.weight
    encoding.to(device=weight.device)  # dtype stays: positions and frequencies are never bf16
    setattr(base, ENCODING_ATTR, encoding)
    _install_dtype_guard(encoding)
    state = _PatchState(encoding=encoding, arch=arch, attention=attention)
    for attn in attention:
        # functools.partial of a module-level function (not a closure): deepcopy and pickle
        # rebuild it around the copied module and state.
        object.__setattr__(attn, "forward", functools.partial(_attention_forward, attn, state))
    object.__setattr__(base.rotary_emb, "forward", _no_tables)
    object.__setattr__(base, _STATE_ATTR, state)
    return encoding


def unpatch(model: nn.Module) -> PositionEncoding | None:
    """Restore the model's own attention and RoPE; returns the removed encoding (None if the
    model was not patched). Caches written by a dynamic schedule hold unrotated keys and must
    not be reused after unpatching."""
    base = base_model(model)
    state: _PatchState | None = getattr(base, _STATE_ATTR, None)
    if state is None:
        return None
    for attn in state.attention:
        attn.__dict__.pop("forward", None)
    base.rotary_emb.__dict__.pop("forward", None)
    if ENCODING_ATTR in base._modules:
        delattr(base, ENCODING_ATTR)
    base.__dict__.pop(_STATE_ATTR, None)
    _remove_dtype_guard(state.encoding)
    return state.encoding
