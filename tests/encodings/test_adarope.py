"""AdaRoPE: at initialisation its base schedule bit for bit; AdaScale as its query temperature;
its per-head parameters named as head rows."""

from __future__ import annotations

import math
import re

import pytest
import torch

from ropekit.encodings import Spec, build, schedules
from ropekit.encodings.adarope import AdaRoPEConfig, TunedYarnConfig, yarn_inv_freq
from ropekit.encodings.remap import ReRopeConfig
from ropekit.encodings.rope import YarnConfig

from .conftest import SHAPE, perturb


# ----------------------------------------------------------------------------- AdaRoPE at init
@pytest.mark.parametrize(
    ("init", "extra"),
    [
        ("rope", ""),
        ("yarn", ",factor=8,original_length=512"),
        ("linear", ",factor=4"),
        ("ntk", ",factor=4"),
        ("llama3", ",factor=8,original_length=512"),
    ],
)
def test_adarope_at_init_is_its_base_schedule_bit_for_bit(init, extra):
    """theta = theta_init * exp(0) is theta_init exactly; forming exp(xi_init + 0) instead was
    off by up to ~4 float64 ulps, which flipped float32 rotations at large positions."""
    shape = {"n_heads": 8, "n_kv_heads": 4, "head_dim": 64, "n_layers": 2}
    ada = build(f"adarope:init={init}{extra}", **shape)
    base = build(init + (":" + extra[1:] if extra else ""), **shape)
    for layer in range(2):
        assert torch.equal(ada.inv_freq(layer)[0], base.inv_freq(layer)[0].expand(4, -1))
    pos = torch.arange(0, 200_000, 7)[None]
    g = torch.Generator().manual_seed(1)
    # Without gradients both rotate on the same kernel (with them AdaRoPE's learnable
    # frequencies would take the compiled training kernel and the fixed schedule the eager
    # one, equal only to round-off).
    for dtype in (torch.float32, torch.float64):
        q = torch.randn(1, 8, pos.shape[1], 64, generator=g, dtype=dtype)
        k = torch.randn(1, 4, pos.shape[1], 64, generator=g, dtype=dtype)
        with torch.no_grad():
            assert torch.equal(ada.rotate_q(q, pos, 1), base.rotate_q(q, pos, 1))
            assert torch.equal(ada.rotate_k(k, pos, 1), base.rotate_k(k, pos, 1))


def test_query_temperature_is_adascale_or_none():
    pos = torch.tensor([[0, 10, 100]])
    ada = perturb(build("adarope:l_ref=8", **SHAPE))
    torch.testing.assert_close(ada.query_temperature(pos, 2), ada.temperature(pos, 2))
    q = torch.randn(1, SHAPE["n_heads"], 3, SHAPE["head_dim"])
    unscaled = build("adarope:l_ref=8,scale=false", **SHAPE)
    unscaled.load_state_dict({"dxi": ada.dxi.detach()})
    torch.testing.assert_close(
        ada.rotate_q(q, pos, 2), unscaled.rotate_q(q, pos, 2) * ada.query_temperature(pos, 2)
    )
    assert unscaled.query_temperature(pos, 2) is None
    assert build("rope", **SHAPE).query_temperature(pos) is None
    assert ada.l_ref == 8 and build("rope", **SHAPE).l_ref is None


def test_head_rows_name_adaropes_per_head_parameters():
    ada = build("adarope:share_heads=true", **SHAPE)
    freq, scale = ada.head_rows("freq"), ada.head_rows("scale")
    assert freq.parameters == (ada.dxi,) and scale.parameters == (ada.log_tau, ada.gamma)
    assert (freq.shared_layers, freq.shared_heads) == (False, True)
    assert build("adarope:freq=false", **SHAPE).head_rows("freq") is None
    assert build("tuned-yarn:factor=2,original_length=8", **SHAPE).head_rows("freq") is None
    with pytest.raises(ValueError, match=r"^kind='bogus' is not allowed; use one of freq, scale$"):
        ada.head_rows("bogus")


def test_adascale_is_its_formula_at_length_position_plus_one():
    """lambda_h(L) = exp(-log_tau_h) ln(1 + max(L, l_ref) / l_ref)^gamma_h, L = position + 1
    (DESIGN.md, "AdaRoPE"): flat at l_ref and below, then growing with the length."""
    ada = perturb(build("adarope:l_ref=8", **SHAPE))
    layer = 2
    pos = torch.tensor([[0, 6, 7, 8, 100]])  # L = 1, 7, 8, 9, 101
    length = torch.tensor([8.0, 8.0, 8.0, 9.0, 101.0], dtype=torch.float64)
    log_tau, gamma = ada.log_tau[layer].detach().double(), ada.gamma[layer].detach().double()
    expected = torch.exp(-log_tau[:, None]) * torch.log1p(length / 8)[None] ** gamma[:, None]
    got = ada.temperature(pos, layer)[0, :, :, 0].double()  # (H, T)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_adascale_in_float64_is_its_formula_to_float64_round_off():
    """A float64 encoding forms the length ratio in float64 too."""
    ada = perturb(build("adarope:l_ref=8", **SHAPE)).double()
    pos = torch.tensor([[0, 8, 100, 12_345]])  # L = 1, 9, 101, 12,346
    length = torch.tensor([8.0, 9.0, 101.0, 12_346.0], dtype=torch.float64)
    log_tau, gamma = ada.log_tau[1].detach(), ada.gamma[1].detach()
    expected = torch.exp(-log_tau[:, None]) * torch.log1p(length / 8)[None] ** gamma[:, None]
    got = ada.temperature(pos, 1)[0, :, :, 0]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=0)


def test_adascale_keeps_the_query_dtype():
    ada = perturb(build("adarope:l_ref=8", **SHAPE))
    q = torch.randn(1, SHAPE["n_heads"], 3, SHAPE["head_dim"]).bfloat16()
    assert ada.rotate_q(q, torch.tensor([[0, 10, 100]]), 1).dtype == torch.bfloat16


@pytest.mark.parametrize("spec", ["adarope", "tuned-yarn:factor=8,original_length=64"])
def test_a_bad_rotation_input_is_refused_naming_query_or_key(spec):
    enc = build(spec, **SHAPE)  # 4 query heads, 2 key heads, head dim 16
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    five = torch.arange(5)[None]
    for rotate_, x, what in ((enc.rotate_q, q, "query"), (enc.rotate_k, k, "key")):
        with pytest.raises(
            ValueError, match=rf"^positions \(1, 5\) must be \(B, T\) with T = {what} "
        ):
            rotate_(x, five)
    with pytest.raises(ValueError, match=r"^query has 2 heads \(x \(1, 2, 3, 16\)\); expected 4$"):
        enc.rotate_q(k)
    with pytest.raises(ValueError, match=r"^key has 4 heads \(x \(1, 4, 3, 16\)\); expected 2$"):
        enc.rotate_k(q)


def test_methods_of_one_layer_default_to_layer_0():
    ada = perturb(build("adarope:l_ref=8", **SHAPE))
    pos = torch.tensor([[0, 10, 100]])
    assert not torch.equal(ada.xi(0), ada.xi(1))  # perturbed per layer
    assert torch.equal(ada.log_frequencies(), ada.xi(0))
    assert torch.equal(ada.inv_freq()[0], ada.inv_freq(0)[0])
    assert torch.equal(ada.query_temperature(pos), ada.temperature(pos, 0))
    one_layer = build("tuned-yarn:factor=8,original_length=64", **{**SHAPE, "n_layers": 1})
    assert torch.equal(one_layer.inv_freq()[0], one_layer.inv_freq(0)[0])


# ----------------------------------------------------------------------------- learned state
def test_adarope_learned_state_reports_its_parameters():
    """dxi (L|1, K|1, F), gamma and tau = exp(log_tau) (L|1, H|1), the base schedule's ln theta
    (F,) and the sharing, as plain lists; a part that is not learned is None."""
    ada = build("adarope:l_ref=8,share_heads=true", **SHAPE)  # L = 3, F = 8
    dxi = 0.01 * torch.arange(24, dtype=torch.float64).reshape(3, 1, 8)
    with torch.no_grad():
        ada.dxi.copy_(dxi)
        ada.log_tau.fill_(math.log(2))
        ada.gamma.fill_(0.5)
    state = ada.learned_state()
    assert set(state) == {"kind", "share_layers", "share_heads", "l_ref", "xi_init", "dxi"} | {
        "gamma",
        "tau",
    }
    assert state["kind"] == "adarope" and state["l_ref"] == 8
    assert state["share_layers"] is False and state["share_heads"] is True
    base = 10000.0  # RoPE's default: theta_f = base^(-2f/D)
    assert state["xi_init"] == pytest.approx([-2 * f / 16 * math.log(base) for f in range(8)])
    torch.testing.assert_close(torch.tensor(state["dxi"], dtype=torch.float64), dxi)
    assert state["gamma"] == [[0.5]] * 3
    assert state["tau"] == [[pytest.approx(2.0, rel=1e-6)]] * 3
    frozen = build("adarope:freq=false,scale=false", **SHAPE).learned_state()
    assert (frozen["dxi"], frozen["gamma"], frozen["tau"]) == (None, None, None)
    assert build("adarope:scale=false", **SHAPE).learned_state()["dxi"] == [[[0.0] * 8] * 2] * 3


def test_tuned_yarn_learned_state_reports_its_knobs_and_the_change_in_ln_theta():
    """The knobs as trained and as configured, and ln theta of the YaRN schedule (no
    truncation) at the configured knobs (xi_init) and its change at the trained ones (dxi, one
    row for every layer and head)."""
    tuned = build("tuned-yarn:factor=8,original_length=64", **SHAPE)  # D = 16, base 10000
    with torch.no_grad():
        tuned.log_factor_ratio.fill_(math.log(2))
    state = tuned.learned_state()
    init = {"factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0}
    init["attention_factor"] = 0.1 * math.log(8) + 1  # YaRN, eq. 22
    assert state["kind"] == "tuned-yarn" and state["gamma"] is None and state["tau"] is None
    assert state["init_knobs"] == pytest.approx(init, rel=1e-12)
    assert state["knobs"] == pytest.approx({**init, "factor": 16.0}, rel=1e-6)

    def ln_theta(factor: float) -> torch.Tensor:
        return schedules.yarn(16, 10000.0, factor, 64, truncate=False)[0].log()

    xi_init = torch.tensor(state["xi_init"], dtype=torch.float64)
    torch.testing.assert_close(xi_init, ln_theta(8.0), rtol=1e-12, atol=1e-12)
    dxi = torch.tensor(state["dxi"], dtype=torch.float64)
    assert dxi.shape == (1, 1, 8) and dxi.min() < -0.5  # the slowest pairs move by -ln 2
    expected = ln_theta(state["knobs"]["factor"]) - ln_theta(8.0)
    torch.testing.assert_close(dxi[0, 0], expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- tuned-yarn
@pytest.mark.parametrize(
    ("dim", "base", "length", "factor"),
    [
        (64, 10000.0, 4096, 8.0),  # the ramp lies inside: 10.5 < pair index < 22.5
        (16, 10.0, 1024, 4.0),  # its slow end (17.7) clamped to the last channel, 15
        (16, 10000.0, 64, 8.0),  # its fast end (below 0) clamped to 0
    ],
)
def test_yarn_inv_freq_is_the_yarn_schedule_without_truncation(dim, base, length, factor):
    beta_fast, beta_slow = 32.0, 1.0
    expected = schedules.yarn(dim, base, factor, length, beta_fast, beta_slow, truncate=False)[0]
    knobs = (torch.tensor(v, dtype=torch.float64) for v in (factor, beta_fast, beta_slow))
    got = yarn_inv_freq(dim, base, length, *knobs)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=0)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ("", 0.1 * math.log(8) + 1),  # YaRN, eq. 22
        (",mscale=1,mscale_all_dim=0.707", (0.1 * math.log(8) + 1) / (0.0707 * math.log(8) + 1)),
        (",attention_factor=1.3", 1.3),
        (",mscale=1,mscale_all_dim=0.707,attention_factor=1.3", 1.3),
    ],
)
def test_tuned_yarn_starts_at_yarns_attention_factor(options, expected):
    """The attention-factor knob starts where YaRN's rule puts it: an explicit value, else the
    mscale/mscale_all_dim ratio (DeepSeek), else 0.1 ln s + 1."""
    tuned = build(f"tuned-yarn:factor=8,original_length=64{options}", **SHAPE)
    assert tuned.knobs()["attention_factor"].item() == pytest.approx(expected, rel=1e-12)
    assert tuned.inv_freq()[1].item() == pytest.approx(expected, rel=1e-12)


def test_tuned_yarn_refuses_truncation_and_names_the_fixed_schedule():
    message = (
        "truncate=true is not allowed for tuned-yarn; the ramp ends must stay continuous to be "
        "learned (use yarn:truncate=true for the fixed schedule)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        TunedYarnConfig(factor=8.0, original_length=64, truncate=True)


# ----------------------------------------------------------------------------- config and shapes
def test_l_ref_defaults_to_the_init_length_else_the_context_else_64():
    """AdaRoPEConfig: L_ref is the init schedule's original length (a model being extended
    keeps its training length), else an l_ref the model supplies, else the paper's 64; one the
    spec gives wins, and only a non-default value is written back into the spec's options. The
    context (base, original length) also fills the init schedule."""
    assert Spec.parse("adarope").config().l_ref == 64
    assert Spec.parse("adarope").config(l_ref=1000).l_ref == 1000
    assert Spec.parse("adarope:l_ref=8").config(l_ref=1000).l_ref == 8
    yarn = "adarope:init=yarn,factor=4,original_length=512"
    assert Spec.parse(yarn).config(l_ref=1000).l_ref == 512
    assert Spec.parse(yarn + ",l_ref=8").config(l_ref=1000).l_ref == 8
    # the model's context reaches the init schedule too (and L_ref follows its length)
    extended = Spec.parse("adarope:init=yarn,factor=4").config(base=5e5, original_length=8192)
    assert (extended.schedule.base, extended.schedule.original_length) == (5e5, 8192)
    assert extended.l_ref == 8192
    assert "l_ref" not in Spec.parse(yarn).config(l_ref=1000).options()
    assert Spec.parse(yarn + ",l_ref=8").config().options()["l_ref"] == 8
    assert build("adarope:l_ref=1", **SHAPE).l_ref == 1
    message = "l_ref=0 is not allowed; it must be a finite number >= 1"
    with pytest.raises(ValueError, match=f": {re.escape(message)}$"):
        build("adarope:l_ref=0", **SHAPE)
    # the temperature clamps int64 positions to L_ref: the largest int64 is the limit (found by
    # the spec fuzzer: l_ref=9.223372036854776e+18, 2**63, overflowed in the forward)
    top = build(f"adarope:l_ref={2**63 - 1}", **SHAPE)
    assert top.temperature(torch.tensor([[0, 1]]), 0).isfinite().all()
    message = "l_ref=9223372036854775808 is not allowed; it must be a length of at most"
    with pytest.raises(ValueError, match=f": {re.escape(message)} 9223372036854775807 tokens"):
        build("adarope:l_ref=9.223372036854776e+18", **SHAPE)


def test_an_unknown_option_names_what_adarope_with_that_init_allows():
    with pytest.raises(ValueError, match=r"\(adarope with init=yarn allows: (.*)\)$") as info:
        build("adarope:init=yarn,factor=4,original_length=64,bogus=1", **SHAPE)
    allowed = re.search(r"allows: (.*)\)$", str(info.value)).group(1).split(", ")
    assert "bogus" in str(info.value).split("(adarope")[0]
    assert {"init", "l_ref", "share_heads", "freq", "scale", "factor", "beta_fast"} <= set(allowed)
    assert "schedule" not in allowed
    with pytest.raises(ValueError, match=r": l_ref='abc' is not an integer$"):  # named
        build("adarope:l_ref=abc", **SHAPE)


@pytest.mark.parametrize("spec", ["adarope", "tuned-yarn:factor=8,original_length=64"])
def test_learned_rotations_refuse_shapes_and_layers_they_cannot_rotate(spec):
    cases = [
        ({"head_dim": 15}, "head_dim=15 is not allowed; rotary encodings need it even"),
        ({"n_kv_heads": 3}, "n_heads=4 must be a multiple of n_kv_heads=3"),
    ]
    enc = build(spec, **SHAPE)  # 3 layers
    for change, message in cases:  # built directly: the registry checks n_heads first
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            type(enc)(enc.config, **{**SHAPE, "d_model": 64, **change})
    with pytest.raises(
        ValueError, match=r": fraction=0.1 of head_dim=16 rotates 1 channels; at least 2"
    ):
        build(f"{spec}{',' if ':' in spec else ':'}fraction=0.1", **SHAPE)  # int(1.6) channels
    two = build(f"{spec}{',' if ':' in spec else ':'}fraction=0.125", **SHAPE)  # 2 channels
    assert two.inv_freq(0)[0].shape[-1] == 1
    enc.inv_freq(2)
    for layer in (3, -1):
        message = f"layer={layer} is out of range; this model has layers 0..2"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            enc.inv_freq(layer)


@pytest.mark.parametrize("spec", ["adarope:init=dynamic-ntk", "rerope:init=bogus"])
def test_an_init_that_is_not_a_fixed_schedule_is_refused_naming_the_allowed_ones(spec):
    """AdaRoPE and the remaps start from rope, linear, ntk, yarn or llama3 (a fixed schedule)."""
    message = f"spec {spec!r}: init={spec.partition('init=')[2]!r} is not allowed; use one of "
    with pytest.raises(ValueError, match=f"^{re.escape(message)}rope, linear, ntk, yarn, llama3$"):
        build(spec, **SHAPE)


def test_a_schedule_other_than_the_init_names_is_refused_naming_both():
    """YarnConfig is a LinearConfig, yet init=linear over it would write another encoding."""
    yarn = YarnConfig(factor=2.0, original_length=64)
    message = "schedule YarnConfig does not match init='linear'"
    for config in (AdaRoPEConfig, ReRopeConfig):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            config(init="linear", schedule=yarn)
