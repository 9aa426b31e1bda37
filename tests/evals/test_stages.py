"""Stage.claim: a stage folder resumes under its own provenance, is refused under another
(naming what differs), and is cleared and redone with overwrite."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest

from ropekit.evals.stages import Stage
from ropekit.results import ResultError, write_records


@dataclass
class _Toy(Stage):
    kind: ClassVar[str] = "task-stage"
    records_file: ClassVar[str] = "data.jsonl"
    settings: ClassVar[str] = "toy settings"


def test_a_new_stage_records_its_provenance_before_any_work(tmp_path):
    stage = _Toy(64, tmp_path / "64", {"seed": 0})
    stage.claim(False, task="toy")
    summary = json.loads((tmp_path / "64" / "summary.json").read_text())
    assert summary["complete"] is False and summary["task"] == "toy"
    assert summary["length"] == 64 and summary["stage"] == stage.fingerprint
    _Toy(64, tmp_path / "64", {"seed": 0}).claim(False, task="toy")  # the same: resumes


def test_another_provenance_is_refused_naming_the_field_then_redone_with_overwrite(tmp_path):
    _Toy(64, tmp_path / "64", {"seed": 0}).claim(False)
    other = _Toy(64, tmp_path / "64", {"seed": 1})
    with pytest.raises(ResultError, match="seed"):
        other.claim(False)
    other.claim(True)
    summary = json.loads((tmp_path / "64" / "summary.json").read_text())
    assert summary["stage"] == other.fingerprint


def test_records_of_another_stage_without_a_summary_are_refused(tmp_path):
    folder = tmp_path / "64"
    folder.mkdir()
    write_records(folder / "data.jsonl", [{"stage": "someone-else"}])
    with pytest.raises(ResultError, match=r"data\.jsonl was made with other settings \(toy"):
        _Toy(64, folder, {"seed": 0}).claim(False)
    assert not (folder / "summary.json").exists()
    _Toy(64, folder, {"seed": 0}).claim(True)
    assert not (folder / "data.jsonl").exists()  # cleared with the folder
