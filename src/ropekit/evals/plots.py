"""Pictures of the evaluation results (matplotlib, Agg canvas, written atomically).

Holds:
- `plot_perplexity`: headline metric vs length, NLL vs token position, last-quarter NLL vs
  length.
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


def plot_perplexity(result: Mapping[str, Any], path: str | Path) -> Path:
    """Three panels from an `evaluate_perplexity` result."""
    rows = result["results"]
    metric = result["metric"]
    lengths = [r["length"] for r in rows]
    fig, axes = figure(14, 4.2, 1, 3)
    ax_m, ax_p, ax_q = axes[0]

    ax_m.plot(lengths, [r[metric] for r in rows], "o-", lw=1.6)
    length_axis(ax_m, lengths, rotate=True)
    ax_m.set(xlabel="context length (tokens)", ylabel=metric.replace("_", " "))
    ax_m.set_title(f"{metric.replace('_', ' ')} vs length (same {rows[0]['tokens']} targets)")

    for r in rows:
        curve = r["position_nll"]
        if curve is None:
            continue
        middle = [(a + b - 1) / 2 + 1 for a, b in zip(curve["start"], curve["stop"], strict=True)]
        ax_p.plot(middle, curve["nll"], lw=1.3, label=f"L={r['length']}")
    ax_p.set(xscale="log", xlabel="target position in window + 1", ylabel="NLL (nats/token)")
    ax_p.set_title("NLL vs position")
    if ax_p.lines:
        ax_p.legend(fontsize=7)

    quarter = [r for r in rows if r["last_quarter_nll"] is not None]
    if quarter:
        ax_q.errorbar(
            [r["length"] for r in quarter],
            [r["last_quarter_nll"] for r in quarter],
            yerr=[r["last_quarter_nll_std"] for r in quarter],
            fmt="o-",
            capsize=3,
        )
        length_axis(ax_q, [r["length"] for r in quarter], rotate=True)
    ax_q.set(xlabel="context length (tokens)", ylabel="NLL (nats/token)")
    ax_q.set_title("last-quarter NLL per window (mean ± sd)")
    fig.suptitle(f"{result.get('spec') or ''} {result['tokenizer']}".strip(), fontsize=9)
    return save(fig, path, dpi=120)


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
