"""Command-line options made from config dataclasses, so a setting is declared once.

A config's fields carry their meaning, unit and paper default in a comment beside them (the
house style); ``add_options`` turns each field into an option whose help is that comment, whose
type follows the annotation and whose default is the field's, and ``from_args`` builds the
config back from the parsed arguments. The CLI therefore never repeats a config's fields, its
defaults or their explanations, and every option has a help text.

Parsing is strict where argparse is lax: floats must be finite (``nan``, ``inf`` and overflow
are refused at parse time), integers must be integers, lists are comma-separated. Ranges are
the configs' own business (``__post_init__`` raises ValueError naming field, value and what is
allowed), so one rule lives in one place.

Holds: OneLineParser, one_line, field_help, add_options, from_args, finite_float, number,
integer, csv.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import math
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

# A word of a message longer than this is cut: a value echoed whole (a 100,000-digit base)
# would make the one line 100 KB long. Paths and specs users type stay well below it.
LONGEST_WORD = 200


def one_line(text: str) -> str:
    """``text`` as one line, each word longer than `LONGEST_WORD` cut to its start and a note
    of its length ("'rope:base=99999…' (100,012 characters)"), so the words around it (the
    option, what is allowed) stay readable."""
    words = []
    for word in text.split():
        if len(word) > LONGEST_WORD:
            word = f"{word[: LONGEST_WORD // 2]}… ({len(word):,} characters)"
        words.append(word)
    return " ".join(words)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit code 2 (argparse's own
    print the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {one_line(message)}; see {self.prog} --help", file=sys.stderr)
        raise SystemExit(2)


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def number(text: str) -> float:
    """A float that may be infinite (an order like E_inf), never NaN."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def csv(item: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """A parser of comma-separated ``item`` values (at least one)."""

    def parse(text: str) -> list[Any]:
        parts = [t.strip() for t in text.split(",") if t.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"{text!r} holds no value; give a comma list")
        return [item(p) for p in parts]

    parse.__name__ = f"list of {getattr(item, '__name__', 'values')}"
    return parse


def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment beside it (or the comment lines right above it)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # pragma: no cover - source not shipped
        return {}
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    by_line = {
        t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = by_line.get(node.end_lineno) or by_line.get(node.lineno)
        if trailing and not lines[node.end_lineno - 1].lstrip().startswith("#"):
            out[node.target.id] = trailing
            continue
        above, line = [], node.lineno - 1
        while line in by_line and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, by_line[line])
            line -= 1
        if above:
            out[node.target.id] = " ".join(above)
    return out


def field_help(cls: type) -> dict[str, str]:
    """Every field's comment, base classes first (a subclass's comment wins)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            out.update(_comments(klass))
    return out


def _parser_for(annotation: Any) -> tuple[Callable[[str], Any] | None, bool]:
    """(parser of one command-line value, whether the field is a list); None parser: bool."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        tuples = [a for a in args if typing.get_origin(a) is tuple]
        return _parser_for(tuples[0] if tuples else args[0])
    if origin is tuple:
        return _parser_for(typing.get_args(annotation)[0])[0], True
    if annotation is bool:
        return None, False
    if annotation is int:
        return integer, False
    if annotation is float:
        return finite_float, False
    return str, False


def add_options(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    fields: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    flags: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    help: Mapping[str, str] | None = None,
    required: Iterable[str] = (),
    parsers: Mapping[str, Callable[[str], Any]] | None = None,
    choices: Mapping[str, Iterable[Any]] | None = None,
    unset: bool = False,
) -> list[str]:
    """Add one option per field of the dataclass ``cls`` (``fields``, in that order, or all but
    ``exclude``); ``flags`` renames options (default ``--field-name``), ``defaults`` and
    ``help`` override the field's, ``parsers`` the parser of an option's whole value (a list
    field then takes what it returns), ``choices`` restrict it. With ``unset`` every option
    defaults to None (the help still shows the field's default), so a caller can tell what was
    given from what was not, e.g. to lay options over a config file. Returns the field names
    added (for ``from_args``)."""
    hints = typing.get_type_hints(cls)
    comments = {**field_help(cls), **(help or {})}
    all_fields = {f.name: f for f in dataclasses.fields(cls)}
    names = list(fields) if fields is not None else [n for n in all_fields if n not in exclude]
    for name in names:
        field = all_fields[name]
        flag = (flags or {}).get(name, "--" + name.replace("_", "-"))
        default = (defaults or {}).get(name, field.default)
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        if default is dataclasses.MISSING:
            default = None
        text = comments.get(name)
        if not text:
            raise ValueError(f"{cls.__name__}.{name} has no comment to serve as its help text")
        text = text.replace("%", "%%")  # argparse expands %-formats in help
        kind, is_list = _parser_for(hints[name])
        if name in (parsers or {}):
            kind, is_list = parsers[name], False
        if kind is None and unset:  # a switch that is only set when given
            # One that is on by default can only be turned off: --no-... stores False.
            on = bool(default)
            flag_name = ("--no-" if on else "--") + name.replace("_", "-")
            # The help says what the flag does: a --no-... flag turns the field's meaning off.
            shown = f"turn off what is on by default: {text}" if on else f"{text} (default: off)"
            parser.add_argument(
                (flags or {}).get(name, flag_name), dest=name, action="store_const",
                const=not on, default=None, help=shown,
            )  # fmt: skip
            continue
        if kind is None:  # a switch; one that is on by default is turned off by --no-...
            off = bool(default)
            flag = (flags or {}).get(name, "--no-" + name.replace("_", "-") if off else flag)
            action = "store_false" if off else "store_true"
            shown = f"turn off what is on by default: {text}" if off else text
            parser.add_argument(flag, dest=name, action=action, default=bool(default), help=shown)
            continue
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        known = name not in required and default is not None
        options: dict[str, Any] = {
            "dest": name,
            "type": csv(kind) if is_list else kind,
            "help": f"{text} (default: {shown})" if known else text,
        }
        if name in (choices or {}):
            options["choices"] = list(choices[name])
        if name in required and not unset:
            options["required"] = True
        else:
            options["default"] = None if unset else default
        parser.add_argument(flag, **options)
    return names


def from_args(cls: type, args: argparse.Namespace, names: Iterable[str], **extra: Any) -> Any:
    """The config ``cls`` from the parsed values of ``names`` (lists become tuples; a
    one-item list of a field that also takes one value becomes that value) and ``extra``."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name)
        if isinstance(value, list):
            single = str in typing.get_args(hints[name])  # e.g. data: str | tuple[str, ...]
            value = value[0] if single and len(value) == 1 else tuple(value)
        values[name] = value
    return cls(**values, **extra)
