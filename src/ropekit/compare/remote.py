"""A comparison's jobs as Ray tasks: ``ropekit compare --executor ray`` (extra ``ropekit[ray]``).

The plan (`plan.jobs`) and the ledger (`ledger.Ledger`) are the same as in one process; what
changes is where a job runs. This process walks the plan, submits each job whose jobs before it
are finished as a Ray task (``run_job``) declaring what it needs (``job_cpus`` CPUs, or one GPU
where the cluster has GPUs), takes in each result as it comes back (`comparison.Comparison.finish`)
and writes the verdict, as the loop in one process does; so the later seeds' rates and a raced
comparison's next round are planned once what they depend on is back.

A task runs its job through the ledger in the comparison's folder, as a ``--join`` process does:
claimed by a lock in ``.jobs/``, timed in times.jsonl, its result written in the job's folder.
So **the output folder must be on storage every node of the cluster reads and writes** (a shared
file system mounted at the same path, with working ``flock``), and a task whose worker dies (a
node lost, a process killed) is rerun by Ray (``MAX_RETRIES``): its claim died with it, and the
rerun resumes from what the job wrote (an extension from its last checkpoint, a perplexity from
its finished windows). Each worker process opens the comparison once (the model, the held-out
streams, the haystacks) and keeps it for the tasks it runs next.

The cluster is the one ``RAY_ADDRESS`` names, or, when it is unset, a local one started for
the run and stopped after it. Use Ray where a cluster is already there; ``--join`` needs none
(processes started by hand on machines that share the folder).

Holds: EXECUTORS, MAX_RETRIES, RayOptions, cluster, run_on_ray, run_job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from . import ledger as ledger_module
from .comparison import RUNNERS, Comparison
from .config import CompareConfig
from .ledger import Held
from .plan import RESULT_FILE, Job

EXECUTORS = ("local", "ray")
# How often Ray reruns a task whose worker died (Ray's own default for tasks is 3).
MAX_RETRIES = 3
# How long the address in RAY_ADDRESS gets to answer before the run is refused (a cluster
# that is up answers at once; Ray's own connection attempt waits minutes).
CONNECT_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """What each job asks of the cluster."""

    job_cpus: int = 1  # CPUs each job declares (its torch threads; Ray sets OMP_NUM_THREADS)

    def __post_init__(self) -> None:
        if not isinstance(self.job_cpus, int) or isinstance(self.job_cpus, bool):
            raise ValueError(f"job_cpus={self.job_cpus!r} is not allowed; give an integer >= 1")
        if self.job_cpus < 1:
            raise ValueError(f"job_cpus={self.job_cpus} is not allowed; give an integer >= 1")


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(
            "--executor ray needs Ray, which is not installed: pip install 'ropekit[ray]' "
            "(or run without --executor ray, in this process)"
        ) from None
    return ray


def _reachable(address: str) -> None:
    """Refuse, in one line, an address in RAY_ADDRESS where nothing answers."""
    if address in ("auto", "local"):
        return  # Ray finds the cluster of this machine (auto) or starts one (local)
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or port is None:
        raise ValueError(
            f"RAY_ADDRESS={address!r} is not an address of a Ray cluster; give host:port "
            "(or ray://host:port), or unset it to run on a local cluster started for this run"
        )
    try:
        socket.create_connection((host, port), timeout=CONNECT_SECONDS).close()
    except OSError as e:
        raise ValueError(
            f"RAY_ADDRESS={address!r}: no Ray cluster answers there ({e.strerror or e}); start "
            "one (ray start --head) or unset RAY_ADDRESS to run on a local cluster started for "
            "this run"
        ) from None


@contextlib.contextmanager
def cluster() -> Iterator[Any]:
    """Ray, connected to the cluster RAY_ADDRESS names or to a local one started for the run
    (stopped after it); refused in one line, before anything is written, where Ray is not
    installed or the address does not answer."""
    ray = _ray()
    if ray.is_initialized():  # a caller's own connection (a notebook, a test): kept
        yield ray
        return
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        _reachable(address)
    try:
        ray.init(address=address or None, log_to_driver=False, include_dashboard=False)
    except (ConnectionError, RuntimeError, TimeoutError) as e:
        where = f"RAY_ADDRESS={address!r}" if address else "a local cluster"
        raise ValueError(f"cannot start Ray on {where}: {str(e).splitlines()[0]}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------- on a worker
@functools.cache
def _opened(config: CompareConfig, out: str, command: str) -> Comparison:
    """The comparison, opened once per worker process (a task reuses it and its last model)."""
    return Comparison(config, Path(out), command, lambda *_: None, False)


def run_job(
    config: CompareConfig, out: str, command: str, job: Job, run: Job | None
) -> tuple[Any, Any]:
    """One job on a worker, through the ledger of the shared folder: its value (a `Held` when
    another process holds it) and, for a perplexity, what each engine serves of its method
    (``Comparison.score`` finds it on the model it attaches)."""
    comparison = _opened(config, out, command)
    if run is not None:
        comparison.runs[run.name] = run
    fn = functools.partial(RUNNERS[job.kind], comparison, job)
    value = comparison.ledger.run(job.name, fn, job.folder, RESULT_FILE.get(job.kind, ""))
    return value, comparison.finished.served.get(job.method.label)


# ---------------------------------------------------------------------------- the driver
def run_on_ray(
    ray: Any, run: Comparison, config: CompareConfig, options: RayOptions, log: Callable
) -> None:
    """Every job of ``run``'s plan as a Ray task on ``ray``'s cluster (module docstring),
    until none is left; ``config`` as the user gave it (each worker opens it)."""
    resources = ray.cluster_resources()
    gpus = 1 if resources.get("GPU", 0) >= 1 else 0
    task = ray.remote(run_job).options(
        num_cpus=options.job_cpus, num_gpus=gpus, max_retries=MAX_RETRIES
    )
    cpus = f"{options.job_cpus} CPU{'s' * (options.job_cpus > 1)}" + " and 1 GPU" * gpus
    log(f"ray: each job a task of {cpus}, on a cluster of {resources.get('CPU', 0):g} CPUs")
    _drive(ray, task, run, config, log)


def _drive(ray: Any, task: Any, run: Comparison, config: CompareConfig, log: Callable) -> None:
    """Submit every job whose jobs before it are finished, take in each result as it comes
    back; a job another process holds (``--join`` beside) is asked again after
    ``ledger.WAIT_SECONDS``, as the loop in one process does."""
    pending: dict[Any, Job] = {}  # task -> its job
    held: dict[str, float] = {}  # job another process held -> when that was found
    while True:
        running, now = {j.name for j in pending.values()}, time.monotonic()
        for job in run.jobs():  # read again after each result: rates chosen, rounds decided
            if job.kind == "training":
                run.runs[job.name] = job
            if job.name in run.done | running or any(a not in run.done for a in job.after):
                continue
            if now - held.get(job.name, -math.inf) < ledger_module.WAIT_SECONDS:
                continue
            before = run.runs.get(job.after[0]) if job.after else None
            pending[task.remote(config, str(run.out), run.command, job, before)] = job
            running.add(job.name)
        if not pending:
            if not held:
                return
            time.sleep(max(0.0, min(held.values()) + ledger_module.WAIT_SECONDS - now))
            continue
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            job = pending.pop(ref)
            value, served = ray.get(ref)
            if isinstance(value, Held):
                if job.name not in held:
                    log(f"{job.name}: held by another process of this comparison; looking "
                        f"again every {ledger_module.WAIT_SECONDS:g} s")  # fmt: skip
                held[job.name] = time.monotonic()
                continue
            held.pop(job.name, None)
            run.ledger.sync()  # the records the task's process wrote
            if served is not None:
                run.finished.served.setdefault(job.method.label, served)
            run.done.add(job.name)
            run.ledger.jobs.add(job.name)  # its time belongs to this comparison's record
            run.finish(job, value)
