"""Figures: which are drawn for which result, and drawing without matplotlib warnings."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ropekit.analysis import AnalysisConfig, analyze_windows
from ropekit.analysis.plots import beta_label, planned_figures, write_figures

from .tiny import tiny_decoder, windows


@pytest.mark.filterwarnings("error")
def test_a_fixed_schedule_draws_its_four_figures_without_warnings(tmp_path: Path) -> None:
    # Every head of plain RoPE has the same effective base: the log axis must not collapse.
    model = tiny_decoder("rope", n_kv_heads=4)
    with torch.no_grad():
        result = analyze_windows(
            model, model.encoding, windows(2, 32), AnalysisConfig((8, 32), n_windows=2)
        )
    expected = {"effective_length", "utilization", "distance_profile", "effective_base"}
    assert set(planned_figures(result)) == expected
    paths = write_figures(result, tmp_path)
    assert set(paths) == expected and all(p.stat().st_size > 0 for p in paths.values())


def test_only_the_effective_length_is_planned_when_the_other_sections_are_absent() -> None:
    model = tiny_decoder("alibi")
    with torch.no_grad():
        result = analyze_windows(
            model, model.encoding, windows(2, 16), AnalysisConfig((16,), n_windows=2)
        )
    assert result.utilization is None and result.schedule is None and result.influence is None
    assert planned_figures(result) == {"effective_length": "effective_length.png"}


@pytest.mark.parametrize(
    ("beta", "label"), [(2.0, "2"), (0.5, "0.5"), ("inf", "inf"), (math.inf, "inf")]
)
def test_beta_label(beta: float | str, label: str) -> None:
    assert beta_label(beta) == label
