"""A decoding loop that advances its positions tensor in place (``pos += 1``) gets exactly what
a loop passing fresh tensors gets, and what a full forward gets: neither the encoding's table
cache nor the KV cache may remember positions by the tensor's identity."""

from __future__ import annotations

import pytest
import torch

from ropekit.model import KVCache

from .tiny import DYNAMIC, FP32, SPECS, random_ids, tiny_model

T = 14


def _decode(model, ids, in_place: bool) -> torch.Tensor:
    """Token by token from an empty cache with explicit positions; logits (B, T, V)."""
    cache = KVCache()
    pos = torch.zeros(1, 1, dtype=torch.long)
    steps = []
    for t in range(ids.shape[1]):
        steps.append(model(ids[:, t : t + 1], position_ids=pos, cache=cache).logits[:, 0])
        if in_place:
            pos += 1
        else:
            pos = pos + 1
    return torch.stack(steps, dim=1)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_in_place_positions_decode_like_fresh_ones(name):
    model = tiny_model(SPECS[name], n_layers=1 if name in DYNAMIC else 2)
    ids = random_ids(2, T)
    with torch.no_grad():
        in_place, fresh = _decode(model, ids, True), _decode(model, ids, False)
        assert torch.equal(in_place, fresh)
        if name not in DYNAMIC:
            torch.testing.assert_close(in_place, model(ids).logits, **FP32)
        else:
            last = model(ids).logits[:, -1]  # one layer: the last step is the full forward
            torch.testing.assert_close(in_place[:, -1], last, **FP32)
