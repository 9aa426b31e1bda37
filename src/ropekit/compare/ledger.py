"""A ledger of named jobs in one folder: each run once, whichever process runs it, and timed.

It knows nothing of what a job does. ``Ledger.run(name, fn, folder=, result=)`` claims the job
for this process, runs ``fn`` (or, for a finished job, calls it to load the result, which the
job's own files make cheap), and records its wall time in ``times.jsonl``:

- **Claims.** Several processes may work in one folder (``ropekit compare --join``): a job is
  claimed by a ``flock`` on ``.jobs/<name>.lock`` (``ropekit.outdir``: the kernel drops it when
  its process dies, kill -9 included, so the job is free again). A job another live process
  holds is not run: ``run`` returns a ``Held`` naming it, and the caller goes on with the jobs
  that do not need it, and looks again later (``WAIT_SECONDS``).
- **Times.** A job is recorded as begun (``started``, wall clock) before it runs and as
  finished (``seconds``) after; a resumed job counts its earlier attempts up to the last file
  each wrote in its folder (the work after that was lost, done again and counted then). A stop
  Python sees (SIGTERM, Ctrl-C) settles the attempt's time at once (``started`` None). A job
  whose result file is in its folder with no record of it here was computed elsewhere (copied
  in, or run ahead): it is loaded and gets no record, since the loading is not its time.
- **Several writers.** times.jsonl is rewritten under a folder-wide lock (``filelock``) with
  every other process's records kept, in the order the jobs finished.

Holds: Ledger, Held, WAIT_SECONDS, CLAIMS.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import filelock

from ropekit.outdir import LockHolder, OutDirLocked, hold_lock, holder_of
from ropekit.results import read_records, write_records

T = TypeVar("T")
# Where the processes of one folder claim its jobs; how long one that has nothing left but
# jobs another holds waits before it looks again.
CLAIMS, WAIT_SECONDS = ".jobs", 60.0
Record = dict[str, Any]  # {"job", "seconds", ...} finished, or {"job", "started", "earlier"}


class Held(NamedTuple):
    """A job another live process holds: not run here."""

    job: str
    holder: LockHolder | None


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip("-") or "job"


class Ledger:
    """The jobs of ``folder``: claimed, timed in ``times.jsonl``, reused when finished."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.times = self.folder / "times.jsonl"
        self.records: dict[str, Record] = {}  # finished jobs
        self.attempts: dict[str, Record] = {}  # jobs begun, not finished
        self.changed: set[str] = set()  # jobs this process changed, not yet written
        self.jobs: set[str] = set()  # the jobs this process ran or loaded
        for record in read_records(self.times):
            self._place(record)

    # ------------------------------------------------------------------ running a job
    def run(
        self, job: str, fn: Callable[[], T], folder: Path | None = None, result: str = ""
    ) -> T | Held:
        """``fn()`` as ``job``, claimed and timed (module docstring); a `Held` when another
        live process holds it."""
        try:
            claim = hold_lock(self._claims(f"{_slug(job)}.lock"), command=job)
        except OutDirLocked as e:
            return Held(job, e.holder)
        with claim:
            self.sync()
            return self._timed(job, fn, folder, result)

    def _timed(self, job: str, fn: Callable[[], T], folder: Path | None, result: str) -> T:
        finished = job in self.records
        unknown = not finished and job not in self.attempts
        if unknown and folder is not None and result and (folder / result).is_file():
            value = fn()  # computed elsewhere: loaded
            self.jobs.add(job)
            return value
        if not finished:
            earlier = self.earlier_seconds(job, folder)
            self.set(job, {"job": job, "started": time.time(), "earlier": earlier})
        start = time.perf_counter()
        try:
            value = fn()
        except BaseException:
            if not finished:
                settled = self.earlier_seconds(job, folder)
                self.set(job, {"job": job, "started": None, "earlier": settled})
            raise
        self.jobs.add(job)
        if not finished:
            self.set(job, {"job": job, "seconds": earlier + time.perf_counter() - start})
        return value

    def earlier_seconds(self, job: str, folder: Path | None) -> float:
        """Wall seconds of ``job``'s earlier attempts, each up to the last file it wrote in
        ``folder`` (0 for a job never begun, or begun with no file written since); an attempt
        settled when it stopped counts as settled."""
        attempt = self.attempts.get(job)
        if attempt is None:
            return 0.0
        if attempt["started"] is None:  # settled when it stopped
            return attempt["earlier"]
        files = folder.rglob("*") if folder is not None and folder.is_dir() else ()
        last = max((f.stat().st_mtime for f in files if f.is_file()), default=0.0)
        return attempt["earlier"] + max(0.0, last - attempt["started"])

    def find(self, match: Callable[[Record], bool]) -> Record | None:
        """The first finished record ``match`` accepts (a cache keyed by what it holds)."""
        return next((r for r in self.records.values() if match(r)), None)

    def running_elsewhere(self) -> list[str]:
        """The jobs other live processes hold now, from their claims' records, read without
        taking them (so asking changes nothing)."""
        claims = self.folder / CLAIMS
        holders = map(holder_of, sorted(claims.glob("*.lock")) if claims.is_dir() else [])
        return [
            h.command
            for h in holders
            if h is not None and h.command and h.pid != os.getpid() and h.alive() is not False
        ]

    # ------------------------------------------------------------------ the records
    def set(self, job: str, entry: Record) -> None:
        """Record ``job`` as finished ({"job", "seconds", ...}) or begun ("started") and write
        times.jsonl, keeping every other process's records."""
        self._place(entry)
        self.changed.add(job)
        self.sync(write=True)

    def _place(self, entry: Record) -> None:
        """``entry`` as its job's one record: begun ("started") or finished."""
        begun = "started" in entry
        (self.records if begun else self.attempts).pop(entry["job"], None)
        (self.attempts if begun else self.records)[entry["job"]] = entry

    def sync(self, write: bool = False) -> None:
        """Take in what times.jsonl now says of every job this process has not changed since
        it last wrote (the other processes' jobs); with ``write``, then write them all back
        under the folder's lock. The records keep the file's order (a job finished since, at
        its attempt's place: after every finished one), so processes writing in turn list the
        jobs in the order they finished."""
        with self.waiting("times"):
            on_file = read_records(self.times)
            for record in on_file:
                if record["job"] not in self.changed:
                    self._place(record)
            place = {r["job"]: i for i, r in enumerate(on_file)}

            def in_file_order(records: dict[str, Record]) -> dict[str, Record]:
                return dict(sorted(records.items(), key=lambda jr: place.get(jr[0], len(place))))

            self.records, self.attempts = map(in_file_order, (self.records, self.attempts))
            if write:
                write_records(self.times, [*self.records.values(), *self.attempts.values()])
                self.changed.clear()

    @contextlib.contextmanager
    def waiting(self, name: str) -> Iterator[None]:
        """The folder-wide lock ``name`` (held for milliseconds of writing), waited for."""
        with filelock.FileLock(self._claims(f".{name}.lock")):
            yield

    def _claims(self, name: str) -> Path:
        (self.folder / CLAIMS).mkdir(parents=True, exist_ok=True)
        return self.folder / CLAIMS / name
