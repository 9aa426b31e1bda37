"""Probes and single-document perplexity shared by several processes (ranks as threads,
tests/processes.py) give the single-process results, the haystacks are prefilled once in all,
and only the main process writes."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

import ropekit.evals.probes as probes_module
from ropekit.data import heldout_stream
from ropekit.evals import PerplexityConfig, as_language_model, evaluate_perplexity
from ropekit.evals.probe_haystacks import ProbeConfig
from ropekit.evals.probes import run_probes
from ropekit.results import read_records

from ..processes import run_ranks
from .models import SuffixCopyLM, tiny_decoder
from .test_probes import RunCounter

CONFIG = ProbeConfig((300, 400), needles=2, haystacks=3, seed=2)


def _ok(results):
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _answers(summary):
    """The summary but its metadata and its paths (the folders differ)."""
    return dataclasses.replace(summary, meta={}, paths={})


@pytest.mark.parametrize("world", [2, 4])  # 4 ranks for 3 haystacks: one answers none
def test_probes_shared_by_processes_equal_one_process(tmp_path, byte_tok, monkeypatch, world):
    single = as_language_model(SuffixCopyLM(), byte_tok)
    read_by_one = RunCounter(single)
    one = run_probes(single, CONFIG, tmp_path / "one", progress=False)
    writers: dict[str, list[str]] = {}

    def recording(write, where):
        def wrapper(*args, **kwargs):
            name = Path(args[where]).name
            writers.setdefault(threading.current_thread().name, []).append(name)
            return write(*args, **kwargs)

        return wrapper

    for name, where in (
        ("write_result", 0),
        ("write_records", 0),
        ("plot_accuracy_vs_distance", 1),
    ):
        monkeypatch.setattr(probes_module, name, recording(getattr(probes_module, name), where))
    lms = [as_language_model(SuffixCopyLM(), byte_tok) for _ in range(world)]
    counters = [RunCounter(lm) for lm in lms]

    def rank(processes):
        return run_probes(
            lms[processes.rank], CONFIG, tmp_path / "two", processes=processes, progress=False
        )

    for summary in _ok(run_ranks(world, rank)):
        assert _answers(summary) == _answers(one)
    assert set(writers) == {"rank-0"}
    # The ranks take the haystacks in turns (haystack h of each length: rank h % world), each
    # read once, by one rank: together they read what one process reads, and a rank without
    # a haystack reads nothing.
    # (one process also keeps the preamble's chunks from one haystack to the next)
    shortest = min(
        max(r["cut"] for r in records if r["haystack"] == h)
        for n in CONFIG.lengths
        if (records := read_records(tmp_path / "one" / str(n) / "probes.jsonl"))
        for h in range(CONFIG.haystacks)
    )
    assert read_by_one.tokens <= sum(c.tokens for c in counters) < read_by_one.tokens + shortest
    assert [c.tokens > 0 for c in counters] == [r < 3 for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_single_document_perplexity_shared_by_processes_equals_one_process(byte_tok, world):
    stream = heldout_stream("kjv", byte_tok)
    config = PerplexityConfig((32, 64), n_tokens=6 * 64, batch_tokens=100, single_documents=True)
    one = evaluate_perplexity(as_language_model(tiny_decoder(), byte_tok), stream, config, False)
    models = [tiny_decoder() for _ in range(world)]

    def rank(processes):
        lm = as_language_model(models[processes.rank], byte_tok)
        return evaluate_perplexity(lm, stream, config, False, processes=processes)

    for result in _ok(run_ranks(world, rank)):
        assert result == one
