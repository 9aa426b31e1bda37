"""References for generation with the Hugging Face models of the hf tests.

Holds:
    positions_from_mask  the position_ids generate() derives from a left-padded mask.
    last_logits, greedy_reference  uncached full forwards: the references generation must match.
    greedy_cached   model.generate with the KV cache, returning its per-step logits.
    assert_layers_attend_as_at_the_final_length  each attention layer alone, cached step by
                    step against uncached calls (layer inputs that carry no position).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def positions_from_mask(mask: Tensor) -> Tensor:
    """What generate computes for left padding: cumsum(mask) - 1, pads at 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def last_logits(model: nn.Module, ids: Tensor) -> Tensor:
    """Logits of the last position of an uncached full forward: (B, V)."""
    return model(ids, use_cache=False).logits[:, -1]


@torch.no_grad()
def greedy_reference(model: nn.Module, ids: Tensor, steps: int) -> tuple[Tensor, list[Tensor]]:
    """Greedy decoding by full forwards (no cache): (tokens (B, T + steps), per-step logits)."""
    logits = []
    for _ in range(steps):
        step = last_logits(model, ids)
        logits.append(step)
        ids = torch.cat([ids, step.argmax(-1, keepdim=True)], dim=-1)
    return ids, logits


@torch.no_grad()
def greedy_cached(model: nn.Module, ids: Tensor, steps: int, **kwargs: Any):
    """model.generate with the KV cache: (tokens, per-step logits)."""
    out = model.generate(
        ids,
        max_new_tokens=steps,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
    return out.sequences, list(out.logits)


def assert_layers_attend_as_at_the_final_length(
    model: nn.Module, prompt: int, total: int, *, seed: int, atol: float
) -> None:
    """Each attention layer of a patched model, fed the same random inputs token by token with
    a cache after a ``prompt``-token prefill, returns at every step what one uncached call over
    all tokens so far returns for the last one: every cached key is rotated (or banded) at the
    current length. The layer is called as its decoder layer calls it, with the model's (neutral)
    rotary tables; no mask, so sdpa attends causally."""
    from transformers import DynamicCache

    hidden = torch.randn(
        2, total, model.config.hidden_size, generator=torch.Generator().manual_seed(seed)
    )

    def call(attn: nn.Module, start: int, stop: int, cache: Any = None) -> Tensor:
        positions = torch.arange(start, stop)[None]
        tables = model.model.rotary_emb(hidden, positions)
        return attn(hidden[:, start:stop], tables, None, position_ids=positions, cache=cache)[0]

    with torch.no_grad():
        for attn in (layer.self_attn for layer in model.model.layers):
            cache = DynamicCache(config=model.config)
            call(attn, 0, prompt, cache)
            for t in range(prompt, total):
                step, full = call(attn, t, t + 1, cache), call(attn, 0, t + 1)
                torch.testing.assert_close(step[:, -1], full[:, -1], atol=atol, rtol=0)
