"""`ropekit schedules`' comparison: each method's inverse frequencies equal its schedule's
formula, a factor filled in one rule, bad settings refused, files written only over their own
settings."""

from __future__ import annotations

import math

import pytest

from ropekit.report.schedules import compare_schedules, method_spec, write_schedules
from ropekit.results import ResultError, read_result


def _rows(result):
    return {row["method"]: row for row in result["methods"]}


def test_linear_and_ntk_are_rope_divided_and_rebased():
    result = compare_schedules(("rope", "linear", "ntk"), head_dim=8, base=100.0, factor=4.0)
    rows = _rows(result)
    rope = [100.0 ** (-2 * i / 8) for i in range(4)]
    assert rows["rope"]["inv_freq"] == pytest.approx(rope, rel=1e-12)
    assert rows["linear"]["inv_freq"] == pytest.approx([v / 4 for v in rope], rel=1e-12)
    ntk_base = 100.0 * 4.0 ** (8 / 6)  # base x factor^(d / (d - 2))
    assert rows["ntk"]["inv_freq"] == pytest.approx(
        [ntk_base ** (-2 * i / 8) for i in range(4)], rel=1e-12
    )
    for row in rows.values():
        assert row["wavelength"] == pytest.approx([2 * math.pi / v for v in row["inv_freq"]])
    assert result["target_length"] == 4 * 512


def test_yarn_carries_its_attention_factor_and_dynamic_ntk_is_read_at_the_target():
    rows = _rows(compare_schedules(("yarn", "dynamic-ntk", "ntk"), head_dim=16, factor=8.0))
    assert rows["yarn"]["attention_factor"] == pytest.approx(0.1 * math.log(8) + 1)
    assert rows["ntk"]["attention_factor"] == 1.0
    # dynamic NTK is read at the target length L = 8 L0: transformers' rule, base x
    # (s L / L0 - (s - 1))^(d / (d - 2)) = base x 57^(16 / 14), not the static NTK base
    base = 10000.0 * (8 * 8 - 7) ** (16 / 14)
    expected = [base ** (-2 * i / 16) for i in range(8)]
    assert rows["dynamic-ntk"]["inv_freq"] == pytest.approx(expected, rel=1e-9)
    assert rows["dynamic-ntk"]["inv_freq"][1] < rows["ntk"]["inv_freq"][1]


def test_a_method_that_takes_a_factor_gets_the_comparisons_unless_it_gives_one():
    assert str(method_spec("linear", 4.0)) == "linear:factor=4"
    assert str(method_spec("linear:factor=2", 4.0)) == "linear:factor=2"
    assert method_spec("longrope", 4.0).gives("long_factor")
    assert not method_spec("rope", 4.0).gives("factor")


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"head_dim": 7}, "head_dim=7"),
        ({"factor": 0.5}, "factor=0.5"),
        ({"factor": math.inf}, "factor=inf"),
        ({"methods": ("rope", "rope")}, "repeat"),
        ({"methods": ("alibi",)}, "not a rotary schedule"),
    ],
)
def test_bad_settings_are_refused_naming_them(kwargs, words):
    with pytest.raises(ValueError, match=words):
        compare_schedules(**kwargs)


def test_files_are_replaced_only_over_the_same_settings(tmp_path):
    first = compare_schedules(("rope", "yarn"), head_dim=8, factor=2.0)
    paths = write_schedules(first, tmp_path, command="ropekit schedules")
    assert read_result(paths["json"], "schedules")["methods"][1]["method"] == "yarn"
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    write_schedules(first, tmp_path)  # the same settings: rewritten
    other = compare_schedules(("rope",), head_dim=8, factor=2.0)
    with pytest.raises(ResultError, match="methods"):
        write_schedules(other, tmp_path)
    assert len(read_result(paths["json"], "schedules")["methods"]) == 2
    write_schedules(other, tmp_path, overwrite=True)
    assert len(read_result(paths["json"], "schedules")["methods"]) == 1


def test_each_row_names_the_pairs_turned_past_their_trained_angles_at_the_target(tmp_path, capsys):
    """At SmolLM2's schedule and 4x: NTK-aware leaves pairs 20-30 past the angles plain RoPE
    saw in 8,192 tokens, YaRN none; `ropekit schedules` prints them as runs."""
    from ropekit.cli import main

    result = compare_schedules(
        ("rope", "ntk", "yarn"), head_dim=64, base=1e5, factor=4.0, original_length=8192
    )
    unseen = {method: row["unseen_pairs"] for method, row in _rows(result).items()}
    assert unseen == {"rope": list(range(20, 32)), "ntk": list(range(20, 31)), "yarn": []}
    argv = ["schedules", "--methods", "rope,ntk,yarn", "--base", "100000", "--factor", "4"]
    assert main([*argv, "--original-length", "8192", "--out", str(tmp_path)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["rope"].endswith("12 (20-31)") and lines["ntk"].endswith("11 (20-30)")
    assert lines["yarn"].endswith(" 0")
