"""The typed half of ``ropekit.results``: records registered by kind, (de)serialized from their
type hints, migrated from older versions, and refused by one line naming a field that is
missing, unknown or of another type (a renamed field never reads as a default)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from ropekit import results
from ropekit.results import (
    ResultError,
    decode,
    encode,
    make_record,
    read_record,
    read_result,
    register,
    write_result,
)


@dataclasses.dataclass(frozen=True)
class _Cell:
    ppl: float
    blocks: tuple[float, ...] | None


@dataclasses.dataclass(frozen=True)
class _Toy:
    meta: dict
    provenance: dict
    by_length: dict[int, _Cell]
    by_lr: dict[float, float]
    note: str | None = None


@pytest.fixture
def toy_kind(monkeypatch):
    """``_Toy`` registered as the ``demo`` kind at version 4 for one test: version 2 renamed
    ``rows`` to ``by_length`` (3), and 3 added ``by_lr`` (4)."""
    monkeypatch.setattr(results, "_SCHEMAS", dict(results._SCHEMAS))

    def rename(data):
        data = dict(data)
        data["by_length"] = data.pop("rows")
        return data

    register("demo", 4, {2: rename, 3: lambda data: {**data, "by_lr": {}}})(_Toy)
    return _Toy


def test_a_record_round_trips_with_int_and_float_keys_converted_at_the_boundary(toy_kind, tmp_path):
    toy = _Toy({"command": "x"}, {"model": "m"}, {8: _Cell(1.5, (1.0, 2.0)), 32: _Cell(2.0, None)},
               {0.01: 3.0})  # fmt: skip
    path = write_result(tmp_path / "demo.json", "demo", toy)
    raw = json.loads(path.read_text())
    assert raw["kind"] == "demo" and raw["format_version"] == 4
    assert raw["by_length"]["8"] == {"ppl": 1.5, "blocks": [1.0, 2.0]}  # strings in JSON
    assert raw["by_lr"] == {"0.01": 3.0} and raw["provenance"] == {"model": "m"}
    assert read_record(path, _Toy) == toy  # ints, floats and tuples again in memory


def test_nan_is_written_as_null_and_reads_back_as_nan(toy_kind, tmp_path):
    toy = _Toy({}, {}, {8: _Cell(math.nan, None)}, {})
    path = write_result(tmp_path / "demo.json", "demo", toy)
    assert json.loads(path.read_text())["by_length"]["8"]["ppl"] is None
    assert math.isnan(read_record(path, _Toy).by_length[8].ppl)


def test_an_older_file_is_migrated_step_by_step_in_memory_and_left_as_it_was(toy_kind, tmp_path):
    old = {"kind": "demo", "format_version": 2, "meta": {}, "provenance": {},
           "rows": {"16": {"ppl": 3.0, "blocks": None}}}  # fmt: skip
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(old))
    before = path.read_bytes()
    assert read_record(path, _Toy) == _Toy({}, {}, {16: _Cell(3.0, None)}, {})
    assert read_result(path, "demo")["format_version"] == 4
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda d: d["by_length"]["8"].update(ppl_mean=d["by_length"]["8"].pop("ppl")),
            "demo.by_length.8.ppl_mean is not a field of _Cell (renamed?",
        ),
        (lambda d: d.pop("by_lr"), "demo.by_lr is missing (_Toy needs it)"),
        (
            lambda d: d["by_length"].update({"eight": d["by_length"].pop("8")}),
            "demo.by_length: key 'eight', expected int",
        ),
        (
            lambda d: d["by_length"]["8"].update(ppl="low"),
            'demo.by_length.8.ppl is "low", expected float',
        ),
    ],
    ids=["renamed", "missing", "key", "type"],
)
def test_a_bad_field_is_one_line_naming_the_file_and_the_field(toy_kind, tmp_path, change, message):
    path = write_result(tmp_path / "demo.json", "demo", _Toy({}, {}, {8: _Cell(1.0, None)}, {}))
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError) as error:
        read_record(path, _Toy)
    text = str(error.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text


def test_a_version_without_a_migration_is_refused(toy_kind, tmp_path):
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({"kind": "demo", "format_version": 1, "meta": {}, "provenance": {}}))
    with pytest.raises(ResultError, match="format_version=1; this ropekit reads 4"):
        read_record(path, _Toy)
    with pytest.raises(ValueError, match="no migration from format_version 3 to 4"):
        register("demo", 4, {2: lambda d: d})(_Toy)


def test_a_record_is_written_only_as_its_own_kind(toy_kind):
    with pytest.raises(ValueError, match="a _Toy is not a 'perplexity' record"):
        make_record("perplexity", _Toy({}, {}, {}, {}))
    with pytest.raises(TypeError, match="frozen dataclass"):
        register("demo", 2)(type("Loose", (), {}))


def test_decode_reads_unions_in_order_and_keeps_any_as_is():
    assert decode(str | list[str], ["a", "b"], "x") == ["a", "b"]
    assert decode(str | list[str], "a", "x") == "a"
    assert decode(int | None, None, "x") is None
    with pytest.raises(ResultError, match="x is true, expected int"):
        decode(int, True, "x")  # a bool is not a count
    assert decode(float, 2, "x") == 2.0 and isinstance(decode(float, 2, "x"), float)
    assert encode({1: (_Cell(1.0, None),)}) == {"1": [{"ppl": 1.0, "blocks": None}]}
