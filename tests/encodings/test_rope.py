"""RotaryEncoding and the schedule configs: a dynamic schedule's frequencies follow the call's
length, a static one's do not; configs refuse what their schedule cannot use and pass every
option to it."""

from __future__ import annotations

import re

import pytest
import torch

from ropekit.encodings import build, schedules
from ropekit.encodings.base import Extension

from .conftest import SHAPE


def test_dynamic_frequencies_follow_the_length_static_ones_do_not():
    dyn = build("dynamic-ntk:factor=4,original_length=16", **SHAPE)
    assert torch.equal(dyn.inv_freq(0, 16)[0], build("rope", **SHAPE).inv_freq(0)[0])
    assert not torch.equal(dyn.inv_freq(0, 64)[0], dyn.inv_freq(0, 16)[0])
    yarn = build("yarn:factor=4,original_length=16", **SHAPE)
    assert torch.equal(yarn.inv_freq(0, 16)[0], yarn.inv_freq(0, 1000)[0])


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "longrope:factor=2,original_length=0",
            "original_length=0 is not allowed; it must be a finite number >= 1",
        ),
        (
            "longrope:factor=2,original_length=16,short_factor=[1,0]",
            "short_factor=0.0 is not allowed; it must be a finite number > 0",
        ),
        (
            "longrope:factor=2,original_length=16,long_factor=[-2]",
            "long_factor=-2.0 is not allowed; it must be a finite number > 0",
        ),
        (
            "longrope:factor=2,original_length=16,attention_factor=0",
            "attention_factor=0.0 is not allowed; it must be a finite number > 0",
        ),
        (
            "longrope:factor=2,original_length=1",
            "original_length=1 is not allowed without attention_factor; the default "
            "sqrt(1 + ln s / ln L0) needs L0 >= 2",
        ),
        (
            "dynamic-ntk:factor=2,original_length=0",
            "original_length=0 is not allowed; it must be a finite number >= 1",
        ),
        (
            "yarn:factor=2,original_length=0",
            "original_length=0 is not allowed; it must be a finite number >= 1",
        ),
        (
            "llama3:factor=2,original_length=0",
            "original_length=0 is not allowed; it must be a finite number >= 1",
        ),
        (
            "yarn:factor=2,original_length=16,beta_slow=0",
            "beta_slow=0.0 is not allowed; it must be a finite number > 0",
        ),
        (
            "yarn:factor=2,original_length=16,beta_fast=2,beta_slow=2",
            "beta_fast=2.0 is not allowed; it must exceed beta_slow=2.0",
        ),
        (
            "yarn:factor=2,original_length=16,attention_factor=0",
            "attention_factor=0.0 is not allowed; it must be a finite number > 0",
        ),
        (
            "yarn:factor=2,original_length=16,mscale=inf,mscale_all_dim=1",
            "mscale=inf is not allowed; it must be a finite number",
        ),
        (
            "yarn:factor=2,original_length=16,mscale=nan,mscale_all_dim=1",
            "mscale=nan is not allowed; it must be a finite number",
        ),
        (
            "yarn:factor=1,original_length=16,mscale=1,mscale_all_dim=-inf",
            "mscale_all_dim=-inf is not allowed; it must be a finite number",
        ),
        (
            "llama3:factor=2,original_length=16,low_freq_factor=0",
            "low_freq_factor=0.0 is not allowed; it must be a finite number > 0",
        ),
        (
            "llama3:factor=2,original_length=16,low_freq_factor=2,high_freq_factor=2",
            "high_freq_factor=2.0 is not allowed; it must exceed low_freq_factor=2.0",
        ),
    ],
)
def test_schedule_configs_refuse_bad_values_naming_the_field_and_the_bound(spec, message):
    """L0 is at least one token, YaRN's ramp needs 0 < beta_slow < beta_fast, Llama 3's bands
    0 < low_freq_factor < high_freq_factor, LongRoPE's rescale factors and an explicit
    attention factor are positive, YaRN's mscale and mscale_all_dim finite (an infinite one
    made the attention factor inf or nan)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        build(spec, **SHAPE)


@pytest.mark.parametrize(
    "spec",
    [
        "dynamic-ntk:factor=2,original_length=1",
        "longrope:factor=2,original_length=1,attention_factor=1",
        "yarn:factor=2,original_length=1,beta_fast=1.5,beta_slow=1",
        "llama3:factor=2,original_length=1,low_freq_factor=1,high_freq_factor=1.5",
    ],
)
def test_schedule_configs_accept_the_edges_of_what_is_allowed(spec):
    """A one-token L0, and band or ramp limits that differ by less than 1, are allowed."""
    assert build(spec, **SHAPE).rotary_dim == SHAPE["head_dim"]


@pytest.mark.parametrize("name", ["dynamic-ntk", "yarn", "llama3", "longrope"])
def test_schedules_with_an_original_length_report_base_factor_and_l0(name):
    config = build(f"{name}:factor=4,original_length=32,base=500000", **SHAPE).config
    assert config.extension() == Extension(500000.0, 4.0, 32)


@pytest.mark.parametrize(
    "spec, expected",
    [
        (
            "yarn:factor=4,original_length=4096,beta_fast=16,beta_slow=2,truncate=false,"
            "mscale=2,mscale_all_dim=1",
            schedules.yarn(
                16,
                10000.0,
                4.0,
                4096,
                beta_fast=16,
                beta_slow=2,
                mscale=2,
                mscale_all_dim=1,
                truncate=False,
            ),
        ),
        (
            "yarn:factor=4,original_length=64,attention_factor=1.7",
            schedules.yarn(16, 10000.0, 4.0, 64, attention_factor=1.7),
        ),
        (
            "longrope:factor=4,original_length=64,attention_factor=1.7",
            schedules.longrope(16, 10000.0, [1.0] * 8, [1.0] * 8, 64, 4.0, 1.7),
        ),
        (
            "llama3:factor=4,original_length=64,low_freq_factor=2,high_freq_factor=8",
            schedules.llama3(16, 10000.0, 4.0, 64, 2.0, 8.0),
        ),
    ],
)
def test_schedule_options_reach_the_schedule(spec, expected):
    """Every option of a spec reaches its schedule function (checked against transformers in
    test_schedules): frequencies and the cos/sin attention factor."""
    inv_freq, factor = build(spec, **SHAPE).inv_freq()
    torch.testing.assert_close(inv_freq[0], expected[0], rtol=0, atol=0)
    assert factor == expected[1]


def test_longrope_follows_the_length_and_rescales_nothing_unless_told():
    """LongRoPE's factors switch from short to long once the call's length passes L0; a
    factor list left out means lambda = 1 (plain RoPE frequencies)."""
    rope = build("rope", **SHAPE).inv_freq()[0]
    given = build("longrope:factor=4,original_length=16,short_factor=[2],long_factor=[4]", **SHAPE)
    torch.testing.assert_close(given.inv_freq(0, 16)[0], rope / 2, rtol=1e-15, atol=0)
    torch.testing.assert_close(given.inv_freq(0, 17)[0], rope / 4, rtol=1e-15, atol=0)
    unset = build("longrope:factor=4,original_length=16", **SHAPE)
    for length in (None, 16, 17):
        torch.testing.assert_close(unset.inv_freq(0, length)[0], rope, rtol=0, atol=0)


@pytest.mark.parametrize("what", ["query", "key"])
def test_rope_refuses_positions_of_the_wrong_length_naming_queries_or_keys(what):
    enc = build("rope", **SHAPE)
    heads = SHAPE["n_heads"] if what == "query" else SHAPE["n_kv_heads"]
    x = torch.randn(1, heads, 4, SHAPE["head_dim"])
    rotate = enc.rotate_q if what == "query" else enc.rotate_k
    with pytest.raises(ValueError, match=re.escape(f"must be (B, T) with T = {what} length 4")):
        rotate(x, torch.arange(5)[None])
