"""Every writer with a cache or a stage file, on a disk that is really full (tests/fulldisk.py:
a tmpfs of a few KiB in a mount namespace of its own): the command ends with one line naming
the file it could not write, exit 2, and leaves no temporary file; run again with room, it
finishes, and what the failed run left (a resumable cache) is reused or cleared, never in the way.

The sizes are chosen so that the disk fills at each of the command's writes in turn (the lock
file, the cache's first and later entries, the result, the figure); a test checks that the
sweep did reach the cache, so a change of file sizes cannot make it pass by missing it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ropekit.cli import main

from .fulldisk import Attempt, can_fill_a_disk, on_full_disk

pytestmark = pytest.mark.skipif(
    not can_fill_a_disk(), reason="no mount namespace here (unshare -rm) to fill a disk in"
)

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--batch-size", "2", "--warmup", "1"]
FULL = "no space left on the device"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("full-disk") / "base"
    try:
        assert main(["pretrain", "--context", "32", "--steps", "2", "--out", str(out), *TINY]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def _temporary(names: list[str]) -> list[str]:
    return [n for n in names if n.rstrip("/").endswith((".tmp", ".part"))]


def _one_line_naming_a_file(attempt: Attempt, command: str, disk: Path) -> str:
    """The error line: the last line, the only one with an error, starting a line of its own
    (not after a progress bar), naming a file on the full disk and the reason."""
    lines = attempt.stderr.splitlines()
    errors = [line for line in lines if "error:" in line]
    assert attempt.code == 2 and errors == lines[-1:], (attempt.kib, attempt.stderr[-1500:])
    line = errors[0]
    assert FULL in line, line
    checkpoint = re.match(
        rf"ropekit {command}: error: could not write checkpoint (\S+) in (\S+) ", line
    )
    if checkpoint:  # train/checkpoint.py: the checkpoint, its folder and the free space
        return str(Path(checkpoint[2], checkpoint[1]).relative_to(disk))
    assert line.startswith(f"ropekit {command}: error: cannot write {disk}/"), line
    assert line.endswith(FULL), line
    return line.removeprefix(f"ropekit {command}: error: cannot write {disk}/").split(":")[0]


def test_eval_ppl_on_a_full_disk_names_the_file_and_leaves_no_temporary_file(base, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    argv = ["eval", "ppl", "--model", str(base), "--lengths", "32", "--tokens", "64",
            "--out", str(disk / "q")]  # fmt: skip
    attempts = on_full_disk(argv, disk, [4, 8, 12, 64])
    named = set()
    for a in attempts:
        named.add(_one_line_naming_a_file(a, "eval", disk))
        assert _temporary(a.left) == [], (a.kib, a.left)
        windows = [n for n in a.left if n.startswith("q/windows/")]
        # The per-window cache is kept only with a window in it (then it is resumable).
        assert windows == [] or any(n.endswith(".npz") for n in windows), (a.kib, a.left)
        assert a.again == 0, (a.kib, a.again_stderr[-1500:])
        assert a.after == ["q/", "q/ppl.json", "q/ppl.png"], (a.kib, a.after)
    assert {"q/windows/key.txt", "q/ppl.json", "q/ppl.png"} <= named, named
    assert any(n.startswith("q/windows/") and n.endswith(".npz") for n in named), named


def _sweep(attempts: list[Attempt], command: str, disk: Path) -> set[str]:
    """What every writer owes a full disk; returns the files the failures named."""
    named = set()
    for a in attempts:
        assert _temporary(a.left) == [] and _temporary(a.after) == [], (a.kib, a.left, a.after)
        assert a.again == 0, (a.kib, a.again_stderr[-1500:])
        if a.code != 0:
            named.add(_one_line_naming_a_file(a, command, disk))
    return named


# (command line with {base} and {out}, sizes in KiB, a file of its cache or stages that the
# sweep must have filled the disk at)
WRITERS = {
    "eval passkey": (
        "eval passkey --model {base} --lengths 96 --depths 1 --samples 1 --out {out}",
        [4, 8, 12, 16, 24, 32],
        "out/passkey/96/pred.jsonl",
    ),
    # Training is rerun with --resume: into a folder without a checkpoint it starts afresh.
    "pretrain": (
        "pretrain --context 32 --steps 4 --checkpoint-interval 2 --layers 1 --d-model 32 "
        "--heads 2 --batch-size 2 --warmup 1 --resume --out {out}",
        [4, 8, 16, 32, 64, 128, 192, 256],
        "out/checkpoints/step-00000002",
    ),
    "extend": (
        "extend --model {base} --method adarope:init=yarn,factor=2 --target-length 64 "
        "--samples 2 --resume --out {out}",
        [4, 16, 64, 128, 192],
        "out/train/checkpoints/step-00000002",
    ),
    "eval probes": (
        "eval probes --model {base} --lengths 256 --haystacks 1 --needles 2 --out {out}",
        [4, 8, 12, 16, 24, 32, 48],
        "out/256/probes.jsonl",
    ),
    "search": (
        "search --model {base} --target-length 64 --samples 1 --budget 6 --population 3 "
        "--parents 2 --chunk 64 --out {out}",
        [4, 8, 12, 16, 24, 32, 64],
        "out/candidates.jsonl",
    ),
}


@pytest.mark.slow  # 30-60 s each here: a CLI process per size in a namespace
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_writer_with_stages_on_a_full_disk(base, tmp_path, writer):
    template, sizes, cache = WRITERS[writer]
    disk = tmp_path / "disk"
    disk.mkdir()
    argv = template.format(base=base, out=disk / "out").split()
    named = _sweep(on_full_disk(argv, disk, sizes), writer.split()[0], disk)
    assert cache in named, named
