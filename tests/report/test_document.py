"""Rendering report blocks: Markdown links figures, HTML embeds them and escapes text."""

from __future__ import annotations

import base64

from ropekit.report.document import Details, Figure, Heading, Table, Text, to_html, to_markdown

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16  # the signature is all the renderers look at


def test_markdown_tables_escape_pipes_and_link_figures():
    blocks = [
        Heading("Title", 1),
        Text("uses `yarn:factor=8`"),
        Table(["a", "b|c"], [["1", "x|y"]], "caption"),
        Figure("sub/plot.png", "a plot"),
    ]
    md = to_markdown(blocks)
    assert md.startswith("# Title\n")
    assert "| a | b\\|c |" in md and "| 1 | x\\|y |" in md
    assert "|---|---|" in md
    assert "![a plot](sub/plot.png)" in md
    assert md.endswith("\n") and not md.endswith("\n\n")


def test_html_embeds_images_as_base64_and_is_self_contained(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "plot.png").write_bytes(PNG)
    page = to_html([Figure("sub/plot.png", "a plot")], tmp_path, "t")
    encoded = base64.b64encode(PNG).decode()
    assert f'src="data:image/png;base64,{encoded}"' in page
    assert "sub/plot.png" in page  # kept as alt text
    assert 'src="sub' not in page and "http" not in page


def test_html_escapes_text_but_keeps_code_spans(tmp_path):
    page = to_html(
        [Text("a <script>x</script> and `rope:base=<b>`"), Table(["<h>"], [["&"]])],
        tmp_path,
        "<title>",
    )
    assert "<script>" not in page
    assert "&lt;script&gt;" in page
    assert "<code>rope:base=&lt;b&gt;</code>" in page
    assert "<th>&lt;h&gt;</th>" in page and "<td>&amp;</td>" in page
    assert "<title>&lt;title&gt;</title>" in page


def test_missing_figure_is_reported_not_fatal(tmp_path):
    page = to_html([Figure("gone.png")], tmp_path, "t")
    assert "missing figure gone.png" in page


def test_details_collapse_their_blocks_in_both_formats(tmp_path):
    (tmp_path / "p.png").write_bytes(PNG)
    blocks = [Details("figures of run", [Figure("p.png", "p")])]
    md = to_markdown(blocks)
    assert "<details><summary>figures of run</summary>" in md and "![p](p.png)" in md
    page = to_html(blocks, tmp_path, "t")
    assert "<details><summary>figures of run</summary>" in page
    assert "data:image/png;base64," in page
