"""Helpers for tests of several processes.

Holds:
    run_ranks       run fn(processes) as `world` ranks, each a thread of this process, whose
                    collectives meet at a barrier: the sharding logic without launch costs.
    launch          `accelerate launch` 2 CPU processes on `python -m ropekit.cli ...`, with
                    every file write of every process logged (see `writes`).
    run_together    several `python -m ropekit.cli ...` processes started at once, each
                    logging its writes under its own name (see `writes`).
    writes          the paths each process created, replaced or removed under a folder.
    locked_elsewhere  a folder's --out lock held by another process (as a running command
                    holds it), for the span of a with block.

Launched processes are fresh Python interpreters: each pays a few seconds of imports.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ropekit.distributed import Processes

T = TypeVar("T")
ACCELERATE = Path(sys.executable).with_name("accelerate")


# --------------------------------------------------------------------------- ranks as threads
class _Exchange:
    def __init__(self, world: int):
        self.slots: list[bytes] = [b""] * world
        self.barrier = threading.Barrier(world, timeout=60)


@dataclass
class ThreadedProcesses(Processes):
    """A rank whose gather/broadcast/barrier meet the other ranks' threads. Objects travel
    pickled, as they do between real processes."""

    exchange: _Exchange = field(default=None, repr=False)  # type: ignore[assignment]

    def gather(self, obj: T) -> list[T]:
        ex = self.exchange
        ex.slots[self.rank] = pickle.dumps(obj)
        ex.barrier.wait()
        out = [pickle.loads(slot) for slot in ex.slots]
        ex.barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return out

    def broadcast(self, obj: T) -> T:
        return self.gather(obj)[0]

    def barrier(self) -> None:
        self.exchange.barrier.wait()


def run_ranks(world: int, fn: Callable[[Processes], T]) -> list[T | BaseException]:
    """fn(processes) on `world` threads, one rank each; each rank's value or exception."""
    exchange = _Exchange(world)
    results: list[Any] = [None] * world

    def rank(r: int) -> None:
        try:
            results[r] = fn(ThreadedProcesses(r, world, None, exchange))
        except BaseException as e:
            # No barrier.abort() here: ranks still leaving the last collective would see it
            # broken. A rank that dies before a collective leaves the others to the timeout.
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# --------------------------------------------------------------------------- real processes
# Installed through PYTHONPATH in every launched interpreter: logs what it writes under ROOT.
# Python raises an audit event for every open() (os.open included, which atomic writes use)
# and every rename, remove and mkdir, so the log shows which process wrote which file.
_AUDIT = """
import os, sys
root = os.environ["ROPEKIT_TEST_WRITE_ROOT"]
name = "rank-%s.log" % os.environ.get("ROPEKIT_TEST_WRITE_NAME", os.environ.get("RANK", "launcher"))
log = open(os.path.join(os.environ["ROPEKIT_TEST_WRITE_LOG"], name), "a", buffering=1)
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writing = any(c in (mode or "") for c in "wax+") if mode else bool((flags or 0) & WRITE)
        paths = [path] if writing else []
    elif event in ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree"):
        paths = [args[1] if event == "os.rename" else args[0]]
    else:
        return
    for p in paths:
        if not isinstance(p, (str, os.PathLike)) or isinstance(os.fspath(p), bytes):
            continue
        p = os.path.abspath(os.fspath(p))  # a relative path: from this process's folder
        if p.startswith(root):
            log.write(event + " " + os.path.relpath(p, root) + "\\n")

sys.addaudithook(hook)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], root: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """`ropekit *args` as 2 CPU processes under `accelerate launch`; writes under `root` are
    logged per process in root/.writes (read them with `writes`). One thread per process."""
    audit = root / ".audit"
    log = root / ".writes"
    audit.mkdir(parents=True, exist_ok=True)
    log.mkdir(exist_ok=True)
    (audit / "sitecustomize.py").write_text(_AUDIT)
    # `accelerate launch --cpu --num_processes 2` starts a single process (accelerate issue
    # #2741); multi-process CPU runs take the multi-GPU launcher with ACCELERATE_USE_CPU=1.
    command = [
        str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
        "-m", "ropekit.cli", *args,
    ]  # fmt: skip
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(audit), os.environ.get("PYTHONPATH")])),
        "ROPEKIT_TEST_WRITE_ROOT": str(root),
        "ROPEKIT_TEST_WRITE_LOG": str(log),
    }
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def run_together(
    argvs: dict[str, list[str]], root: Path, timeout: float = 300
) -> dict[str, subprocess.CompletedProcess]:
    """{name: `ropekit *argv`} started at once in `root` as separate processes (one thread
    each), each logging what it writes under `root` as `name` (read them with `writes`);
    their results."""
    audit, log = root / ".audit", root / ".writes"
    audit.mkdir(parents=True, exist_ok=True)
    log.mkdir(exist_ok=True)
    (audit / "sitecustomize.py").write_text(_AUDIT)
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(audit), os.environ.get("PYTHONPATH")])),
        "ROPEKIT_TEST_WRITE_ROOT": str(root),
        "ROPEKIT_TEST_WRITE_LOG": str(log),
    }
    started = {}
    for name, argv in argvs.items():  # output to files: a full pipe would stall a process
        with open(log / f"{name}.out", "w") as stdout, open(log / f"{name}.err", "w") as stderr:
            started[name] = subprocess.Popen(
                [sys.executable, "-m", "ropekit.cli", *argv],
                env=env | {"ROPEKIT_TEST_WRITE_NAME": name},
                cwd=root,
                stdout=stdout,
                stderr=stderr,
            )
    out = {}
    for name, process in started.items():
        process.wait(timeout=timeout)
        stdout, stderr = ((log / f"{name}.{s}").read_text() for s in ("out", "err"))
        out[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return out


def writes(root: Path) -> dict[str, set[str]]:
    """{"0": paths, "1": paths} that each launched process wrote, renamed onto, removed or
    created under `root` (relative paths; the audit's own folders left out)."""
    out = {}
    for file in sorted((root / ".writes").glob("rank-*.log")):
        rank = file.stem.removeprefix("rank-")
        paths = {line.split(" ", 1)[1] for line in file.read_text().splitlines()}
        out[rank] = {p for p in paths if not p.startswith((".audit", ".writes"))}
    return out


@contextlib.contextmanager
def locked_elsewhere(
    folder: Path, lock_file: Path | None = None, command: str = "test"
) -> Iterator[None]:
    """``folder``'s lock (``ropekit.outdir.lock_out_dir``), or the lock file ``lock_file``
    (``hold_lock``, its record naming ``command``), held by another process for the span of
    the block, as a running command holds it; that process is killed after (kill -9: it
    releases nothing itself), and the lock file it leaves removed. (A lock taken in this
    process would not stop this process.)"""
    from ropekit.outdir import LOCK_FILE

    path = Path(lock_file) if lock_file is not None else Path(folder) / LOCK_FILE
    take = (
        f"hold_lock({str(path)!r}, command={command!r})"
        if lock_file is not None
        else f"lock_out_dir({str(folder)!r})"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from ropekit.outdir import hold_lock, lock_out_dir; "
         f"lock = {take}; print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()
        path.unlink(missing_ok=True)
