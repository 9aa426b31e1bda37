"""``build_report``: a run folder's result JSON in, ``report.md`` and ``report.html`` out
(what `ropekit report RUN_DIR` and `ropekit demo` run).

Holds: ReportPaths, report_blocks, build_report.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path

from ropekit.utils import atomic_write_text

from .document import Block, Heading, Text, to_html, to_markdown
from .sections import KINDS, SECTIONS, Result, discover


@dataclasses.dataclass(frozen=True)
class ReportPaths:
    markdown: Path
    html: Path
    results: int  # result files the report was made from


def report_blocks(results: list[Result], root: Path, title: str) -> list[Block]:
    """The report: a title, what it was made from, then one section per kind found."""
    counts = Counter(r.kind for r in results)
    found = ", ".join(f"{n} {k} result{'s' if n > 1 else ''}" for k, n in counts.items())
    blocks: list[Block] = [
        Heading(title, 1),
        Text(
            f"Made by `ropekit report` on {time.strftime('%Y-%m-%d %H:%M')} from {found}. "
            "Every number below is read from those files."
        ),
    ]
    for kind, section_title in KINDS.items():
        mine = [r for r in results if r.kind == kind]
        if mine:
            blocks.append(Heading(section_title, 2))
            blocks += SECTIONS[kind](mine, root)
    return blocks


def build_report(run_dir: str | Path, *, title: str | None = None) -> ReportPaths:
    """Write ``report.md`` and ``report.html`` into ``run_dir`` from the result JSON found in
    it (recursively). Raises FileNotFoundError when the folder holds no result."""
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder")
    results = discover(root)
    if not results:
        names = ", ".join(KINDS)
        raise FileNotFoundError(f"{root} holds no result JSON ({names}) in any folder")
    title = title or f"ropekit report: {root.resolve().name}"
    blocks = report_blocks(results, root, title)
    paths = ReportPaths(root / "report.md", root / "report.html", len(results))
    # Both renderers name figures they may not read (links, `..`, outside paths) as skipped.
    atomic_write_text(paths.markdown, to_markdown(blocks, root))
    atomic_write_text(paths.html, to_html(blocks, root, title))
    return paths
