"""The figures that compare methods side by side: what each draws, read back from the axes
before the PNG is written."""

from __future__ import annotations

import math

import pytest

from ropekit.evals.perplexity import PositionCurve
from ropekit.report import plots


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plots hand to ``save`` (still written, so the PNG path is real)."""
    figs = []
    save = plots.save

    def keep(fig, path):
        figs.append(fig)
        return save(fig, path)

    monkeypatch.setattr(plots, "save", keep)
    return figs


def test_nll_vs_position_draws_each_bin_at_its_middle_position(tmp_path, drawn):
    curves = {
        "rope": PositionCurve(start=(0, 2, 6), stop=(2, 6, 14), nll=(4.0, 3.0, 2.5)),
        "yarn": PositionCurve(start=(0, 2, 6), stop=(2, 6, 14), nll=(4.1, 3.1, 2.4)),
    }
    path = plots.plot_nll_vs_position(
        curves, tmp_path / "nll.png", length=14, train_length=8, ylim=(2.0, None), title="x: "
    )
    assert path.read_bytes()[:4] == b"\x89PNG"
    ax = drawn[0].axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    # bin [a, b) holds positions a..b-1; drawn at their middle, + 1 for the log axis
    assert list(lines["rope"].get_xdata()) == [1.5, 4.5, 10.5]
    assert list(lines["yarn"].get_ydata()) == [4.1, 3.1, 2.4]
    assert list(lines["training length"].get_xdata()) == [8, 8]
    assert ax.get_xscale() == "log" and ax.get_ylim()[0] == 2.0
    assert ax.get_title() == "x: NLL vs position in windows of 14 tokens"


def test_nll_vs_position_without_a_training_length_draws_no_marker(tmp_path, drawn):
    curve = PositionCurve(start=(0,), stop=(4,), nll=(1.0,))
    plots.plot_nll_vs_position({"rope": curve}, tmp_path / "nll.png", length=4)
    assert [line.get_label() for line in drawn[0].axes[0].get_lines()] == ["rope"]


def test_tasks_vs_length_draws_a_panel_per_task_and_skips_what_did_not_fit(tmp_path, drawn):
    tasks = {
        "passkey": {"rope": {64: 1.0, 128: 0.5}, "yarn": {64: 1.0, 128: 1.0}},
        "niah": {"rope": {64: 0.8, 128: None}, "yarn": {64: 0.9, 128: 0.7}},
    }
    plots.plot_tasks_vs_length(tasks, tmp_path / "tasks.png", train_length=64)
    axes = drawn[0].axes
    assert [ax.get_title() for ax in axes] == ["passkey", "niah"]
    niah = {line.get_label(): line for line in axes[1].get_lines()}
    assert list(niah["rope"].get_xdata()) == [64]  # 128 did not fit: not drawn as 0
    assert list(niah["yarn"].get_ydata()) == [0.9, 0.7]
    low, high = axes[0].get_ylim()
    assert low < 0 and 1 < high < 1.1 and not math.isnan(low)
