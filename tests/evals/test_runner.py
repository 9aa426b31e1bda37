"""The staged runner end to end on tiny models: the file layout, resuming (a finished run calls
the model zero times; a partial one predicts only what is missing), settings checks, skipped
tasks, Hugging Face models with a chat template."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ropekit.evals import EvalConfig, as_language_model, get_task, run_passkey, run_ruler
from ropekit.evals.runner import VERSION, TasksResult
from ropekit.results import ResultError, read_record
from ropekit.results import read_records as read_jsonl
from ropekit.results import write_records as write_jsonl

from .models import tiny_decoder, tiny_llama

OPTIONS = {"progress": False}


class PromptCounter:
    """Counts the prompts a model prefills (forward calls on more than one new token)."""

    def __init__(self, model: torch.nn.Module):
        self.prompts = 0
        model.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, output):
        ids = args[0] if args else kwargs["input_ids"]  # Decoder: positional; HF: keyword
        if ids.shape[1] > 1:
            self.prompts += ids.shape[0]


def _files(out):
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*.jsonl"))}


def test_passkey_run_writes_stages_and_resumes_without_recomputing(tmp_path):
    model = tiny_decoder()
    counter = PromptCounter(model)
    config = EvalConfig((96, 128), samples=2, depths=(0.0, 1.0), seed=3, batch_size=3)
    summary = run_passkey(
        model, config, tmp_path, spec="rope", command="ropekit eval passkey", **OPTIONS
    )
    assert counter.prompts == 8  # 2 lengths x 2 depths x 2 samples

    for length in (96, 128):
        stage = tmp_path / "passkey" / str(length)
        data, pred = read_jsonl(stage / "data.jsonl"), read_jsonl(stage / "pred.jsonl")
        assert [r["index"] for r in data] == [r["index"] for r in pred] == [0, 1, 2, 3]
        assert all(r["n_tokens"] + r["max_new_tokens"] <= length for r in data)
        stage_summary = json.loads((stage / "summary.json").read_text())
        assert stage_summary["n"] == 4 and stage_summary["complete"]
        assert [d["depth"] for d in stage_summary["by_depth"]] == [0.0, 1.0]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert read_record(tmp_path / "summary.json", TasksResult) == summary
    assert saved["format_version"] == VERSION and saved["tasks"]["passkey"]["spec"]["needle"]
    assert saved["spec"] == "rope" and saved["seed"] == 3 and "versions" in saved["meta"]
    assert saved["meta"]["command"] == "ropekit eval passkey"
    task = saved["tasks"]["passkey"]
    assert [s["length"] for s in task["scores"]] == [96, 128]
    assert {(c["length"], c["depth"]) for c in task["cells"]} == {
        (n, d) for n in (96, 128) for d in (0.0, 1.0)
    }
    assert "effective_length" in task and saved["effective_length"]["threshold"] == 0.5
    for name in ("accuracy_vs_length.png", "passkey/heatmap.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"

    before = _files(tmp_path)
    again = run_passkey(model, config, tmp_path, **OPTIONS)
    assert counter.prompts == 8  # nothing recomputed
    assert _files(tmp_path) == before
    assert again.tasks == summary.tasks

    # Lose two predictions (an interrupted run): only those two are predicted again.
    pred_path = tmp_path / "passkey" / "128" / "pred.jsonl"
    kept = read_jsonl(pred_path)
    write_jsonl(pred_path, kept[:2])
    run_passkey(model, config, tmp_path, **OPTIONS)
    assert counter.prompts == 10
    assert read_jsonl(pred_path) == kept  # greedy decoding: the same predictions


def test_other_settings_in_the_same_directory_are_refused_unless_overwritten(tmp_path):
    model = tiny_decoder()
    config = EvalConfig((96,), samples=1, depths=(0.5,), batch_size=3)
    run_passkey(model, config, tmp_path, **OPTIONS)
    other = dataclasses.replace(config, seed=1)
    with pytest.raises(ValueError, match="other settings"):
        run_passkey(model, other, tmp_path, **OPTIONS)
    summary = run_passkey(model, other, tmp_path, overwrite=True, **OPTIONS)
    assert summary.seed == 1
    assert (
        read_jsonl(tmp_path / "passkey" / "96" / "data.jsonl")[0]["stage"]
        == (read_jsonl(tmp_path / "passkey" / "96" / "pred.jsonl")[0]["stage"])
    )


def test_ruler_run_records_tasks_that_do_not_fit(tmp_path):
    summary = run_ruler(
        tiny_decoder(),
        EvalConfig((300, 600), samples=2, max_new_tokens=8, batch_size=3),
        tmp_path,
        tasks=["niah_single_1", "cwe_small", "fwe"],
        **OPTIONS,
    )
    cwe = summary.tasks["cwe_small"]
    assert [s.length for s in cwe.scores] == [600] and cwe.cells is None  # not a needle task
    assert cwe.skipped[0].length == 300 and "length >= " in cwe.skipped[0].reason
    # The average exists only where every task was scored.
    assert [a.length for a in summary.average] == [600]
    # Without explicit depths, needle samples spread over [0, 1].
    niah = read_jsonl(tmp_path / "niah_single_1" / "300" / "data.jsonl")
    assert [r["depth"] for r in niah] == [0.0, 1.0]
    assert all(r["max_new_tokens"] == 8 for r in niah)
    assert not (tmp_path / "cwe_small" / "300" / "data.jsonl").exists()


def test_hugging_face_model_with_chat_template(tmp_path, bpe_tok):
    model = tiny_llama(vocab_size=bpe_tok.vocab_size)
    counter = PromptCounter(model)
    summary = run_passkey(
        as_language_model(model, bpe_tok),
        EvalConfig((120, 200), samples=2, depths=(0.5,), chat=True, batch_size=3),
        tmp_path,
        **OPTIONS,
    )
    assert summary.format == "chat"
    assert counter.prompts == 4
    for row in read_jsonl(tmp_path / "passkey" / "200" / "data.jsonl"):
        assert row["input"].startswith("<s><|user|>")
        assert row["n_tokens"] + row["max_new_tokens"] <= 200
    assert all(0.0 <= s.score <= 1.0 for s in summary.tasks["passkey"].scores)


def test_eval_config_validates_and_plans():
    with pytest.raises(ValueError, match="depths="):
        EvalConfig(lengths=(128,), depths=(0.5, 1.5))
    with pytest.raises(ValueError, match="lengths="):
        EvalConfig(lengths=())
    with pytest.raises(ValueError, match="samples="):
        EvalConfig(lengths=(128,), samples=0)
    config = EvalConfig(lengths=(256, 128), samples=2, depths=(1.0, 0.0))
    assert config.lengths == (128, 256) and config.depths == (0.0, 1.0)
    # Index enumerates (depth, draw); the draw, not the depth, fixes the needle.
    assert config.plan(get_task("passkey")) == [(0, 0.0, 0), (1, 0.0, 1), (2, 1.0, 0), (3, 1.0, 1)]
    assert config.plan(get_task("vt")) == [(0, None, 0), (1, None, 1)]


def test_an_untyped_summary_reads_as_the_record_and_a_renamed_field_is_refused(tmp_path):
    """A summary.json of the untyped writer (format_version 2: ``cells`` only for needle
    tasks) reads as the TasksResult of today; a renamed field is refused in one line naming
    it, and the folder is then not reused."""
    config = EvalConfig((96,), samples=1, depths=(0.5,), batch_size=2)
    summary = run_ruler(tiny_decoder(), config, tmp_path, tasks=["passkey", "vt"], **OPTIONS)
    path = tmp_path / "summary.json"
    data = json.loads(path.read_text())
    assert data["tasks"]["vt"]["cells"] is None  # written at this version, even when None
    del data["tasks"]["vt"]["cells"]
    path.write_text(json.dumps({**data, "format_version": 2}))
    assert read_record(path, TasksResult) == summary
    data["tasks"]["passkey"]["effective"] = data["tasks"]["passkey"].pop("effective_length")
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError, match=r"tasks\.tasks\.passkey\.effective is not a field"):
        read_record(path, TasksResult)
    with pytest.raises(ResultError, match=r"passkey\.effective is not a field of TaskEntry"):
        run_ruler(tiny_decoder(), config, tmp_path, tasks=["passkey", "vt"], **OPTIONS)
