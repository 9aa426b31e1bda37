"""analysis.json as a typed record: every committed analysis file (the untyped layout of
format_version 2, written by ``analyze`` before the record) reads as an ``AnalysisResult``, a
renamed field is refused naming it, and a current file round-trips through its class."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ropekit.analysis import AnalysisResult, summary_lines
from ropekit.analysis.plots import planned_figures, write_figures
from ropekit.analysis.record import VERSION, AnalysedLayer, nested
from ropekit.results import ResultError, encode, read_record, result_kind, schema_of, write_result

from ..records import assert_refused

DATA = Path(__file__).parent / "data"
# analysis.json files written by the untyped ``analyze`` (format_version 2): an AdaRoPE decoder
# on given ids (influence; no tokenizer, no split; AdaRoPE's learned fields only), tuned-yarn
# on a token stream (its knobs only; no split) and ALiBi (no rotary sections).
V2 = sorted(DATA.glob("v2/*/analysis.json"))


def _committed() -> list[Path]:
    """Every analysis.json committed under tests/ (and any file whose kind is analysis)."""
    root = Path(__file__).parents[1]
    return sorted(p for p in root.rglob("*.json") if result_kind(p) == "analysis")


def test_the_committed_files_are_the_untyped_layout_and_all_read():
    assert [p.parent.name for p in V2] == ["adarope", "alibi", "tuned-yarn"]
    for path in V2:
        assert json.loads(path.read_text())["format_version"] == 2
    committed = _committed()
    assert set(V2) <= set(committed)
    for path in committed:  # any other analysis file committed beside them reads too
        assert read_record(path, AnalysisResult).spec


def test_the_analysis_kind_is_registered_at_its_version_with_a_migration_from_2():
    schema = schema_of("analysis")
    assert schema is not None and schema.cls is AnalysisResult and schema.version == VERSION
    assert set(schema.migrations) == set(range(2, VERSION))


@pytest.mark.parametrize("path", V2, ids=lambda p: p.parent.name)
def test_every_committed_file_reads_as_the_record(path: Path, tmp_path: Path):
    raw = json.loads(path.read_text())
    record = read_record(path, AnalysisResult)
    assert record.model.class_name == raw["model"]["class"] == "Decoder"
    assert record.spec == raw["spec"] and record.figures == raw["figures"]
    assert record.data.tokens == raw["data"]["tokens"]
    assert record.effective_length.lengths == tuple(raw["effective_length"]["lengths"])
    assert set(planned_figures(record)) == set(raw["figures"])  # drawn as it was drawn
    assert summary_lines(record)[0].startswith(f"Decoder with {raw['spec']}: ")
    # written again, it is the current layout and reads back as the same record
    again = write_result(tmp_path / "analysis.json", "analysis", record)
    assert json.loads(again.read_text())["format_version"] == VERSION
    assert json.dumps(encode(read_record(again, AnalysisResult))) == json.dumps(encode(record))


def test_the_migration_fills_what_each_old_layout_left_out():
    adarope, alibi, tuned = (read_record(p, AnalysisResult) for p in V2)
    assert adarope.data.tokenizer is None and adarope.data.split is None  # given ids
    assert adarope.data.source == "tensor" and adarope.data.starts is None
    assert tuned.data.tokenizer == "bytes" and tuned.data.starts is not None
    learned = adarope.schedule.learned
    assert learned.kind == "adarope" and learned.knobs is None and learned.init_knobs is None
    assert isinstance(learned.share_layers, bool) and isinstance(learned.l_ref, int)
    assert learned.gamma is not None and learned.dxi is not None
    knobs = tuned.schedule.learned
    assert knobs.kind == "tuned-yarn" and knobs.share_layers is None and knobs.l_ref is None
    assert set(knobs.knobs) == set(knobs.init_knobs) and knobs.gamma is None
    assert alibi.utilization is None and alibi.schedule is None and alibi.influence is None
    assert list(alibi.skipped) == ["utilization", "schedule", "influence"]
    assert set(adarope.influence.kinds()) == {"freq", "scale"}
    assert adarope.effective_length.betas == (2.0, "inf")  # JSON has no infinity


def test_a_file_from_before_layer_types_reads_as_every_layer_of_full_attention(tmp_path: Path):
    path, data = _current(tmp_path)
    n_layers = data["model"]["n_layers"]
    del data["layers"]
    path.write_text(json.dumps({**data, "format_version": 3}))
    record = read_record(path, AnalysisResult)
    assert record.layers == tuple(AnalysedLayer(i, "full_attention") for i in range(n_layers))
    assert [layer.label for layer in record.layers] == ["L0 full_attention", "L1 full_attention"]


def test_a_committed_file_still_draws_every_figure(tmp_path: Path):
    record = read_record(DATA / "v2" / "adarope" / "analysis.json", AnalysisResult)
    paths = write_figures(record, tmp_path)
    assert set(paths) == set(record.figures) and len(paths) == 7


def _current(tmp_path: Path) -> tuple[Path, dict]:
    record = read_record(DATA / "v2" / "adarope" / "analysis.json", AnalysisResult)
    path = write_result(tmp_path / "analysis.json", "analysis", record)
    return path, json.loads(path.read_text())


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda d: d["model"].update(cls=d["model"].pop("class_name")),
            "analysis.model.cls is not a field of ModelShape (renamed?",
        ),
        (
            lambda d: d["utilization"].update(cov_per_head=d["utilization"].pop("cov")),
            "analysis.utilization.cov_per_head is not a field of Utilization (renamed?",
        ),
        (
            lambda d: d["influence"]["freq"]["top"][0].pop("delta_nll"),
            "analysis.influence.freq.top[0].delta_nll is missing (InfluenceUnit needs it)",
        ),
        (
            lambda d: d["schedule"]["learned"].pop("knobs"),
            "analysis.schedule.learned.knobs is missing (Learned needs it)",
        ),
        (
            lambda d: d["data"].update(starts="0"),
            'analysis.data.starts is "0", not a list',
        ),
    ],
    ids=["renamed-model", "renamed-section", "missing-unit", "missing-learned", "type"],
)
def test_a_renamed_missing_or_mistyped_field_is_refused_naming_it(tmp_path, change, message):
    path, data = _current(tmp_path)
    change(data)
    assert_refused(path, data, AnalysisResult, message)


def test_an_old_file_with_a_current_field_name_is_not_read_as_current(tmp_path: Path):
    """A version 2 file keeps its own names: one already renamed is an error, not a default."""
    data = json.loads((DATA / "v2" / "alibi" / "analysis.json").read_text())
    data["model"]["class_name"] = data["model"].pop("class")
    path = tmp_path / "analysis.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError, match=r"does not read as format_version 2 \(KeyError: 'class'"):
        read_record(path, AnalysisResult)


def test_nested_makes_tuples_of_lists_and_leaves_numbers():
    grid = nested([[1.0, math.nan], [2.0]])
    assert grid[0][0] == 1.0 and math.isnan(grid[0][1]) and grid[1] == (2.0,)
    assert nested(3) == 3 and nested(None) is None and nested(([1],)) == ((1,),)
