"""The ledger of a comparison's jobs (``compare.ledger``), alone: it knows nothing of compare,
so these tests run jobs that are plain functions in a folder."""

from __future__ import annotations

import json
import os
import time

import pytest

from ropekit.compare.ledger import Held, Ledger
from ropekit.results import read_records
from tests.processes import locked_elsewhere


def test_processes_writing_in_turn_keep_the_jobs_in_the_order_they_finished(tmp_path):
    """times.jsonl lists finished jobs in the order they finished, whichever process writes
    it, and so does the report's time table read from a process's records: experiment E's two
    processes (one with --join) flipped two probe jobs' rows at each other's writes, because
    each wrote its own records first."""
    out = tmp_path
    first, second = Ledger(out), Ledger(out)
    second.set("job b", {"job": "job b", "started": 1.0, "earlier": 0.0})
    first.set("job a", {"job": "job a", "started": 2.0, "earlier": 0.0})
    first.set("job a", {"job": "job a", "seconds": 10.0})  # a finishes first
    second.set("job b", {"job": "job b", "seconds": 20.0})

    def finished() -> list[str]:
        return [r["job"] for r in read_records(out / "times.jsonl") if "seconds" in r][-2:]

    assert finished() == ["job a", "job b"]
    first.set("job c", {"job": "job c", "started": 3.0, "earlier": 0.0})
    assert finished() == ["job a", "job b"]
    for run in (first, second):
        run.sync()
        assert [j for j in run.records if j.startswith("job ")] == ["job a", "job b"]


def test_a_job_resumed_after_a_stop_counts_its_earlier_attempts(tmp_path):
    """times.jsonl records a job as begun before it runs; a stop Python sees settles the
    attempt's time there (up to the last file it wrote in the job's folder), a kill -9 leaves
    the begun record, and the resumed job's time adds the earlier attempt's wall time up to
    the last file it wrote (not the stop, not files older than the attempt). Only finished
    jobs reach compare.json's time table; a finished job's time is never rewritten."""
    out = tmp_path / "out"
    run = Ledger(out)
    folder = out / "eval" / "job"
    folder.mkdir(parents=True)

    def stopped() -> None:  # saves a window 30 s into the attempt, then is stopped
        started = run.attempts["eval job"]["started"]
        (folder / "saved.npz").write_bytes(b"")
        os.utime(folder / "saved.npz", (started + 30, started + 30))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run.run("eval job", stopped, folder)
    (settled,) = read_records(out / "times.jsonl")  # a stop Python sees: settled at once
    assert settled["started"] is None and settled["earlier"] == pytest.approx(30, abs=1e-3)
    (folder / "saved.npz").unlink()
    # a kill -9 leaves the record as the attempt began it (what follows fakes that record)
    begun = {"job": "eval job", "started": time.time(), "earlier": 0.0}
    # the stopped attempt began 100 s ago and saved its last file 60 s after that; an older
    # file (before the attempt) and the time since the last file do not count
    started = begun["started"] - 100
    (out / "times.jsonl").write_text(json.dumps({**begun, "started": started}) + "\n")
    for name, when in (("old.npz", started - 500), ("last.npz", started + 60)):
        (folder / name).write_bytes(b"")
        os.utime(folder / name, (when, when))

    run = Ledger(out)
    assert run.records == {} and set(run.attempts) == {"eval job"}
    run.run("eval job", lambda: time.sleep(0.2), folder)
    (record,) = read_records(out / "times.jsonl")
    assert record.keys() == {"job", "seconds"} and 60.2 <= record["seconds"] < 61
    run.run("eval job", lambda: time.sleep(0.1), folder)  # finished: reused, not retimed
    assert read_records(out / "times.jsonl") == [record]
    # settled at a stop: the files' times no longer count (a copy may have changed them)
    run.records.clear()
    run.attempts["eval job"] = {"job": "eval job", "started": None, "earlier": 42.0}
    os.utime(folder / "last.npz")  # touched now, long after the stop
    assert run.earlier_seconds("eval job", folder) == 42.0
    # a second stop after the resumed attempt wrote its own file: both attempts count
    run.records.clear()
    run.attempts["eval job"] = {"job": "eval job", "started": time.time() - 30, "earlier": 60.0}
    os.utime(folder / "last.npz", (time.time() - 10, time.time() - 10))
    assert 79 < run.earlier_seconds("eval job", folder) < 81
    os.utime(folder / "last.npz", (time.time() - 40, time.time() - 40))  # before it began
    assert run.earlier_seconds("eval job", folder) == 60.0


def test_a_job_another_process_holds_is_returned_held_not_run(tmp_path):
    """A job whose claim another live process holds is not run: ``run`` returns a `Held`
    naming it and its holder (no exception for the caller to thread through), the job is
    listed as running elsewhere, and once that process is gone (kill -9) the job runs here."""
    from ropekit.compare.ledger import CLAIMS, _slug

    ledger = Ledger(tmp_path)
    (tmp_path / CLAIMS).mkdir()
    ran = []
    with locked_elsewhere(tmp_path, tmp_path / CLAIMS / f"{_slug('job x')}.lock", "job x"):
        value = ledger.run("job x", lambda: ran.append(1))
        assert isinstance(value, Held) and value.job == "job x" and value.holder is not None
        assert ledger.running_elsewhere() == ["job x"] and ran == []
        assert "job x" not in ledger.records
    assert ledger.run("job x", lambda: "ran") == "ran"
    assert ledger.records["job x"]["seconds"] >= 0 and ledger.running_elsewhere() == []
