"""The command-line reference (``docs/cli.md``), generated from the argparse parser so it
cannot drift from the code (a test compares the committed file with this output).

Holds: cli_reference (parser -> Markdown), main (``python -m ropekit.cli_reference
[PATH]`` prints the reference, or writes it to PATH).

Output is independent of the terminal: usage lines are formatted at a fixed width and
options are listed in Markdown tables.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from ropekit.utils import atomic_write_text

USAGE_WIDTH = 88  # fixed, so the text never depends on the terminal that generated it
REGENERATE = "python -m ropekit.cli_reference docs/cli.md"


def _subcommands(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """(prog, parser, one-line help) of every command, depth first in registration order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield sub.prog, sub, helps.get(name, "")
                yield from _subcommands(sub)


def _has_subcommands(parser: argparse.ArgumentParser) -> bool:
    return any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(prog=parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "flag"
    if action.choices is not None:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    if action.metavar is not None:
        return f"`{action.metavar}`"
    return f"`{action.dest.upper()}`"


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    default = action.default
    if action.nargs == 0 or default is None or default == argparse.SUPPRESS:
        return ""
    if isinstance(default, list | tuple):
        default = ",".join(str(d) for d in default)
    return f"`{default}`"


def _options(parser: argparse.ArgumentParser) -> list[str]:
    formatter = argparse.HelpFormatter(prog=parser.prog, width=USAGE_WIDTH)
    rows = []
    for action in parser._actions:
        hidden = action.help == argparse.SUPPRESS
        if hidden or isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
        description = formatter._expand_help(action) if action.help else ""
        row = [name, _value(action), _default(action), _cell(description)]
        rows.append("| " + " | ".join(row) + " |")
    if not rows:
        return []
    return ["| option | value | default | description |", "|---|---|---|---|", *rows, ""]


def cli_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """The Markdown reference of every `ropekit` command (default: the real parser)."""
    if parser is None:
        from ropekit.cli import build_parser

        parser = build_parser()
    lines = [
        f"# `{parser.prog}` command-line reference",
        "",
        f"Generated from the argument parser by `{REGENERATE}`; do not edit by hand (a test "
        "checks that this file matches the code). Every command prints where its outputs went.",
        "",
        parser.description or "",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    commands = list(_subcommands(parser))
    for prog, sub, summary in commands:
        if not _has_subcommands(sub):
            anchor = prog.replace(" ", "-")
            lines.append(f"| [`{prog}`](#{anchor}) | {_cell(summary)} |")
    lines.append("")
    for prog, sub, summary in commands:
        if _has_subcommands(sub):
            continue
        lines += [f"## {prog}", ""]
        sentence = _cell(summary)[0].upper() + _cell(summary)[1:] + "." if summary else ""
        # A command's --help description opens with its summary (ropekit.cli.build_parser);
        # what it adds follows the summary here.
        more = " ".join((sub.description or "").split()).removeprefix(sentence).strip()
        lines += [sentence, ""] if sentence else []
        lines += [more, ""] if more else []
        lines += ["```text", _usage(sub), "```", ""]
        lines += _options(sub)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m ropekit.cli_reference",
        description="print the command-line reference (docs/cli.md) generated from the parser",
    )
    parser.add_argument("path", nargs="?", type=Path, help="write it here instead of stdout")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    text = cli_reference()
    if args.path is not None:
        atomic_write_text(args.path, text)
        print(f"wrote {args.path}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
