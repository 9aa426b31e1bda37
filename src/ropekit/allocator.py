"""Resident memory of long forwards: glibc's malloc and large tensors.

PyTorch's CPU tensors come from the C library's malloc. glibc serves a request of at least
``M_MMAP_THRESHOLD`` bytes with a mapping of its own, unmapped when freed; smaller ones come
from its heap, where freed memory stays resident until the top of the heap is free. The
threshold is dynamic: freeing a mapped chunk raises it to that chunk's size (up to 32 MiB on
64-bit systems), so once the first activations of a long forward are freed, tensors of up to
32 MiB come from the heap, and the resident memory of the process grows past the tensors it
holds by an amount that depends only on the order of allocations.

Measured (SmolLM2-135M, one 4096-token forward, one thread, resident peak above the loaded
model): the tensors alive at the peak are the same for the unpatched model and the model
patched with ``yarn:factor=2`` (torch's allocation peak 1290 and 1291 MiB), but the resident
peak was 1298 MiB against 1448 MiB (1.12x; 1522 MiB, 1.17x, with the compiled rotation
kernel, whose compiler adds its own). With the threshold fixed at 4 MiB both are 1274-1280
MiB: the excess was the heap, not ropekit's tensors.

``bound_resident_memory`` fixes the threshold (``mallopt``), which also turns the dynamic
adjustment off: every tensor of ``MMAP_THRESHOLD`` bytes or more is then given back when it is
freed. The command line calls it when it starts; a program using ropekit as a library may call
it too. ``ROPEKIT_MALLOC=default`` leaves glibc as it is; elsewhere than glibc it does
nothing.

Holds: bound_resident_memory, MMAP_THRESHOLD.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

MMAP_THRESHOLD = 4 << 20  # bytes: tensors this large or larger are mapped, and unmapped when freed
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MODES = ("bounded", "default")


def bound_resident_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (module docstring); True when set.

    ``ROPEKIT_MALLOC``: ``bounded`` (default) or ``default`` (leave glibc alone); another
    value is a one-line ValueError naming the allowed ones."""
    mode = os.environ.get("ROPEKIT_MALLOC", "bounded")
    if mode not in MODES:
        raise ValueError(f"ROPEKIT_MALLOC={mode!r} is not allowed; use one of {', '.join(MODES)}")
    if mode == "default" or platform.libc_ver()[0] != "glibc":
        return False
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    return bool(ctypes.CDLL(path).mallopt(_M_MMAP_THRESHOLD, int(threshold)))
