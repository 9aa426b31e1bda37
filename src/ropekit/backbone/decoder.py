"""The reference decoder behind the Backbone seam.

Shape legend: B batch · T tokens · C tokens in one chunk · V vocabulary.

``DecoderBackbone`` serves ropekit's ``Decoder`` and, for scoring, any module with its forward
contract (``forward(input_ids, position_ids=None, cache=KVCache, labels=None)`` returning
``.logits`` and ``.cache``): evaluations of hand-built models use it. Encoding, identity and
training methods need a ``Decoder`` and say so otherwise.

The decoder has no padding mask (a pad token would be attended to), so prompts are decoded in
groups of equal length; its default positions continue after the cached ones.

Holds: DecoderBackbone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from torch import Tensor, nn

from ropekit.data.tokenizers import ByteTokenizer, Tokenizer
from ropekit.encodings import PositionEncoding, Spec, build
from ropekit.model import Decoder, DecoderConfig, KVCache
from ropekit.model.decoder import one_layer_type

from .base import Backbone


class DecoderBackbone(Backbone):
    """A ropekit ``Decoder`` (or a module with its forward contract, for scoring only)."""

    kind: ClassVar[str] = "decoder"
    lora_targets: ClassVar[tuple[str, ...]] = ("qkv", "proj")

    def __init__(self, model: nn.Module, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(model, tokenizer if tokenizer is not None else ByteTokenizer())

    @property
    def decoder(self) -> Decoder:
        """The model as a ``Decoder``; ValueError for a module that only shares its forward."""
        if not isinstance(self.model, Decoder):
            raise ValueError(
                f"{type(self.model).__name__} follows the Decoder's forward contract but is not a "
                "ropekit Decoder: it can be scored, not given an encoding or trained"
            )
        return self.model

    @property
    def config(self) -> DecoderConfig:
        return self.decoder.config

    # ------------------------------------------------------------------ the encoding
    @property
    def encoding(self) -> PositionEncoding | None:
        return self.model.encoding if isinstance(self.model, Decoder) else None

    def build_encoding(self, spec: Spec | str) -> PositionEncoding:
        c = self.config
        context = c.encoding_context()
        base = self.decoder.encoding.base
        if base is not None:
            context["base"] = base
        return one_layer_type(
            build(
                spec,
                n_heads=c.n_heads,
                n_kv_heads=c.n_kv_heads,
                head_dim=c.head_dim,
                n_layers=c.n_layers,
                d_model=c.d_model,
                **context,
            )
        )

    def set_encoding(self, spec: Spec | str | PositionEncoding) -> PositionEncoding:
        decoder, c = self.decoder, self.config
        encoding = spec if isinstance(spec, PositionEncoding) else self.build_encoding(spec)
        decoder.encoding = encoding.to(next(decoder.parameters()).device)
        decoder.config = dataclasses.replace(c, encoding=encoding.spec)
        return encoding

    @contextlib.contextmanager
    def own_encoding(self) -> Iterator[tuple[PositionEncoding, bool]]:
        yield self.decoder.encoding, False

    @property
    def training_length(self) -> int:
        return self.config.context_length

    # ------------------------------------------------------------------ identity
    def fingerprint(self) -> dict[str, Any]:
        if not isinstance(self.model, Decoder):
            return {"architecture": type(self.model).__name__}
        c = self.config
        return {
            "architecture": "ropekit-decoder",
            "n_layers": c.n_layers,
            "n_heads": c.n_heads,
            "n_kv_heads": c.n_kv_heads,
            "head_dim": c.head_dim,
            "base": self.model.encoding.base,
            "original_length": c.context_length,
        }

    def config_identity(self) -> dict[str, Any]:
        if not isinstance(self.model, Decoder):
            return {"class": type(self.model).__name__}
        config = self.config.to_dict()
        config.pop("encoding")  # recorded apart, with its parameters (Backbone.identity)
        return config

    # ------------------------------------------------------------------ training
    def enable_grad_checkpointing(self) -> Callable[[], None]:
        decoder = self.decoder
        decoder.gradient_checkpointing_enable()
        return decoder.gradient_checkpointing_disable

    def training_logits(self, module: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
        inputs = {"input_ids": batch["input_ids"]}
        if "position_ids" in batch:
            inputs["position_ids"] = batch["position_ids"]
        return module(**inputs).logits  # (B, T, V)

    def block_names(self) -> tuple[str, ...]:
        return tuple(f"blocks.{i}" for i in range(len(self.decoder.blocks)))

    # ------------------------------------------------------------------ scoring
    @property
    def vocab_size(self) -> int:
        if isinstance(self.model, Decoder):
            return self.model.config.vocab_size
        return super().vocab_size

    def new_cache(self) -> KVCache:
        return KVCache()

    def cache_length(self, cache: KVCache) -> int:
        return len(cache)

    def crop_cache(self, cache: KVCache, length: int) -> None:
        cache.crop(length)  # keys, values and positions (model/cache.py)

    def final_hidden(self, ids: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        return self.decoder.final_hidden(ids), self.decoder.lm_head

    def run(self, ids, cache, mask, positions, last_only):
        # Default positions continue after the cached ones, which is what unpadded rows need.
        logits = self.model(ids, cache=cache).logits  # (B, C, V)
        return logits[:, -1:] if last_only else logits

    def group_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        groups: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(len(prompt), []).append(i)
        return list(groups.values())
