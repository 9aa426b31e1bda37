"""CompareConfig: an unknown method named before the model is read; bad configs refused; fields
added later left out of the JSON at their defaults; which split of a corpus is held out."""

from __future__ import annotations

import pytest

from ropekit.cli import build_parser
from ropekit.compare import CompareConfig


def test_an_unknown_method_in_a_list_is_named_in_one_line(tmp_path, capsys):
    from ropekit.cli import main

    out = tmp_path / "out"
    argv = ["compare", "--model", "m", "--target-length", "64", "--methods", "rope,bogus"]
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown encoding 'bogus'; known: nope" in err and err.count("\n") == 1
    assert not out.exists()


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="names"):
        CompareConfig("m", 64, ("rope", "yarn"), names=("a",))
    with pytest.raises(ValueError, match="above target_length"):
        CompareConfig("m", 64, ("rope",), lengths=(128,))
    with pytest.raises(ValueError, match="margin"):
        CompareConfig("m", 64, ("rope",), margin=2.0)
    with pytest.raises(ValueError, match="seeds"):
        CompareConfig("m", 64, ("rope",), seeds=(0, 0))


def test_the_compute_dtype_is_part_of_the_config_only_when_it_is_not_float32():
    """A field added after comparisons were committed keeps their provenance: at its default
    it is left out of the config's JSON (so those folders stay resumable); set, it is in."""
    assert "dtype" not in CompareConfig("m", 64, ("rope",)).to_dict()
    assert CompareConfig("m", 64, ("rope",), dtype="bfloat16").to_dict()["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="dtype='int8' is not allowed; allowed: float32"):
        CompareConfig("m", 64, ("rope",), dtype="int8")


def test_single_documents_is_on_unless_turned_off():
    parse = build_parser().parse_args
    assert parse(["compare", "--out", "x"]).single_documents is None  # the config's default
    assert parse(["compare", "--no-single-documents", "--out", "x"]).single_documents is False
    assert CompareConfig("m", 64, ("rope",)).single_documents is True


def test_a_corpus_no_method_trains_on_can_be_scored_whole():
    """KJV's validation split (7 books by text hash) holds no 32k-token book; a comparison
    that trains on Shakespeare only may score all of KJV, every book held out from training."""
    whole = CompareConfig("m", 64, ("rope",), whole_untrained_corpora=True)
    assert whole.heldout_split("kjv") == "all"
    assert whole.heldout_split("shakespeare") == "validation"  # trained on: its split only
    assert CompareConfig("m", 64, ("rope",)).heldout_split("kjv") == "validation"  # default
    assert CompareConfig("m", 64, ("rope",)).heldout_split("/my/book.txt") == "all"
    trains_on_kjv = CompareConfig("m", 64, ("rope",), train_data=("shakespeare", "kjv"),
                                  whole_untrained_corpora=True)  # fmt: skip
    assert trains_on_kjv.heldout_split("kjv") == "validation"
    assert "whole_untrained_corpora" not in CompareConfig("m", 64, ("rope",)).to_dict()


@pytest.mark.parametrize(
    ("field", "says"),
    [
        ('"race": "maybe"', "race='maybe' is not allowed; allowed: on, off"),
        ('"spans": 0', "spans=0 is not allowed; it must be an integer >= 1"),
        ('"margin": -0.5', "margin=-0.5 is not allowed; it must lie in [0, 1)"),
    ],
)
def test_racing_nonsense_in_a_config_file_is_one_line_and_nothing_written(
    tmp_path, capsys, field, says
):
    """The racing rule's fields given in --config as on the command line (test_race_run.py):
    refused before the model is read."""
    from ropekit.cli import main

    config, out = tmp_path / "c.json", tmp_path / "out"
    config.write_text(f'{{"model": "m", "target_length": 64, "methods": ["rope"], {field}}}')
    assert main(["compare", "--config", str(config), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
    assert not out.exists()
