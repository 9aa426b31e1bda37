"""`ropekit compare --executor ray`: the plan's jobs as Ray tasks end with the comparison one
process writes, number for number, and a worker killed mid-job has its job rerun (a local
2-CPU cluster; `make test-ray`, marked ``ray``); and what is refused before anything is
written (no Ray installed, a RAY_ADDRESS where nothing answers), in every `make test`."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time

import pytest
import torch

from ropekit.cli import main
from ropekit.compare.record import CompareResult
from ropekit.outdir import holder_of
from ropekit.results import read_record

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--batch-size", "4", "--warmup", "2"]


def _argv(base, out, *more):
    """A raced comparison (rounds planned as the race decides them) with a trained method
    whose rate is selected, two seeds, two domains and probes: every kind of job."""
    return [
        "compare", "--model", str(base), "--target-length", "128",
        "--methods", "yarn:factor=4,adarope:init=yarn,factor=4", "--names", "yarn,adarope",
        "--seeds", "0,1", "--samples", "2", "--lrs", "0.01,0.03", "--selection-samples", "1",
        "--eval-data", "shakespeare,kjv", "--lengths", "32,128", "--spans", "2",
        "--probe-lengths", "128", "--probe-needles", "1", "--probe-haystacks", "2",
        "--probe-task", "kv1_shakespeare", "--out", str(out), *more,
    ]  # fmt: skip


def _refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_executor_ray_without_ray_installed_is_refused_naming_the_extra(
    capsys, monkeypatch, tmp_path
):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = tmp_path / "out"
    err = _refused(capsys, _argv(tmp_path / "no-model", out, "--executor", "ray"))
    assert "pip install 'ropekit[ray]'" in err
    assert not out.exists()  # nothing written


def test_a_ray_address_where_nothing_answers_is_refused_before_anything_is_written(
    capsys, monkeypatch, tmp_path
):
    pytest.importorskip("ray")
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    out = tmp_path / "out"
    err = _refused(capsys, _argv(tmp_path / "no-model", out, "--executor", "ray"))
    assert f"RAY_ADDRESS='127.0.0.1:{port}': no Ray cluster answers there" in err
    assert not out.exists()
    monkeypatch.setenv("RAY_ADDRESS", "no port")
    assert "is not an address of a Ray cluster" in _refused(
        capsys, _argv(tmp_path / "no-model", out, "--executor", "ray")
    )
    assert not out.exists()


def test_job_cpus_below_one_is_refused(capsys, tmp_path):
    out = tmp_path / "out"
    err = _refused(
        capsys, _argv(tmp_path / "no-model", out, "--executor", "ray", "--job-cpus", "0")
    )
    assert "job_cpus=0 is not allowed; give an integer >= 1" in err
    assert not out.exists()


def _kill_first_claimed(claims, killed: list[int], stop: threading.Event) -> None:
    """Kill (SIGKILL) the first worker process seen holding a claim of a training job of the
    trained method: mid-job, since the claim is held exactly while the job runs."""
    while not stop.is_set() and not killed:
        for lock in claims.glob("train*adarope*.lock") if claims.is_dir() else ():
            holder = holder_of(lock)
            if holder is not None and holder.pid != os.getpid() and holder.alive():
                os.kill(holder.pid, signal.SIGKILL)
                killed.append(holder.pid)
                return
        time.sleep(0.002)


@pytest.mark.ray
def test_ray_ends_with_the_comparison_one_process_writes_and_reruns_a_killed_workers_job(
    tmp_path,
):
    ray = pytest.importorskip("ray")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a Ray worker of one CPU runs (OMP_NUM_THREADS=1)
    try:
        assert main(["pretrain", "--context", "32", "--steps", "30", *TINY,
                     "--out", str(tmp_path / "base")]) == 0  # fmt: skip
        assert main(_argv(tmp_path / "base", tmp_path / "alone")) == 0
    finally:
        torch.set_num_threads(threads)
    out, killed, stop = tmp_path / "ray", [], threading.Event()
    watcher = threading.Thread(target=_kill_first_claimed, args=(out / ".jobs", killed, stop))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        watcher.start()
        assert main(_argv(tmp_path / "base", out, "--executor", "ray", "--job-cpus", "1")) == 0
    finally:
        stop.set()
        watcher.join()
        ray.shutdown()
    assert killed, "no worker was seen holding a training job"
    with pytest.raises(ProcessLookupError):
        os.kill(killed[0], 0)  # it was killed, and the job still finished (below)

    alone, mine = (
        read_record(f / "compare.json", CompareResult) for f in (tmp_path / "alone", out)
    )
    assert mine.stage == "done" and mine.verdict is not None
    skip = {"meta", "times"}  # the command and the wall times differ; every number is equal
    for field in (f.name for f in dataclasses.fields(CompareResult) if f.name not in skip):
        assert getattr(mine, field) == getattr(alone, field), field
    assert sorted(t.job for t in mine.times) == sorted(t.job for t in alone.times)
    records = [json.loads(line) for line in (out / "times.jsonl").read_text().splitlines()]
    jobs = [r["job"] for r in records]
    assert len(jobs) == len(set(jobs)) and all("seconds" in r for r in records)  # once each
    report, alone_report = ((f / "report.md").read_text() for f in (out, tmp_path / "alone"))
    assert report.split("## Time")[0] == alone_report.split("## Time")[0]
    assert [p.name for p in (out / ".jobs").iterdir() if not p.name.startswith(".")] == []
