"""Patched models under generate(), the KV cache and padding.

References are uncached full forwards; tolerances are fp32 noise (the cached and full paths
batch their matmuls differently, about 1e-6 on logits of magnitude ~3).
"""

from __future__ import annotations

import pytest
import torch

from ropekit.hf import encoding_of, patch, spec_from_config

from ..tiny import ARCH_NAMES, L0, VOCAB, perturb, tiny_model
from .generation import (
    assert_layers_attend_as_at_the_final_length,
    greedy_cached,
    greedy_reference,
    last_logits,
    positions_from_mask,
)

ATOL = 1e-5


def _ids(batch: int, length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _patched(arch: str, spec: str, **overrides) -> torch.nn.Module:
    model = tiny_model(arch, **overrides)
    spec = spec_from_config(model.config) if spec == "own" else spec
    perturb(patch(model, spec))
    return model


def _assert_same_steps(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")


# --------------------------------------------------------------------------- static schedules
GENERATION_CASES = [
    *((arch, "adarope:init=yarn,factor=2") for arch in ARCH_NAMES),  # per layer and head
    ("llama", "own"),
    ("qwen3", "tuned-yarn:factor=2"),
    ("mistral", "adarope:share_heads=true,share_layers=true"),
]


@pytest.mark.parametrize(("arch", "spec"), GENERATION_CASES)
def test_greedy_generation_with_cache_equals_full_forwards(arch: str, spec: str) -> None:
    """Prompt of 24 tokens, 12 new ones: decoding crosses the original length L0 = 32."""
    model = _patched(arch, spec)
    prompt = _ids(2, 24)
    tokens, logits = greedy_cached(model, prompt, 12)
    ref_tokens, ref_logits = greedy_reference(model, prompt, 12)
    _assert_same_steps(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize(("arch", "spec"), [("llama", "own"), ("qwen2", "adarope")])
def test_left_padding_gives_the_unpadded_logits(arch: str, spec: str) -> None:
    model = _patched(arch, spec)
    long, short = _ids(1, 14, seed=4), _ids(1, 9, seed=5)
    pad = torch.zeros(1, 5, dtype=torch.long)
    batch = torch.cat([long, torch.cat([pad, short], dim=-1)])  # (2, 14), row 1 left-padded
    mask = (torch.arange(14) >= torch.tensor([[0], [5]])).long()
    with torch.no_grad():
        padded = model(
            batch, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False
        ).logits
        alone_long = model(long, use_cache=False).logits
        alone_short = model(short, use_cache=False).logits
    torch.testing.assert_close(padded[:1], alone_long, atol=ATOL, rtol=0)
    torch.testing.assert_close(padded[1:, 5:], alone_short, atol=ATOL, rtol=0)


def test_left_padded_generation_equals_generating_each_prompt_alone() -> None:
    model = _patched("llama", "adarope:init=linear,factor=2")
    long, short = _ids(1, 12, seed=6), _ids(1, 7, seed=7)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 5, dtype=torch.long), short], -1)])
    mask = (torch.arange(12) >= torch.tensor([[0], [5]])).long()
    together, steps = greedy_cached(model, batch, 10, attention_mask=mask)
    for row, prompt in enumerate((long, short)):
        alone, alone_steps = greedy_cached(model, prompt, 10)
        assert torch.equal(together[row, -10:], alone[0, -10:])
        _assert_same_steps([s[row : row + 1] for s in steps], alone_steps)


# --------------------------------------------------------------------------- dynamic schedules
DYNAMIC_SPECS = [
    "dynamic-ntk:factor=4",
    "longrope:factor=4,short_factor=[1.5],long_factor=[1,1.2,1.5,2,2.5,3,3.5,4]",
]


@pytest.mark.parametrize("spec", DYNAMIC_SPECS)
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_dynamic_schedule_with_cache_equals_full_forward_at_each_length(
    arch: str, spec: str
) -> None:
    """One layer, so the layer inputs carry no position: every decoding step (prompt 26 tokens,
    14 new, crossing L0 = 32) must equal a full forward at that step's length. Mistral runs
    with a sliding window of 8, whose cache keeps only the last 7 keys (and their positions).
    Caching keys rotated at their own step's length instead (what transformers does) misses
    by up to ~0.2 here once the length passes L0."""
    overrides = {"num_hidden_layers": 1}
    if arch == "mistral":
        overrides["sliding_window"] = 8
    model = _patched(arch, spec, **overrides)
    assert encoding_of(model).dynamic
    prompt = _ids(2, 26)
    tokens, logits = greedy_cached(model, prompt, 14)
    references = [last_logits(model, tokens[:, : 26 + i]) for i in range(14)]
    _assert_same_steps(logits, references)


@pytest.mark.parametrize("spec", DYNAMIC_SPECS)
def test_dynamic_schedule_every_layer_attends_as_at_the_final_length(spec: str) -> None:
    """Each attention layer of a 2-layer model, fed the same inputs token by token with a
    cache, returns what one full call over all of them returns: all cached keys are rotated
    at the current length (the inputs of layers > 0 are what the cache cannot revisit)."""
    model = _patched("qwen3", spec)
    assert_layers_attend_as_at_the_final_length(model, 26, 40, seed=8, atol=ATOL)
    assert L0 < 40


def test_dynamic_schedule_refuses_a_cache_it_did_not_fill() -> None:
    model = tiny_model("llama")
    prompt = _ids(1, 10)
    with torch.no_grad():
        cache = model(prompt, use_cache=True).cache  # rotated keys, written unpatched
        patch(model, "dynamic-ntk:factor=4")
        with pytest.raises(RuntimeError, match="did not write"):
            model(_ids(1, 1), cache=cache, position_ids=torch.tensor([[10]]))
