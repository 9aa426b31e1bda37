"""The mixed window (LongRoPE2): what it wraps, its spec and config checks, and the rule that
rotates with the original RoPE within the window and with the wrapped encoding beyond it."""

from __future__ import annotations

import re

import pytest
import torch

from ropekit.encodings import REGISTRY, Spec, build
from ropekit.encodings.adarope import TunedYarnConfig
from ropekit.encodings.base import Extension
from ropekit.encodings.mixed import MIXABLE, MixedConfig, MixedWindow
from ropekit.encodings.rope import LinearConfig, YarnConfig

from .conftest import SHAPE, perturb


def test_the_mixed_window_wraps_every_rotary_entry_of_the_registry_but_the_remaps():
    def rotates(name: str) -> bool:
        spec = Spec.parse(name)
        if spec.takes("factor"):
            spec = spec.with_options(factor=2)
        return build(spec, **SHAPE, original_length=64).rotary_dim > 0

    remaps = {n for n, e in REGISTRY.items() if e.module.remaps_distance}  # AdaRoPE's included
    wrappers = {"mixed", "temperature"}  # each wraps another encoding
    rotary = {n for n in REGISTRY if n not in wrappers | remaps and rotates(n)}
    assert set(MIXABLE) == rotary and len(rotary) == 13


def test_plain_rope_within_the_window_and_the_wrapped_schedule_beyond_it():
    """LongRoPE2's rule: a call whose length (max position + 1) is within the window rotates
    with the original RoPE; a longer one with the method, at every position of the call."""
    mixed = build("mixed:method=yarn,factor=4", **SHAPE, original_length=16)
    rope = build("rope", **SHAPE)
    yarn = build("yarn:factor=4", **SHAPE, original_length=16)
    q = torch.randn(1, SHAPE["n_heads"], 16, SHAPE["head_dim"], dtype=torch.float64)
    inside = torch.arange(16)[None]  # length 16 = the window
    torch.testing.assert_close(mixed.rotate_q(q, inside), rope.rotate_q(q, inside))
    beyond = torch.arange(1, 17)[None]  # length 17: past the window, early positions included
    torch.testing.assert_close(mixed.rotate_q(q, beyond), yarn.rotate_q(q, beyond))
    assert not torch.allclose(mixed.rotate_q(q, beyond), rope.rotate_q(q, beyond))


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "mixed:method=foo",
            "method='foo' is not allowed; use one of rope, linear, proportional, ntk, ",
        ),
        (
            "mixed:method=yarn,factor=0",
            "factor=0.0 is not allowed; it must be a finite number >= 1 (mixed with method=yarn)",
        ),
        ("mixed:method=yarn,factor=2,window=abc", "window='abc' is not an integer"),
        (
            "mixed:method=yarn,factor=2,window=0",
            "window=0 is not allowed; it must be a finite number >= 1",
        ),
    ],
)
def test_mixed_spec_errors_name_the_option_and_what_is_allowed(spec, message):
    """A bad mixed spec is refused in one message naming the option, its value and what is
    allowed; an error of the wrapped method says it came from inside the mixed window."""
    with pytest.raises(ValueError, match=re.escape(message)):
        build(spec, **SHAPE, original_length=16)


def test_mixed_without_a_method_lists_every_mixable_encoding():
    for ask in (lambda: build("mixed", **SHAPE), lambda: MixedConfig.option_types({})):
        with pytest.raises(ValueError) as info:
            ask()
        assert str(info.value).endswith(
            "method is required for mixed; e.g. mixed:method=yarn,factor=2 "
            "(allowed: rope, linear, proportional, ntk, dynamic-ntk, yarn, llama3, longrope, "
            "cope, hardclip, harpe, adarope, tuned-yarn)"
        )


def test_mixed_option_types_refuse_an_unknown_method():
    with pytest.raises(
        ValueError, match=re.escape("method='foo' is not allowed; use one of rope,")
    ):
        MixedConfig.option_types({"method": "foo"})


YARN = YarnConfig(factor=2, original_length=16)


def _mixed(spec: str, **context: int) -> MixedWindow:
    return build(spec, **SHAPE, **context)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "foo", "schedule": YARN}, "method='foo' is not allowed; use one of rope,"),
        (
            {"method": "yarn", "schedule": LinearConfig(factor=2)},
            "schedule LinearConfig does not match method='yarn'",
        ),
        # tuned-yarn's config is a YarnConfig, but it is another method
        (
            {"method": "yarn", "schedule": TunedYarnConfig(factor=2, original_length=16)},
            "schedule TunedYarnConfig does not match method='yarn'",
        ),
        (
            {"method": "linear", "schedule": LinearConfig(factor=2)},
            "window is required for mixed (the original length L0), or a method with "
            "original_length, or a model that supplies it",
        ),
        ({"method": "yarn", "schedule": YARN, "window": 16.5}, "window=16.5 is not an integer"),
        ({"method": "yarn", "schedule": YARN, "window": True}, "window=True is not an integer"),
        (
            {"method": "yarn", "schedule": YARN, "window": 0},
            "window=0 is not allowed; it must be a finite number >= 1",
        ),
    ],
)
def test_mixed_config_refuses_what_it_cannot_run(kwargs, message):
    """The config checks itself when built directly too: a known method, a schedule of that
    method, and a window that is a positive integer (or one to default to)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        MixedConfig(**kwargs)


def test_mixed_config_accepts_a_window_of_one_token():
    assert MixedConfig(method="yarn", schedule=YARN, window=1).window == 1


@pytest.mark.parametrize(
    "spec, window, named",
    [
        ("mixed:method=yarn,factor=4,window=8", 8, True),  # given
        ("mixed:method=yarn,factor=4,original_length=64", 64, False),  # the method's L0 first
        ("mixed:method=yarn,factor=4", 16, False),  # the method's L0, from the model
        ("mixed:method=linear,factor=2", 16, True),  # a method without L0: the model's
    ],
)
def test_mixed_window_defaults_to_the_methods_original_length_else_the_models(spec, window, named):
    """``window`` is the one given, else the wrapped method's original length, else the
    model's (16 here); the config's extension reports the method's base and factor with that
    window as L0; the spec it writes names the window when the method's L0 would not restore
    it, and rebuilds the same config without the model."""
    enc = _mixed(spec, original_length=16)
    assert enc.config.window == enc.window == window
    factor = enc.config.schedule.factor
    assert enc.config.extension() == Extension(10000.0, factor, window)
    assert ("window" in enc.config.options()) == named
    assert build(enc.spec, **SHAPE).config == enc.config


def _adarope_mixed(**options: str) -> MixedWindow:
    """A mixed window over an AdaRoPE with per-layer, per-head parameters moved off init."""
    spec = "mixed:method=adarope,init=yarn,factor=4,original_length=16,l_ref=24"
    enc = _mixed(spec + "".join(f",{k}={v}" for k, v in options.items()))
    perturb(enc.schedule_encoding)
    return enc.double()


def test_mixed_original_rope_keeps_the_methods_base_pairing_and_fraction():
    """Within the window the rotation is plain RoPE at the wrapped schedule's base, pairing
    and rotated fraction (not RoPE's defaults)."""
    options = "base=500000,pairing=interleaved,fraction=0.5"
    mixed = _mixed(f"mixed:method=yarn,factor=4,{options}", original_length=16)
    rope = build(f"rope:{options}", **SHAPE)
    q = torch.randn(1, SHAPE["n_heads"], 8, SHAPE["head_dim"], dtype=torch.float64)
    k = torch.randn(1, SHAPE["n_kv_heads"], 8, SHAPE["head_dim"], dtype=torch.float64)
    pos = torch.arange(8, 16)[None]
    torch.testing.assert_close(mixed.rotate_q(q, pos), rope.rotate_q(q, pos))
    torch.testing.assert_close(mixed.rotate_k(k, pos), rope.rotate_k(k, pos))


def test_mixed_rotates_keys_like_queries_within_and_beyond_the_window():
    """Keys follow the same rule as queries: plain RoPE when the call's positions fit the
    window (positions None: 0..S-1), the wrapped schedule when they do not."""
    mixed = _mixed("mixed:method=yarn,factor=4", original_length=16)
    rope = build("rope", **SHAPE)
    yarn = build("yarn:factor=4", **SHAPE, original_length=16)
    k = torch.randn(2, SHAPE["n_kv_heads"], 16, SHAPE["head_dim"], dtype=torch.float64)
    torch.testing.assert_close(mixed.rotate_k(k), rope.rotate_k(k))
    inside = torch.tensor([list(range(16)), list(range(15, -1, -1))])
    torch.testing.assert_close(mixed.rotate_k(k, inside), rope.rotate_k(k, inside))
    beyond = torch.arange(1, 17)[None]
    torch.testing.assert_close(mixed.rotate_k(k, beyond), yarn.rotate_k(k, beyond))
    assert not torch.allclose(mixed.rotate_k(k, beyond), rope.rotate_k(k, beyond))


@pytest.mark.parametrize("what", ["query", "key"])
def test_mixed_refuses_positions_of_the_wrong_length(what):
    mixed = _mixed("mixed:method=yarn,factor=4", original_length=16)
    heads = SHAPE["n_heads"] if what == "query" else SHAPE["n_kv_heads"]
    x = torch.randn(1, heads, 4, SHAPE["head_dim"])
    rotate = mixed.rotate_q if what == "query" else mixed.rotate_k
    with pytest.raises(ValueError, match=re.escape(f"must be (B, T) with T = {what} length 4")):
        rotate(x, torch.arange(5)[None])


def test_mixed_passes_the_layer_to_a_per_layer_method():
    """Beyond the window every call is the wrapped encoding's for the same layer (layer 0
    when none is named): AdaRoPE's per-layer frequencies and query temperatures."""
    mixed = _adarope_mixed()
    inner = mixed.schedule_encoding
    q = torch.randn(1, SHAPE["n_heads"], 4, SHAPE["head_dim"], dtype=torch.float64)
    k = torch.randn(1, SHAPE["n_kv_heads"], 4, SHAPE["head_dim"], dtype=torch.float64)
    beyond = torch.tensor([[30, 31, 32, 40]])
    for layer in (0, 2):
        torch.testing.assert_close(
            mixed.rotate_q(q, beyond, layer), inner.rotate_q(q, beyond, layer)
        )
        torch.testing.assert_close(
            mixed.rotate_k(k, beyond, layer), inner.rotate_k(k, beyond, layer)
        )
        torch.testing.assert_close(mixed.inv_freq(layer)[0], inner.inv_freq(layer)[0])
        torch.testing.assert_close(mixed.log_frequencies(layer), inner.log_frequencies(layer))
        torch.testing.assert_close(
            mixed.query_temperature(beyond, layer), inner.query_temperature(beyond, layer)
        )
    assert not torch.allclose(inner.rotate_q(q, beyond, 0), inner.rotate_q(q, beyond, 2))
    torch.testing.assert_close(mixed.rotate_q(q, beyond), inner.rotate_q(q, beyond, 0))
    torch.testing.assert_close(mixed.rotate_k(k, beyond), inner.rotate_k(k, beyond, 0))
    torch.testing.assert_close(mixed.inv_freq()[0], inner.inv_freq(0)[0])
    torch.testing.assert_close(mixed.log_frequencies(), inner.log_frequencies(0))
    torch.testing.assert_close(mixed.query_temperature(beyond), inner.query_temperature(beyond, 0))


def test_mixed_frequencies_and_temperature_follow_the_length():
    """inv_freq / log_frequencies of a length within the window are plain RoPE's; beyond it
    (or with no length) the wrapped schedule's at that length; queries within the window carry
    no temperature."""
    rope = build("rope", **SHAPE)
    yarn = _mixed("mixed:method=yarn,factor=4,original_length=16")
    torch.testing.assert_close(yarn.inv_freq(0, 16)[0], rope.inv_freq()[0])
    torch.testing.assert_close(yarn.log_frequencies(0, 16), rope.log_frequencies())
    assert not torch.allclose(yarn.inv_freq(0, 17)[0], rope.inv_freq()[0])
    mixed = _mixed("mixed:method=dynamic-ntk,factor=4,original_length=16")
    ntk = mixed.schedule_encoding
    for length in (None, 17, 100):
        torch.testing.assert_close(mixed.inv_freq(0, length)[0], ntk.inv_freq(0, length)[0])
        torch.testing.assert_close(mixed.log_frequencies(0, length), ntk.log_frequencies(0, length))
    assert not torch.allclose(ntk.inv_freq(0, 100)[0], ntk.inv_freq(0, None)[0])
    ada = _adarope_mixed()
    assert ada.query_temperature(torch.arange(16)[None]) is None
    assert ada.query_temperature(torch.arange(17)[None]) is not None


def test_mixed_reports_the_wrapped_encodings_learned_parts():
    """Analyses see the wrapped encoding: its per-head rows of each kind, its learned state
    and AdaScale's reference length."""
    mixed = _adarope_mixed()
    inner = mixed.schedule_encoding
    assert mixed.l_ref == inner.l_ref == 24
    for kind in ("freq", "scale"):
        assert mixed.head_rows(kind) == inner.head_rows(kind)
        assert mixed.head_rows(kind) is not None
    assert mixed.learned_state() == inner.learned_state()
