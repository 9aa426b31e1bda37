"""Experiment E's stage 2, computed beside stage 1 in its own folder, copied into the full
comparison's folder job by job.

Stage 2 runs as its own comparison (``stage2.json`` into ``stage2/``) on the second core. Every
job it has finished is copied to the same place in ``final/``: an evaluation's ``ppl.json`` and
figure (not its window caches), a probes run (once its summary is written), an extension
run's ``extend.json`` and adapter (not its training checkpoints); and each copied job's wall
time is appended to ``final/times.jsonl``. When stage 2's methods are added to compare.json,
the comparison in ``final/`` finds those jobs done and reuses them (a job is reused by its
provenance, not by the folder it was computed in) and keeps their real times, which it would
otherwise not know (compare records no time for a job it finds finished with no record).

Nothing is ever replaced: a file already in ``final/`` is left when it is the same bytes and
refused otherwise, and every file is checked before any is copied, so a refused merge copies
nothing. It takes ``final/``'s lock, so it refuses to run while the comparison there runs
(that run rewrites times.jsonl from memory and would drop the appended records).

    python -m experiments.smollm2_32k.merge [--stage2 DIR] [--final DIR]

Holds: finished_jobs, plan, merge, main.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from ropekit.outdir import LOCK_FILE, lock_out_dir
from ropekit.results import read_records, write_records

HERE = Path(__file__).parent
TIMES = "times.jsonl"
# caches and files in progress: never results (window caches, atomic writes, locks)
SKIPPED = (".npz", ".part", LOCK_FILE)


def finished_jobs(stage2: Path) -> list[Path]:
    """The folders of ``stage2``'s finished jobs, relative to it: evaluations (ppl.json
    written), probes runs (summary.json written) and extension runs (extend.json written)."""
    marks = ("eval/*/s*/*/ppl.json", "eval/*/s*/probes/summary.json", "methods/**/extend.json")
    return sorted({p.parent.relative_to(stage2) for mark in marks for p in stage2.glob(mark)})


def _files(folder: Path, job: Path) -> list[Path]:
    """A job's result files: an evaluation's own files (not its windows/ caches), a probes
    run's whole tree, an extension's extend.json and adapter/ (not train/)."""
    if job.parts[0] == "methods":
        return [folder / "extend.json", *sorted((folder / "adapter").glob("*"))]
    files = folder.rglob("*") if job.name == "probes" else folder.glob("*")
    return sorted(f for f in files if f.is_file() and not f.name.endswith(SKIPPED))


def plan(stage2: Path, final: Path) -> tuple[list[tuple[Path, Path]], list[Path]]:
    """(source, target) of every file to copy, and the jobs whose times move with them.
    Raises ValueError naming the first file that ``final`` holds with other content."""
    copies, jobs = [], []
    for job in finished_jobs(stage2):
        new = False
        for source in _files(stage2 / job, job):
            target = final / source.relative_to(stage2)
            if not target.exists():
                copies.append((source, target))
                new = True
            elif target.read_bytes() != source.read_bytes():
                raise ValueError(
                    f"{target} holds another result than {source}: nothing is merged "
                    "(a file in the comparison's folder is never replaced)"
                )
        if new:
            jobs.append(job)
    return copies, jobs


def merge(stage2: Path, final: Path, log: Callable[[str], None] = print) -> int:
    """Copy ``stage2``'s finished jobs into ``final`` (module docstring); returns the number
    of files copied."""
    with lock_out_dir(final, command="python -m experiments.smollm2_32k.merge"):
        copies, jobs = plan(stage2, final)
        for source, target in copies:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        records = read_records(final / TIMES) if (final / TIMES).is_file() else []
        known = {r["job"] for r in records}
        moved = {str(job) for job in jobs}
        added = [
            r for r in (read_records(stage2 / TIMES) if (stage2 / TIMES).is_file() else [])
            if "seconds" in r  # a finished job's time, not an attempt in progress
            and r["job"] not in known and r["job"].split(" ", 1)[1] in moved
        ]  # fmt: skip
        if added:
            write_records(final / TIMES, records + added)
        for job in jobs:
            log(f"merged {job}")
        log(f"{len(copies)} files of {len(jobs)} jobs copied, {len(added)} job times added")
        return len(copies)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.smollm2_32k.merge")
    parser.add_argument("--stage2", type=Path, default=HERE / "stage2",
                        help="the stage-2 comparison's folder (default: stage2/)")  # fmt: skip
    parser.add_argument("--final", type=Path, default=HERE / "final",
                        help="the full comparison's folder (default: final/)")  # fmt: skip
    args = parser.parse_args(argv)
    for name in ("stage2", "final"):
        if not (getattr(args, name) / "eval").is_dir():
            parser.error(f"--{name} {getattr(args, name)} is not a comparison's folder (no eval/)")
    try:
        merge(args.stage2, args.final)
    except ValueError as e:  # a file that differs; final/ locked (OutDirLocked is one)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
