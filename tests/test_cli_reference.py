"""docs/cli.md is generated from the parser: it must equal what the code generates now."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ropekit.cli import build_parser
from ropekit.cli_reference import REGENERATE, cli_reference, main

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_committed_cli_reference_matches_the_parser():
    assert DOCS.read_text(encoding="utf-8") == cli_reference(), (
        f"docs/cli.md is out of date; regenerate it with `{REGENERATE}`"
    )


def _leaves(parser: argparse.ArgumentParser):
    """Every parser that runs a command (eval ppl, models list, ...), recursively."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for action in subs:
        for sub in action.choices.values():
            yield from _leaves(sub)


def test_every_command_and_option_is_documented():
    text = cli_reference()
    leaves = list(_leaves(build_parser()))
    assert len(leaves) >= 14
    for sub in leaves:
        assert f"## {sub.prog}\n" in text
        for action in sub._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}`" in text
    assert "`--tiny`" not in text  # hidden, test-only options stay out


def test_reference_does_not_depend_on_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = cli_reference()
    monkeypatch.setenv("COLUMNS", "250")
    assert cli_reference() == narrow


def test_main_writes_the_file(tmp_path, capsys):
    path = tmp_path / "cli.md"
    assert main([str(path)]) == 0
    assert path.read_text() == cli_reference()
    assert str(path) in capsys.readouterr().out


def test_every_option_has_a_help_text():
    """Options come from the configs' field comments (ropekit.options): none may be bare."""
    bare = [
        f"{sub.prog} {action.option_strings or action.dest}"
        for sub in _leaves(build_parser())
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()
    ]
    assert bare == []


def test_help_speaks_of_the_tool_not_of_its_issues():
    """Help texts come from source comments, which cite the project's issues; a user's help
    must not ("(issue 19)" once reached --no-single-documents)."""
    cited = re.findall(r"[^\n]{0,40}\b(?:issue|task) #?\d+[^\n]{0,20}", cli_reference(), re.I)
    assert not cited, cited
