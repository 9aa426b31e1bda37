"""The one figure helper: PNGs written whole (no temporary file left), the length axis with one
tick per evaluated length, method styles (AdaRoPE bold, the unmodified RoPE dashed), and the
metric-against-length figure: a point per measured length, error bars where given."""

from __future__ import annotations

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
