"""train() across processes: data parallel under `accelerate launch`, SIGKILL then resume, a kill
right after a resume starts, and two runs into one folder at once.

Both launch tests/train/tiny.py in fresh Python processes (one thread each, as in-process
tests run), so each pays a few seconds of imports.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ropekit.outdir import OutDirLocked, lock_out_dir
from ropekit.train import latest_checkpoint, train
from ropekit.train.checkpoint import verify_checkpoint

from ..processes import ACCELERATE, free_port
from .test_loop import assert_same_tensors, metrics, optimizer_state
from .tiny import CountingData, tiny_config, tiny_llama

SCRIPT = Path(__file__).with_name("tiny.py")


def environment() -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": "1"}


def test_two_processes_train_like_one_on_the_same_global_batch(tmp_path):
    one = tiny_llama()
    train(one, CountingData(), tiny_config(tmp_path / "one", steps=6, grad_accum=2))

    # `accelerate launch --cpu --num_processes 2` starts a single process (accelerate issue
    # #2741); multi-process CPU runs take the multi-GPU launcher with ACCELERATE_USE_CPU=1.
    command = [
        str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
        str(SCRIPT), str(tmp_path / "two"), "--steps", "6", "--grad-accum", "1",
    ]  # fmt: skip
    env = environment() | {"ACCELERATE_USE_CPU": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]

    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["num_processes"] == 2
    final = latest_checkpoint(tmp_path / "two")
    assert {p.name for p in final.glob("rng-*.pt")} == {"rng-0.pt", "rng-1.pt"}
    manifest = json.loads((final / "manifest.json").read_text())
    assert {"rng-0.pt", "rng-1.pt"} <= set(manifest["files"])  # both ranks' files, verified
    verify_checkpoint(final)
    # Same micro-batches, summed in another order across processes: equal up to rounding.
    for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two"), strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5 * a["loss"]
        assert a["tokens"] == b["tokens"]
    two = load_file(final / "model.safetensors")
    for name, param in one.named_parameters():
        torch.testing.assert_close(two[name], param.detach(), rtol=0, atol=1e-5)


def test_killed_with_sigkill_then_resumed_is_bit_identical(tmp_path):
    reference = tiny_llama(dropout=0.1)
    result = train(reference, CountingData(), tiny_config(tmp_path / "reference", steps=16))

    out = tmp_path / "killed"
    args = [sys.executable, str(SCRIPT), str(out), "--steps", "16", "--dropout", "0.1"]
    # Slow steps (0.1 s a batch) leave time to kill the run between checkpoints 4 and 16.
    run = subprocess.Popen([*args, "--sleep", "0.1"], env=environment(), stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while latest_checkpoint(out) is None and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    run.send_signal(signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL, run.stderr.read().decode()[-3000:]
    assert latest_checkpoint(out).name < "step-00000016"
    assert not (out / "summary.json").exists()

    done = subprocess.run([*args, "--resume"], env=environment(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    final = latest_checkpoint(out)
    assert final.name == result.checkpoint.name == "step-00000016"
    resumed = load_file(final / "model.safetensors")
    for name, param in reference.named_parameters():
        assert torch.equal(resumed[name], param.detach()), name
    assert_same_tensors(optimizer_state(result.checkpoint), optimizer_state(final))
    # Parameters and optimizer state are bit-identical (above). A logged loss whose interval
    # straddles the kill is re-averaged from the checkpoint's float32 record, so the log agrees
    # to float32 rounding, not bit for bit.
    resumed_losses = [m["loss"] for m in metrics(out)]
    reference_losses = [m["loss"] for m in metrics(tmp_path / "reference")]
    assert resumed_losses == pytest.approx(reference_losses, rel=1e-6)


def _start(out, *extra):
    args = [sys.executable, str(SCRIPT), str(out), "--steps", "16", *extra]
    return subprocess.Popen(args, env=environment(), stderr=subprocess.PIPE)


def _wait_for(condition, run, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert condition(), run.stderr.read().decode()[-3000:] if run.poll() is not None else "timeout"


def _kill(run):
    run.send_signal(signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL, run.stderr.read().decode()[-3000:]


def test_a_kill_right_after_a_resume_starts_loses_no_logged_line(tmp_path):
    out = tmp_path / "run"
    log = out / "metrics.jsonl"
    run = _start(out, "--sleep", "0.05")
    _wait_for(lambda: latest_checkpoint(out) is not None, run)
    _kill(run)
    checkpoint = int(latest_checkpoint(out).name.removeprefix("step-"))
    before = log.read_text().splitlines()
    assert len(before) >= checkpoint  # log_interval=1: a line per step, then the checkpoint
    identity = (log.stat().st_ino, log.stat().st_size)

    # A resumed session whose first step takes 2 s: killed the moment it touches the log.
    run = _start(out, "--resume", "--sleep", "2")
    _wait_for(lambda: (log.stat().st_ino, log.stat().st_size) != identity, run)
    _kill(run)
    kept = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert kept == list(range(1, checkpoint + 1))
    assert log.read_text().splitlines() == before[:checkpoint]


def test_a_second_run_into_a_busy_folder_fails_at_once_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    run = _start(out, "--sleep", "0.1")
    try:
        _wait_for(lambda: (out / "metrics.jsonl").is_file(), run)
        started = time.monotonic()
        with pytest.raises(OutDirLocked, match=rf"in use by another run \(pid {run.pid} on "):
            train(tiny_llama(), CountingData(), tiny_config(out, steps=16, resume=True))
        assert time.monotonic() - started < 5  # at once: no training, no waiting
    finally:
        _kill(run)
    steps = [m["step"] for m in metrics(out)]
    assert steps == list(range(1, len(steps) + 1))  # one run's log, not two interleaved


def test_every_process_of_a_run_stops_when_its_folder_is_busy(tmp_path):
    out = tmp_path / "run"
    with lock_out_dir(out):  # this process holds it, as another run would
        (out / "metrics.jsonl").write_text("")
        command = [
            str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), str(SCRIPT), str(out), "--resume",
        ]  # fmt: skip
        env = environment() | {"ACCELERATE_USE_CPU": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    # The main process met the lock; the other got its error instead of waiting for it.
    assert done.stderr.count(f"in use by another run (pid {os.getpid()} on") >= 2, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]
