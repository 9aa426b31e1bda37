"""AdaRoPE: at initialisation its base schedule bit for bit; AdaScale as its query temperature;
its per-head parameters named as head rows."""

from __future__ import annotations

import pytest
import torch

from ropekit.encodings import build

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
    with pytest.raises(ValueError, match="kind"):
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
