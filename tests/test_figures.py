"""The one figure helper: PNGs written whole (no temporary file left), the length axis with one
tick per evaluated length, method styles (AdaRoPE bold, the unmodified RoPE dashed), and the
metric-against-length figure: a point per measured length, error bars where given; and
`redraw`, which draws a figure again only when what it shows changed."""

from __future__ import annotations

import math

import pytest

from ropekit import figures


def test_save_writes_a_whole_png_and_leaves_nothing_else(tmp_path):
    fig, axes = figures.figure(3, 2)
    assert axes.shape == (1, 1)
    path = figures.save(fig, tmp_path / "a.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]


def test_styles_set_adarope_bold_and_the_baseline_dashed():
    ada, rope, other = figures.style("adarope"), figures.style("rope"), figures.style("x")
    assert ada["lw"] > other["lw"] and rope["ls"] == "--" and other["ls"] == "-"
    assert "color" not in other and ada["color"] == figures.COLORS["adarope"]


def test_lines_skip_unmeasured_lengths_and_carry_error_bars(tmp_path):
    _, axes = figures.figure(4, 3)
    ax = axes[0, 0]
    series = {"rope": {64: 10.0, 128: None, 256: 30.0}, "yarn": {64: 9.0, 128: 9.5, 256: 9.9}}
    figures.lines(ax, series, train_length=128, errors={"yarn": {64: 0.5, 128: 0.1}})
    by_label = {line.get_label(): line for line in ax.get_lines()}
    assert list(by_label["rope"].get_xdata()) == [64, 256]  # None: not measured, not drawn
    assert list(by_label["training length"].get_xdata()) == [128, 128]
    assert len(ax.containers) == 1  # yarn's error bars
    assert [float(t) for t in ax.get_xticks()] == [64.0, 128.0, 256.0]
    assert ax.get_xscale() == "log"
    path = figures.plot_vs_length(series, tmp_path / "p.png", ylabel="ppl", title="t")
    assert path.is_file()


def _counting():
    """plot_vs_length, counting its calls."""
    calls = []
    real = figures.plot_vs_length

    def plot(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    plot.__module__, plot.__qualname__ = real.__module__, real.__qualname__
    return plot, calls


SERIES = {"rope": {64: 10.0, 256: 30.0}, "yarn": {64: 9.0, 256: 9.9}}


def test_redraw_draws_a_figure_once_for_the_same_inputs_and_again_for_others(tmp_path, monkeypatch):
    """A report rewritten after every job keeps the PNGs whose inputs did not change: the
    digest of the inputs is saved in the PNG, and one bit of one value is a new figure."""
    plot, calls = _counting()
    path = tmp_path / "p.png"
    figures.redraw(plot, path, series=SERIES, ylabel="ppl", title="t")
    first = path.read_bytes()
    assert figures.drawn_from(path) is not None and len(calls) == 1
    assert figures.redraw(plot, path, series=SERIES, ylabel="ppl", title="t") == path
    assert len(calls) == 1 and path.read_bytes() == first  # not drawn again
    nudged = {**SERIES, "yarn": {64: 9.0, 256: math.nextafter(9.9, 10.0)}}
    for inputs in (
        {"series": nudged, "ylabel": "ppl", "title": "t"},  # one value, by one ulp
        {"series": SERIES, "ylabel": "ppl", "title": "T"},  # a label
        {"series": dict(reversed(SERIES.items())), "ylabel": "ppl", "title": "T"},  # the order
        {"series": {"rope": {64: 10.0, 256: math.nan}}, "ylabel": "ppl", "title": "T"},
        {"series": {"rope": {64: 10.0, 256: math.inf}}, "ylabel": "ppl", "title": "T"},
    ):
        before = len(calls)
        figures.redraw(plot, path, **inputs)
        assert len(calls) == before + 1, inputs
    assert [p.name for p in tmp_path.iterdir()] == ["p.png"]


def test_redraw_draws_over_what_it_cannot_vouch_for(tmp_path, monkeypatch):
    """A PNG saved without `redraw`, a file that is not a PNG, and one drawn by other code
    (the plotting module's source changed) are drawn again."""
    plot, calls = _counting()
    path = tmp_path / "p.png"
    figures.plot_vs_length(SERIES, path, ylabel="ppl", title="t")  # not through redraw
    assert figures.drawn_from(path) is None
    figures.redraw(plot, path, series=SERIES, ylabel="ppl", title="t")
    path.write_bytes(b"not a png")
    figures.redraw(plot, path, series=SERIES, ylabel="ppl", title="t")
    assert len(calls) == 2 and figures.drawn_from(path) is not None
    monkeypatch.setattr(figures, "_source_digest", lambda module: "other code")
    figures.redraw(plot, path, series=SERIES, ylabel="ppl", title="t")
    assert len(calls) == 3


def test_redraw_refuses_inputs_it_cannot_tell_apart(tmp_path):
    """An array's repr elides its middle: anything but plain data and dataclasses of it is
    refused before drawing, so two different figures never share a digest."""
    import numpy as np

    with pytest.raises(TypeError, match="plain data, not ndarray"):
        figures.redraw(
            figures.plot_vs_length, tmp_path / "p.png", series={"rope": np.arange(2000.0)},
            ylabel="ppl", title="t",
        )  # fmt: skip
    assert not (tmp_path / "p.png").exists()
