"""Small shared helpers: atomic file writes and the metadata every result JSON carries.

Holds: atomic_write_text, atomic_write_bytes, run_metadata.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename: readers see the old file
    or the new one, never a partial write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; give the file the mode an ordinary open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def run_metadata(command: str = "", **extra: Any) -> dict[str, Any]:
    """Versions, time and the command that produced a result (every result JSON records it)."""
    import torch

    from ropekit import __version__

    versions = {
        "ropekit": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    return {
        "command": command or " ".join(sys.argv),
        "versions": versions,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }
