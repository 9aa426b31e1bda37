"""Options made from config dataclasses: each field becomes an option whose help is the comment
beside it, whose type follows the annotation and whose default is the field's; the config comes
back from the parsed arguments. Strict value parsers; one-line parser errors."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ropekit.options import (
    OneLineParser,
    add_options,
    csv,
    field_help,
    finite_float,
    from_args,
    integer,
    number,
)


@dataclasses.dataclass(frozen=True)
class Toy:
    name: str  # what the run is called
    steps: int = 10  # optimizer steps
    # learning rate, 100% of
    # the schedule's peak
    lr: float = 1e-3
    lengths: tuple[int, ...] = (64, 128)  # evaluation lengths (tokens)
    data: str | tuple[str, ...] = "essays"  # corpus or corpora
    compile: bool = False  # compile the model
    shuffle: bool = True  # shuffle the batches


def _parser(**kwargs) -> tuple[argparse.ArgumentParser, list[str]]:
    parser = argparse.ArgumentParser()
    return parser, add_options(parser, Toy, required=("name",), **kwargs)


def test_each_field_is_an_option_helped_by_its_comment_and_typed_by_its_annotation():
    parser, names = _parser()
    assert names == ["name", "steps", "lr", "lengths", "data", "compile", "shuffle"]
    args = parser.parse_args(
        ["--name", "x", "--steps", "3", "--lengths", "8, 16", "--data", "a,b", "--compile",
         "--no-shuffle"]
    )  # fmt: skip
    config = from_args(Toy, args, names)
    assert config == Toy("x", 3, 1e-3, (8, 16), ("a", "b"), True, False)
    one = from_args(Toy, parser.parse_args(["--name", "x", "--data", "kjv"]), names)
    assert one.data == "kjv" and one.lengths == (64, 128)  # one value, not a 1-tuple
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["steps"] == "optimizer steps (default: 10)"
    assert helps["lr"] == "learning rate, 100%% of the schedule's peak (default: 0.001)"
    assert helps["shuffle"] == "turn off what is on by default: shuffle the batches"
    assert field_help(Toy)["lengths"] == "evaluation lengths (tokens)"


def test_with_unset_only_what_was_given_is_set():
    parser, names = _parser(unset=True)
    args = parser.parse_args(["--steps", "3", "--no-shuffle"])
    assert {n: getattr(args, n) for n in names} == {
        "name": None, "steps": 3, "lr": None, "lengths": None, "data": None, "compile": None,
        "shuffle": False,
    }  # fmt: skip


def test_a_field_without_a_comment_cannot_become_an_option():
    @dataclasses.dataclass
    class Silent:
        steps: int = 1

    with pytest.raises(ValueError, match=r"Silent\.steps has no comment"):
        add_options(argparse.ArgumentParser(), Silent)


@pytest.mark.parametrize(
    ("parse", "text", "words"),
    [
        (finite_float, "nan", "not a finite number"),
        (finite_float, "1e999", "not a finite number"),
        (finite_float, "ten", "not a number"),
        (number, "nan", "not a number"),
        (integer, "2.5", "not an integer"),
        (csv(integer), " , ", "holds no value"),
    ],
)
def test_values_argparse_would_take_are_refused(parse, text, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        parse(text)


def test_infinity_is_a_number_and_lists_parse_each_item():
    assert number("inf") == float("inf")
    assert csv(finite_float)("1, 2.5,") == [1.0, 2.5]


def test_a_parser_error_is_one_line_and_exit_code_2(capsys):
    parser = OneLineParser(prog="ropekit")
    parser.add_argument("--steps", type=integer, required=True)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ropekit: error: ")
    assert err.rstrip().endswith("see ropekit --help")
