"""tests/mutation.py, the script that turns mutmut's results into docs/mutation.json (counts per
module and status) and docs/mutation.md: every mutant not killed either explained as equivalent
or listed to kill (the table is docs.tables', tested in tests/test_docs_tables.py)."""

import pytest

from tests.mutation import equivalents, parse, record, report

LINES = [
    "    ropekit.a.x_f__mutmut_1: killed",
    "    ropekit.a.x_f__mutmut_2: survived",
    "    ropekit.a.xǁCǁg__mutmut_1: no tests",
    "    ropekit.a.x_f__mutmut_3: timeout",
    "    ropekit.b.x_h__mutmut_1: not checked",
    "    ropekit.b.x_h__mutmut_2: killed",
    "not a result line",
]


def test_the_record_counts_every_status_and_keeps_each_mutant_not_killed():
    data = record(parse([*LINES, "    ropekit.b.x_h__mutmut_3: suspicious"]))
    assert data["modules"] == {
        "ropekit.a": {"killed": 1, "no tests": 1, "survived": 1, "timeout": 1},
        "ropekit.b": {"killed": 1, "not checked": 1, "suspicious": 1},
    }
    assert data["not_killed"] == {
        "ropekit.a.x_f__mutmut_2": "survived",
        "ropekit.a.xǁCǁg__mutmut_1": "no tests",
        "ropekit.b.x_h__mutmut_3": "suspicious",
    }


def test_the_report_lists_mutants_to_kill_and_leaves_the_table_to_the_generator():
    text = report(parse(LINES), {}, "12")
    assert "in 12 s" in text
    assert "<!-- table: mutation -->\n<!-- /table: mutation -->" in text
    assert "- `ropekit.a.x_f`: 2" in text and "- `ropekit.a.xǁCǁg`: 1" in text


def test_an_explained_survivor_moves_from_to_kill_to_equivalent_with_its_reason():
    explained = equivalents("# why\n\nropekit.a.x_f__mutmut_2: a default no caller uses\n")
    text = report(parse(LINES), explained, None)
    assert "- `ropekit.a.x_f__mutmut_2` (survived): a default no caller uses" in text
    assert "- `ropekit.a.x_f`: 2" not in text


@pytest.mark.parametrize("line", ["ropekit.a.x_f__mutmut_2:", "ropekit.a.x_f: reason"])
def test_an_equivalent_line_without_a_mutant_or_a_reason_is_refused(line):
    with pytest.raises(ValueError, match=":1: expected 'NAME__mutmut_N: reason'"):
        equivalents(line)


def test_the_rerun_finds_each_mutants_function_results_file_and_tests():
    from tests.mutation_rerun import MUTANTS, function_of, meta_of, tests_of

    method = "ropekit.train.search.xǁ_Scorerǁ__call____mutmut_12"
    assert function_of(method) == "ropekit.train.search.xǁ_Scorerǁ__call__"
    assert meta_of(method) == MUTANTS / "src/ropekit/train/search.py.meta"
    plain = "ropekit.encodings.bands_flex.x_tiles__mutmut_163"
    assert function_of(plain) == "ropekit.encodings.bands_flex.x_tiles"
    assert meta_of(plain) == MUTANTS / "src/ropekit/encodings/bands_flex.py.meta"
    stats = {
        "tests_by_mangled_function_name": {"ropekit.encodings.bands_flex.x_tiles": ["b", "a"]},
        "duration_by_test": {"a": 0.1, "b": 2.0},
    }
    assert tests_of(plain, stats) == ["a", "b"]  # fastest first
    assert tests_of(method, stats) == []  # no test reaches it: recorded as mutmut's "no tests"
