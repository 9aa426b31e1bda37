"""demo.json as a typed record: every committed demo file (the untyped layout of format_version
2, written by ``ropekit demo`` before the record) reads as a ``DemoResult`` holding the numbers
the file holds, a renamed field is refused naming it, the report and the terminal table render
from it, and a current file round-trips through its class."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from ropekit.demo import (
    METHODS,
    PRESETS,
    VERSION,
    DemoResult,
    MethodRow,
    _notes,
    summary_table,
)
from ropekit.report.build import build_report
from ropekit.report.sections import fmt
from ropekit.results import ResultError, read_record, result_kind, schema_of, write_result

from .records import assert_refused

DATA = Path(__file__).parent / "demo_data"  # demo.json files written at older versions
# demo.json files written by the untyped ``ropekit demo`` (format_version 2): the quick preset
# (two tasks the base model retrieves at L, three lengths), the tiny one (a task it does not
# retrieve) and a quick run stopped after its first write (status and config only).
DONE = [DATA / "v2" / "quick" / "demo.json", DATA / "v2" / "tiny" / "demo.json"]
RUNNING = DATA / "v2" / "running" / "demo.json"
# The untyped layout's copies of config fields, which the migration drops.
COPIES = ("context", "target_length", "lengths", "data", "extend_samples", "task_samples", "tasks")


def _raw(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_committed_files_are_the_untyped_layout_and_all_read():
    committed = sorted(p for p in DATA.rglob("*.json") if result_kind(p) == "demo")
    assert committed == sorted([*DONE, RUNNING])
    for path in committed:
        assert _raw(path)["format_version"] == 2
        assert read_record(path, DemoResult).config.preset in ("quick", "tiny")


def test_the_demo_kind_is_registered_at_its_version_with_a_migration_from_2():
    schema = schema_of("demo")
    assert schema is not None and schema.cls is DemoResult and schema.version == VERSION == 3
    assert set(schema.migrations) == {2}


@pytest.mark.parametrize("path", DONE, ids=lambda p: p.parent.name)
def test_a_finished_file_reads_with_the_numbers_it_holds(path: Path):
    raw, record = _raw(path), read_record(path, DemoResult)
    outcome = record.finished()
    assert record.status == "done" and record.config == PRESETS[raw["config"]["preset"]]
    # the copies the migration drops are what the config says
    config = record.config
    copies = (config.context, config.target_length, config.lengths, config.data)
    copies += (config.extend_samples, config.task_samples, list(config.tasks))
    assert copies == tuple(raw[k] for k in COPIES)
    assert [m.name for m in outcome.methods] == list(METHODS)
    for m, old in zip(outcome.methods, raw["methods"], strict=True):
        assert m.bpb == {int(n): v for n, v in old["bpb"].items()}  # lengths are ints again
        assert sorted(m.bpb) == config.lengths
        assert m.tasks == {t: {int(n): v for n, v in s.items()} for t, s in old["tasks"].items()}
        assert (m.spec, m.trainable, m.extend_s, m.final_loss) == (
            old["spec"], old["trainable"], old["extend_s"], old["final_loss"]
        )  # fmt: skip
        assert dataclasses.asdict(m.files) == old["files"]
    base = outcome.base
    assert (base.key, base.parameters, base.reused) == (
        raw["base"]["key"], raw["base"]["parameters"], raw["base"]["reused"]
    )  # fmt: skip
    assert [dataclasses.asdict(st) for st in base.stages] == raw["base"]["stages"]
    assert list(outcome.notes) == raw["notes"] and outcome.timings == raw["timings"]
    assert outcome.figures == raw["figures"] and outcome.analysis == raw["analysis"]


@pytest.mark.parametrize("path", DONE, ids=lambda p: p.parent.name)
def test_the_notes_read_from_the_record_are_those_the_untyped_demo_wrote(path: Path):
    record = read_record(path, DemoResult)
    methods = list(record.finished().methods)
    assert _notes(record.config, methods) == list(record.finished().notes)


def test_a_run_stopped_after_its_first_write_reads_without_an_outcome():
    record = read_record(RUNNING, DemoResult)
    assert record.status == "running" and record.outcome is None
    assert record.config == PRESETS["quick"]
    with pytest.raises(ValueError, match=r"^the demo has not finished \(status 'running'\)$"):
        record.finished()


@pytest.mark.parametrize("path", [*DONE, RUNNING], ids=lambda p: p.parent.name)
def test_written_again_a_file_is_the_current_layout_and_reads_back_the_same(path, tmp_path):
    record = read_record(path, DemoResult)
    again = write_result(tmp_path / "demo.json", "demo", record)
    raw = _raw(again)
    assert raw["format_version"] == VERSION and not set(COPIES) & set(raw)
    assert read_record(again, DemoResult) == record


def _current(tmp_path: Path) -> tuple[Path, dict]:
    path = write_result(tmp_path / "demo.json", "demo", read_record(DONE[0], DemoResult))
    return path, _raw(path)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda d: d.update(result=d.pop("outcome")),
            "demo.result is not a field of DemoResult (renamed?",
        ),
        (
            lambda d: d["outcome"]["methods"][0].update(bits=d["outcome"]["methods"][0].pop("bpb")),
            "demo.outcome.methods[0].bits is not a field of MethodRow (renamed?",
        ),
        (
            lambda d: d["config"]["base"].update(L=d["config"]["base"].pop("context")),
            "demo.config.base.L is not a field of BaseRecipe (renamed?",
        ),
        (
            lambda d: d["outcome"]["base"]["stages"][1].pop("retrieval_ratio"),
            "demo.outcome.base.stages[1].retrieval_ratio is missing (BaseStage needs it)",
        ),
        (
            lambda d: d["outcome"]["methods"][2]["files"].pop("extend"),
            "demo.outcome.methods[2].files.extend is missing (MethodFiles needs it)",
        ),
        (
            lambda d: d["outcome"]["methods"][0]["bpb"].update(L=0.0),
            "demo.outcome.methods[0].bpb: key 'L', expected int",
        ),
    ],
    ids=[
        "renamed-outcome",
        "renamed-row",
        "renamed-config",
        "missing-stage",
        "missing-file",
        "key",
    ],
)
def test_a_renamed_missing_or_mistyped_field_is_refused_naming_it(tmp_path, change, message):
    path, data = _current(tmp_path)
    change(data)
    assert_refused(path, data, DemoResult, message)


def test_an_old_finished_file_without_a_copied_field_is_not_its_version(tmp_path: Path):
    """The migration drops the config's copies only where the old layout had them."""
    data = _raw(DONE[1])
    del data["lengths"]
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError, match=r"does not read as format_version 2 \(KeyError: 'len"):
        read_record(path, DemoResult)


def test_score_is_none_only_where_a_task_does_not_fit():
    row = read_record(DONE[0], DemoResult).finished().methods[0]
    skipped = dataclasses.replace(row, tasks={"kv1_shakespeare": {768: 0.5}})
    assert skipped.score("kv1_shakespeare", 768) == 0.5
    assert skipped.score("kv1_shakespeare", 96) is None
    with pytest.raises(KeyError):  # every method ran every task
        skipped.score("passkey_shakespeare", 96)


def _with_first_task_skipped_at(record: DemoResult, length: int) -> DemoResult:
    """``record`` as if its first task did not fit in ``length`` bytes."""
    task = record.config.tasks[0]

    def skip(m: MethodRow) -> MethodRow:
        scores = {n: v for n, v in m.tasks[task].items() if n != length}
        return dataclasses.replace(m, tasks={**m.tasks, task: scores})

    outcome = record.finished()
    methods = tuple(skip(m) for m in outcome.methods)
    return dataclasses.replace(record, outcome=dataclasses.replace(outcome, methods=methods))


def test_the_terminal_table_shows_every_method_and_a_dash_where_a_task_does_not_fit():
    record = read_record(DONE[0], DemoResult)
    lengths, tasks = record.config.lengths, record.config.tasks
    lines = summary_table(_with_first_task_skipped_at(record, lengths[0]))
    assert lines[0].split() == [
        "method", "trained", *(f"bpb@{n}" for n in lengths),
        *(f"{t.removesuffix('_shakespeare')}@{n}" for t in tasks for n in lengths),
    ]  # fmt: skip
    for line, m in zip(lines[2:], record.finished().methods, strict=True):
        cells = [f"{m.bpb[n]:.3f}" for n in lengths]
        cells += ["-" if (t, n) == (tasks[0], lengths[0]) else f"{m.tasks[t][n]:.0%}"
                  for t in tasks for n in lengths]  # fmt: skip
        assert line.split() == [m.name, f"{m.trainable:,}", *cells]


def test_the_report_of_a_folder_with_an_old_demo_file_renders_its_numbers(tmp_path: Path):
    raw = _raw(DONE[0])
    shutil.copy(DONE[0], tmp_path / "demo.json")
    md = build_report(tmp_path).markdown.read_text()
    lengths = raw["lengths"]
    for m in raw["methods"]:
        row = next(line for line in md.splitlines() if line.startswith(f"| {m['name']} | "))
        cells = [fmt(m["bpb"][str(n)]) for n in lengths]
        cells += [f"{100 * m['tasks'][t][str(n)]:.0f}%" for t in raw["tasks"] for n in lengths]
        assert row == f"| {m['name']} | {fmt(m['trainable'])} | " + " | ".join(cells) + " |"
    for note in raw["notes"]:
        assert note in md
    assert f"trained at L = {raw['context']} bytes" in md


def test_the_report_of_an_unfinished_demo_says_so(tmp_path: Path):
    shutil.copy(RUNNING, tmp_path / "demo.json")
    md = build_report(tmp_path).markdown.read_text()
    assert "The demo in . has not finished (running)." in md
