"""Which method a probing thread takes next, so that two threads (one per core) can run one
experiment's ``eval probes`` jobs side by side without a hand-made split: each takes the first
method in the fixed order that has not finished and that no live process is probing.

    python -m experiments.probe_queue OUT LABEL [LABEL ...]   # prints the label, or nothing
    python -m experiments.probe_queue --held OUT/LABEL        # exit 0 if a live process holds it

A method has finished when its folder holds summary.json (``run_probes`` writes it last); it
is held while the process that took its folder's lock (``ropekit.outdir``, the lock every
``eval probes`` takes on its folder) is alive on this host. A lock taken on another host
counts as free here, and ``eval probes`` itself then refuses the folder if it really is held.
Two threads that look in the same instant may pick the same method; the second one's
``eval probes`` is refused (the folder is in use) and the scripts ask ``--held`` to tell that
refusal from a failure and move on.

Used by experiments/smollm2_32k/retrieval/run.sh and experiments/smollm2_32k_neighbours/
retrieval.sh.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ropekit.outdir import LOCK_FILE, holder_of


def finished(folder: Path) -> bool:
    """Whether the method probed into ``folder`` has finished (its summary.json is written)."""
    return (folder / "summary.json").is_file()


def held(folder: Path) -> bool:
    """Whether a live process on this host holds ``folder``'s lock."""
    holder = holder_of(folder / LOCK_FILE)
    return holder is not None and holder.alive() is True


def next_label(out: Path, labels: Sequence[str]) -> str | None:
    """The first of ``labels`` (in order) whose folder under ``out`` has neither finished nor
    is held; None when every one has or is."""
    return next((m for m in labels if not finished(out / m) and not held(out / m)), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--held", type=Path, help="exit 0 if a live process holds this folder")
    parser.add_argument("out", type=Path, nargs="?", help="the folder of the methods' folders")
    parser.add_argument("labels", nargs="*", help="the methods, in the order to take them")
    args = parser.parse_args(argv)
    if args.held is not None:
        return 0 if held(args.held) else 1
    if args.out is None or not args.labels:
        parser.error("give OUT and at least one LABEL (or --held FOLDER)")
    label = next_label(args.out, args.labels)
    if label is not None:
        print(label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
