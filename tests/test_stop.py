"""SIGTERM and Ctrl-C stop a command within seconds even in the middle of a long forward, with
a real `ropekit eval probes` process and a real signal: a prefill of 131,072 tokens (one
attention call of minutes here) once held SIGTERM off for all of it, and a kill then left the
folder's lock behind. Now the process ends a few seconds after the signal (ropekit.outdir
.stop_within), gives the lock back, and the same command run again goes past its stages to
the prefill: nothing it left is in its way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ropekit.cli import main
from ropekit.outdir import LOCK_FILE

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--batch-size", "2", "--warmup", "1"]
LENGTH = 131072  # 4096x the model's training length: a prefill of minutes on one core


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("stop") / "base"
    try:
        assert main(["pretrain", "--context", "32", "--steps", "2", "--out", str(out), *TINY]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def _probes(base: Path, out: Path) -> tuple[subprocess.Popen, list[str]]:
    """Start `ropekit eval probes` at LENGTH; returns the process and its stderr so far (a
    thread keeps reading it: progress bars end their lines with \\r)."""
    argv = [sys.executable, "-m", "ropekit.cli", "eval", "probes", "--model", str(base),
            "--lengths", str(LENGTH), "--haystacks", "1", "--yes", "--out", str(out)]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    # Ctrl-C as a terminal delivers it: a shell starts background jobs (CI's) with SIGINT
    # ignored, and a process that inherits that is not meant to stop on it.
    run = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    err: list[str] = []

    def read() -> None:
        while chunk := run.stderr.read1(4096):
            err.append(chunk.decode(errors="replace"))

    threading.Thread(target=read, daemon=True).start()
    return run, err


def _in_the_prefill(run: subprocess.Popen, err: list[str], timeout: float = 300) -> None:
    """Wait until the probes bar shows the length being prefilled, then a moment more."""
    start = time.monotonic()
    while f"@ {LENGTH}" not in "".join(err):
        assert run.poll() is None, "".join(err)[-2000:]
        assert time.monotonic() - start < timeout, "".join(err)[-2000:]
        time.sleep(0.2)
    time.sleep(1.0)


def _stopped_within_seconds(run: subprocess.Popen, err: list[str], signum: int) -> None:
    sent = time.monotonic()
    run.send_signal(signum)
    code = run.wait(timeout=120)
    waited = time.monotonic() - sent
    text = "".join(err)
    assert code == 128 + signum and waited < 15, (code, waited, text[-2000:])
    assert "stopped by" in text or "interrupted" in text, text[-2000:]


@pytest.mark.slow
def test_a_signal_mid_prefill_stops_within_seconds_and_leaves_nothing_in_the_way(base, tmp_path):
    out = tmp_path / "probes"
    run, err = _probes(base, out)
    _in_the_prefill(run, err)
    _stopped_within_seconds(run, err, signal.SIGTERM)
    assert not (out / LOCK_FILE).exists()
    assert not [p for p in out.rglob("*") if p.name.endswith((".tmp", ".part"))]
    # The same command again: its stages are taken as they are, and it reaches the prefill;
    # Ctrl-C (SIGINT) then stops it as promptly.
    again, err = _probes(base, out)
    _in_the_prefill(again, err)
    _stopped_within_seconds(again, err, signal.SIGINT)
    assert not (out / LOCK_FILE).exists()
