"""Evaluations shared by several processes give the single-process result, and only the main
process writes. The ranks here are threads (tests/processes.py): the sharding, gathering and
file logic of real processes without their launch costs; tests/test_cli_processes.py runs
the same through `accelerate launch`."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

from ropekit.data import heldout_stream
from ropekit.evals import (
    EvalConfig,
    PerplexityConfig,
    as_language_model,
    evaluate_perplexity,
    run_passkey,
    run_perplexity,
)
from ropekit.evals import runner as runner_module
from ropekit.results import read_records as read_jsonl
from ropekit.results import write_records as write_jsonl

from ..processes import run_ranks
from .models import tiny_decoder
from .test_runner import PromptCounter

OPTIONS = {"progress": False, "spec": "rope", "command": "ropekit eval"}
PASSKEY = EvalConfig((96, 128), samples=2, depths=(0.0, 1.0), seed=3, batch_size=1)


def _ok(results):
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _models(world):
    """One tiny decoder per rank, all alike, built here: `tiny_decoder` seeds the global RNG,
    which threads building their own at once would race on; and threads must not share one
    module's forward-time state."""
    return [tiny_decoder() for _ in range(world)]


def _without_time(result):
    return {k: v for k, v in result.items() if k not in ("time", "paths")}


@pytest.fixture
def record_writers(monkeypatch):
    """{thread name: [file names]} of every result file and plot the evaluations write."""
    import ropekit.evals.perplexity as perplexity_module

    writers: dict[str, list[str]] = {}

    def recording(write, where):  # `where`: the position of the path argument
        def wrapper(*args, **kwargs):
            name = Path(args[where]).name
            writers.setdefault(threading.current_thread().name, []).append(name)
            return write(*args, **kwargs)

        return wrapper

    # Each module holds its own references to the writers it calls.
    for module, name, where in (
        (runner_module, "write_result", 0),
        (runner_module, "write_records", 0),
        (perplexity_module, "write_result", 0),
        (perplexity_module, "plot_perplexity", 1),
        (runner_module, "plot_heatmap", 1),
        (runner_module, "plot_accuracy_vs_length", 1),
    ):
        monkeypatch.setattr(module, name, recording(getattr(module, name), where))
    return writers


# Uneven shares, and 5 ranks for 4 windows of the longest length: one rank scores none.
@pytest.mark.parametrize(("world", "stride"), [(2, None), (3, 20), (5, None)])
def test_perplexity_shared_by_processes_equals_one_process(byte_tok, world, stride):
    stream = heldout_stream("shakespeare", byte_tok)
    # 100 tokens a forward: several batches per length, so shares cut across batches.
    config = PerplexityConfig(lengths=(32, 64, 96), stride=stride, batch_tokens=100)
    one = evaluate_perplexity(as_language_model(tiny_decoder(), byte_tok), stream, config, False)

    models = _models(world)

    def rank(processes):
        lm = as_language_model(models[processes.rank], byte_tok)
        return evaluate_perplexity(lm, stream, config, False, processes=processes)

    for result in _ok(run_ranks(world, rank)):
        # A window's NLL does not depend on what else is in its batch (rows are independent),
        # and the sums run in the same order: equal to the last bit, every field.
        assert result == one


def test_run_perplexity_under_processes_writes_once(tmp_path, record_writers):
    config = PerplexityConfig((32, 64), n_tokens=128)
    kwargs = dict(progress=False, command="ropekit eval ppl")
    one = run_perplexity(tiny_decoder(), config, tmp_path / "one", **kwargs)
    record_writers.clear()
    models = _models(2)
    two = _ok(
        run_ranks(
            2,
            lambda p: run_perplexity(
                models[p.rank], config, tmp_path / "two", processes=p, **kwargs
            ),
        )
    )
    assert set(record_writers) == {"rank-0"}
    assert sorted(record_writers["rank-0"]) == ["ppl.json", "ppl.png"]
    for result in two:  # the same record, bar the paths
        assert result.result == one.result and result.reused is one.reused is False
    saved = json.loads((tmp_path / "two" / "ppl.json").read_text())
    assert _without_time(saved) == _without_time(
        json.loads((tmp_path / "one" / "ppl.json").read_text())
    )


def test_tasks_shared_by_processes_equal_one_process_and_resume(tmp_path, record_writers):
    one = run_passkey(tiny_decoder(), PASSKEY, tmp_path / "one", **OPTIONS)
    record_writers.clear()
    models = _models(2)

    def rank(processes):
        return run_passkey(
            models[processes.rank], PASSKEY, tmp_path / "two", processes=processes, **OPTIONS
        )

    counters = [PromptCounter(m) for m in models]
    two = _ok(run_ranks(2, rank))
    # 2 lengths x 2 depths x 2 samples, one a batch: each rank prefilled half of them.
    assert [c.prompts for c in counters] == [4, 4]
    assert set(record_writers) == {"rank-0"}  # the other rank computed, and wrote nothing
    for result in two:  # the same summary, bar the paths (other folders)
        assert dataclasses.replace(result, paths={}) == dataclasses.replace(one, paths={})
    for stage in ("passkey/96", "passkey/128"):
        for name in ("data.jsonl", "pred.jsonl", "summary.json"):
            assert (tmp_path / "two" / stage / name).read_bytes() == (
                tmp_path / "one" / stage / name
            ).read_bytes(), f"{stage}/{name}"

    # Interrupted runs resume under processes too: three lost predictions (two rounds, one
    # rank idle in the second) are predicted again, and come out the same.
    pred = tmp_path / "two" / "passkey" / "128" / "pred.jsonl"
    kept = read_jsonl(pred)
    write_jsonl(pred, kept[:1])
    again = _ok(run_ranks(2, rank))
    assert read_jsonl(pred) == kept
    assert all(r.tasks == one.tasks for r in again)


def test_an_error_on_the_main_process_reaches_every_process(tmp_path):
    run_passkey(tiny_decoder(), PASSKEY, tmp_path, **OPTIONS)
    other = dataclasses.replace(PASSKEY, seed=4)  # other settings in the same folder: refused
    models = _models(2)

    def rank(processes):
        return run_passkey(models[processes.rank], other, tmp_path, processes=processes, **OPTIONS)

    results = run_ranks(2, rank)
    assert all(isinstance(r, ValueError) and "other settings" in str(r) for r in results)
