"""The typed half of ``ropekit.results``: records registered by kind, (de)serialized from their
type hints, migrated from older versions, and refused by one line naming a field that is
missing, unknown or of another type (a renamed field never reads as a default)."""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import importlib.metadata
import json
import locale
import math
import typing
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from ropekit import results
from ropekit.analysis.record import AnalysisResult
from ropekit.compare.record import CompareResult
from ropekit.evals.perplexity import PerplexityResult
from ropekit.evals.probe_summary import ProbesResult
from ropekit.evals.runner import TasksResult
from ropekit.report import sections
from ropekit.report.demo_record import DemoResult
from ropekit.results import (
    ResultError,
    check_provenance,
    check_replaceable,
    decode,
    encode,
    make_record,
    read_record,
    read_result,
    register,
    run_metadata,
    write_result,
)
from ropekit.train.extend import ExtendRecord
from ropekit.train.search import SearchRecord

from .records import assert_refused


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


# Every record class, imported by name (results.py imports none: issue 55).
OWNERS = {
    "analysis": AnalysisResult,
    "compare": CompareResult,
    "demo": DemoResult,
    "extend": ExtendRecord,
    "perplexity": PerplexityResult,
    "probes": ProbesResult,
    "search": SearchRecord,
    "tasks": TasksResult,
}


def _private_registry(monkeypatch) -> None:
    """A copy of the registry for one test (every owner is imported above: one imported while
    the copy is in place would register into the copy alone, and be lost after)."""
    monkeypatch.setattr(results, "_SCHEMAS", dict(results._SCHEMAS))


@pytest.fixture
def toy_kind(monkeypatch):
    """``_Toy`` registered as the ``demo`` kind at version 4 for one test: version 2 renamed
    ``rows`` to ``by_length`` (3), and 3 added ``by_lr`` (4)."""
    _private_registry(monkeypatch)

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
    assert_refused(path, data, _Toy, message)


def test_a_file_not_in_the_layout_of_its_version_is_one_line(toy_kind, tmp_path):
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({"kind": "demo", "format_version": 2, "meta": {}, "provenance": {}}))
    with pytest.raises(ResultError) as error:  # version 2 had "rows", which rename() moves
        read_record(path, _Toy)
    assert str(error.value) == (
        f"{path} does not read as format_version 2 (KeyError: 'rows'); recompute it (--overwrite)"
    )


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


# --------------------------------------------------------------------------- encode / decode
@dataclasses.dataclass(frozen=True)
class _Inner:
    n: int
    x: float


@dataclasses.dataclass(frozen=True)
class _Every:
    """One field of each hint the decoder reads."""

    count: int
    flag: bool
    name: str
    ratio: float
    by_int: dict[int, float]
    by_float: dict[float, str]
    inner: _Inner
    maybe: _Inner | None
    pairs: tuple[tuple[int, float], ...]
    names: list[str]
    loose: dict
    mapping: Mapping[str, int]
    anything: Any
    later: int = 7
    listed: tuple[int, ...] = dataclasses.field(default_factory=tuple)


def _every() -> _Every:
    pairs = ((1, 1.5), (2, 2.5))
    return _Every(3, True, "a", 0.5, {8: 1.0, 16: math.nan}, {0.01: "low"}, _Inner(1, 2.0), None,
                  pairs, ["x"], {"k": [1]}, {"m": 4}, {"free": None}, 9, (5,))  # fmt: skip


def test_every_hint_round_trips_through_json():
    value = _every()
    raw = json.loads(results.to_json(encode(value)))
    assert raw["by_int"] == {"8": 1.0, "16": None} and raw["by_float"] == {"0.01": "low"}
    assert raw["pairs"] == [[1, 1.5], [2, 2.5]] and raw["inner"] == {"n": 1, "x": 2.0}
    assert list(raw) == [f.name for f in dataclasses.fields(_Every)]  # field order kept
    back = decode(_Every, raw, "every")
    assert math.isnan(back.by_int[16]) and back.by_int[8] == 1.0
    assert dataclasses.replace(back, by_int={}) == dataclasses.replace(value, by_int={})
    assert isinstance(back.pairs, tuple) and isinstance(back.pairs[0], tuple)
    assert isinstance(back.names, list) and list(back.by_int) == [8, 16]
    assert list(back.by_float) == [0.01] and isinstance(back.inner, _Inner)


def test_fields_with_defaults_may_be_absent_and_others_may_not():
    raw = encode(_every())
    del raw["later"], raw["listed"]
    back = decode(_Every, raw, "every")
    assert back.later == 7 and back.listed == ()
    del raw["maybe"]
    with pytest.raises(ResultError, match=r"^every\.maybe is missing \(_Every needs it\)$"):
        decode(_Every, raw, "every")


@pytest.mark.parametrize(
    "kind, value, message",
    [
        (_Inner, [1], "w is [1], not a _Inner object"),
        (_Inner, {"n": 1, "x": 1.0, "y": 2}, "w.y is not a field of _Inner (renamed? it has n, x)"),
        (_Inner, {"n": 1.5, "x": 1.0}, "w.n is 1.5, expected int"),
        (_Inner, {"n": "1", "x": 1.0}, 'w.n is "1", expected int'),
        (_Inner, {"n": 1, "x": "1"}, 'w.x is "1", expected float'),
        (_Inner, {"n": 1, "x": True}, "w.x is true, expected float"),
        (tuple[int, ...], {"a": 1}, 'w is {"a": 1}, not a list'),
        (list[int], "ab", 'w is "ab", not a list'),
        (tuple[int, ...], [1, "b"], 'w[1] is "b", expected int'),
        (list[int], [1, True], "w[1] is true, expected int"),
        (list[int], [1, 2, 3.0], "w[2] is 3.0, expected int"),
        (list[float], [1.0, 2, True], "w[2] is true, expected float"),
        (list[float], [0.5, "1"], 'w[1] is "1", expected float'),
        (list[str], ["a", None], "w[1] is null, expected str"),
        (list[bool], [True, 0], "w[1] is 0, expected bool"),
        (tuple[int, str], [1, 2], "w[1] is 2, expected str"),
        (tuple[int, str], [1], "w has 1 items, expected 2"),
        (dict[int, int], [1], "w is [1], not an object"),
        (dict, 3, "w is 3, not an object"),
        (dict[str, int], {"a": "b"}, 'w.a is "b", expected int'),
        (dict[float, int], {"x": 1}, "w: key 'x', expected float"),
        (bool, 1, "w is 1, expected bool"),
        (str, None, "w is null, expected str"),
        (int | None, "a", 'w is "a", expected int'),
        (int, "x" * 100, 'w is "' + "x" * 39 + ", expected int"),
    ],
)
def test_decode_refuses_by_one_line_naming_where(kind, value, message):
    with pytest.raises(ResultError) as error:
        decode(kind, value, "w")
    assert str(error.value) == message


@dataclasses.dataclass(frozen=True)
class _Checked:
    n: int

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n={self.n} is not allowed; it must be >= 1")


def test_a_record_its_own_checks_refuse_is_a_result_error_naming_where():
    """A file whose values break the record's own checks (a config's __post_init__) is a bad
    result file like any other, so readers that skip bad files (the report) skip it too."""
    with pytest.raises(ResultError) as error:
        decode(_Checked, {"n": 0}, "w")
    assert str(error.value) == "w is not a valid _Checked: n=0 is not allowed; it must be >= 1"


def test_a_list_of_scalars_reads_as_item_by_item_would():
    """Lists of JSON scalars take a fast path (results.py's `_plain_scalars`); what it gives
    is what decoding each item gives, types included, and what it does not take (a numpy
    float, not a JSON type) still reads item by item."""
    import numpy as np

    cases = [
        (list[float], [1, None, 2.5, -0.0]),
        (tuple[float, ...], [3, 1e300]),
        (list[int], [1, -2, 10**20]),
        (tuple[int, ...], []),
        (list[str], ["a", ""]),
        (list[bool], [True, False]),
        (list[float], [np.float64(0.5), 1]),
    ]
    for kind, value in cases:
        got = decode(kind, value, "w")
        item = typing.get_args(kind)[0]
        each = [decode(item, v, f"w[{i}]") for i, v in enumerate(value)]
        assert type(got) is typing.get_origin(kind) and len(got) == len(each)
        for a, b in zip(got, each, strict=True):
            assert type(a) is type(b) and (a == b or (math.isnan(a) and math.isnan(b)))


def test_decode_reads_the_plain_hints():
    assert decode(bool, False, "w") is False and decode(int, 0, "w") == 0
    assert decode(float, None, "w") != decode(float, None, "w")  # NaN
    assert decode(dict, {"1": 2}, "w") == {"1": 2}  # a bare dict keeps string keys
    assert decode(Mapping[int, int], {"1": 2}, "w") == {1: 2}
    assert decode(tuple[int, str], [1, "a"], "w") == (1, "a")
    assert decode(list[Any], [None], "w") == [None]
    assert decode(_Inner | None, None, "w") is None
    assert decode(_Inner | None, {"n": 1, "x": 2}, "w") == _Inner(1, 2.0)
    assert decode(int | str, "3", "w") == "3" and decode(int | str, 3, "w") == 3
    assert decode(float | str, "inf", "w") == "inf" and decode(float | str, 2, "w") == 2.0
    assert decode(Any, {"x": [1]}, "w") == {"x": [1]}


def test_encode_leaves_scalars_and_turns_containers_into_json_shapes():
    assert encode(_Inner(1, 2.0)) == {"n": 1, "x": 2.0}
    assert encode(_Inner) is _Inner  # a class is not a record
    assert encode({(1): [_Inner(2, 3.0)], "a": (1, 2)}) == {"1": [{"n": 2, "x": 3.0}], "a": [1, 2]}
    assert encode(None) is None and encode("s") == "s" and encode(1.5) == 1.5


# --------------------------------------------------------------------------- the registry
def test_register_checks_the_kind_the_migrations_and_the_class(monkeypatch):
    _private_registry(monkeypatch)
    with pytest.raises(ValueError, match=r"^kind='nope' is not allowed; use one of pretrain, tr"):
        register("nope", 2)
    with pytest.raises(ValueError, match=r"^demo: no migration from format_version 2 to 3$"):
        register("demo", 3)
    with pytest.raises(ValueError, match=r"^demo: no migration from format_version 3 to 5$"):
        register("demo", 5, {2: dict, 4: dict})
    loose = dataclasses.dataclass(type("Loose", (), {"__annotations__": {"a": int}}))
    with pytest.raises(TypeError, match=r"^Loose must be a frozen dataclass to record 'demo'$"):
        register("demo", 2)(loose)
    with pytest.raises(TypeError, match=r"^int must be a frozen dataclass"):
        register("demo", 2)(int)
    assert register("demo", 2)(_Inner) is _Inner
    schema = results.schema_of("demo")
    assert (schema.kind, schema.cls, schema.version, dict(schema.migrations)) == (
        "demo",
        _Inner,
        2,
        {},
    )
    assert results.record_kind(_Inner) == "demo"


def test_a_typed_file_read_before_its_record_class_is_registered_is_refused(monkeypatch, tmp_path):
    """results.py imports no owner: a file of a typed version whose class is not registered
    is refused in one line naming the way to read it, never read as a dict of another layout."""
    path = tmp_path / "demo.json"
    write_result(path, "demo", {"status": "running"}, meta={})
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "format_version": 3}))
    _private_registry(monkeypatch)
    monkeypatch.setattr(results, "_SCHEMAS", {})
    assert results.schema_of("demo") is None
    with pytest.raises(ResultError, match=r"demo.json is a typed 'demo' result \(format_versi"):
        read_result(path)
    with pytest.raises(ValueError, match=r"^_Inner is not a registered result record$"):
        results.record_kind(_Inner)


def test_every_owner_registers_its_kind():
    for kind, cls in OWNERS.items():
        schema = results.schema_of(kind)
        assert schema is not None and schema.kind == kind and schema.cls is cls
        assert schema.version > results.FORMAT_VERSION
        assert set(range(results.FORMAT_VERSION, schema.version)) <= set(schema.migrations)
    # every typed kind of ropekit is listed here (benchmarks/ registers its own on import)
    assert {
        k for k, s in results._SCHEMAS.items() if s.cls.__module__.startswith("ropekit")
    } == set(OWNERS)
    # the report reads every typed kind it shows as its class, never as a dict
    assert set(sections.RECORDS) == set(OWNERS) & set(sections.KINDS)
    assert all(sections.RECORDS[kind] is OWNERS[kind] for kind in sections.RECORDS)


def test_migrations_run_in_order_and_stop_at_the_current_version(monkeypatch, tmp_path):
    _private_registry(monkeypatch)
    seen = []

    def step(v):
        def migrate(data):
            seen.append((v, data["format_version"]))
            return {**data, "steps": [*data.get("steps", []), v]}

        return migrate

    @register("demo", 5, {2: step(2), 3: step(3), 4: step(4), 5: step(5)})
    @dataclasses.dataclass(frozen=True)
    class Stepped:
        meta: dict
        provenance: dict
        steps: tuple[int, ...]

    path = tmp_path / "old.json"
    path.write_text(json.dumps({"kind": "demo", "format_version": 3, "meta": {}, "provenance": {}}))
    assert read_record(path, Stepped).steps == (3, 4)
    assert seen == [(3, 3), (4, 4)]  # never past the writer's version
    path.write_text(json.dumps({"kind": "demo", "format_version": 5, "meta": {}, "provenance": {},
                                "steps": []}))  # fmt: skip
    assert read_record(path, Stepped).steps == () and seen == [(3, 3), (4, 4)]
    path.write_text(json.dumps({"kind": "demo", "format_version": 6, "meta": {}, "provenance": {}}))
    with pytest.raises(ResultError, match="format_version=6; this ropekit reads 5: recompute it"):
        read_record(path, Stepped)


# --------------------------------------------------------------------------- files
def test_read_result_says_what_is_wrong_with_a_file(tmp_path):
    path = tmp_path / "r.json"
    with pytest.raises(ResultError, match=rf"^{path} does not exist$"):
        read_result(path)
    path.write_text("{")
    with pytest.raises(ResultError, match=rf"^{path} is not valid JSON \(corrupted\?\): "):
        read_result(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ResultError, match="is not valid JSON"):
        read_result(path)
    for content in ("[1]", '{"kind": "nope"}', "{}"):
        path.write_text(content)
        with pytest.raises(
            ResultError, match=rf"^{path} is not a ropekit result \(no known 'kind'\)$"
        ):
            read_result(path)
    path.write_text(json.dumps({"kind": "schedules", "format_version": 2}))
    with pytest.raises(ResultError, match=rf"^{path} is a 'schedules' result, not a 'demo' one$"):
        read_result(path, "demo")
    assert read_result(path) == {"kind": "schedules", "format_version": 2}
    assert read_result(path, "schedules")["kind"] == "schedules"
    path.write_text(json.dumps({"kind": "schedules"}))
    with pytest.raises(ResultError, match="format_version=None; this ropekit reads 2"):
        read_result(path)


def test_make_record_puts_the_header_first_and_keeps_the_payloads_own(monkeypatch):
    monkeypatch.setattr(results, "run_metadata", lambda: {"command": "default"})
    record = make_record("schedules", {"kind": "x", "format_version": 9, "a": 1, "meta": {"m": 0}},
                         provenance={"model": "m"})  # fmt: skip
    assert list(record) == ["kind", "format_version", "meta", "provenance", "a"]
    assert record == {"kind": "schedules", "format_version": 2, "meta": {"command": "default"},
                      "provenance": {"model": "m"}, "a": 1}  # fmt: skip
    assert make_record("schedules", {}, meta={"own": 1})["meta"] == {"own": 1}
    assert make_record("schedules", {}, meta={})["provenance"] == {}
    with pytest.raises(ValueError, match=r"^kind='nope' is not allowed; use one of pretrain, "):
        make_record("nope", {})


def test_a_records_own_meta_and_provenance_are_the_header_unless_given(toy_kind):
    toy = _Toy({"command": "c"}, {"model": "m"}, {}, {})
    record = make_record("demo", toy)
    assert record["meta"] == {"command": "c"} and record["provenance"] == {"model": "m"}
    assert record["format_version"] == 4 and record["by_lr"] == {}
    other = make_record("demo", toy, meta={"command": "d"}, provenance={"model": "n"})
    assert other["meta"] == {"command": "d"} and other["provenance"] == {"model": "n"}


def test_run_metadata_records_the_command_spec_seed_and_versions(monkeypatch):
    monkeypatch.setattr(results.sys, "argv", ["ropekit", "eval", "ppl"])
    meta = run_metadata(spec="yarn:factor=2", seed=3)
    assert list(meta) == ["command", "spec", "seed", "versions", "machine", "cpu"]
    assert meta["command"] == "ropekit eval ppl" and meta["spec"] == "yarn:factor=2"
    assert meta["seed"] == 3 and run_metadata("given")["command"] == "given"
    assert {"ropekit", "torch", "python", "transformers", "numpy"} <= set(meta["versions"])
    assert meta["versions"]["python"] == results.platform.python_version()
    assert meta["machine"].endswith(" cpus") and run_metadata()["seed"] is None
    # the host's processor and the kernels torch dispatches to there (numbers move with them)
    assert meta["cpu"].endswith(f", {torch.backends.cpu.get_cpu_capability()}")
    assert len(meta["cpu"]) > len(", AVX2")


def test_plain_writes_non_finite_floats_as_null_and_paths_as_text(tmp_path):
    value = {1: [math.nan, math.inf, -math.inf, 1.5], "p": (tmp_path, 2), "s": "x"}
    assert results.plain(value) == {"1": [None, None, None, 1.5], "p": [str(tmp_path), 2], "s": "x"}
    assert results.plain(True) is True and results.plain(0.0) == 0.0
    text = results.to_json({"a": math.nan, "b": object.__new__(object)}, indent=None)
    assert text.startswith('{"a": null, "b": "<object object')
    assert results.to_json({"a": [1]}) == '{\n  "a": [\n    1\n  ]\n}'


def test_digest_is_stable_across_key_order_and_runs():
    # Pinned: a digest names cached work on disk, so it must not change between versions.
    assert results.digest({"b": [1, 2.5, None], "a": "x"}) == "d0816bdf78f5c27aa5f75b5e28fcea64"
    assert results.digest({"a": "x", "b": [1, 2.5, None]}) == "d0816bdf78f5c27aa5f75b5e28fcea64"
    assert results.digest({"a": 1}, 4) == "5b09908e"
    assert results.digest(math.nan) == results.digest(None) == "941dffce4e4308ceb33e87326003257d"
    assert results.digest({"a": 2}) != results.digest({"a": 1}, 16)


def test_result_kind_is_none_for_anything_but_a_result(tmp_path):
    path = tmp_path / "r.json"
    assert results.result_kind(path) is None  # absent
    for content, kind in [("{", None), ("[]", None), ('{"kind": 3}', None), ('{"a": 1}', None),
                          ('{"kind": "anything"}', "anything")]:  # fmt: skip
        path.write_text(content)
        assert results.result_kind(path) == kind
    path.write_bytes(b"\xff")
    assert results.result_kind(path) is None


@pytest.mark.parametrize(
    "recorded, current, field",
    [
        ({"a": 1, "b": 2}, {"a": 1, "b": 3}, "b"),
        ({"b": 1, "a": 1}, {"b": 2, "a": 2}, "a"),  # sorted: a before b
        ({"a": {"x": 1, "y": [1]}}, {"a": {"x": 1, "y": [2]}}, "a.y"),
        ({"a": 1}, {"a": 1, "c": 0}, "c"),
        ({"a": {"x": 1}}, {"a": 5}, "a"),
    ],
)
def test_check_provenance_names_the_first_differing_field(recorded, current, field):
    with pytest.raises(results.ProvenanceMismatch) as error:
        check_provenance(recorded, current, "run/x.json")
    assert str(error.value).startswith(f"run/x.json was made with other settings: {field} is ")
    assert str(error.value).endswith(
        "now; use another output folder, or --overwrite to recompute it"
    )


def test_check_provenance_shows_both_values_and_passes_equal_ones():
    check_provenance({"a": math.nan, "b": (1, 2)}, {"b": [1, 2], "a": None}, "f")  # as JSON: equal
    check_provenance({}, {}, "f")
    with pytest.raises(results.ProvenanceMismatch) as error:
        check_provenance({"m": {"n": "x" * 100}}, {"m": {"n": "y"}}, "f")
    assert f'm.n is "{"x" * 56}... there, "y" now;' in str(error.value)
    with pytest.raises(results.ProvenanceMismatch) as error:
        check_provenance({"a": {"k": 1}}, {}, "f")
    assert 'a is {"k": 1} there, null now' in str(error.value)
    short = "z" * 58  # with its quotes exactly 60 characters: shown whole
    with pytest.raises(results.ProvenanceMismatch, match=f'a is "{short}" there'):
        check_provenance({"a": short}, {"a": 0}, "f")


def test_check_replaceable_reuses_only_the_same_kind_and_provenance(tmp_path):
    path = tmp_path / "r.json"
    assert check_replaceable(path, "schedules", {"a": 1}) is False  # free
    write_result(path, "schedules", {"x": 1}, meta={}, provenance={"a": 1})
    assert check_replaceable(path, "schedules", {"a": 1}) is True
    assert check_replaceable(path, "schedules") is True  # no provenance asked: any
    assert check_replaceable(path, "schedules", {"a": 2}, overwrite=True) is False
    with pytest.raises(results.ProvenanceMismatch, match="a is 1 there, 2 now"):
        check_replaceable(path, "schedules", {"a": 2})
    with pytest.raises(ResultError) as error:
        check_replaceable(path, "demo")
    assert str(error.value) == (
        f"{path} holds a 'schedules' result, not a 'demo' result; use another output folder, "
        "or --overwrite to replace it"
    )
    path.write_text("notes")
    with pytest.raises(ResultError, match=rf"^{path} holds a file ropekit did not write, not a"):
        check_replaceable(path, "schedules")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"kind": "schedules", "format_version": 1, "provenance": {}}))
    with pytest.raises(ResultError, match="format_version=1"):
        check_replaceable(old, "schedules")


def test_check_replaceable_refuses_what_is_not_a_regular_file(tmp_path):
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ResultError, match="exists and is not a regular file; use another output"):
        check_replaceable(tmp_path / "dir.json", "schedules")
    write_result(tmp_path / "real.json", "schedules", {}, meta={})
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    (tmp_path / "dangling.json").symlink_to(tmp_path / "gone.json")
    for name in ("link.json", "dangling.json"):
        with pytest.raises(ResultError, match="is not a regular file"):
            check_replaceable(tmp_path / name, "schedules")
    assert check_replaceable(tmp_path / "link.json", "schedules", overwrite=True) is False


def test_a_typed_file_its_class_cannot_read_is_not_reused(toy_kind, tmp_path):
    path = write_result(tmp_path / "demo.json", "demo", _Toy({}, {"a": 1}, {}, {}))
    assert check_replaceable(path, "demo", {"a": 1}) is True
    data = json.loads(path.read_text())
    data["by_lr"] = {"fast": 1.0}
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError, match=r"demo\.by_lr: key 'fast', expected float"):
        check_replaceable(path, "demo", {"a": 1})


def test_write_result_replaces_atomically_and_refuses_when_told(tmp_path):
    path = tmp_path / "sub" / "r.json"
    write_result(path, "schedules", {"x": [1, math.nan]}, meta={}, indent=None)
    assert path.read_text() == (
        '{"kind": "schedules", "format_version": 2, "meta": {}, "provenance": {}, "x": [1, null]}\n'
    )
    write_result(path, "schedules", {"x": 2}, meta={})
    assert json.loads(path.read_text())["x"] == 2 and path.read_text().startswith('{\n  "kind"')
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"]  # no temporary left
    write_result(path, "schedules", {"x": 3}, meta={}, provenance={}, overwrite=False)
    with pytest.raises(results.ProvenanceMismatch):
        write_result(path, "schedules", {"x": 4}, meta={}, provenance={"a": 1}, overwrite=False)
    assert json.loads(path.read_text())["x"] == 3  # refused: left as it was
    assert write_result(path, "schedules", {}, meta={}) == path


def test_read_record_names_the_file_and_leaves_out_the_header(toy_kind, tmp_path):
    path = write_result(tmp_path / "demo.json", "demo", _Toy({"c": 1}, {}, {}, {}, note="n"))
    assert read_record(path, _Toy).note == "n" and read_record(path, _Toy).meta == {"c": 1}
    with pytest.raises(ValueError, match="_Inner is not a registered result record"):
        read_record(path, _Inner)
    path.write_text(json.dumps({**json.loads(path.read_text()), "meta": []}))
    with pytest.raises(ResultError, match=rf"^{path}: demo\.meta is \[\], not an object$"):
        read_record(path, _Toy)


# --------------------------------------------------------------------------- JSONL stages
def test_records_round_trip_one_per_line(tmp_path):
    path = tmp_path / "stage.jsonl"
    assert results.read_records(path) == []
    rows = [{"a": 1, "b": math.nan}, {"a": (2, 3)}]
    assert results.write_records(path, rows) == path
    assert path.read_text() == '{"a": 1, "b": null}\n{"a": [2, 3]}\n'
    assert results.read_records(path) == [{"a": 1, "b": None}, {"a": [2, 3]}]
    results.write_records(path, [])
    assert path.read_text() == "" and results.read_records(path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage.jsonl"]


def test_a_torn_last_line_is_dropped_and_a_damaged_one_elsewhere_is_named(tmp_path):
    path = tmp_path / "stage.jsonl"
    path.write_text('{"a": 1}\n\n   \n{"a": 2}\n{"a": ')
    assert results.read_records(path) == [{"a": 1}, {"a": 2}]
    path.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(ResultError, match=rf"^{path}, line 2, is not valid JSON \(corrupted\?\)$"):
        results.read_records(path)
    path.write_bytes(b'{"a": "\xff"}\n{"b": 1}\n')  # a stray byte is read, not a crash
    assert results.read_records(path) == [{"a": "\ufffd"}, {"b": 1}]
    path.write_text('{"a": 1}\n{"a": 2')  # torn, no newline
    assert results.read_records(path) == [{"a": 1}]
    path.write_text('{"a": \n\n')  # the only record torn, blank lines after it
    with pytest.raises(ResultError, match="line 1"):
        results.read_records(path)


# --------------------------------------------------------------------------- edges mutants found
def test_a_union_tries_every_option_but_the_last_in_order():
    assert decode(bool | int | str, 3, "w") == 3  # bool fails, int reads it
    assert decode(bool | int | str, "3", "w") == "3"
    with pytest.raises(ResultError, match=r"^w is \[\], expected str$"):
        decode(bool | int | str, [], "w")  # the last option's error


def test_a_one_place_tuple_and_unparametrized_containers():
    assert decode(tuple[int], [1], "w") == (1,)
    assert decode(typing.List, [1, "a"], "w") == [1, "a"]  # noqa: UP006 (no item hint)
    assert decode(typing.Tuple, [None], "w") == (None,)  # noqa: UP006


@pytest.mark.parametrize(
    "kind, tail",
    [
        (list[int], "not a list"),
        (dict[str, int], "not an object"),
        (_Inner, "not a _Inner object"),
    ],
)
def test_a_long_value_is_cut_at_40_characters_in_the_error(kind, tail):
    with pytest.raises(ResultError) as error:
        decode(kind, "y" * 100, "w")
    assert str(error.value) == f'w is "{"y" * 39}, {tail}'


def test_run_metadata_records_every_installed_package_and_skips_a_missing_one(monkeypatch):
    installed = {}
    for package in ("transformers", "accelerate", "peft", "safetensors", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            installed[package] = importlib.metadata.version(package)
    assert {k: v for k, v in run_metadata("c")["versions"].items() if k in installed} == installed
    real = importlib.metadata.version

    def version(package):
        if package == "peft":
            raise importlib.metadata.PackageNotFoundError(package)
        return real(package)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert "peft" not in run_metadata("c")["versions"]


def test_digest_and_provenance_write_what_json_cannot_hold_as_text():
    assert results.digest({"x": {1}}) == results.digest({"x": "{1}"})
    with pytest.raises(results.ProvenanceMismatch, match=r'x is "\{1\}" there, "\{2\}" now'):
        check_provenance({"x": {1}}, {"x": {2}}, "f")


def test_check_provenance_sorts_mixed_keys_and_shows_values_with_sorted_keys():
    with pytest.raises(results.ProvenanceMismatch, match=r"f was made with other settings: 1 is"):
        check_provenance({1: 0, "b": 1}, {1: 2, "b": 1}, "f")
    with pytest.raises(results.ProvenanceMismatch) as error:
        check_provenance({"m": {"b": 1, "a": 2}}, {"m": 3}, "f")
    assert 'm is {"a": 2, "b": 1} there, 3 now' in str(error.value)


def test_check_provenance_names_dotted_and_x_keys_as_they_are():
    with pytest.raises(results.ProvenanceMismatch, match=r": model\.name is 1 there, 2 now;"):
        check_provenance({"model.name": 1}, {"model.name": 2}, "f")  # a key with a dot
    with pytest.raises(results.ProvenanceMismatch, match=r": XL\.X is 1 there, 2 now;"):
        check_provenance({"XL": {"X": 1}}, {"XL": {"X": 2}}, "f")


def test_check_provenance_cuts_a_value_over_60_characters():
    long = "z" * 59  # with its quotes 61 characters: cut to 57 and "..."
    with pytest.raises(results.ProvenanceMismatch, match=f'a is "{"z" * 56}... there'):
        check_provenance({"a": long}, {"a": 0}, "f")


def test_check_replaceable_names_the_file_whose_provenance_differs(tmp_path):
    path = write_result(tmp_path / "r.json", "schedules", {}, meta={}, provenance={"a": 1})
    with pytest.raises(results.ProvenanceMismatch, match=rf"^{path} was made with other"):
        check_replaceable(path, "schedules", {"a": 2})


def test_write_result_replaces_by_default_whatever_was_there(tmp_path):
    path = write_result(tmp_path / "r.json", "schedules", {}, meta={}, provenance={"a": 1})
    write_result(path, "schedules", {}, meta={}, provenance={"a": 2})
    assert json.loads(path.read_text())["provenance"] == {"a": 2}


def test_a_record_of_an_untyped_kind_is_refused():
    with pytest.raises(ValueError, match=r"^a _Inner is not a 'schedules' record$"):
        make_record("schedules", _Inner(1, 2.0))


def test_read_errors_name_the_file(toy_kind, tmp_path):
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({"kind": "demo", "format_version": 9, "meta": {}}))
    with pytest.raises(ResultError, match=rf"^{path} has format_version=9; this ropekit reads 4"):
        read_result(path)
    write_result(path, "schedules", {}, meta={})
    with pytest.raises(ResultError, match=rf"^{path} is a 'schedules' result, not a 'demo' one$"):
        read_record(path, _Toy)


@pytest.fixture
def ascii_locale():
    """The process's text locale switched to C, whose encoding is ASCII: what a file opened
    without an encoding is read as on a machine whose locale is not UTF-8 (Windows' cp1252, a
    server's C or latin-1 locale). Skipped in Python's UTF-8 mode, where every locale reads as
    UTF-8."""
    saved = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        if codecs.lookup(locale.getpreferredencoding(False)).name == "utf-8":
            pytest.skip("the C locale reads as UTF-8 here (Python's UTF-8 mode)")
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, saved)


def test_stage_files_result_kinds_and_results_read_as_utf8_under_a_non_utf8_locale(
    tmp_path, ascii_locale
):
    """A JSON file with non-ASCII text written as UTF-8 (by a tool that writes it unescaped, or
    by hand) reads back as that text whatever the machine's locale."""
    stage = tmp_path / "stage.jsonl"
    stage.write_bytes('{"origin": "café ✓"}\n'.encode())
    assert results.read_records(stage) == [{"origin": "café ✓"}]
    result = tmp_path / "r.json"
    result.write_bytes('{"kind": "schedules", "note": "café"}'.encode())
    assert results.result_kind(result) == "schedules"
    current = tmp_path / "current.json"  # a result of this format version, with a note in UTF-8
    write_result(current, "schedules", {}, meta={})
    data = {**json.loads(current.read_bytes()), "note": "café ✓"}
    current.write_bytes(json.dumps(data, ensure_ascii=False).encode())
    assert results.read_result(current, "schedules")["note"] == "café ✓"
