"""Distance remaps (rerope, self-extend, dca, string) and the mixed window in patched Hugging
Face models: eager and sdpa agree, GQA, left padding, and DynamicCache decoding equals full
forwards (greedy tokens and logits); identity remaps leave the model's own logits."""

from __future__ import annotations

import pytest
import torch

from ropekit.hf import encoding_of, patch, spec_from_config

from ..tiny import ARCH_NAMES, L0, VOCAB, tiny_model
from .generation import (
    assert_layers_attend_as_at_the_final_length,
    greedy_cached,
    greedy_reference,
    last_logits,
    positions_from_mask,
)

ATOL = 1e-5
REMAPS = [
    "rerope:window=8,leaky=4",
    "rerope:window=6,logn=true",  # log-n scaling by ln L0 = ln 32, from the model's config
    "self-extend:group=4,window=8",
    "self-extend:group=2,window=8,mode=llama.cpp",
    "dca:chunk_size=12,local_size=4,scale=none",  # the positions alone: static remaps
    "string:shift=10,window=3,scale=none",
    "string:shift=10,window=3",  # the authors' logit scale: constant, still static
]
# The authors' length-following variants (DCA's logit scale beyond L0, STRING's shift of
# 0.33 x the length attended): cached decoding is exact per layer, as for dynamic schedules.
FOLLOWING = ["dca:chunk_size=12,local_size=4", "string:window=3"]


def _ids(batch: int, length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _patched(arch: str, spec: str, attn: str = "sdpa", **overrides) -> torch.nn.Module:
    model = tiny_model(arch, attn_implementation=attn, **overrides)
    patch(model, spec)
    return model


def _assert_same_steps(got, expected):
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")


@pytest.mark.parametrize("spec", REMAPS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cached_greedy_generation_equals_full_forwards(arch: str, spec: str) -> None:
    """Prompt 20, 14 new tokens: past every window and past L0 = 32."""
    model = _patched(arch, spec)
    prompt = _ids(2, 20)
    tokens, logits = greedy_cached(model, prompt, 14)
    ref_tokens, ref_logits = greedy_reference(model, prompt, 14)
    _assert_same_steps(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)


def test_sliding_window_layers_keep_the_positions_of_the_keys_they_keep() -> None:
    """Mistral with a window of 8: the cache stores only the last 7 keys, the mask holds the
    window, and cached decoding still equals full forwards."""
    model = _patched("mistral", "self-extend:group=2,window=4", sliding_window=8)
    prompt = _ids(1, 12)
    tokens, logits = greedy_cached(model, prompt, 10)
    ref_tokens, ref_logits = greedy_reference(model, prompt, 10)
    _assert_same_steps(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_eager_and_sdpa_agree_on_every_architecture(arch: str) -> None:
    spec = "dca:chunk_size=12,local_size=4"
    eager, sdpa = _patched(arch, spec, "eager"), _patched(arch, spec, "sdpa")
    ids = _ids(2, 30)
    with torch.no_grad():
        torch.testing.assert_close(eager(ids).logits, sdpa(ids).logits, atol=ATOL, rtol=0)
        plain = tiny_model(arch)(ids).logits
        assert (sdpa(ids).logits - plain).abs().max() > 1e-3  # the remap is in effect


@pytest.mark.parametrize(
    "spec",
    [
        "rerope:window=64",
        "self-extend:group=1,window=4",
        "dca:chunk_size=80,local_size=8,scale=none",
        "string:shift=64,window=8,scale=none",
    ],
)
def test_identity_remaps_leave_the_models_own_logits(spec: str) -> None:
    reference = tiny_model("qwen2")
    model = tiny_model("qwen2", like=reference)
    patch(model, spec)
    ids = _ids(2, 40)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("spec", REMAPS[::2])
def test_left_padding_gives_the_unpadded_logits(spec: str, attn: str) -> None:
    model = _patched("qwen2", spec, attn)
    long, short = _ids(1, 30, seed=4), _ids(1, 21, seed=5)
    pad = torch.zeros(1, 9, dtype=torch.long)
    batch = torch.cat([long, torch.cat([pad, short], dim=-1)])  # (2, 30), row 1 left-padded
    mask = (torch.arange(30) >= torch.tensor([[0], [9]])).long()
    with torch.no_grad():
        padded = model(
            batch, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False
        ).logits
        alone_long = model(long, use_cache=False).logits
        alone_short = model(short, use_cache=False).logits
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[:1], alone_long, atol=ATOL, rtol=0)
    torch.testing.assert_close(padded[1:, 9:], alone_short, atol=ATOL, rtol=0)


def test_left_padded_generation_equals_generating_each_prompt_alone() -> None:
    model = _patched("llama", "self-extend:group=4,window=8")
    long, short = _ids(1, 18, seed=6), _ids(1, 11, seed=7)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 7, dtype=torch.long), short], -1)])
    mask = (torch.arange(18) >= torch.tensor([[0], [7]])).long()
    together, steps = greedy_cached(model, batch, 12, attention_mask=mask)
    for row, prompt in enumerate((long, short)):
        alone, alone_steps = greedy_cached(model, prompt, 12)
        assert torch.equal(together[row, -12:], alone[0, -12:])
        _assert_same_steps([s[row : row + 1] for s in steps], alone_steps)


def test_a_remap_refuses_a_cache_it_did_not_fill() -> None:
    model = tiny_model("llama")
    with torch.no_grad():
        cache = model(_ids(1, 10), use_cache=True).past_key_values  # rotated keys, unpatched
        patch(model, "string:shift=4,window=2")
        with pytest.raises(RuntimeError, match="did not write"):
            model(_ids(1, 1), past_key_values=cache, position_ids=torch.tensor([[10]]))


def test_a_remap_refuses_attention_dropout_in_training() -> None:
    model = _patched("llama", "string:shift=4,window=2", attention_dropout=0.1).train()
    with pytest.raises(ValueError, match="attention_dropout"):
        model(_ids(1, 8))


# --------------------------------------------------------------------------- mixed window
MIXED = [
    "mixed:method=yarn,factor=2",
    "mixed:method=adarope,init=linear,factor=2",
    f"mixed:method=longrope,factor=2,long_factor=[1,1.2,1.5,2,2.5,3,3.5,4],window={L0}",
]


@pytest.mark.parametrize("spec", MIXED)
def test_mixed_window_is_the_models_rope_inside_and_its_method_beyond(spec: str) -> None:
    reference = tiny_model("llama")
    model = tiny_model("llama", like=reference)
    encoding = patch(model, spec)
    assert encoding.dynamic and encoding.window == L0
    method = tiny_model("llama", like=reference)
    patch(method, encoding.schedule_encoding)  # the wrapped encoding on its own
    ids = _ids(2, L0 + 8)
    with torch.no_grad():
        inside, beyond = ids[:, :L0], ids
        torch.testing.assert_close(
            model(inside).logits, reference(inside).logits, atol=ATOL, rtol=0
        )
        torch.testing.assert_close(model(beyond).logits, method(beyond).logits, atol=ATOL, rtol=0)
        assert (model(beyond).logits[:, :L0] - reference(beyond).logits[:, :L0]).abs().max() > 1e-4


@pytest.mark.parametrize("spec", MIXED)
def test_mixed_window_decoding_across_the_boundary_equals_full_forwards(spec: str) -> None:
    """One layer, so the layer inputs carry no position: every step (prompt 26, 14 new
    tokens, crossing L0 = 32) equals a full forward at that step's length. The cached keys are
    rotated with the model's RoPE while the length is <= 32 and re-rotated, not dropped, once
    it passes: caching them rotated would miss (checked below)."""
    model = _patched("llama", spec, num_hidden_layers=1)
    prompt = _ids(2, 26)
    tokens, logits = greedy_cached(model, prompt, 14)
    references = [last_logits(model, tokens[:, : 26 + i]) for i in range(14)]
    _assert_same_steps(logits, references)


def test_mixed_window_every_layer_attends_as_at_the_final_length() -> None:
    model = _patched("qwen3", "mixed:method=yarn,factor=2")
    assert_layers_attend_as_at_the_final_length(model, 26, 40, seed=8, atol=ATOL)
    assert L0 < 40


def test_remap_and_mixed_specs_round_trip_through_a_patched_model() -> None:
    model = tiny_model("qwen2")
    own = spec_from_config(model.config)
    for spec in ("dca", "string:window=2", "mixed:method=ntk,factor=2", "rerope:logn=true"):
        encoding = patch(model, spec)
        again = patch(model, encoding.spec)
        assert again.config == encoding.config, spec
    assert encoding_of(model).original_length == L0 and own.name == "rope"


@pytest.mark.parametrize("spec", FOLLOWING)
def test_length_following_remaps_decode_as_full_forwards_with_one_layer(spec: str) -> None:
    """One layer (the layer inputs carry no position): every step equals a full forward at
    that step's length, past L0 = 32, where DCA's scale and STRING's shift move."""
    model = _patched("llama", spec, num_hidden_layers=1)
    assert encoding_of(model).dynamic
    prompt = _ids(2, 26)
    tokens, logits = greedy_cached(model, prompt, 14)
    _assert_same_steps(logits, [last_logits(model, tokens[:, : 26 + i]) for i in range(14)])


@pytest.mark.parametrize("spec", FOLLOWING)
def test_length_following_remaps_every_layer_attends_as_at_the_final_length(spec: str) -> None:
    model = _patched("qwen2", spec)
    assert_layers_attend_as_at_the_final_length(model, 30, 44, seed=9, atol=ATOL)
