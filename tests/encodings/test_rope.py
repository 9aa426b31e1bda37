"""RotaryEncoding and the schedule configs: a dynamic schedule's frequencies follow the call's
length, a static one's do not; configs refuse what their schedule cannot use and pass every
option to it."""

from __future__ import annotations

import math
import re

import pytest
import torch

from ropekit.encodings import build, schedules
from ropekit.encodings.base import Extension
from ropekit.encodings.rope import TABLES_KEPT

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


def rotate_pairs(x, theta, positions, pairing):
    """x (B, H, T, D) rotated pair by pair: pair f, channels (f, f + F) for ``half`` and
    (2f, 2f + 1) for ``interleaved``, turned by the angle position * theta_f; the channels past
    2F (partial RoPE) pass through. Written out with explicit indices, in float64."""
    n = len(theta)
    out = x.clone()
    for t, p in enumerate(positions):
        for f, th in enumerate(theta):
            i, j = (f, f + n) if pairing == "half" else (2 * f, 2 * f + 1)
            c, s = math.cos(p * th), math.sin(p * th)
            out[:, :, t, i] = x[:, :, t, i] * c - x[:, :, t, j] * s
            out[:, :, t, j] = x[:, :, t, j] * c + x[:, :, t, i] * s
    return out


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rope_rotates_queries_and_keys_pair_by_pair_in_its_pairing(pairing, fraction, dtype):
    """theta_f = b^(-2f/d) over the d = int(D * fraction) rotated channels, in the pairing the
    spec names; the result keeps x's dtype."""
    enc = build(f"rope:pairing={pairing},fraction={fraction},base=500", **SHAPE)
    d = int(SHAPE["head_dim"] * fraction)
    theta = [500.0 ** (-2 * f / d) for f in range(d // 2)]
    positions = [0, 3, 17, 1000]
    g = torch.Generator().manual_seed(0)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 0, "atol": 2e-6}
    for what, heads in (("q", SHAPE["n_heads"]), ("k", SHAPE["n_kv_heads"])):
        x = torch.randn(2, heads, len(positions), SHAPE["head_dim"], generator=g, dtype=dtype)
        rotate = enc.rotate_q if what == "q" else enc.rotate_k
        got = rotate(x, torch.tensor([positions]))
        assert got.dtype == dtype
        expected = rotate_pairs(x.double(), theta, positions, pairing)
        torch.testing.assert_close(got.double(), expected, **tol)


def test_dynamic_ntk_rotates_with_the_base_of_the_calls_last_position_plus_one():
    """Dynamic NTK's length is max(positions) + 1 (transformers' rule), not the number of
    positions: b' = b * (s L / L0 - (s - 1))^(d/(d-2)) once L passes L0, plain RoPE within."""
    enc = build("dynamic-ntk:factor=4,original_length=16", **SHAPE).double()
    d = SHAPE["head_dim"]
    g = torch.Generator().manual_seed(0)
    for positions in (list(range(5, 40)), [3, 9, 15]):  # L = 40 > L0; L = 16 = L0
        length = max(positions) + 1
        base = 10000.0 * max(4 * length / 16 - 3, 1) ** (d / (d - 2))
        theta = [base ** (-2 * f / d) for f in range(d // 2)]
        q = torch.randn(1, SHAPE["n_heads"], len(positions), d, generator=g, dtype=torch.float64)
        got = enc.rotate_q(q, torch.tensor([positions]))
        expected = rotate_pairs(q, theta, positions, "half")
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "spec", ["yarn:factor=4,original_length=16", "dynamic-ntk:factor=4,original_length=16"]
)
def test_a_schedule_rotates_an_empty_sequence(spec):
    """No positions, no rotation: zero tokens give an empty result, also for a dynamic
    schedule, whose length max(positions) + 1 an empty sequence does not have."""
    enc = build(spec, **SHAPE)
    q = torch.randn(1, SHAPE["n_heads"], 0, SHAPE["head_dim"])
    assert enc.rotate_q(q, torch.zeros(1, 0, dtype=torch.long)).shape == q.shape


def test_tables_come_in_the_dtype_asked_and_are_cached_per_dtype():
    """cos and sin of position * theta_f times the attention factor, in float32 by default and
    in float64 when asked; each dtype has its own tables."""
    enc = build("yarn:factor=4,original_length=16", **SHAPE)
    pos = torch.tensor([[0, 5, 300]])
    theta, factor = enc.inv_freq()
    phi = pos[:, None, :, None] * theta[0]  # float64
    for dtype in (torch.float32, torch.float64):
        cos, sin = enc.tables(pos, dtype)
        assert cos.dtype == sin.dtype == dtype and cos.shape == (1, 1, 3, 8)
        torch.testing.assert_close(cos, (phi.cos() * factor).to(dtype), rtol=0, atol=0)
        torch.testing.assert_close(sin, (phi.sin() * factor).to(dtype), rtol=0, atol=0)
    assert enc.tables(pos)[0].dtype == torch.float32
    assert enc.tables(pos)[0] is not enc.tables(pos, torch.float64)[0]


def test_the_cache_keeps_the_most_recent_tables_kept_tables_only():
    """Memory stays bounded: the tables of the TABLES_KEPT most recent positions are reused,
    older ones are dropped and made anew."""
    enc = build("rope", **SHAPE)
    steps = [torch.tensor([[i]]) for i in range(TABLES_KEPT + 1)]
    first = enc.tables(steps[0])[0]
    for pos in steps[1:TABLES_KEPT]:
        enc.tables(pos)
    assert enc.tables(steps[0])[0] is first  # TABLES_KEPT - 1 newer ones: still kept
    for pos in steps[1 : TABLES_KEPT + 1]:
        enc.tables(pos)
    again = enc.tables(steps[0])[0]  # TABLES_KEPT newer ones: dropped, the same values anew
    assert again is not first and torch.equal(again, first)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tables_live_on_the_device_of_the_positions():
    enc = build("rope", **SHAPE)
    cos, sin = enc.tables(torch.arange(5, device="cuda")[None])
    assert cos.device.type == sin.device.type == "cuda"
    q = torch.randn(1, SHAPE["n_heads"], 5, SHAPE["head_dim"], device="cuda")
    assert enc.rotate_q(q).device.type == "cuda"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("linear", "factor is required for LinearConfig; e.g. factor=4"),
        ("ntk", "factor is required for NTKConfig; e.g. factor=4"),
        (
            "dynamic-ntk:factor=2",
            "original_length is required for DynamicNTKConfig; e.g. original_length=4",
        ),
        ("yarn:factor=2", "original_length is required for YarnConfig; e.g. original_length=4"),
        ("longrope:original_length=16", "factor is required for LongRopeConfig; e.g. factor=4"),
    ],
)
def test_a_missing_required_option_is_named_with_the_config_and_an_example(spec, message):
    with pytest.raises(ValueError, match=f"^spec {re.escape(repr(spec))}: {re.escape(message)}$"):
        build(spec, **SHAPE)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("base=1", "base=1.0 is not allowed; it must be a finite number > 1"),
        ("base=0.5", "base=0.5 is not allowed; it must be a finite number > 1"),
        ("pairing=zigzag", "pairing='zigzag' is not allowed; use one of half, interleaved"),
        ("fraction=0.1", "fraction=0.1 of head_dim=16 rotates 1 channels; at least 2 are needed"),
    ],
)
def test_bad_rope_options_are_refused_naming_the_option_and_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=f"^spec 'rope:{options}': {re.escape(message)}$"):
        build(f"rope:{options}", **SHAPE)


@pytest.mark.parametrize(("options", "rotary_dim"), [("base=1.5", 16), ("fraction=0.125", 2)])
def test_rope_options_at_the_edge_of_what_is_allowed_build(options, rotary_dim):
    """A base just above 1, and a fraction that rotates exactly one pair (two channels)."""
    assert build(f"rope:{options}", **SHAPE).rotary_dim == rotary_dim
