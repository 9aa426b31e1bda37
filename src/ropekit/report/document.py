"""A report as a list of blocks, rendered to Markdown (images linked) or to one self-contained
HTML page (images embedded as base64, so the file can be mailed or archived alone).

Holds: the blocks (Heading, Text, Table, Figure, Details), Block, to_markdown, to_html,
figure_problem (why a figure may not be embedded).

Figure paths are kept relative to the report's folder: Markdown links them, HTML reads and
embeds them. Text is plain text with `code` spans; both renderers escape the rest.

Only regular files inside the report's folder are linked or embedded: a figure path that is
absolute, climbs out with `..`, passes through a symbolic link, or names something other than
a regular file (a FIFO, a device) is never read; both renderers name it as skipped instead, so
a report made from a folder cannot carry (or hang on) a file from elsewhere.
"""

from __future__ import annotations

import base64
import html
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2  # 1 = the title


@dataclass(frozen=True)
class Text:
    text: str  # one paragraph; `code` spans are kept as code


@dataclass(frozen=True)
class Table:
    headers: Sequence[str]
    rows: Sequence[Sequence[str]]  # cells already formatted as text
    caption: str = ""


@dataclass(frozen=True)
class Figure:
    path: str  # relative to the report's folder
    caption: str = ""


@dataclass(frozen=True)
class Details:
    """Collapsed content (per-run figures of a section with many runs)."""

    summary: str
    blocks: Sequence[Block] = field(default_factory=tuple)


Block = Heading | Text | Table | Figure | Details

_CODE = re.compile(r"`([^`]+)`")
_MISSING = "missing"
_RULE = "only regular files inside the run folder are embedded"


def figure_problem(root: str | Path, path: str) -> str | None:
    """Why figure `path` (relative to `root`) may not be read, or None if it may.

    "missing" when nothing is there; otherwise the reason it is skipped: an absolute path, a
    `..` component, a symbolic link on the way (or the file itself), not a regular file, or a
    real path outside `root` (a bind mount, say). `root` itself may be a link.
    """
    relative = Path(path)
    if relative.is_absolute():
        return "it is an absolute path"
    if ".." in relative.parts:
        return "it leaves the run folder (..)"
    if not relative.parts:
        return "it names the run folder itself"
    base = Path(root)
    current = base
    for part in relative.parts:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            return _MISSING
        except OSError as e:
            return f"it cannot be read ({e.strerror})"
        if stat.S_ISLNK(mode):
            return f"{current.relative_to(base).as_posix()} is a symbolic link"
    if not stat.S_ISREG(mode):
        return "it is not a regular file"
    if not current.resolve().is_relative_to(base.resolve()):
        return "it resolves outside the run folder"
    return None


def _skipped(path: str, reason: str) -> str:
    return f"skipped figure {path}: {reason}; {_RULE}"


# ----------------------------------------------------------------------------- Markdown
def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md(block: Block, root: Path | None) -> list[str]:
    if isinstance(block, Heading):
        return ["#" * block.level + " " + block.text, ""]
    if isinstance(block, Text):
        return [block.text, ""]
    if isinstance(block, Table):
        lines = [block.caption, ""] if block.caption else []
        lines.append("| " + " | ".join(_md_cell(h) for h in block.headers) + " |")
        lines.append("|" + "---|" * len(block.headers))
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
        return [*lines, ""]
    if isinstance(block, Figure):
        problem = None if root is None else figure_problem(root, block.path)
        if problem not in (None, _MISSING):
            return [f"*{_md_cell(_skipped(block.path, problem))}*", ""]
        return [f"![{block.caption}]({block.path})", ""]
    # GitHub renders Markdown inside <details> when blank lines surround it.
    inner = [line for b in block.blocks for line in _md(b, root)]
    summary = f"<details><summary>{html.escape(block.summary)}</summary>"
    return [summary, "", *inner, "</details>", ""]


def to_markdown(blocks: Sequence[Block], root: str | Path | None = None) -> str:
    """The report as GitHub-flavoured Markdown; figures are relative links. Given the report's
    folder `root`, a figure that may not be embedded (see figure_problem) is named as skipped
    instead of linked."""
    folder = None if root is None else Path(root)
    return "\n".join(line for b in blocks for line in _md(b, folder)).rstrip() + "\n"


# ----------------------------------------------------------------------------- HTML
_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
caption { caption-side: top; text-align: left; color: #555; padding-bottom: 0.3em; }
figure { margin: 0.8em 0 1.4em; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; }
code { background: #f3f3f3; padding: 0 0.2em; }
details { margin: 0.5em 0 1em; }
summary { cursor: pointer; color: #335; }
""".strip()


def _inline(text: str) -> str:
    parts = _CODE.split(text)  # even indexes: plain text; odd: code spans
    return "".join(
        f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts)
    )


def _image(path: Path) -> str:
    # O_NOFOLLOW and the fstat: what is read is the regular file figure_problem looked at.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        data = base64.b64encode(f.read()).decode("ascii")
    return f"data:image/png;base64,{data}"


def _html(block: Block, root: Path) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{_inline(block.text)}</h{block.level}>"
    if isinstance(block, Text):
        return f"<p>{_inline(block.text)}</p>"
    if isinstance(block, Table):
        caption = f"<caption>{_inline(block.caption)}</caption>" if block.caption else ""
        head = "".join(f"<th>{_inline(h)}</th>" for h in block.headers)
        body = "".join(
            "<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in block.rows
        )
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    if isinstance(block, Figure):
        path = root / block.path
        problem = figure_problem(root, block.path)
        if problem == _MISSING:
            return f"<p><em>missing figure {html.escape(block.path)}</em></p>"
        if problem is not None:
            return f"<p><em>{html.escape(_skipped(block.path, problem))}</em></p>"
        caption = _inline(block.caption or block.path)
        return (
            f'<figure><img src="{_image(path)}" alt="{html.escape(block.path)}">'
            f"<figcaption>{caption}</figcaption></figure>"
        )
    inner = "\n".join(_html(b, root) for b in block.blocks)
    return f"<details><summary>{_inline(block.summary)}</summary>\n{inner}\n</details>"


def to_html(blocks: Sequence[Block], root: str | Path, title: str) -> str:
    """One self-contained HTML page; figures are read from ``root`` and embedded."""
    body = "\n".join(_html(b, Path(root)) for b in blocks)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>\n{_STYLE}\n</style>\n</head>\n"
        f"<body>\n{body}\n</body>\n</html>\n"
    )
