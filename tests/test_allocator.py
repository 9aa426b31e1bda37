"""ropekit.allocator: glibc's mmap threshold fixed, so freed large tensors leave the process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from ropekit.allocator import bound_resident_memory
from ropekit.cli import main

# A child that puts glibc in the state a long forward leaves it in (the dynamic threshold
# raised to its maximum, 32 MiB, by the first large frees; set here with mallopt, since where
# the dynamic rule lands depends on every allocation before it: CI measured it otherwise),
# then allocates and frees large tensors, each followed by a small live one so the heap cannot
# shrink, and reports its resident memory at the end, when it holds almost nothing. Each tensor
# is 64 KiB larger than the one before, so none fits the hole an earlier one left (equal sizes
# sometimes reused one hole throughout, depending on its alignment: CI measured 289 against
# 283 MiB once, and 517 against 283 another time).
CHILD = """
import ctypes, ctypes.util, resource, sys, torch
from ropekit.allocator import bound_resident_memory
assert ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 32 << 20)
if sys.argv[1] == "bounded":
    assert bound_resident_memory()
keep = []
for i in range(40):
    a = torch.ones((6 << 20) + (i << 16), dtype=torch.uint8)  # 6-8.5 MiB: the heap's, < 32 MiB
    keep.append(torch.ones(1024))
    del a
rss = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
print(rss >> 20)
"""


def _resident_mib(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_fixed_threshold_gives_freed_tensors_back():
    # 40 x 6-8.5 MiB freed: resident in glibc's heap unless bounded (measured 244 against 526-533
    # MiB, three runs each)
    assert _resident_mib("bounded") + 150 < _resident_mib("default")
    assert bound_resident_memory() is True


def test_a_bad_mode_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("ROPEKIT_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="ROPEKIT_MALLOC='jemalloc' is not allowed"):
        bound_resident_memory()
    assert main(["encodings"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "bounded, default" in err
    monkeypatch.setenv("ROPEKIT_MALLOC", "default")
    assert bound_resident_memory() is False
    assert os.environ["ROPEKIT_MALLOC"] == "default"
