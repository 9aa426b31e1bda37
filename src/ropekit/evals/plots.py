"""Pictures of the evaluation results (matplotlib, Agg canvas, written atomically).

Holds:
- `plot_heatmap`: needle accuracy over length (columns) x depth (rows).
- `plot_accuracy_vs_length`: one line per task, the task average in bold, the effective-length
  threshold dashed.

Figures are drawn on an explicit Agg canvas, never through pyplot's global state, so plotting
works in threads and on machines without a display.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ropekit.figures import figure, length_axis, save


def plot_heatmap(cells: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """cells: rows with "length", "depth", "score" (0..1). Depth 0 (start) at the top."""
    import numpy as np

    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for c in cells:
        grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["score"]
    fig, axes = figure(1.6 + 0.7 * len(lengths), 1.4 + 0.4 * len(depths))
    ax = axes[0, 0]
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([str(n) for n in lengths], rotation=45, fontsize=7)
    ax.set_yticks(range(len(depths)))
    ax.set_yticklabels([f"{d:.0%}" for d in depths], fontsize=7)
    ax.set(xlabel="context length (tokens)", ylabel="needle depth")
    for (i, j), value in np.ndenumerate(grid):
        if not np.isnan(value):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6)
    fig.colorbar(image, ax=ax, label="accuracy")
    ax.set_title(title, fontsize=9)
    return save(fig, path, dpi=120)


def plot_accuracy_vs_length(
    scores: Mapping[str, Mapping[int, float]],
    path: str | Path,
    threshold: float | None = None,
    average: Mapping[int, float] | None = None,
    title: str = "",
) -> Path:
    """One line per task (length -> score), the average in bold, the threshold dashed."""
    fig, axes = figure(7, 4.2)
    ax = axes[0, 0]
    lengths = sorted({n for task in scores.values() for n in task})
    for task, by_length in scores.items():
        xs = sorted(by_length)
        ax.plot(xs, [by_length[n] for n in xs], "o-", lw=1.1, ms=3, label=task)
    if average:
        xs = sorted(average)
        ax.plot(xs, [average[n] for n in xs], "k-", lw=2.6, label="average")
    if threshold is not None:
        ax.axhline(threshold, color="gray", ls="--", lw=1, label=f"threshold {threshold:g}")
    if lengths:
        length_axis(ax, lengths, rotate=True)
    ax.set(xlabel="context length (tokens)", ylabel="score", ylim=(-0.03, 1.03))
    ax.legend(fontsize=6, ncol=2)
    ax.set_title(title, fontsize=9)
    return save(fig, path, dpi=120)
