"""Fault injection on `ropekit pretrain`: kill -9 at random moments, resume, and end where an
uninterrupted run ends.

Each run is a fresh `python -m ropekit.cli pretrain` process (one thread) killed with SIGKILL
at a moment drawn from a seeded generator, once training is under way: mid-step, mid-log-line,
mid-checkpoint, mid-prune or while the final model is written, wherever it falls. `--resume`
then continues, and the final model's weights must be bit-identical to an uninterrupted run's
and metrics.jsonl must hold the same lines (every field but the timings). One variant also
damages the newest checkpoint between the kill and the resume: the run must fall back to the
older one, say so, and still end identical.

The default suite runs one kill followed by a damaged checkpoint (two processes); the slow
test runs several seeds with several kills each.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ropekit.cli import main

STEPS = 200
TIMINGS = {"tokens_per_s", "elapsed"}  # the only fields a resumed log may change


def _pretrain_args(data: Path) -> list[str]:
    tiny = ["--d-model", "32", "--layers", "1", "--heads", "2", "--context", "32"]
    run = ["--steps", str(STEPS), "--batch-size", "4", "--warmup", "5"]
    return ["pretrain", *tiny, *run, "--checkpoint-interval", "7", "--data", str(data)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    rng = random.Random(0)
    words = [
        "".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(2, 8))) for _ in range(400)
    ]
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(6000)))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> Path:
    """The uninterrupted run, in this process (one thread, as the killed ones)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([*_pretrain_args(data), "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def _start(data: Path, out: Path, resume: bool) -> subprocess.Popen:
    args = [sys.executable, "-m", "ropekit.cli", *_pretrain_args(data), "--out", str(out)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        args + ["--resume"] * resume, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def _log_identity(out: Path) -> tuple[int, int] | None:
    try:
        stat = (out / "metrics.jsonl").stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _kill_at_random(run: subprocess.Popen, out: Path, rng: random.Random, min_checkpoints=0):
    """SIGKILL `run` a random 0-2.5 s after its training is under way (it has written its
    metrics log, a new one after a resume's rewind, and `min_checkpoints` checkpoints exist);
    returns whether it was still running."""
    before = _log_identity(out)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and run.poll() is None:
        written = len(list((out / "checkpoints").glob("step-*")))
        log = _log_identity(out)
        if log is not None and log != before and written >= min_checkpoints:
            break
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 2.5))
    running = run.poll() is None
    run.send_signal(signal.SIGKILL)
    code = run.wait()
    assert code in (0, -signal.SIGKILL), run.stderr.read().decode()[-3000:]
    return running


def _finish(data: Path, out: Path) -> str:
    run = _start(data, out, resume=True)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err.decode()[-3000:]
    return err.decode()


def _flip_a_bit(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 5] ^= 0x01  # inside the last tensor's data
    path.write_bytes(bytes(raw))


def _assert_same_run(out: Path, reference: Path) -> None:
    final, expected = (
        load_file(out / "model" / "model.safetensors"),
        load_file(reference / "model" / "model.safetensors"),
    )
    assert final.keys() == expected.keys()
    for name in expected:
        assert torch.equal(final[name], expected[name]), name

    def lines(folder):
        records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]

    assert lines(out) == lines(reference)
    assert (
        json.loads((out / "pretrain.json").read_text())["final_loss"]
        == json.loads((reference / "pretrain.json").read_text())["final_loss"]
    )
    assert not (out / ".ropekit.lock").exists()


def test_killed_then_damaged_then_resumed_ends_like_an_uninterrupted_run(tmp_path, data, reference):
    out, rng = tmp_path / "run", random.Random(1)
    # Two checkpoints first (keep_last=2), so one is left when the newest is damaged.
    _kill_at_random(_start(data, out, resume=False), out, rng, min_checkpoints=2)
    steps = sorted((out / "checkpoints").glob("step-*"))
    _flip_a_bit(steps[-1] / "model.safetensors")

    if len(steps) == 1:  # killed while pruning, the older one already renamed away
        run = _start(data, out, resume=True)
        _, err = run.communicate(timeout=300)
        assert run.returncode == 2 and "no intact checkpoint" in err.decode()
        return
    err = _finish(data, out)
    assert f"{steps[-1].name} is damaged (model.safetensors does not match its sha256" in err
    assert f"resuming from {steps[-2].name}" in err
    assert (out / "checkpoints" / f"damaged-{steps[-1].name}").is_dir()  # kept, not deleted
    _assert_same_run(out, reference)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_several_kills_at_random_moments_then_resume_end_like_an_uninterrupted_run(
    tmp_path, data, reference, seed
):
    out, rng = tmp_path / "run", random.Random(seed)
    _kill_at_random(_start(data, out, resume=False), out, rng)
    for _ in range(2):  # and kill the resumed runs too
        _kill_at_random(_start(data, out, resume=True), out, rng)
    _finish(data, out)
    _assert_same_run(out, reference)


# ----------------------------------------------------------------------------- extend, eval
EXTEND = ["--method", "adarope:init=yarn,factor=2", "--target-length", "64", "--samples", "120"]
EXTEND += ["--batch-size", "2", "--lr", "3e-2"]
PASSKEY = ["--lengths", "96,128", "--depths", "3", "--samples", "10", "--batch-size", "1"]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, data) -> Path:
    out = tmp_path_factory.mktemp("base") / "run"
    tiny = ["--d-model", "32", "--layers", "1", "--heads", "2", "--context", "32", "--steps", "20"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert (
            main(["pretrain", *tiny, "--batch-size", "4", "--warmup", "2", "--out", str(out)]) == 0
        )
    finally:
        torch.set_num_threads(threads)
    return out


def _cli(args: list[str]) -> subprocess.Popen:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "ropekit.cli", *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _kill_when(run: subprocess.Popen, started, rng: random.Random, spread: float) -> bool:
    """SIGKILL `run` a random 0-`spread` s after ``started()`` first holds (some work is saved
    and more is under way); returns whether it was still running."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and run.poll() is None and not started():
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, spread))
    running = run.poll() is None
    run.send_signal(signal.SIGKILL)
    code = run.wait()
    assert code in (0, -signal.SIGKILL), run.stderr.read().decode()[-3000:]
    return running


def _done(run: subprocess.Popen) -> None:
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err.decode()[-3000:]


def _extend_result(out: Path) -> tuple[dict, float]:
    weights = load_file(out / "adapter" / "adapter.safetensors")
    return weights, json.loads((out / "extend.json").read_text())["final_loss"]


@pytest.mark.parametrize("kills", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_extend_killed_at_random_then_resumed_ends_like_an_uninterrupted_run(
    tmp_path, base_model, kills
):
    args = ["extend", "--model", str(base_model), *EXTEND]
    _done(_cli([*args, "--out", str(tmp_path / "reference")]))
    out, rng = tmp_path / "run", random.Random(kills)

    def checkpointed() -> bool:
        return any((out / "train" / "checkpoints").glob("step-*"))

    # Killed mid-run, so that the resume has work to do: a kill that came after the result was
    # written (a loaded machine, a fast run) is tried again, sooner, from scratch.
    spread = 1.0
    while not (_kill_when(_cli([*args, "--out", str(out)]), checkpointed, rng, spread)
               and not (out / "extend.json").exists()):  # fmt: skip
        assert spread > 1e-3, "every kill came after the run had written its result"
        shutil.rmtree(out)
        spread /= 4
    for _ in range(kills - 1):
        _kill_when(_cli([*args, "--resume", "--out", str(out)]), checkpointed, rng, 2.0)
    _done(_cli([*args, "--resume", "--out", str(out)]))
    weights, loss = _extend_result(out)
    expected, expected_loss = _extend_result(tmp_path / "reference")
    assert weights.keys() == expected.keys() and loss == expected_loss
    for name in expected:
        assert torch.equal(weights[name], expected[name]), name
    assert not (out / ".ropekit.lock").exists()


def _without_command(path: Path) -> dict:
    """A result without what names its own run: the command and the output paths."""
    record = json.loads(path.read_text())
    record["meta"].pop("command")
    record.pop("paths")
    return record


@pytest.mark.parametrize("kills", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_eval_killed_at_random_then_rerun_ends_like_an_uninterrupted_run(
    tmp_path, base_model, kills
):
    args = ["eval", "passkey", "--model", str(base_model), *PASSKEY]
    _done(_cli([*args, "--out", str(tmp_path / "reference")]))
    out, rng = tmp_path / "run", random.Random(10 + kills)

    def predicting() -> bool:
        return any(out.rglob("pred.jsonl"))

    assert _kill_when(_cli([*args, "--out", str(out)]), predicting, rng, 0.3)
    assert not (out / "summary.json").exists()  # killed mid-run: the rerun has work to do
    for _ in range(kills - 1):
        _kill_when(_cli([*args, "--out", str(out)]), predicting, rng, 1.0)
    _done(_cli([*args, "--out", str(out)]))
    assert _without_command(out / "summary.json") == _without_command(
        tmp_path / "reference" / "summary.json"
    )
    for pred in (tmp_path / "reference").rglob("pred.jsonl"):
        assert (out / pred.relative_to(tmp_path / "reference")).read_bytes() == pred.read_bytes()


# The other writers with a cache or stage files, killed once some of it is saved: (arguments,
# the glob of what it saves as it goes, its result file). The rerun is the same command.
KILLED = {
    "eval ppl": (
        ["eval", "ppl", "--lengths", "32,64", "--tokens", "8192", "--batch-tokens", "64"],
        "windows/*.npz",
        "ppl.json",
    ),
    "eval probes": (
        ["eval", "probes", "--lengths", "256,512", "--haystacks", "6", "--needles", "2"],
        "*/probes.jsonl",
        "summary.json",
    ),
    "search": (
        [
            "search",
            "--target-length",
            "64",
            "--samples",
            "2",
            "--budget",
            "60",
            "--population",
            "6",
            "--parents",
            "2",
            "--chunk",
            "64",
        ],
        "candidates.jsonl",
        "search.json",
    ),
}
_OWN_RUN = {"command", "paths", "adapter", "elapsed_s"}  # what names or times its own run


def _result(path: Path) -> object:
    def strip(value: object) -> object:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _OWN_RUN}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(json.loads(path.read_text()))


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(KILLED))
def test_a_writer_with_a_cache_killed_then_rerun_ends_like_an_uninterrupted_run(
    tmp_path, base_model, command
):
    """kill -9 once something is saved (a window, a stage's probes, a candidate): the rerun
    takes it as it is and ends with an uninterrupted run's result, lock given back."""
    args, saved, result = KILLED[command]
    args = [*args, "--model", str(base_model)]
    _done(_cli([*args, "--out", str(tmp_path / "reference")]))
    out = tmp_path / "run"
    assert _kill_when(_cli([*args, "--out", str(out)]), lambda: any(out.glob(saved)),
                      random.Random(7), 0.2)  # fmt: skip
    assert not (out / result).exists(), "killed after the result: nothing was left to redo"
    _done(_cli([*args, "--out", str(out)]))
    assert _result(out / result) == _result(tmp_path / "reference" / result)
    assert not (out / ".ropekit.lock").exists()
