"""Small shared helpers: the user cache folder, atomic file writes, and the warning for a
reduced precision this CPU only emulates.

Holds: cache_dir, atomic_write_text, atomic_write_bytes, emulated_precision,
warn_if_emulated.

The atomic writers refuse to follow a symbolic link (see ropekit.outdir.check_target) and turn
an OSError (full disk, read-only folder, name too long, a file where a folder should be) into
ropekit.outdir.OutputError, a ValueError naming the path and the reason in one line; whatever
goes wrong, the temporary file is removed and the previous file is left as it was.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import torch

from ropekit.outdir import check_target, temporary, writing


def cache_dir() -> Path:
    """ropekit's user cache: ``$ROPEKIT_CACHE`` if set, else ``~/.cache/ropekit``."""
    return Path(os.environ.get("ROPEKIT_CACHE") or Path.home() / ".cache" / "ropekit")


def atomic_write_bytes(path: Path, data: bytes, *, root: Path | None = None) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename: readers see the old file
    or the new one, never a partial write.

    Refused (OutputError): ``path`` being a symbolic link, or a folder between ``root`` and it
    being one; ``root`` defaults to the output folder this process holds a lock on (see
    ropekit.outdir.lock_out_dir), if it holds one around ``path``.
    """
    path = Path(path)
    check_target(path, root)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        # The temp name is at most 64 + 14 bytes longer than nothing: a target whose own name
        # is close to the 255-byte limit must not fail because of its temp file's name.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:64]}.", suffix=".tmp")
        try:
            with temporary(tmp):  # removed even by a stop that runs no `finally` (stop_within)
                try:
                    # mkstemp creates 0600; give the file the mode an ordinary open() would.
                    umask = os.umask(0)
                    os.umask(umask)
                    os.chmod(tmp, 0o666 & ~umask)
                    view = memoryview(data)
                    while view:  # os.write may write less than asked
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def atomic_write_text(path: Path, text: str, *, root: Path | None = None) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), root=root)


# The reduced precisions whose matmuls oneDNN runs natively only on some CPUs, and its check.
_NATIVE = {
    torch.bfloat16: lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    torch.float16: lambda: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
}
_warned: set[tuple[torch.dtype, str]] = set()


def emulated_precision(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether ``dtype``'s matmuls on ``device`` run without the CPU's support: bfloat16 or
    float16 on a CPU where oneDNN has no native kernel (bfloat16 wants AVX512 or AMX; an AVX2
    CPU has neither). torch then takes a reference loop: on this project's AVX2 host (AMD
    EPYC, one thread) a 256-square bfloat16 matmul took 27x float32's time, a 512-square one
    44x, a 2048-square one 290x (0.2 against 57 GFLOP/s)."""
    check = _NATIVE.get(dtype)
    return torch.device(device).type == "cpu" and check is not None and not check()


def warn_if_emulated(dtype: torch.dtype, device: torch.device | str, what: str) -> None:
    """One warning per process for each ``what`` (the run asking for it) that computes in a
    precision this CPU only emulates (`emulated_precision`): it is slower than float32 there,
    and no more exact."""
    name = str(dtype).removeprefix("torch.")
    if emulated_precision(dtype, device) and (dtype, what) not in _warned:
        _warned.add((dtype, what))
        warnings.warn(
            f"{what} in {name} on this CPU ({torch.backends.cpu.get_cpu_capability()}, no "
            f"native {name} matmul): torch emulates it, tens to hundreds of times slower than "
            "float32 here; float32 is faster and more exact",
            stacklevel=3,
        )
