"""Rendering report blocks: Markdown links figures, HTML embeds them and escapes text; only
regular files inside the run folder are linked or embedded, the rest named as skipped."""

from __future__ import annotations

import base64
import io
import os
import re
from pathlib import Path

import pytest

from ropekit.report.document import (
    Details,
    Figure,
    Heading,
    Table,
    Text,
    figure_problem,
    to_html,
    to_markdown,
)

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


# ----------------------------------------------------------------------------- what is embedded
SECRET = b"\x89PNG\r\n\x1a\n" + b"not the run's: " + b"\x01" * 16


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run folder with one good figure and every kind that must not be read; yields the
    folder and the list of paths the renderers opened."""
    root, outside = tmp_path / "run", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.png").write_bytes(SECRET)
    (root / "good.png").write_bytes(PNG)
    (root / "linked.png").symlink_to(outside / "secret.png")
    (root / "inside-link.png").symlink_to(root / "good.png")  # a link, even to a good file
    (root / "linked-dir").symlink_to(outside, target_is_directory=True)
    os.mkfifo(root / "pipe.png")  # reading it would hang the report
    opened = []
    real_os_open, real_io_open = os.open, io.open

    def os_open(path, *args, **kwargs):
        opened.append(Path(path))
        return real_os_open(path, *args, **kwargs)

    def io_open(path, *args, **kwargs):
        if not isinstance(path, int):  # os.fdopen passes the descriptor os.open returned
            opened.append(Path(path))
        return real_io_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(io, "open", io_open)
    return root, outside, opened


UNSAFE = {
    "linked.png": "linked.png is a symbolic link",
    "inside-link.png": "inside-link.png is a symbolic link",
    "linked-dir/secret.png": "linked-dir is a symbolic link",
    "../outside/secret.png": r"it leaves the run folder \(\.\.\)",
    "sub/../../outside/secret.png": r"it leaves the run folder \(\.\.\)",
    "pipe.png": "it is not a regular file",
}


def test_only_regular_files_inside_the_run_folder_are_embedded(run):
    root, outside, opened = run
    absolute = str(outside / "secret.png")
    figures = [Figure("good.png", "good"), *(Figure(p) for p in UNSAFE), Figure(absolute)]
    page = to_html(figures, root, "t")
    md = to_markdown(figures, root)
    assert base64.b64encode(PNG).decode() in page  # the good one is embedded
    assert "![good](good.png)" in md
    for path, reason in {**UNSAFE, absolute: "it is an absolute path"}.items():
        line = rf"skipped figure {re.escape(path)}: {reason}; only regular files inside"
        assert re.search(line, page), path
        assert re.search(line, md), path
        assert f"]({path})" not in md  # not linked either
    assert base64.b64encode(SECRET).decode()[:40] not in page
    assert {p.name for p in opened} <= {"good.png"}  # nothing else was even opened


def test_a_run_folder_that_is_itself_a_link_still_embeds_its_files(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "p.png").write_bytes(PNG)
    (tmp_path / "latest").symlink_to(tmp_path / "real", target_is_directory=True)
    assert base64.b64encode(PNG).decode() in to_html([Figure("p.png")], tmp_path / "latest", "t")


def test_figure_problem_names_each_case(run):
    root, _, _ = run
    assert figure_problem(root, "good.png") is None
    assert figure_problem(root, "gone.png") == "missing"
    assert figure_problem(root, "") == "it names the run folder itself"
    for path, reason in UNSAFE.items():
        assert re.fullmatch(reason, figure_problem(root, path)), path
