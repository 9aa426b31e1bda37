"""The evaluation figures, read back from the figure they draw: the needle heatmap puts depth
0 at the top and each cell at its (depth, length), empty cells blank; the accuracy figure has
one line per task, the average in bold and the threshold dashed; both are written as PNGs."""

from __future__ import annotations

import numpy as np
import pytest

from ropekit.evals import plots


@pytest.fixture
def drawn(monkeypatch):
    """The figures plots would save, kept in memory after the real save ran."""
    kept = []

    def save(fig, path, dpi=110):
        kept.append(fig)
        return real(fig, path, dpi)

    real = plots.save
    monkeypatch.setattr(plots, "save", save)
    return kept


def test_the_heatmap_puts_each_cell_at_its_depth_and_length(drawn, tmp_path):
    cells = [
        {"length": 256, "depth": 0.5, "score": 0.25},
        {"length": 64, "depth": 0.0, "score": 1.0},
        {"length": 256, "depth": 0.0, "score": 0.75},
    ]
    path = plots.plot_heatmap(cells, tmp_path / "heat.png", title="needles")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = drawn[0].axes[0]
    grid = np.ma.filled(ax.images[0].get_array(), np.nan)  # (depths, lengths)
    np.testing.assert_array_equal(grid, [[1.0, 0.75], [np.nan, 0.25]])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0%", "50%"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "256"]
    assert sorted(t.get_text() for t in ax.texts) == ["0.25", "0.75", "1.00"]  # none for NaN


def test_the_accuracy_figure_draws_tasks_the_average_in_bold_and_the_threshold(drawn, tmp_path):
    scores = {"niah": {64: 1.0, 128: 0.5}, "vt": {64: 0.8, 128: 0.2}}
    plots.plot_accuracy_vs_length(
        scores, tmp_path / "acc.png", threshold=0.6, average={64: 0.9, 128: 0.35}
    )
    ax = drawn[0].axes[0]
    by_label = {line.get_label(): line for line in ax.get_lines()}
    assert set(by_label) == {"niah", "vt", "average", "threshold 0.6"}
    assert list(by_label["niah"].get_ydata()) == [1.0, 0.5]
    assert by_label["average"].get_linewidth() > by_label["niah"].get_linewidth()
    assert by_label["threshold 0.6"].get_linestyle() == "--"
    assert (tmp_path / "acc.png").is_file()
