"""Which engines serve an encoding exactly (ropekit.serve.serving), by inspect's rules, on
tiny Llamas: what each engine's source says it computes, held to ropekit's encoding."""

from __future__ import annotations

import pytest

from ropekit.backbone import as_backbone
from ropekit.hf import patch
from ropekit.model import Decoder, DecoderConfig
from ropekit.serve.engines import ENGINES
from ropekit.serve.serving import served_by
from tests.tiny import perturb

PER_HEAD = "adarope:init=yarn,factor=2"
SHARED = "adarope:init=yarn,factor=2,share_heads=true,share_layers=true,scale=false"
ALL = set(ENGINES)


@pytest.mark.parametrize(
    ("spec", "exact"),
    [
        ("rope", ALL),
        ("yarn:factor=2", ALL),
        ("llama3:factor=4", ALL),
        (SHARED, ALL),  # one learned schedule: longrope factors, rope_freqs in GGUF
        (PER_HEAD, {"vllm+ropekit"}),  # per (layer, kv head): only the plugin
        ("dynamic-ntk:factor=2", set()),  # transformers' cache, vLLM's static base, refusals
        # Distance remaps: no engine's rope config has them; vLLM with ropekit's plugin
        # computes them in its attention (banded, over its KV cache)
        ("rerope:window=8,leaky=4", {"vllm+ropekit"}),
        ("self-extend:group=4,window=8", {"vllm+ropekit"}),  # the paper's sliding window
        # llama.cpp's own blocks: also llama.cpp through ropekit.serve.llamacpp_self_extend
        ("self-extend:group=4,window=8,mode=llama.cpp", {"llama.cpp", "vllm+ropekit"}),
        # ... but not on a YaRN base: llama.cpp's K-shift scales moved keys again
        ("self-extend:group=4,window=8,mode=llama.cpp,init=yarn,factor=2", {"vllm+ropekit"}),
        # ReRoPE's clip has no longest length: served at a given target only
        ("rerope:window=8", set()),
    ],
)
def test_the_engines_that_serve_each_method_exactly(spec: str, exact: set[str], tiny_llama) -> None:
    model = tiny_llama()
    encoding = patch(model, spec)
    if encoding.positional_parameters():
        perturb(encoding)  # trained values: per head really differs per head
    served = served_by(as_backbone(model))
    assert list(served) == list(ENGINES)
    assert {name for name, s in served.items() if s.exact} == exact
    for s in served.values():
        assert bool(s.why) != s.exact and "\n" not in s.why  # why not, in one line


def test_what_the_plain_engines_say_about_dynamic_ntk(tiny_llama) -> None:
    model = tiny_llama()
    patch(model, "dynamic-ntk:factor=2")
    served = served_by(as_backbone(model))
    assert "KV cache" in served["transformers"].why
    assert "frequencies differ" in served["vllm"].why
    assert "refuses" in served["llama.cpp"].why and "refused" in served["vllm+ropekit"].why


def test_ropekits_own_decoder_is_served_by_no_engine() -> None:
    decoder = Decoder(DecoderConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2))
    served = served_by(as_backbone(decoder))
    assert not any(s.exact for s in served.values())
    assert all("ropekit's own decoder" in s.why for s in served.values())


def test_what_the_engines_say_about_self_extend(tiny_llama) -> None:
    model = tiny_llama()
    patch(model, "self-extend:group=4,window=8,mode=llama.cpp")
    served = served_by(as_backbone(model))
    assert "--format gguf" in served["transformers"].why
    assert "ropekit.serve.llamacpp_self_extend" in served["vllm"].why
    patch(model, "self-extend:group=4,window=8")
    assert "mode=llama.cpp" in served_by(as_backbone(model))["llama.cpp"].why
