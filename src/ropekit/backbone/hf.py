"""Hugging Face causal LMs behind the Backbone seam (the families of ``hf.archs.ARCHS``;
PEFT-wrapped or not).

Shape legend: B batch · T tokens · C tokens in one chunk · S keys so far · V vocabulary.

The encoding is attached by ``ropekit.hf.patch`` (every attention layer calls it); an unpatched
model runs its own RoPE, and ``own_encoding`` patches it for a block with the ropekit spec
equal to that RoPE (``spec_from_config``). Unequal prompts are left-padded, with an attention
mask and positions counted from each row's first real token.

``crop_cache`` uses transformers' ``Cache.crop`` (which, in 5.24, takes the number of tokens
to remove, as a negative int). A dynamic schedule's key positions, kept beside each cache
layer, need no trimming: ``ropekit.hf.patching`` reads the positions of the oldest keys a layer
still holds. A sliding-window layer that has filled its window no longer holds the prefix, so
cropping it is refused.

Training batches with ``position_ids`` (PoSE: positions that jump) get an all-ones attention
mask: transformers (5.24) reads a jump in ``position_ids`` as the start of a new packed
sequence when it gets neither a mask nor a cache (``masking_utils.
find_packed_sequence_indices``; activation checkpointing forces ``use_cache=False`` in
training), so the second chunk would not attend to the first. No KV cache is built there.

Holds: HFBackbone.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from transformers import Cache, DynamicCache

from ropekit.data.tokenizers import HFTokenizer, Tokenizer
from ropekit.encodings import PositionEncoding, Spec
from ropekit.hf import build_for_model, encoding_of, patch, spec_from_config, unpatch
from ropekit.hf.archs import (
    arch_for,
    base_model,
    covered_types,
    layer_infos,
    model_dims,
    original_length,
    rope_context,
    unwrap,
)
from ropekit.hf.patching import encoded_layers as patched_layers

from .base import Backbone


class HFBackbone(Backbone):
    """A transformers causal LM with its tokenizer."""

    kind: ClassVar[str] = "hf"
    lora_targets: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(self, model: nn.Module, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(model, tokenizer)
        # Not every architecture accepts logits_to_keep; where it does, decoding computes one
        # row of logits per step instead of C.
        self._keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    @property
    def config(self) -> Any:
        return unwrap(self.model).config

    # ------------------------------------------------------------------ the encoding
    @property
    def encoding(self) -> PositionEncoding | None:
        return encoding_of(self.model)

    def build_encoding(self, spec: Spec | str) -> PositionEncoding:
        return build_for_model(self.config, spec)

    def set_encoding(self, spec: Spec | str | PositionEncoding) -> PositionEncoding:
        return patch(self.model, spec)

    @contextlib.contextmanager
    def own_encoding(self) -> Iterator[tuple[PositionEncoding, bool]]:
        existing = encoding_of(self.model)
        if existing is not None:
            yield existing, False
            return
        encoding = patch(self.model, spec_from_config(self.config))
        try:
            yield encoding, True
        finally:
            unpatch(self.model)

    def encoded_layers(self) -> dict[int, str]:
        """From the patch (``hf.patching.encoded_layers``); unpatched, the layers
        ``own_encoding`` would give its encoding: those of the family's default types."""
        infos = layer_infos(self.config)
        indices = patched_layers(self.model)
        if indices is None:
            kinds = covered_types(self.config, None)
            indices = tuple(i.index for i in infos if i.rotates and i.kind in kinds)
        return {index: infos[index].kind for index in indices}

    @property
    def training_length(self) -> int:
        return original_length(self.config)

    # ------------------------------------------------------------------ identity
    def fingerprint(self) -> dict[str, Any]:
        config = self.config
        dims, context = model_dims(config), rope_context(config)
        return {
            "architecture": arch_for(config).model_type,
            "n_layers": dims.n_layers,
            "n_heads": dims.n_heads,
            "n_kv_heads": dims.n_kv_heads,
            "head_dim": dims.head_dim,
            "base": context["base"],
            "original_length": context["original_length"],
        }

    def config_identity(self) -> dict[str, Any]:
        c = self.config
        keys = (
            "rope_parameters",
            "max_position_embeddings",
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "sliding_window",
            "tie_word_embeddings",
            "rms_norm_eps",
        )
        out = {k: getattr(c, k, None) for k in keys}
        out["dtype"] = str(next(self.model.parameters()).dtype)
        return out

    # ------------------------------------------------------------------ training
    def enable_grad_checkpointing(self) -> Callable[[], None]:
        """transformers' ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``
        before 5.x) with ``use_reentrant=False``: the reentrant variant gives no gradient to
        parameters when no layer input requires grad, which is the case when only positional
        parameters train."""
        hf = unwrap(self.model)
        kwargs = {"use_reentrant": False}
        had_hooks = bool(getattr(hf, "_require_grads_hooks", None))
        if hasattr(hf, "activation_checkpointing_enable"):
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            turn_off = hf.activation_checkpointing_disable
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            turn_off = hf.gradient_checkpointing_disable

        def disable() -> None:
            turn_off()
            # Enabling also made the embedding output require grad (a forward hook, for PEFT);
            # disabling leaves it unless PEFT is loaded: remove it when we installed it.
            if not had_hooks and getattr(hf, "_require_grads_hooks", None):
                hf.disable_input_require_grads()

        return disable

    def training_logits(self, module: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
        ids = batch["input_ids"]  # (B, T)
        if "position_ids" not in batch:
            return module(input_ids=ids).logits  # (B, T, V)
        return module(
            input_ids=ids,
            position_ids=batch["position_ids"],
            attention_mask=torch.ones_like(ids),  # one causal sequence (module docstring)
            use_cache=False,
        ).logits  # (B, T, V)

    def block_names(self) -> tuple[str, ...]:
        """``model.layers.<i>`` of Llama, Mistral and Qwen (under PEFT's prefix when
        wrapped): found by identity, so any wrapper's prefix is right."""
        names = {id(module): name for name, module in self.model.named_modules()}
        return tuple(names[id(layer)] for layer in base_model(self.model).layers)

    # ------------------------------------------------------------------ scoring
    @property
    def vocab_size(self) -> int:
        return int(self.config.get_text_config().vocab_size)

    @property
    def eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        generation = getattr(self.model, "generation_config", None)
        for source in (getattr(generation, "eos_token_id", None), self.config.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        if (
            isinstance(self.tokenizer, HFTokenizer)
            and self.tokenizer.tokenizer.eos_token_id is not None
        ):
            ids.add(int(self.tokenizer.tokenizer.eos_token_id))
        return frozenset(ids)

    def new_cache(self) -> DynamicCache:
        # Full layers for every layer type: a sliding-window layer's cache drops its oldest
        # keys, so it could not be cropped back to a probe's cut point; the model's mask
        # still applies the window (checked against uncached forwards on Gemma 2/3, Mistral,
        # GPT-OSS, Cohere 2, Llama 4). It costs the window's memory on those layers.
        return DynamicCache()

    def cache_length(self, cache: Cache) -> int:
        return int(cache.get_seq_length())

    def crop_cache(self, cache: Cache, length: int) -> None:
        held = self.cache_length(cache)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= held:
            raise ValueError(
                f"length={length!r} is not allowed; allowed: an integer in 0..{held} (the "
                "tokens cached)"
            )
        for index, layer in enumerate(getattr(cache, "layers", ())):
            window = getattr(layer, "sliding_window", None)
            if window is not None and layer.get_seq_length() >= window:
                raise ValueError(
                    f"the cache of layer {index} is a sliding window of {window} tokens and "
                    f"holds {layer.get_seq_length()}: it no longer holds the prefix, so it "
                    f"cannot be cropped back; allowed: prefixes shorter than {window} tokens"
                )
        if length < held:
            cache.crop(length - held)  # a negative count: the tokens to remove

    def final_hidden(self, ids: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        hidden = base_model(self.model)(input_ids=ids, use_cache=False).last_hidden_state
        return hidden, unwrap(self.model).get_output_embeddings()  # (B, T, d), lm_head

    def run(self, ids, cache, mask, positions, last_only):
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": cache is not None}
        if cache is not None:
            kwargs["cache"] = cache
        if mask is not None:
            kwargs["attention_mask"] = mask
        if positions is not None:
            kwargs["position_ids"] = positions
        if last_only and self._keep:
            kwargs["logits_to_keep"] = 1
        logits = self.model(**kwargs).logits  # (B, C, V) or (B, 1, V)
        return logits[:, -1:] if last_only else logits

    def group_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        return [list(range(len(prompts)))]  # left padding lets any prompts share a batch

    def forward_logits(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, use_cache=False).logits  # (B, T, V)
