"""A real full disk for a command: its output folder is a tmpfs of a few KiB, mounted in a
mount namespace of its own (`unshare -rm`: no root on the host needed, nothing outside the
test sees it), so every write past the room fails with ENOSPC wherever it happens (numpy's
writes, matplotlib's, the lock file's), not only where a test thought to inject it.

Holds:
    can_fill_a_disk  whether this machine lets a test mount a tmpfs in a namespace.
    on_full_disk     run one command on a disk of each size, then again on the same files with
                     room to spare: what each run said and left.
    Attempt          one size's outcome.

The whole sweep runs in one interpreter in the namespace (the command's imports are paid once);
the tmpfs and everything on it vanish with the namespace, so what was left is listed inside.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_DRIVER = r"""
import contextlib, io, json, os, subprocess, sys, torch
from ropekit.cli import main

folder, argv, sizes = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
torch.set_num_threads(1)

def listing():
    return sorted(
        os.path.relpath(os.path.join(root, name), folder) + ("/" if name in dirs else "")
        for root, dirs, files in os.walk(folder) for name in dirs + files
    )

def run():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()

out = []
for kib in sizes:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", folder], check=True)
    code, err = run()
    left = listing()
    subprocess.run(["mount", "-o", "remount,size=65536k", folder], check=True)
    again, again_err = run()
    out.append({"kib": kib, "code": code, "stderr": err, "left": left, "again": again,
                "again_stderr": again_err, "after": listing()})
    subprocess.run(["umount", folder], check=True)
print("RESULT " + json.dumps(out))
"""


@dataclass(frozen=True)
class Attempt:
    kib: int  # the disk's size
    code: int  # the command's exit code on it
    stderr: str  # what it printed on stderr (progress bars included)
    left: list[str]  # what it left on the disk ("a/" for a folder), relative to it
    again: int  # the exit code of the same command rerun on those files with room to spare
    again_stderr: str
    after: list[str]  # what the rerun left


def can_fill_a_disk() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return done.returncode == 0


def on_full_disk(argv: list[str], folder: Path, sizes: list[int]) -> list[Attempt]:
    """Run ``ropekit argv`` with ``folder`` (which must exist, empty) a tmpfs of each of
    ``sizes`` KiB, then again with 64 MiB; ``argv`` writes its outputs under ``folder``."""
    done = subprocess.run(
        ["unshare", "-rm", sys.executable, "-c", _DRIVER, str(folder), json.dumps(argv),
         json.dumps(sizes)],
        capture_output=True, text=True,
    )  # fmt: skip
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and result, done.stderr[-3000:]
    return [Attempt(**a) for a in json.loads(result[0].removeprefix("RESULT "))]
