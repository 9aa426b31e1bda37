"""Pictures that compare several runs (methods) side by side, drawn from their result JSON.

Holds: plot_vs_length (one line per method: a metric against context length),
plot_nll_vs_position (one line per method: NLL against token position at one length),
plot_tasks_vs_length (one panel per task, one line per method).

Figures are drawn on an explicit Agg canvas (no pyplot state) and written atomically.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ropekit.utils import atomic_write_bytes

# Fixed colours per method, so every figure of a report agrees.
_COLORS = {
    "rope": "#444444",
    "linear": "#1f77b4",
    "ntk": "#ff7f0e",
    "yarn": "#2ca02c",
    "tuned-yarn": "#9467bd",
    "adarope": "#d62728",
}


def _figure(width: float, height: float, ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=110)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def _style(label: str) -> dict[str, Any]:
    color = _COLORS.get(label)
    style: dict[str, Any] = {
        "lw": 2.2 if label == "adarope" else 1.5,
        "ls": "--" if label == "rope" else "-",  # the unmodified baseline stands apart
    }
    if color:
        style["color"] = color
    return style


def _lines(ax, series: Mapping[str, Mapping[int, float | None]], train_length: int | None) -> None:
    lengths = sorted({int(n) for s in series.values() for n in s})
    for label, by_length in series.items():
        xs = [n for n in lengths if by_length.get(n) is not None]
        ax.plot(xs, [by_length[n] for n in xs], marker="o", ms=4, label=label, **_style(label))
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(n) for n in lengths])
    ax.minorticks_off()
    if train_length is not None:
        ax.axvline(train_length, color="gray", ls=":", lw=1, label="training length")
    ax.grid(alpha=0.3)


def plot_vs_length(
    series: Mapping[str, Mapping[int, float | None]],
    path: str | Path,
    *,
    ylabel: str,
    title: str,
    train_length: int | None = None,
    ylim: tuple[float, float] | None = None,
) -> Path:
    """One line per method: ``series[method][length] = value`` (None: not measured)."""
    fig, (ax,) = _figure(6.8, 4.2)
    _lines(ax, series, train_length)
    ax.set(xlabel="evaluation length (tokens)", ylabel=ylabel, title=title)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_nll_vs_position(
    curves: Mapping[str, Mapping[str, Sequence[float]]],
    path: str | Path,
    *,
    length: int,
    train_length: int | None = None,
) -> Path:
    """One line per method: binned NLL against position (``position_nll`` of a ppl result)."""
    fig, (ax,) = _figure(6.8, 4.2)
    for label, curve in curves.items():
        middle = [(a + b - 1) / 2 + 1 for a, b in zip(curve["start"], curve["stop"], strict=True)]
        ax.plot(middle, curve["nll"], label=label, **_style(label))
    if train_length is not None:
        ax.axvline(train_length, color="gray", ls=":", lw=1, label="training length")
    ax.set(
        xscale="log",
        xlabel="token position in the window + 1",
        ylabel="NLL (nats/token)",
        title=f"NLL vs position in windows of {length} tokens",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_tasks_vs_length(
    tasks: Mapping[str, Mapping[str, Mapping[int, float | None]]],
    path: str | Path,
    *,
    train_length: int | None = None,
) -> Path:
    """One panel per task, one line per method: ``tasks[task][method][length] = accuracy``."""
    fig, axes = _figure(5.2 * len(tasks), 4.0, len(tasks))
    for ax, (task, series) in zip(axes, tasks.items(), strict=True):
        _lines(ax, series, train_length)
        ax.set(xlabel="evaluation length (tokens)", ylabel="accuracy", title=task)
        ax.set_ylim(-0.03, 1.03)
        ax.legend(fontsize=7)
    return _save(fig, path)
