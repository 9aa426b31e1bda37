"""Pictures of an analysis result (matplotlib on an explicit Agg canvas, written atomically).

Each figure is drawn from the result of ``analyze`` alone (an ``AnalysisResult``, or the
``Sections`` of ``analyze_windows``), so a saved ``analysis.json`` can be re-plotted from its
record (``read_record``). Figures whose section is absent (a non-rotary encoding, no
learned schedule, no influence run) are not drawn; ``planned_figures`` says which will be.
Only the layers the encoding rotates are analysed, each labelled by its index in the model and
its type (``record.AnalysedLayer``).

- ``effective_length.png``: E_beta (window mean) against context length, one line per head, one
  panel per layer, log-log, with uniform causal attention ((L + 1) / 2) dashed (paper,
  Figure 2 left, Figure 7).
- ``utilization.png``: each head's share of |logit contribution| per rotary pair (rows = layer x
  head), and the CoV across pairs per layer as box plots (paper, Figure 2 right, Figure 3 left).
- ``distance_profile.png``: signed contribution per pair against relative distance for a few
  heads (paper, Figure 1).
- ``effective_base.png``: effective base per layer (geometric mean line) and per kv head
  (points) (paper, Figure 3 middle).
- ``dxi.png``: learned minus initial log-frequency, rows = layer x kv head (paper, Figure 4
  right).
- ``adascale.png``: histograms of AdaScale gamma and tau (paper, Figure 6 middle, Figure 11).
- ``influence.png``: histograms of head influence for AdaFreq and AdaScale (paper, Figures
  10-11 left).

Holds: FIGURES, planned_figures, write_figures, beta_label and one ``plot_*`` function per
figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ropekit.figures import figure, save

from .record import AnalysisResult, Sections

Drawn = AnalysisResult | Sections  # what a figure is drawn from: both hold every section


def _array(values: Any) -> np.ndarray:
    """A record's nested tuples (NaN for non-finite) -> float array."""
    return np.array(values, dtype=float)


def beta_label(beta: float | str) -> str:
    """A beta as JSON holds it (a number, or "inf") -> "2", "0.5", "inf"."""
    value = float(beta)
    return "inf" if math.isinf(value) else f"{value:g}"


def plot_effective_length(result: Drawn, path: Path) -> Path:
    section = result.effective_length
    betas, lengths = section.betas, section.lengths
    b = section.primary_beta_index
    values = _array(section.window_mean)[b]  # (n_L, L, H)
    n_layers, n_heads = values.shape[1], values.shape[2]
    ncols = min(4, n_layers)
    nrows = math.ceil(n_layers / ncols)
    fig, axes = figure(3.4 * ncols, 2.9 * nrows, nrows, ncols, constrained=True)
    colors = _colors(n_heads)
    for layer in range(nrows * ncols):
        ax = axes[layer // ncols][layer % ncols]
        if layer >= n_layers:
            ax.set_axis_off()
            continue
        for h in range(n_heads):
            ax.plot(
                lengths,
                values[:, layer, h],
                "o-",
                ms=2.5,
                lw=1.1,
                color=colors[h],
                label=f"head {h}",
            )
        ax.plot(lengths, [(n + 1) / 2 for n in lengths], "k--", lw=0.8, label="uniform")
        _length_axis(ax, lengths)
        ax.set_yscale("log")
        _log_numbers(ax.yaxis)
        ax.set_title(f"layer {result.layers[layer].index} ({result.layers[layer].kind})")
        if layer % ncols == 0:
            ax.set_ylabel(f"E_{beta_label(betas[b])} (keys)")
        if layer // ncols == nrows - 1:
            ax.set_xlabel("context length (tokens)")
    if n_heads <= 12:
        axes[0][0].legend(fontsize=6, ncol=2)
    fig.suptitle(
        f"effective attention length per head (mean over a window's queries)\n{result.spec}",
        fontsize=10,
    )
    return save(fig, path)


def _length_axis(ax, lengths: tuple[int, ...]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(lengths), [str(n) for n in lengths], rotation=45, fontsize=7)
    ax.minorticks_off()


def _log_numbers(axis) -> None:
    """Log-axis ticks at 1, 2, 5 x 10^n written as plain numbers."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FormatStrFormatter("%g"))
    axis.set_minor_formatter(NullFormatter())
    axis.set_tick_params(labelsize=7)


def _pair_ticks(ax, n_pairs: int, axis: str = "x") -> None:
    """Integer ticks for the rotary pairs (at most ~16 of them)."""
    step = max(1, math.ceil(n_pairs / 16))
    ticks = list(range(0, n_pairs, step))
    (ax.set_xticks if axis == "x" else ax.set_yticks)(ticks, [str(t) for t in ticks], fontsize=7)


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["viridis" if n > 10 else "tab10"]
    return [cmap(i / max(n - 1, 1)) if n > 10 else cmap(i) for i in range(n)]


def plot_utilization(result: Drawn, path: Path) -> Path:
    section = _present(result.utilization)
    u = _array(section.mean_abs)  # (L, H, F)
    n_layers, n_heads, n_pairs = u.shape
    share = u / u.sum(-1, keepdims=True)  # each head's distribution over pairs
    fig, axes = figure(
        12, min(14.0, max(3.5, 0.12 * n_layers * n_heads + 1.5)), 1, 2, constrained=True
    )
    ax_map, ax_box = axes[0]
    image = ax_map.imshow(
        share.reshape(n_layers * n_heads, n_pairs),
        aspect="auto",
        cmap="magma",
        interpolation="nearest",
    )
    ax_map.set(
        xlabel="rotary pair f (fast → slow)",
        ylabel="layer · head",
        title="share of |logit contribution| per pair",
    )
    _pair_ticks(ax_map, n_pairs)
    every = max(1, math.ceil(n_layers / 32))  # at most ~32 layer labels
    ticks = [layer * n_heads for layer in range(0, n_layers, every)]
    labels = [result.layers[layer].label for layer in range(0, n_layers, every)]
    ax_map.set_yticks(ticks, labels, fontsize=7)
    fig.colorbar(image, ax=ax_map, fraction=0.04)
    cov = _array(section.cov)  # (L, H)
    ax_box.boxplot([row[np.isfinite(row)] for row in cov], showmeans=True)
    every = max(1, math.ceil(n_layers / 16))
    ax_box.set_xticks(
        range(1, n_layers + 1, every),
        [result.layers[layer].label for layer in range(0, n_layers, every)],
        rotation=45,
        fontsize=7,
    )
    ax_box.axhline(math.sqrt(n_pairs - 1), color="gray", ls=":", lw=1, label="one pair only")
    ax_box.set(
        xlabel="layer",
        ylabel="CoV across pairs",
        title="utilization coefficient of variation per head",
    )
    ax_box.legend(fontsize=7)
    fig.suptitle(f"frequency utilization at length {section.length}\n{result.spec}", fontsize=10)
    return save(fig, path)


def plot_distance_profile(result: Drawn, path: Path) -> Path:
    section = _present(result.utilization).distance_profile
    heads, distances = section.heads, section.distances
    kinds = {layer.index: layer.kind for layer in result.layers}
    fig, axes = figure(4.6 * len(heads), 3.8, 1, len(heads), constrained=True)
    for ax, head in zip(axes[0], heads, strict=True):
        c = _array(head.contribution)  # (F, R)
        vmax = float(np.nanmax(np.abs(c))) or 1.0
        image = ax.imshow(
            c,
            aspect="auto",
            cmap="RdBu_r",
            vmin=-vmax,
            vmax=vmax,
            interpolation="nearest",
            extent=(distances[0] - 0.5, distances[-1] + 0.5, c.shape[0] - 0.5, -0.5),
        )
        ax.set(
            xlabel="relative distance Δ (tokens)",
            ylabel="rotary pair f",
            title=f"layer {head.layer} ({kinds[head.layer]}) head {head.head}: {head.why}",
        )
        ax.title.set_fontsize(8)
        _pair_ticks(ax, c.shape[0], axis="y")
        fig.colorbar(image, ax=ax, fraction=0.05)
    fig.suptitle(f"mean logit contribution q_f·k_f / √D by distance\n{result.spec}", fontsize=10)
    return save(fig, path)


def plot_effective_base(result: Drawn, path: Path) -> Path:
    schedule = _present(result.schedule)
    section = schedule.effective_base
    per_head, per_layer = _array(section.per_head), _array(section.per_layer)  # (L, K), (L,)
    layers = np.arange(len(per_layer))  # positions; labelled with the layers' index and type
    fig, axes = figure(6, 4, constrained=True)
    ax = axes[0][0]
    for k in range(per_head.shape[1]):
        ax.scatter(
            layers,
            per_head[:, k],
            s=12,
            alpha=0.6,
            color="tab:blue",
            label="kv heads" if k == 0 else None,
        )
    ax.plot(layers, per_layer, "o-", color="tab:red", lw=1.6, label="layer (geometric mean)")
    initial = schedule.initial_base
    if initial:
        ax.axhline(initial, color="gray", ls="--", lw=1, label="initial schedule")
    values = np.concatenate([per_head.ravel(), [initial or np.nan]])
    values = values[np.isfinite(values) & (values > 0)]
    if values.size:  # a fixed schedule is one value: widen so the log axis is not singular
        ax.set_ylim(values.min() / 2, values.max() * 2)
    ax.set_yscale("log")
    ax.set(xlabel="layer", ylabel="effective base Θ", title=f"effective RoPE base, {result.spec}")
    ax.set_xticks(layers, [layer.label for layer in result.layers], rotation=45, fontsize=7)
    ax.legend(fontsize=7)
    return save(fig, path)


def plot_dxi(result: Drawn, path: Path) -> Path:
    learned = _present(_present(result.schedule).learned)
    dxi = _array(learned.dxi)  # (L|1, K|1, F)
    rows = dxi.reshape(-1, dxi.shape[-1])
    fig, axes = figure(8, min(14.0, max(3.0, 0.16 * rows.shape[0] + 1.5)), constrained=True)
    ax = axes[0][0]
    vmax = float(np.nanmax(np.abs(rows))) or 1.0
    image = ax.imshow(
        rows, aspect="auto", cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest"
    )
    if dxi.shape[0] > 1 or dxi.shape[1] > 1:
        layers = range(0, dxi.shape[0], max(1, math.ceil(dxi.shape[0] / 32)))
        ax.set_yticks([i * dxi.shape[1] for i in layers], [f"L{i}" for i in layers], fontsize=7)
    ax.set(
        xlabel="rotary pair f (fast → slow)",
        ylabel="layer · kv head",
        title=f"learned − initial log-frequency Δξ ({learned.kind}), {result.spec}",
    )
    ax.title.set_fontsize(9)
    _pair_ticks(ax, rows.shape[1])
    fig.colorbar(image, ax=ax, fraction=0.04)
    return save(fig, path)


def plot_adascale(result: Drawn, path: Path) -> Path:
    learned = _present(_present(result.schedule).learned)
    fig, axes = figure(9, 3.6, 1, 2, constrained=True)
    for ax, name, symbol, rows in (
        (axes[0][0], "gamma", "γ", learned.gamma),
        (axes[0][1], "tau", "τ", learned.tau),
    ):
        values = _array(rows).ravel()
        ax.hist(values, bins=min(30, max(5, values.size // 2)), color="tab:blue", alpha=0.8)
        ax.axvline(0.0 if name == "gamma" else 1.0, color="gray", ls="--", lw=1, label="init")
        ax.set(xlabel=symbol, ylabel="heads", title=f"AdaScale {symbol} per head")
        ax.legend(fontsize=7)
    fig.suptitle(result.spec)
    return save(fig, path)


def plot_influence(result: Drawn, path: Path) -> Path:
    section = _present(result.influence)
    kinds = section.kinds()
    fig, axes = figure(4.8 * len(kinds), 3.6, 1, len(kinds), constrained=True)
    names = {"freq": "AdaFreq (revert one kv head's Δξ)", "scale": "AdaScale (revert γ, τ)"}
    for ax, (kind, measured) in zip(axes[0], kinds.items(), strict=True):
        deltas = np.array([u.delta_nll for u in measured.units], dtype=float)
        ax.hist(deltas, bins=min(30, max(5, deltas.size // 2)), color="tab:orange", alpha=0.85)
        ax.axvline(0, color="gray", ls="--", lw=1)
        ax.set(xlabel="Δ NLL (nats/token)", ylabel="heads", title=names[kind])
        ax.title.set_fontsize(9)
    fig.suptitle(
        f"head influence at length {section.target_length} "
        f"({section.windows} windows), {result.spec}"
    )
    return save(fig, path)


def _present(section: Any) -> Any:
    """A section a figure needs (``FIGURES`` draws a figure only when it is there)."""
    if section is None:
        raise ValueError("this result does not hold the section the figure draws")
    return section


def _has_dxi(result: Drawn) -> bool:
    learned = None if result.schedule is None else result.schedule.learned
    return learned is not None and learned.dxi is not None


def _has_adascale(result: Drawn) -> bool:
    learned = None if result.schedule is None else result.schedule.learned
    return learned is not None and learned.gamma is not None


# name -> (file, is drawable for this result, plot function)
FIGURES: dict[str, tuple[str, Callable[[Drawn], bool], Callable[[Drawn, Path], Path]]] = {
    "effective_length": ("effective_length.png", lambda r: True, plot_effective_length),
    "utilization": ("utilization.png", lambda r: r.utilization is not None, plot_utilization),
    "distance_profile": (
        "distance_profile.png",
        lambda r: r.utilization is not None and bool(r.utilization.distance_profile.heads),
        plot_distance_profile,
    ),
    "effective_base": (
        "effective_base.png",
        lambda r: r.schedule is not None,
        plot_effective_base,
    ),
    "dxi": ("dxi.png", _has_dxi, plot_dxi),
    "adascale": ("adascale.png", _has_adascale, plot_adascale),
    "influence": (
        "influence.png",
        lambda r: r.influence is not None and bool(r.influence.kinds()),
        plot_influence,
    ),
}


def planned_figures(result: Drawn) -> dict[str, str]:
    """Figure name -> file name for every figure this result can draw."""
    return {name: file for name, (file, drawable, _) in FIGURES.items() if drawable(result)}


def write_figures(result: Drawn, out_dir: str | Path) -> dict[str, Path]:
    """Draw every planned figure into ``out_dir``; returns name -> path."""
    out = Path(out_dir)
    paths = {}
    for name, file in planned_figures(result).items():
        paths[name] = FIGURES[name][2](result, out / file)
    return paths
