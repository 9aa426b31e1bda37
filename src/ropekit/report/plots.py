"""Pictures that compare several runs (methods) side by side, drawn from their result JSON.

Holds: plot_nll_vs_position (one line per method: NLL against token position at one length),
plot_tasks_vs_length (one panel per task, one line per method).

Figures are drawn on an explicit Agg canvas (no pyplot state) and written atomically.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ropekit.figures import figure, lines, save, style

if TYPE_CHECKING:
    from ropekit.evals.perplexity import PositionCurve


def plot_nll_vs_position(
    curves: Mapping[str, PositionCurve],
    path: str | Path,
    *,
    length: int,
    train_length: int | None = None,
    xlim: tuple[float | None, float | None] | None = None,
    ylim: tuple[float | None, float | None] | None = None,
    title: str = "",
) -> Path:
    """One line per method: binned NLL against position (``position_nll`` of a ppl result);
    ``title`` goes before the default one."""
    fig, axes = figure(6.8, 4.2)
    ax = axes[0, 0]
    for label, curve in curves.items():
        middle = [(a + b - 1) / 2 + 1 for a, b in zip(curve.start, curve.stop, strict=True)]
        ax.plot(middle, curve.nll, label=label, **style(label))
    if train_length is not None:
        ax.axvline(train_length, color="gray", ls=":", lw=1, label="training length")
    ax.set(
        xscale="log",
        xlabel="token position in the window + 1",
        ylabel="NLL (nats/token)",
        title=f"{title}NLL vs position in windows of {length} tokens",
    )
    if xlim is not None:
        ax.set_xlim(*xlim)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def plot_tasks_vs_length(
    tasks: Mapping[str, Mapping[str, Mapping[int, float | None]]],
    path: str | Path,
    *,
    train_length: int | None = None,
) -> Path:
    """One panel per task, one line per method: ``tasks[task][method][length] = accuracy``."""
    fig, axes = figure(5.2 * len(tasks), 4.0, 1, len(tasks))
    for ax, (task, series) in zip(axes[0], tasks.items(), strict=True):
        lines(ax, series, train_length)
        ax.set(xlabel="evaluation length (tokens)", ylabel="accuracy", title=task)
        ax.set_ylim(-0.03, 1.03)
        ax.legend(fontsize=7)
    return save(fig, path)
