"""compare.json as a typed record (``ropekit.compare.record``): every committed comparison
reads through the one reader (migrated from the untyped layout), its report is made from
attributes, and a running comparison's file stays resumable by this version."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from ropekit.compare import CompareConfig, from_file
from ropekit.compare.record import VERSION, CompareResult, Verdict
from ropekit.compare.report import report_blocks
from ropekit.compare.run import _folder_config
from ropekit.evals.intervals import accuracy_entry
from ropekit.report.document import to_markdown
from ropekit.results import ResultError, check_replaceable, read_record, write_result

ROOT = Path(__file__).resolve().parents[2]
# Experiment E's folder is rewritten by its running comparison as jobs finish: read, never
# written (copies go to tmp_path).
RUNNING = ROOT / "experiments/smollm2_32k/final/compare.json"
# Experiment D's out-of-domain comparison as it was committed in the untyped layout (format
# version 2), with the report this version makes of it: the migration's fixture, frozen here
# since the committed folder was brought up to date (`ropekit report --engines`).
FINISHED = Path(__file__).resolve().parent / "data/ood_v2/compare.json"
COMMITTED = sorted({RUNNING, *ROOT.glob("experiments/smollm2_16k/**/compare.json")})


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_comparison_reads_as_a_compare_result(path, tmp_path):
    record = read_record(path, CompareResult)
    assert isinstance(record.verdict, Verdict) and record.verdict.winner in record.table
    assert record.baseline in record.table and record.served is not None
    for label, domains in record.table.items():
        for domain, rows in domains.items():
            assert set(rows) <= set(record.lengths)  # int lengths in memory
            for n, entry in rows.items():
                assert len(entry.ppl) == len(entry.last_quarter_blocks) == len(entry.position_nll)
                assert record.summary[label][domain][n].ppl.n == len(entry.ppl)
    assert record.compare_config.target_length == record.target_length
    # its report drawn elsewhere: a test writes nothing into the committed experiment
    text = to_markdown(report_blocks(record, tmp_path), tmp_path)
    assert record.verdict.sentence in text


def test_a_comparison_written_before_distances_keeps_its_table_and_says_what_it_measured(
    tmp_path,
):
    """Experiment E's compare.json (format version 5) probed one needle at depth 0.5 of each
    haystack: it reads with its retrieval as written, per haystack length, and none by
    distance; its report says a length there was not the needle's distance; written again at
    this version, the table stays."""
    record = read_record(RUNNING, CompareResult)
    written = json.loads(RUNNING.read_text())["retrieval"]
    assert record.retrieval == {} and set(record.length_retrieval) == set(written)
    for label, by_length in written.items():
        kept = record.length_retrieval[label]
        assert {n: (e.correct, e.n) for n, e in kept.items()} == {
            int(n): (e["correct"], e["n"]) for n, e in by_length.items()
        }
    text = to_markdown(report_blocks(record, tmp_path), tmp_path)
    assert "| method | @16384 | @32768 |" in text
    assert "(depth 0.5: about n / 2), so @n is not a distance of n" in text
    again = read_record(write_result(tmp_path / "compare.json", "compare", record), CompareResult)
    assert again.length_retrieval == record.length_retrieval


def test_the_report_of_a_finished_comparison_is_the_committed_one_byte_for_byte(tmp_path):
    """The untyped layout (format_version 2, without held_out, blocks or collapsed) migrated
    and reported from attributes gives the report the dict reader wrote."""
    record = read_record(FINISHED, CompareResult)
    text = to_markdown(report_blocks(record, tmp_path), tmp_path)  # its figures go there
    assert text == (FINISHED.parent / "report.md").read_text()
    assert json.loads(FINISHED.read_text())["format_version"] == 2  # migrated in memory only


def test_a_record_written_at_this_version_reads_back_equal(tmp_path):
    record = read_record(FINISHED, CompareResult)
    path = write_result(tmp_path / "compare.json", "compare", record)
    assert json.loads(path.read_text())["format_version"] == VERSION
    assert read_record(path, CompareResult) == record


def test_a_running_comparison_resumes_from_the_file_it_wrote(tmp_path):
    """Restarted with this version, experiment E's comparison accepts its own compare.json
    (written by the version before): its config is the folder's, the same or with methods
    added (stage 2's, while the file still holds stage 1's), the file reusable, nothing
    refused."""
    out = tmp_path / "final"
    out.mkdir()
    shutil.copy(RUNNING, out / "compare.json")
    config = from_file(ROOT / "experiments/smollm2_32k/compare.json")
    written = read_record(out / "compare.json", CompareResult).provenance["config"]
    recorded = _folder_config(out, config, print)
    assert recorded == written
    assert set(CompareConfig(**written).labels) <= set(config.labels)
    assert check_replaceable(out / "compare.json", "compare", {"config": recorded}) is True


def test_a_verdict_written_before_the_seeds_spread_reads_without_it(tmp_path):
    """format_version 3: the difference's error was over windows and blocks only; it reads
    with no seeds' spread and the error as written (never recomputed on reading)."""
    record = read_record(FINISHED, CompareResult)
    path = write_result(tmp_path / "compare.json", "compare", record)
    data = json.loads(path.read_text())
    assert data["verdict"]["difference"].keys() >= {"se_seeds", "seeds"}
    for key in ("se_seeds", "seeds"):
        del data["verdict"]["difference"][key]
    data["format_version"] = 3
    path.write_text(json.dumps(data))
    old = read_record(path, CompareResult)
    assert old.verdict.difference.se_seeds is None and old.verdict.difference.seeds is None
    assert old.verdict.difference.se == record.verdict.difference.se
    data["format_version"] = VERSION  # at this version the fields are written: refused
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError, match=r"compare\.verdict\.difference\.se_seeds is missing"):
        read_record(path, CompareResult)


@pytest.mark.parametrize(
    "rename",
    [("verdict", "winner", "best"), (None, "held_out", "held"), ("verdict", "serving", "engines")],
)
def test_a_renamed_field_is_refused_in_one_line_naming_it(tmp_path, rename):
    where, old, new = rename
    data = json.loads(FINISHED.read_text())
    data["held_out"] = {}  # present in files written since (the migration adds it otherwise)
    parent = data if where is None else data[where]
    parent[new] = parent.pop(old)
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError) as error:
        read_record(path, CompareResult)
    field = new if where is None else f"{where}.{new}"
    assert str(error.value).startswith(f"{path}: compare.{field} is not a field of ")
    assert "\n" not in str(error.value)
    # and the check that guards a folder refuses it too, rather than replacing it
    with pytest.raises(ResultError, match=re.escape(f"compare.{field} is not a field")):
        check_replaceable(path, "compare", {"config": data["config"]})


def test_a_file_of_this_version_lacking_a_field_is_refused(tmp_path):
    record = read_record(FINISHED, CompareResult)
    path = write_result(tmp_path / "compare.json", "compare", record)
    data = json.loads(path.read_text())
    del data["served"]  # at version 2 absent meant "never asked"; at this version it is written
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError, match=r"compare\.served is missing"):
        read_record(path, CompareResult)
    kept = dataclasses.replace(record, served=None)
    assert read_record(write_result(path, "compare", kept), CompareResult).served is None


def _v2_retrieval(label: str, counted: bool) -> dict:
    """compare.json's retrieval as the untyped writer wrote it: one seed's probes at 1024
    tokens (``counted``: with the wrong answers naming another needle, else as summaries
    written before they were counted)."""
    seed = {"length": 1024, **accuracy_entry(3, 4)}
    if counted:
        seed.update(other_needle=1, nearest_needle=0)
    pooled = {**accuracy_entry(3, 4), "runs": 1, "other_needle": 1, "nearest_needle": 0}
    return {label: {"1024": {**pooled, "per_seed": [{**seed, "seed": 0}]}}}


@pytest.mark.parametrize("counted", [True, False])
def test_the_oldest_untyped_layout_reads_as_its_readers_took_it(tmp_path, counted):
    """A format_version 2 file without any field later writers added (held_out, skipped,
    single_documents, probes, served, the blocks, the curves, collapsed, the verdict's
    retrieval note, the block errors, beyond_margin, the distractor counts) reads with the
    value its readers assumed when it was absent; retrieval keys become int lengths (kept per
    length: they predate distances)."""
    data = json.loads(FINISHED.read_text())
    for key in ("held_out", "skipped", "single_documents", "probes", "served"):
        data.pop(key, None)
    verdict = data["verdict"]
    for key in ("collapsed", "retrieval"):
        verdict.pop(key, None)
    for entry in verdict["serving"].values():
        del entry["beyond_margin"]
    for key in ("se_windows", "se_blocks", "block_tokens", "blocks"):
        verdict["difference"].pop(key, None)
    for domains in data["table"].values():
        for rows in domains.values():
            for entry in rows.values():
                entry.pop("last_quarter_blocks", None)
                del entry["position_nll"]
    data["retrieval"] = _v2_retrieval(data["baseline"], counted)
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(data))
    record = read_record(path, CompareResult)
    assert (record.held_out, record.skipped, record.single_documents) == ({}, (), False)
    assert record.probes is None and record.served is None
    assert record.verdict.collapsed == () and record.verdict.retrieval is None
    assert record.verdict.difference.se_blocks is None
    assert all(e.beyond_margin is None for e in record.verdict.serving.values())
    for domains in record.table.values():
        for rows in domains.values():
            for entry in rows.values():
                assert entry.last_quarter_blocks == entry.position_nll == (None,) * len(entry.ppl)
    assert record.retrieval == {}
    pooled = record.length_retrieval[record.baseline][1024]
    assert (pooled.correct, pooled.n, pooled.per_seed[0].seed) == (3, 4, 0)
    assert pooled.per_seed[0].other_needle == (1 if counted else None)
    text = to_markdown(report_blocks(record, tmp_path), tmp_path)
    assert record.verdict.sentence in text


def test_a_method_recorded_as_the_user_wrote_it_reads_by_its_canonical_spec(tmp_path):
    """format_version 5 recorded each method as the user wrote it: read now, its spec is the
    canonical one (a factor it left out is N / L0, extend's rule), the text it was written as
    is kept as ``given``, and the config it records (provenance and ``config``) names the
    canonical specs, so the folder is the comparison a rerun spelling the factor out makes.
    Every committed comparison wrote its specs canonical already: given == spec there."""
    record = read_record(FINISHED, CompareResult)
    assert record.trained_at * 2 == record.target_length
    path = write_result(tmp_path / "compare.json", "compare", record)
    data = json.loads(path.read_text())
    data["format_version"] = 5
    for method in data["methods"]:
        del method["given"]
    yarn = next(m for m in data["methods"] if m["spec"] == "yarn:factor=2")
    yarn["spec"] = "yarn"
    for config in (data["config"], data["provenance"]["config"]):
        config["methods"] = ["yarn" if m == "yarn:factor=2" else m for m in config["methods"]]
    path.write_text(json.dumps(data))
    old = read_record(path, CompareResult)
    method = next(m for m in old.methods if m.label == yarn["label"])
    assert (method.spec, method.given) == ("yarn:factor=2", "yarn")
    assert old.config == record.config and old.provenance == record.provenance
    for committed in COMMITTED:
        assert all(m.given == m.spec for m in read_record(committed, CompareResult).methods)


@pytest.mark.slow
def test_experiment_e_resumes_with_nothing_left_to_run():
    """Issue 55, must 7: planned by this version (its jobs, names and canonical specs), the
    committed experiment E has nothing left: every job's result is in its folder (a changed
    job name, folder or spec would put it back in the plan); the plan writes nothing there.
    Opens SmolLM2-135M (installed from the GGUF, offline) and tokenizes the held-out domains:
    a few minutes."""
    from ropekit.compare import plan_compare
    from ropekit.hf import install_model

    install_model("smollm2-135m")
    final = RUNNING.parent
    before = sorted((str(p), p.stat().st_mtime_ns) for p in final.rglob("*"))
    plan = plan_compare(from_file(ROOT / "experiments/smollm2_32k/compare.json"), final)
    assert plan.startswith("plan: 11 methods; 12 training runs")
    assert "; left (a job in progress counted whole): none (rough" in plan
    assert sorted((str(p), p.stat().st_mtime_ns) for p in final.rglob("*")) == before
