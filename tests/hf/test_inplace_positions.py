"""A decoding loop over a patched model that advances ``position_ids`` in place (``pos += 1``)
gives the unpatched model's logits: the encoding's tables must follow the values, not the
tensor (issue: stale rotations, logits off by 2.5 and other tokens)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from ropekit.hf import patch, spec_from_config

from ..tiny import VOCAB, tiny_model

ATOL = 1e-5


@torch.no_grad()
def _decode(model, ids: torch.Tensor, prompt: int, in_place: bool) -> list[torch.Tensor]:
    cache = DynamicCache(config=model.config)
    out = model(ids[:, :prompt], position_ids=torch.arange(prompt)[None], past_key_values=cache)
    steps = [out.logits[:, -1]]
    pos = torch.tensor([[prompt]])
    for t in range(prompt, ids.shape[1]):
        out = model(ids[:, t : t + 1], position_ids=pos, past_key_values=cache)
        steps.append(out.logits[:, -1])
        if in_place:
            pos += 1
        else:
            pos = pos + 1
    return steps


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_in_place_positions_give_the_unpatched_logits(arch: str, attn: str) -> None:
    reference = tiny_model(arch, attn_implementation=attn)
    patched = tiny_model(arch, like=reference, attn_implementation=attn)
    patch(patched, spec_from_config(patched.config))
    ids = torch.randint(2, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    expected = _decode(reference, ids, 8, in_place=True)
    for got_steps in (_decode(patched, ids, 8, True), _decode(patched, ids, 8, False)):
        for step, (got, want) in enumerate(zip(got_steps, expected, strict=True)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"step {step}")


def test_in_place_positions_with_a_dynamic_schedule_equal_fresh_positions() -> None:
    model = tiny_model("llama")
    patch(model, "dynamic-ntk:factor=4")
    ids = torch.randint(2, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    in_place, fresh = _decode(model, ids, 24, True), _decode(model, ids, 24, False)
    for got, want in zip(in_place, fresh, strict=True):
        assert torch.equal(got, want)
