"""Small shared helpers: the user cache folder and atomic file writes.

Holds: cache_dir, atomic_write_text, atomic_write_bytes.

The atomic writers refuse to follow a symbolic link (see ropekit.outdir.check_target) and turn
an OSError (full disk, read-only folder, name too long, a file where a folder should be) into
ropekit.outdir.OutputError, a ValueError naming the path and the reason in one line; whatever
goes wrong, the temporary file is removed and the previous file is left as it was.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ropekit.outdir import check_target, writing


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
