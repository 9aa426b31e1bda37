"""Frequencies per layer and head, the effective base, and learned-versus-initial schedules."""

from __future__ import annotations

import pytest
import torch

from ropekit.analysis.schedules import (
    effective_bases,
    head_log_frequencies,
    learned_schedule,
    rotary_layout,
)
from ropekit.encodings import build

DIMS = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "n_layers": 3}


@pytest.mark.parametrize(
    "spec",
    [
        "rope:base=10000",
        "rope:base=500000,pairing=interleaved",
        "rope:base=1000,fraction=0.5",
        "adarope:base=20000",  # AdaRoPE at init is its base schedule
        "adarope:base=20000,share_heads=true,share_layers=true",
    ],
)
def test_effective_base_of_a_plain_rope_schedule_is_its_base(spec: str) -> None:
    encoding = build(spec, **DIMS)
    base = encoding.config.base if hasattr(encoding.config, "base") else None
    base = base or encoding.config.schedule.base
    result = effective_bases(encoding)
    per_head = torch.tensor(result["per_head"])  # (L, K)
    assert per_head.shape == (3, 2)
    assert torch.allclose(per_head, torch.full_like(per_head, base), rtol=1e-12)
    assert result["per_layer"] == pytest.approx([base] * 3, rel=1e-12)
    assert max(max(r) for r in result["fit_rms"]) < 1e-12


def test_effective_base_follows_a_learned_change_of_base_per_head() -> None:
    # dxi_f = -(2f/d) delta multiplies that head's base by e^delta, and nothing else moves.
    encoding = build("adarope:base=10000", **DIMS)
    x = torch.arange(0, 16, 2, dtype=torch.float64) / 16
    with torch.no_grad():
        encoding.dxi[1, 0] = (-x * 0.7).float()
    per_head = torch.tensor(effective_bases(encoding)["per_head"], dtype=torch.float64)
    expected = torch.full((3, 2), 1e4, dtype=torch.float64)
    expected[1, 0] = 1e4 * torch.tensor(0.7, dtype=torch.float64).exp()
    assert torch.allclose(per_head, expected, rtol=1e-6)  # dxi is float32
    # The layer's base is the geometric mean of its heads' (the pooled least-squares fit).
    per_layer = effective_bases(encoding)["per_layer"]
    assert per_layer[1] == pytest.approx(float((per_head[1].log().mean()).exp()), rel=1e-12)


def test_head_log_frequencies_per_kv_head_and_none_without_rotation() -> None:
    encoding = build("adarope", **DIMS)
    with torch.no_grad():
        encoding.dxi[2, 1, 0] = 0.5
    log_theta = head_log_frequencies(encoding, 2)  # (K, F)
    assert log_theta.shape == (2, 8) and log_theta.dtype == torch.float64
    assert log_theta[1, 0] - log_theta[0, 0] == pytest.approx(0.5)
    assert head_log_frequencies(build("alibi", **DIMS), 0) is None
    assert rotary_layout(build("nope", **DIMS)) is None
    assert effective_bases(build("alibi", **DIMS)) is None


def test_dynamic_schedule_frequencies_follow_the_length() -> None:
    encoding = build("dynamic-ntk:factor=4,original_length=32", **DIMS)
    short = effective_bases(encoding, 32)["per_layer"][0]
    long = effective_bases(encoding, 128)["per_layer"][0]
    assert short == pytest.approx(10000.0, rel=1e-12) and long > short


def test_learned_schedule_reports_the_change_from_init() -> None:
    encoding = build("adarope", **DIMS)
    at_init = learned_schedule(encoding)
    assert at_init["kind"] == "adarope"
    assert torch.count_nonzero(torch.tensor(at_init["dxi"])) == 0
    assert at_init["gamma"] == [[0.0] * 4] * 3 and at_init["tau"] == [[1.0] * 4] * 3
    with torch.no_grad():
        encoding.log_tau[0, 1] = 0.25
    assert learned_schedule(encoding)["tau"][0][1] == pytest.approx(torch.tensor(0.25).exp())
    ablated = learned_schedule(build("adarope:freq=false,scale=false", **DIMS))
    assert ablated["dxi"] is None and ablated["gamma"] is None
    assert learned_schedule(build("rope", **DIMS)) is None


def test_tuned_yarn_learned_change_is_zero_at_init_and_follows_its_knobs() -> None:
    encoding = build("tuned-yarn:factor=4,original_length=32", **DIMS)
    learned = learned_schedule(encoding)
    assert learned["kind"] == "tuned-yarn"
    assert torch.count_nonzero(torch.tensor(learned["dxi"])) == 0
    assert learned["knobs"] == pytest.approx(learned["init_knobs"])
    with torch.no_grad():
        encoding.log_factor_ratio.fill_(0.3)
    moved = torch.tensor(learned_schedule(encoding)["dxi"])  # (1, 1, F)
    assert float(moved.min()) < 0  # a larger factor interpolates the slow pairs further
    assert float(moved[0, 0, 0]) == 0.0  # the fastest pair extrapolates, unchanged
