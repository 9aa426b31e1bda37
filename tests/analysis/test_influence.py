"""Head influence: exactly zero at init, non-zero only for the head that moved, parameters
restored exactly."""

from __future__ import annotations

import pytest
import torch

from ropekit.analysis.influence import (
    Unit,
    at_init,
    head_influence,
    influence_units,
    mean_nll,
    reverted,
)
from ropekit.encodings import build

from .tiny import tiny_decoder, windows

WINDOWS = windows(2, 48)


def _deltas(result: dict) -> dict[str, float]:
    return {u["label"]: u["delta_nll"] for u in result["units"]}


@pytest.mark.parametrize("kind", ["freq", "scale"])
def test_influence_is_exactly_zero_for_adarope_at_init(kind: str) -> None:
    model = tiny_decoder()
    result = head_influence(
        model, model.encoding, WINDOWS, kind, batch_size=2, skip_unchanged=False
    )
    assert result["baseline_nll"] == pytest.approx(mean_nll(model, WINDOWS, 1), rel=1e-6)
    assert all(u["computed"] for u in result["units"])  # forwards really ran
    assert all(u["delta_nll"] == 0.0 for u in result["units"])
    assert len(result["units"]) == (4 if kind == "freq" else 8)  # 2 layers x (2 kv | 4 q) heads


def test_reverting_one_moved_kv_head_is_the_only_nonzero_freq_influence() -> None:
    model = tiny_decoder()
    with torch.no_grad():
        model.encoding.dxi[1, 0] = torch.linspace(-0.8, 0.8, model.encoding.n_pairs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = head_influence(
        model, model.encoding, WINDOWS, "freq", batch_size=1, skip_unchanged=False
    )
    deltas = _deltas(result)
    assert abs(deltas.pop("L1/K0")) > 1e-5
    assert set(deltas.values()) == {0.0}
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # restored exactly
    scale = head_influence(model, model.encoding, WINDOWS, "scale", batch_size=2)
    assert {u["delta_nll"] for u in scale["units"]} == {0.0}
    assert not any(u["computed"] for u in scale["units"])  # unchanged rows are skipped


def test_reverting_one_moved_query_head_is_the_only_nonzero_scale_influence() -> None:
    model = tiny_decoder()
    with torch.no_grad():
        model.encoding.gamma[0, 2] = 1.5  # lambda = ln(1 + L/L_ref)^1.5, not 1, at every L
        model.encoding.log_tau[0, 2] = -0.5
    deltas = _deltas(head_influence(model, model.encoding, WINDOWS, "scale", batch_size=2))
    assert abs(deltas.pop("L0/H2")) > 1e-5
    assert set(deltas.values()) == {0.0}


def test_reverted_restores_even_when_the_block_raises() -> None:
    encoding = build("adarope", n_heads=4, n_kv_heads=2, head_dim=8, n_layers=2)
    with torch.no_grad():
        encoding.gamma.fill_(0.3)
    unit = influence_units(encoding, "scale")[3]
    assert unit == Unit("scale", (0, 3), 0, 3) and not at_init(encoding, unit)
    with pytest.raises(KeyError), reverted(encoding, unit):
        assert at_init(encoding, unit)
        raise KeyError("boom")
    assert torch.equal(encoding.gamma, torch.full((2, 4), 0.3))


def test_units_follow_sharing_and_ablations() -> None:
    dims = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "n_layers": 3}
    shared = influence_units(build("adarope:share_heads=true", **dims), "freq")
    assert [(u.layer, u.head, u.label) for u in shared] == [
        (0, None, "L0/all heads"),
        (1, None, "L1/all heads"),
        (2, None, "L2/all heads"),
    ]
    assert len(influence_units(build("adarope:share_layers=true", **dims), "scale")) == 4
    assert influence_units(build("adarope:freq=false", **dims), "freq") == []
    assert influence_units(build("rope", **dims), "freq") == []
    with pytest.raises(ValueError, match="kind='both'"):
        influence_units(build("adarope", **dims), "both")
