"""The one attention function ropekit registers with transformers, for every family.

Shape legend: B batch · H query heads · K key/value heads · T query length · S key length
(cached + new) · D head dim.

A patched model runs its own attention forward unchanged (projections, q/k norms, the KV
cache, softcap, sinks, windows). Its rotary tables are made neutral (cos 1, sin 0: the
family's own ``apply_rotary_pos_emb`` is then the identity, whatever its pairing or partial
width), and each rotating layer's ``config`` is a ``RoutedConfig``, the model's config in all
but ``_attn_implementation``, which names ``ROPEKIT``: the module's own
``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, ...)`` then calls
``ropekit_attention`` with unrotated q and k and ``position_ids`` in its kwargs. That function
rotates with the layer's ropekit encoding (or computes a distance remap's bands) and calls the
implementation the model chose (sdpa, eager, flex, flash) with the same arguments. The model's
masks are built from its real config, so they are the ones that implementation expects.

The KV cache holds unrotated keys (the model caches what it computed, and the tables are
neutral), with their positions kept on each transformers cache layer: a forward pre-hook on
the attention module reads what the layer held before this step (the cache is not an argument
of the attention function), the function adds this step's positions after the update. So a
dynamic schedule rotates every key again at the current length, as a full forward would, and a
static schedule or a remap keeps its rotated keys beside the cache (``bands.RotatedKeys``) and
rotates only the keys a step adds. ``cache.crop`` keeps a prefix of both; a reordered or
refilled cache starts the rotated keys again; a cache this patched model did not fill, and a
static cache (its unfilled slots have no position), are refused.

What a cache cannot change is the past tokens' hidden states: in layers > 0 the keys of an
earlier token were computed (in the layers below) at the length of its own step, as in any
cached decoder; only recomputing the prefix removes that (measured on ``tests/tiny.py``'s
2-layer Llama, 24 prompt + 24 new tokens past L0 = 32: max |cached - full| logit 0.035 for
dynamic-ntk x4, 0.11 for longrope, against a logit std of 0.65; one layer: 1e-7).

Holds: ROPEKIT, RoutedConfig, LayerPatch, PatchState, ropekit_attention, before_attention,
neutral_tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from ropekit.encodings import PositionEncoding, banded_attention
from ropekit.encodings.bands import RotatedKeys

from .archs import Architecture

ROPEKIT = "ropekit"  # the name ropekit_attention is registered under
_POSITIONS_ATTR = "_ropekit_key_positions"  # on a transformers cache layer: (B, S_stored)
_ROTATED_ATTR = "_ropekit_rotated_keys"  # on a transformers cache layer: RotatedKeys
CACHE_KWARGS = ("cache", "past_key_values", "layer_past")  # GPT-NeoX: layer_past


@dataclasses.dataclass(eq=False)
class PatchState:
    """What the patched layers of one model share: the architecture, and the key positions of
    the last step. Every layer builds its own (B, S) key positions; handing each the one tensor
    of equal *values* lets an encoding's table cache (keyed on a tensor and its version counter)
    compute cos/sin once per step. The comparison is by value, so a cache grown, cropped or
    refilled in between never gets another step's positions."""

    arch: Architecture
    key_positions: Tensor | None = None
    positions: Tensor | None = None  # the position_ids the decoder stack was called with

    def read_positions(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the decoder stack: the positions it was given, for families
        whose layers do not hand ``position_ids`` to their attention (Llama 4)."""
        self.positions = kwargs.get("position_ids")

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


@dataclasses.dataclass(eq=False)
class LayerPatch:
    """One rotating layer: the encoding it rotates with (the patch's, or the model's own RoPE
    for a layer type the patch leaves), and what the pre-hook saw of the cache this step."""

    index: int
    encoding: PositionEncoding
    state: PatchState
    renorm: bool = False  # Llama 4: the module's qk_norm follows the rotation
    source: int | None = None  # kv sharing: the layer whose cache holds this layer's keys
    cache: Any = None
    held: Tensor | None = None  # (B, S_held) positions of the keys held before this step
    memo: RotatedKeys | None = None


class RoutedConfig:
    """A rotating layer's view of its model's config: every attribute is the model's config's,
    except ``_attn_implementation``, which is ``ROPEKIT`` outside ``ropekit_attention`` (so the
    module's own forward calls it) and the model's choice inside (flash attention reads it from
    the module to pick its version). ``layer`` is what ropekit does to this layer."""

    def __init__(self, config: Any, layer: LayerPatch) -> None:
        self.__dict__.update(_config=config, layer=layer, _inside=False)

    def __getattr__(self, name: str) -> Any:  # only for names this object does not hold
        if name.startswith("__") or name in ("_config", "layer", "_inside"):
            raise AttributeError(name)
        return getattr(self._config, name)

    @property
    def _attn_implementation(self) -> str:
        return self._config._attn_implementation if self._inside else ROPEKIT

    @property
    def inner(self) -> str:
        """The attention implementation the model's config chose."""
        return self._config._attn_implementation

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        self.__dict__["_inside"] = True
        try:
            yield
        finally:
            self.__dict__["_inside"] = False


# ----------------------------------------------------------------------------- tables
def neutral_tables(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Stands in for a rotary embedding's ``forward``: the family's own tables with every
    angle zero (cos 1, sin 0; Llama 4's complex ``freqs_cis`` 1 + 0i), so its rotation is the
    identity and ropekit rotates instead. Same shapes and dtypes as the model's."""
    out = type(self).forward(self, *args, **kwargs)
    # Broadcast scalars (stride 0): a table's shape and dtype without its memory.
    if isinstance(out, tuple) and len(out) == 2:
        cos, sin = out
        return cos.new_ones(()).expand_as(cos), sin.new_zeros(()).expand_as(sin)
    if isinstance(out, Tensor) and out.is_complex():
        return out.new_ones(()).expand_as(out)
    raise TypeError(
        f"{type(self).__name__}.forward returned {type(out).__name__}; ropekit neutralises "
        "(cos, sin) tables or complex freqs_cis"
    )


# ----------------------------------------------------------------------------- the cache
def _held_positions(layer_cache: Any, layer: int, batch: int, device: torch.device) -> Tensor:
    """Positions (B, S_held) of the unrotated keys a cache layer holds before this update."""
    keys = getattr(layer_cache, "keys", None) if layer_cache is not None else None
    # DynamicLayer starts with a 1-D empty tensor (lazy_initialization): nothing held yet.
    n_held = keys.shape[-2] if keys is not None and keys.dim() == 4 else 0
    if n_held == 0:
        return torch.zeros(batch, 0, dtype=torch.long, device=device)
    held = getattr(layer_cache, _POSITIONS_ATTR, None)
    if held is None or held.shape[-1] < n_held or held.shape[0] != batch:
        raise RuntimeError(
            f"the cache of layer {layer} holds {n_held} keys that this patched model did not "
            "write (a cache filled before patching, by another model, or reshaped after the "
            "fact); a patched model caches unrotated keys with their positions, so start "
            "from a fresh DynamicCache"
        )
    # DynamicLayer.crop drops the newest tokens: keep the positions of the oldest n_held.
    return held[:, :n_held]


def _rotated_keys(layer_cache: Any) -> RotatedKeys:
    """The rotated keys kept on a cache layer, told what the layer holds now (before this
    step's update): a key tensor replaced by anything but a prefix view of the one last seen
    (crop) means reordered or refilled keys, and starts them again."""
    memo = getattr(layer_cache, _ROTATED_ATTR, None) if layer_cache is not None else None
    memo = memo if memo is not None else RotatedKeys()
    memo.follow(getattr(layer_cache, "keys", None) if layer_cache is not None else None)
    return memo


def before_attention(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a rotating attention module: what its cache layer holds before
    this step's update (positions, rotated keys)."""
    patch: LayerPatch = module.config.layer
    cache = next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)
    patch.cache, patch.held, patch.memo = cache, None, None
    if cache is None or patch.source is not None:
        return
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RuntimeError(
            f"{type(cache).__name__} has no per-layer storage; a patched model caches "
            "unrotated keys with their positions in transformers' DynamicCache"
        )
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    layer_cache = layers[patch.index] if patch.index < len(layers) else None
    patch.held = _held_positions(layer_cache, patch.index, hidden.shape[0], hidden.device)
    # A remap's bands are guarded by their positions; a dynamic schedule's keys change with
    # every step's length, so it keeps none.
    if patch.encoding.remaps_distance or not patch.encoding.dynamic:
        patch.memo = _rotated_keys(layer_cache)


def _key_positions(patch: LayerPatch, positions: Tensor, n_keys: int) -> Tensor:
    """(B, S) positions of the n_keys keys this step attends to, recorded on the cache."""
    cache = patch.cache
    if cache is None:
        if n_keys != positions.shape[-1]:
            raise RuntimeError(
                f"layer {patch.index} attends to {n_keys} keys for {positions.shape[-1]} "
                "positions without a cache; ropekit cannot place the others"
            )
        return positions
    if patch.source is not None:  # kv sharing: the source layer recorded them this step
        seen = getattr(cache.layers[patch.source], _POSITIONS_ATTR)
    else:
        seen = torch.cat([patch.held, positions.expand(patch.held.shape[0], -1)], dim=-1)
        layer_cache = cache.layers[patch.index]
        stored = layer_cache.keys.shape[-2]
        # Sliding-window layers keep only the newest keys (DynamicSlidingWindowLayer.update).
        setattr(layer_cache, _POSITIONS_ATTR, seen[:, max(seen.shape[-1] - stored, 0) :])
    if seen.shape[-1] != n_keys:
        raise RuntimeError(
            f"{type(cache.layers[patch.index]).__name__} returned {n_keys} keys for "
            f"{seen.shape[-1]} known positions; a patched model needs a DynamicCache (static "
            "caches return unfilled slots whose positions are unknown)"
        )
    return patch.state.shared_positions(seen)


def _query_positions(
    patch: LayerPatch, kwargs: dict[str, Any], length: int, device: torch.device
) -> Tensor:
    """(B|1, T) positions of this step's queries: the ``position_ids`` the layer was handed,
    else those the decoder stack was called with, else what transformers counts when it is
    given none (past tokens + arange, ``LlamaModel.forward``)."""
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = patch.state.positions
    if positions is None:
        past = 0 if patch.held is None else patch.held.shape[-1]
        positions = torch.arange(past, past + length, device=device)[None]
    return positions


def _remember(patch: LayerPatch) -> None:
    if patch.memo is not None and patch.cache is not None:
        layer_cache = patch.cache.layers[patch.index]
        setattr(layer_cache, _ROTATED_ATTR, patch.memo)
        patch.memo.seen(layer_cache.keys)


# ----------------------------------------------------------------------------- attention
def _banded(
    module: nn.Module,
    patch: LayerPatch,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    key_positions: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None,
    dropout: float,
) -> Tensor:
    """A distance remap's attention (``ropekit.encodings.bands``): (B, T, H, D).

    transformers hands sdpa a boolean mask (True = attend) or None when ``is_causal``
    suffices, and eager an additive float mask; both mean the same causal, padding and window
    pattern, which the banded kernel applies block by block on top of the bands."""
    encoding = patch.encoding
    if dropout:
        raise ValueError(
            f"{encoding.spec!r} attends in bands, which have no attention dropout; set "
            f"attention_dropout=0 (it is {dropout})"
        )
    S, T = k.shape[-2], q.shape[-2]
    mask_rows = None
    if attention_mask is not None:
        if attention_mask.dim() != 4:
            raise ValueError(
                f"{encoding.spec!r} attends in bands and reads 4-D attention masks (sdpa and "
                f"eager attention); attn_implementation={module.config.inner!r} passed a "
                f"{attention_mask.dim()}-D one"
            )
        full = attention_mask[..., -T:, -S:]  # (B, 1, T, S); static masks may be longer

        def mask_rows(start: int, stop: int, n: int) -> Tensor:
            return full[..., start:stop, :n]

    out = banded_attention(
        q,
        k,
        v,
        encoding.bands(positions, key_positions, patch.index),
        key_positions,
        functools.partial(encoding.rotate_band, layer=patch.index),
        scale=scaling,
        causal_offset=S - T,  # these decoders are causal; the mask adds padding and windows
        mask=mask_rows,
        rotated_keys=patch.memo,
    )  # (B, H, T, D)
    return out.transpose(1, 2)  # (B, T, H, D)


def ropekit_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """The attention of a patched layer: q (B, H, T, D) and k, v (B, K, S, D) unrotated, as
    the module's own forward hands them over; returns what the model's attention returns."""
    view: RoutedConfig = module.config
    patch = view.layer
    encoding, layer = patch.encoding, patch.index
    positions = _query_positions(patch, kwargs, query.shape[-2], query.device)
    key_positions = _key_positions(patch, positions, key.shape[-2])
    if encoding.remaps_distance:
        out = _banded(
            module,
            patch,
            query,
            key,
            value,
            positions,
            key_positions,
            attention_mask,
            kwargs.get("scaling"),
            kwargs.get("dropout", 0.0),
        )
        _remember(patch)
        return out, None

    q = encoding.rotate_q(query, positions, layer)  # (B, H, T, D)
    if patch.memo is None or key.requires_grad:
        k = encoding.rotate_k(key, key_positions, layer)  # (B, K, S, D)
    else:  # rotate only the keys this step adds
        (k,) = patch.memo.rotate(
            key, [key_positions], functools.partial(encoding.rotate_band, layer=layer)
        )
        _remember(patch)
    if patch.renorm:
        q, k = module.qk_norm(q), module.qk_norm(k)
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(view.inner, patch.state.arch.eager_attention())
    with view.inside():
        return inner(module, q, k, value, attention_mask, **kwargs)


AttentionInterface.register(ROPEKIT, ropekit_attention)
