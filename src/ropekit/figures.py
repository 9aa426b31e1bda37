"""The one figure helper: canvases, atomic PNG writes, the length axis, method styles, and the
figure every comparison draws (a metric against context length, one line per method, with
error bars when there are seeds).

Used by evals, analysis, report and the experiments, so every figure of a run agrees in look
and every PNG is written the same way (temp file, fsync, rename). Figures are drawn on an
explicit Agg canvas, never through pyplot's global state, so plotting works in threads and on
machines without a display.

A report rewritten after every job (``ropekit compare``) draws its figures through `redraw`,
which skips a figure whose PNG already shows the same inputs drawn by the same code: drawing
is most of a small comparison's report time (0.3-0.8 s a figure, a dozen figures a rewrite).

Holds: COLORS, figure, save, redraw, length_axis, style, lines, plot_vs_length.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import io
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ropekit.utils import atomic_write_bytes

# Fixed colours per method, so every figure of a report agrees.
COLORS = {
    "rope": "#444444",
    "linear": "#1f77b4",
    "ntk": "#ff7f0e",
    "yarn": "#2ca02c",
    "tuned-yarn": "#9467bd",
    "adarope": "#d62728",
}

Series = Mapping[str, Mapping[int, float | None]]  # label -> length -> value (None: missing)


def figure(
    width: float, height: float, nrows: int = 1, ncols: int = 1, *, constrained: bool = False
) -> tuple[Any, Any]:
    """A figure on its own Agg canvas and its axes as a (nrows, ncols) array.

    ``constrained`` lays the panels out with room for a suptitle (otherwise ``save`` tightens
    the layout)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained" if constrained else None)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


# The PNG text chunk that holds the digest of what a figure was drawn from (`redraw`).
INPUTS_KEY = "ropekit-inputs"
# The digest `redraw` is drawing for, which `save` writes into the PNG (unset: none written).
_DRAWING: contextvars.ContextVar[str | None] = contextvars.ContextVar("drawing", default=None)


def save(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG at ``path`` atomically; returns the path."""
    path = Path(path)
    buffer = io.BytesIO()
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    digest = _DRAWING.get()
    fig.savefig(buffer, format="png", dpi=dpi, metadata={INPUTS_KEY: digest} if digest else None)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def redraw(plot: Callable[..., Path], path: str | Path, /, **inputs: Any) -> Path:
    """``plot(path=path, **inputs)``, unless the PNG at ``path`` is already what that call
    draws: the digest of the plotting function, its code, matplotlib's version and every
    input (`_canonical`) is saved in the PNG and compared before drawing. Only plain data can
    be an input (a figure drawn from anything else could not be told apart): other types are
    refused with TypeError. Returns the path."""
    path = Path(path)
    digest = _digest(plot, inputs)
    if drawn_from(path) == digest:
        return path
    token = _DRAWING.set(digest)
    try:
        return plot(path=path, **inputs)
    finally:
        _DRAWING.reset(token)


def drawn_from(path: str | Path) -> str | None:
    """The inputs' digest `redraw` saved in the PNG at ``path`` (None: no such file, not a PNG,
    or drawn without `redraw`)."""
    from PIL import Image

    try:  # PIL's "not an image" is an OSError; a damaged chunk can raise the other two
        with Image.open(path) as image:
            return image.info.get(INPUTS_KEY)
    except (OSError, SyntaxError, ValueError):
        return None


def _digest(plot: Callable[..., Path], inputs: Mapping[str, Any]) -> str:
    """Not `results.digest`: that one writes NaN and infinity as null and anything else as its
    str, so it would give two different figures one digest (`_canonical` refuses instead)."""
    import matplotlib

    what = {
        "plot": f"{plot.__module__}.{plot.__qualname__}",
        "code": [_source_digest(__name__), _source_digest(plot.__module__)],
        "matplotlib": matplotlib.__version__,
        "inputs": _canonical(dict(inputs)),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


@functools.cache
def _source_digest(module: str) -> str:
    """The digest of a module's source file: a figure drawn by other code is drawn again."""
    return hashlib.sha256(Path(sys.modules[module].__file__ or "").read_bytes()).hexdigest()


def _canonical(value: Any) -> Any:
    """``value`` as JSON that tells apart every two inputs a figure could differ by: floats by
    their exact repr, mappings as ordered pairs (a line's order is the legend's), dataclasses
    by type and fields."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value  # json writes a float as its repr (NaN and Infinity included)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return [[_canonical(k), _canonical(v)] for k, v in value.items()]
    if isinstance(value, (tuple, list)):
        return [_canonical(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {type(value).__qualname__: fields}
    raise TypeError(f"a figure's input must be plain data, not {type(value).__name__}")


def length_axis(ax: Any, lengths: Sequence[int], *, rotate: bool = False) -> None:
    """A log2 x axis with one labelled tick per evaluated length."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(lengths))
    ax.set_xticklabels([str(n) for n in lengths], rotation=45 if rotate else 0, fontsize=7)
    ax.minorticks_off()


def style(label: str) -> dict[str, Any]:
    """Line style of a method: its fixed colour; AdaRoPE bold, the unmodified RoPE dashed."""
    color = COLORS.get(label)
    kwargs: dict[str, Any] = {
        "lw": 2.2 if label == "adarope" else 1.5,
        "ls": "--" if label == "rope" else "-",  # the unmodified baseline stands apart
    }
    if color:
        kwargs["color"] = color
    return kwargs


def lines(
    ax: Any,
    series: Series,
    train_length: int | None = None,
    errors: Series | None = None,
    styles: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """One line per label on ``ax``, with ``errors`` (same keys) as error bars."""
    lengths = sorted({int(n) for s in series.values() for n in s})
    for label, by_length in series.items():
        xs = [n for n in lengths if by_length.get(n) is not None]
        ys = [by_length[n] for n in xs]
        kwargs = {**style(label), **((styles or {}).get(label) or {})}
        err = (errors or {}).get(label)
        if err is not None:
            yerr = [err.get(n) or 0.0 for n in xs]
            ax.errorbar(xs, ys, yerr=yerr, marker="o", ms=4, capsize=3, label=label, **kwargs)
        else:
            ax.plot(xs, ys, marker="o", ms=4, label=label, **kwargs)
    length_axis(ax, lengths)
    if train_length is not None:
        ax.axvline(train_length, color="gray", ls=":", lw=1, label="training length")
    ax.grid(alpha=0.3)


def plot_vs_length(
    series: Series,
    path: str | Path,
    *,
    ylabel: str,
    title: str,
    errors: Series | None = None,
    train_length: int | None = None,
    ylim: tuple[float | None, float | None] | None = None,
    xlabel: str = "evaluation length (tokens)",
    styles: Mapping[str, Mapping[str, Any]] | None = None,
    size: tuple[float, float] = (6.8, 4.2),
) -> Path:
    """One line per method, ``series[method][length] = value`` (None: not measured), with
    ``errors[method][length]`` (e.g. the std over seeds) as error bars where given."""
    fig, axes = figure(*size)
    ax = axes[0, 0]
    lines(ax, series, train_length, errors, styles)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.legend(fontsize=7, ncol=2 if len(series) > 6 else 1)
    return save(fig, path)
