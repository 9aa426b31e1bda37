"""Greedy generation with the cache equals the argmax of repeated full forwards."""

from __future__ import annotations

import pytest
import torch

from .tiny import DYNAMIC, SPECS, random_ids, tiny_model


def reference_greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        token = model(ids).logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        ids = torch.cat((ids, token), dim=1)
    return ids[:, -n:]


# float64: argmax over logits that differ by summation order only must not flip on a near tie.
# A dynamic schedule runs one layer: only then is cached decoding a full forward of each prefix
# (see ropekit.model.cache).
@pytest.mark.parametrize("name", ["rope", "alibi", "adarope", "dynamic-ntk", "sinusoidal"])
def test_generate_equals_argmax_of_full_forwards(name):
    model = tiny_model(SPECS[name], n_layers=1 if name in DYNAMIC else 2).double()
    prompt = random_ids(3, 5)
    out = model.generate(prompt, max_new_tokens=14)
    assert out.shape == (3, 14) and out.dtype == torch.long
    torch.testing.assert_close(out, reference_greedy(model, prompt, 14), atol=0, rtol=0)


def test_stop_tokens_end_rows_and_generation():
    model = tiny_model("rope").double()
    prompt = random_ids(2, 4, seed=3)
    free = model.generate(prompt, max_new_tokens=12)
    assert not torch.equal(free[0], free[1])
    stop = int(free[0, 2])  # row 0 emits it at step 2 (or earlier)
    first = {row: int((free[row] == stop).nonzero()[0]) for row in (0, 1) if stop in free[row]}
    out = model.generate(prompt, max_new_tokens=12, stop_token_ids=[stop])
    for row in range(2):
        if row in first:
            k = first[row]
            assert torch.equal(out[row, : k + 1], free[row, : k + 1])
            assert (out[row, k:] == stop).all()  # a stopped row repeats its stop token
    if len(first) == 2:
        assert out.shape[1] == max(first.values()) + 1  # stops when every row has stopped
    else:
        assert out.shape[1] == 12


def test_zero_new_tokens_and_bad_arguments():
    model = tiny_model("rope")
    assert model.generate(random_ids(2, 3), max_new_tokens=0).shape == (2, 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(random_ids(2, 3), max_new_tokens=-1)
    with pytest.raises(ValueError, match="input_ids"):
        model.generate(random_ids(1, 3)[0], max_new_tokens=2)


def test_generate_leaves_no_gradient_state():
    model = tiny_model("rope")
    model.generate(random_ids(1, 3), max_new_tokens=3)
    assert all(p.grad is None for p in model.parameters())
