"""Reach into a model's attention: find its ropekit encoding, capture each layer's rotated
queries and keys as the forward runs, and run a plain forward for logits.

Shape legend: B batch · H query heads · K key/value heads · T queries · S keys · D head dim ·
V vocabulary.

Two kinds of model carry a ropekit encoding, and two capture paths serve them:

- ``probe``: a ropekit ``Decoder``. Every attention owns an identity child module ``probe``,
  called as ``q, k = probe(q, k, bias)`` right before SDPA; a forward hook on it sees q
  (B, H, T, D) after ``rotate_q`` (rotation and AdaScale) and k (B, K, S, D) after ``rotate_k``,
  exactly what SDPA receives, with ``probe.layer`` naming the layer.
- ``encoding``: any model whose attention calls ``encoding.rotate_q(q, positions, layer)`` and
  ``encoding.rotate_k(k, positions, layer)``, which is what ``ropekit.hf.patch`` makes of a
  Hugging Face model of a supported family (and what the Decoder does too). The encoding's two
  methods are wrapped on the instance for the duration; a layer is reported once both its q
  and its k have passed, whatever the order. Only the layers the spec covers call it (the
  backbone's ``encoded_layers``): the layer types it leaves rotate with the model's own RoPE,
  other encoding instances that are not wrapped, and NoPE layers call nothing.

Either way the consumer ``on_layer(layer, q, k)`` runs inside the forward, one layer at a time,
so statistics are reduced as they come and no layer's q, k or attention outlives its turn.

A Hugging Face model that is not patched is analysed through ``own_encoding``: patched for the
duration with the ropekit spec equal to its own RoPE (``Backbone.own_encoding``) and unpatched
afterwards. Models are reached through their ``Backbone``; nothing here asks which kind a
model is.

What analysis recomputes from the captured q and k is causal attention with the logit scale
1/sqrt(D) (Llama, Mistral, Qwen2/3 and the Decoder all use it) plus the encoding's score bias.
A sliding-window layer (Mistral / Qwen2 configured with one, Gemma's local layers) is measured
without its window; a family's other attention extras (Gemma's query_pre_attn_scalar, Gemma 2's
logit softcap, GPT-OSS's sinks) are not recomputed either.

Holds: CAPTURE_METHODS, model_encoding, own_encoding, capture_qk, forward_logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import Tensor, nn

from ropekit.backbone import Backbone, as_backbone
from ropekit.encodings import PositionEncoding
from ropekit.encodings.base import check_choice
from ropekit.model import Probe

CAPTURE_METHODS = ("auto", "probe", "encoding")
OnLayer = Callable[[int, Tensor, Tensor], None]  # (layer, q (B, H, T, D), k (B, K, S, D))


def model_encoding(model: Backbone | nn.Module) -> PositionEncoding:
    """The ropekit encoding every attention layer of ``model`` calls."""
    encoding = as_backbone(model).encoding
    if encoding is None:
        raise ValueError(
            f"model {type(model).__name__} is not patched with a ropekit encoding; use "
            "ropekit.hf.patch(model, spec) or analyse it inside own_encoding(model)"
        )
    return encoding


@contextlib.contextmanager
def own_encoding(model: Backbone | nn.Module) -> Iterator[tuple[PositionEncoding, bool]]:
    """Yield (the model's ropekit encoding, whether it was attached just for this block): an
    unpatched Hugging Face model runs with its own RoPE as a ropekit encoding for the duration
    (``Backbone.own_encoding``)."""
    with as_backbone(model).own_encoding() as found:
        yield found


def _probes(model: nn.Module) -> list[Probe]:
    return [m for m in model.modules() if isinstance(m, Probe)]


@contextlib.contextmanager
def capture_qk(
    model: Backbone | nn.Module, on_layer: OnLayer, method: str = "auto"
) -> Iterator[str]:
    """While active, every forward calls ``on_layer(layer, q, k)`` once per attention layer
    with the rotated q (B, H, T, D) and k (B, K, S, D). Yields the path used (module docstring):
    ``auto`` picks ``probe`` for a Decoder and ``encoding`` otherwise."""
    check_choice("method", method, CAPTURE_METHODS)
    probes = _probes(as_backbone(model).model)
    if method == "auto":
        method = "probe" if probes else "encoding"
    if method == "probe":
        if not probes:
            raise ValueError(
                f"method='probe' is not allowed for {type(model).__name__}: it has no probe "
                "modules; allowed: 'encoding' (or 'auto')"
            )

        def hook(probe: Probe, args: tuple, output: tuple[Tensor, Tensor]) -> None:
            q, k = output
            on_layer(probe.layer, q, k)

        handles = [p.register_forward_hook(hook) for p in probes]
        try:
            yield method
        finally:
            for handle in handles:
                handle.remove()
        return

    encoding = model_encoding(model)
    if encoding.remaps_distance:
        raise ValueError(
            f"encoding {encoding.spec!r} remaps query-key distances band by band; capturing one "
            "rotation of q and k would misrepresent its attention, so it is not analysed"
        )
    rotate_q, rotate_k = encoding.rotate_q, encoding.rotate_k  # the bound originals
    queries: dict[int, Tensor] = {}
    keys: dict[int, Tensor] = {}

    def captured_q(q: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        out = rotate_q(q, positions, layer)
        if layer in keys:
            on_layer(layer, out, keys.pop(layer))
        else:
            queries[layer] = out
        return out

    def captured_k(k: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        out = rotate_k(k, positions, layer)
        if layer in queries:
            on_layer(layer, queries.pop(layer), out)
        else:
            keys[layer] = out
        return out

    # Instance attributes shadow the class's methods; deleting them restores the originals.
    encoding.__dict__["rotate_q"] = captured_q
    encoding.__dict__["rotate_k"] = captured_k
    try:
        yield method
    finally:
        encoding.__dict__.pop("rotate_q", None)
        encoding.__dict__.pop("rotate_k", None)
        queries.clear()
        keys.clear()


def forward_logits(model: Backbone | nn.Module, ids: Tensor) -> Tensor:
    """Logits (B, T, V) of one plain forward over ids (B, T): positions 0..T-1, no cache."""
    return as_backbone(model).forward_logits(ids)
