"""References for generation with the Hugging Face models of the hf tests.

Holds:
    positions_from_mask  the position_ids generate() derives from a left-padded mask.
    last_logits, greedy_reference  uncached full forwards: the references generation must match.
    greedy_cached   model.generate with the KV cache, returning its per-step logits.
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
