"""Output folders: one run at a time, no writes through symbolic links, OS errors as one line.

Holds:
    OutputError      an OSError *and* a ValueError: "cannot write <path>: <reason>", one line.
    OutDirLocked     OutputError: another live process holds the folder (names its pid).
    LockHolder       who holds a lock: pid, host, command, since (the lock file's record).
    holder_of        the record in a lock file, read without taking the lock.
    OutDirLock       a lock this process holds (or, on a non-main process, a no-op one).
    lock_out_dir     create `--out` if needed, check it is a writable folder, lock it.
    hold_lock        the same lock on any lock-file path (`models install` locks its model).
    LOCK_FILE        the lock's name inside `--out`; has_outputs ignores it.
    has_outputs      whether a folder holds anything but the lock file.
    check_target     refuse a write whose target, or a folder on the way to it inside an
                     out folder, is a symbolic link.
    output_error     an OSError met while writing a path, as an OutputError.
    writing          context manager: OSErrors raised inside it become OutputErrors.
    exit_on_sigterm  context manager: SIGTERM raises SystemExit(143), so `finally` blocks (and
                     lock releases) run as they do for Ctrl-C.
    stop_within      context manager: a SIGTERM or Ctrl-C the main thread has not acted on
                     within a few seconds (it is inside one long C call) ends the process from
                     a watchdog thread, giving back every lock and removing every temporary
                     file this process holds.
    temporary        context manager: a temporary file that `stop_within` removes if the
                     process is ended while it exists (the atomic writers register theirs).

How a command uses it (the main process; the others pass main=False or take nothing):

    with lock_out_dir(args.out, command=...):   # OutDirLocked / OutputError: print, exit 2
        ...                                     # atomic writers now also refuse symlinks
                                                # anywhere inside args.out

- `lock_out_dir(out, *, main=None, command="") -> OutDirLock` creates `out` (and parents), and
  raises OutputError when `out` is a file, is not writable, is on a read-only or full file
  system, or has a name too long for it; OutDirLocked (a subclass) when another live process
  holds it. `main=None` reads the launcher's RANK (rank 0, or no launcher, is main); a
  non-main process gets a lock that holds nothing, so only one process of a run takes it. A
  process may lock a folder it already holds (e.g. the CLI, then `train` inside it): the inner
  lock shares the outer one. `release()` (or leaving the `with`) gives it back; so does the
  end of the process (atexit), and a killed process's lock is taken over by the next run. A
  folder that `lock_out_dir` created and that is still empty at release is removed again, so
  a refused command leaves nothing behind.
- Errors raised on the main process must reach the other processes (`Processes.on_main` in
  ropekit.distributed does that), or they would wait for it forever.

The lock. `<out>/.ropekit.lock` holds a one-line JSON record {pid, host, command, since}; the
exclusion itself is an advisory `flock` on that file, held for the life of the run. The kernel
drops a flock when its process dies, however it dies (kill -9 included), so a lock left by a
dead process is free to the next run, which takes it over and warns, naming the dead pid; a
pid that was reused by an unrelated process meanwhile cannot fool it, and neither can the
container hostname that changes with every `docker run`. Linux's NFS client maps flock onto
NFS byte-range locks, so runs on two hosts sharing a folder exclude each other too. Where a
file system has no flock at all (ENOLCK / EOPNOTSUPP), the record decides: a lock whose pid
is alive on this host, or that was taken on another host (whose processes this one cannot
see), is held; otherwise it is stale and taken over. That fallback cannot exclude two runs
starting in the same instant, which the flock does. Release unlinks the file while still
holding the flock, and every acquirer checks that the file it locked is still the one at the
path, so a run that opened the old file before it was unlinked tries again.

Symbolic links. A run writes only what it made: `check_target` refuses a target that is a
symbolic link and, below the out folder, any folder on the way that is one (`out` itself may
be a link the user made, e.g. runs/latest). The atomic writers in ropekit.utils call it, with
the out folder given or, by default, the outermost folder this process holds a lock on that
contains the target. The check runs just before the write: it protects a run from links a
careless user left, not from a concurrent attacker racing it.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import signal
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the record alone decides
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".ropekit.lock"

# File systems without flock answer with one of these.
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
# What an OSError met while writing means, for a user; others use the system's strerror.
_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied (the folder is not writable)",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "it is a folder, not a file",
    errno.ELOOP: "it is a symbolic link",
    errno.EEXIST: "it already exists",
    errno.EIO: "input/output error (a failing disk or a lost network mount?)",
}


class OutputError(OSError, ValueError):
    """Something the user can fix about an output path: one line, "cannot write X: why".

    Both an OSError (callers that caught the raw error still do) and a ValueError (the CLI
    prints ValueErrors as one line and exits 2). `path` and `errno` say what and why.
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str] = "", code: int = 0):
        super().__init__(message)
        # Plain attributes, so the error survives pickling between processes.
        self.path = os.fspath(path)
        self.code = code  # the errno, kept as a plain attribute (OSError's is lost in pickling)
        if code:
            self.errno = code


@dataclass(frozen=True)
class LockHolder:
    """The record a lock file holds: which process took it, where, doing what, since when."""

    pid: int
    host: str
    command: str
    since: str  # local time, ISO 8601

    def alive(self) -> bool | None:
        """True if the process runs, False if it does not; None when it ran on another host
        (this one cannot see its processes)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by someone else
            return True
        return True

    def describe(self) -> str:
        what = f": {self.command}" if self.command else ""
        return f"pid {self.pid} on {self.host}, since {self.since}{what}"


class OutDirLocked(OutputError):
    """The folder (or lock file) is held by another live process; `holder` says which."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] = "", holder=None):
        super().__init__(message, path=path, code=errno.EBUSY)
        self.holder: LockHolder | None = holder


# ----------------------------------------------------------------------------- OS errors
def output_error(path: str | os.PathLike[str], error: OSError) -> OutputError:
    """`error`, met while writing `path`, as one line naming the path and the reason."""
    if isinstance(error, OutputError):
        return error
    code = error.errno or 0
    reason = _REASONS.get(code) or (error.strerror or str(error)).splitlines()[0]
    if code == errno.ENAMETOOLONG:
        reason = _name_too_long(Path(path))
    elif code in (errno.ENOTDIR, errno.EEXIST):
        # mkdir says EEXIST when a file sits where a folder of the path should be.
        blocker = next((p for p in _ancestors(Path(path)) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            reason = f"{blocker} is a file, not a folder"
    return OutputError(f"cannot write {os.fspath(path)}: {reason}", path=path, code=code)


def _ancestors(path: Path) -> list[Path]:
    """The folders above `path`, outermost first (the root excluded)."""
    return list(reversed(path.parents))[1:]


def _name_too_long(path: Path) -> str:
    longest = max(path.parts, key=lambda part: len(os.fsencode(part)))
    size = len(os.fsencode(longest))
    limit = 255  # NAME_MAX of ext4, xfs, btrfs, tmpfs, APFS
    existing = next((p for p in path.parents if p.is_dir()), None)
    if existing is not None:
        with contextlib.suppress(OSError, ValueError):
            limit = os.pathconf(existing, "PC_NAME_MAX")
    if size > limit:
        return f"a name in it is {size} bytes long; this file system allows at most {limit}"
    return f"the path is too long for this file system ({len(os.fsencode(path))} bytes)"


@contextlib.contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn an OSError raised inside into an OutputError naming `path` (one line)."""
    try:
        yield
    except OutputError:
        raise
    except OSError as e:
        raise output_error(path, e) from e


# ----------------------------------------------------------------------------- symlinks
def check_target(path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> None:
    """Raise OutputError if writing `path` would follow a symbolic link.

    Refused: `path` itself being a link, and any existing folder strictly between `root` and
    `path` being one. `root` defaults to the outermost folder this process holds a lock on
    that contains `path`; with none, only `path` itself is checked (links the user put above
    an output folder, such as a home directory on another disk, are theirs to make).
    """
    target = Path(os.path.abspath(path))  # lexical: no link is followed to find the parents
    with writing(target):
        if target.is_symlink():
            raise OutputError(
                f"cannot write {os.fspath(path)}: it is a symbolic link (ropekit writes only "
                "its own files and never follows a link inside an output folder)",
                path=path,
                code=errno.ELOOP,
            )
        base = Path(os.path.abspath(root)) if root is not None else held_root(target)
        if base is None or not target.is_relative_to(base) or target == base:
            return
        folder = base
        for part in target.relative_to(base).parts[:-1]:
            folder = folder / part
            if folder.is_symlink():
                raise OutputError(
                    f"cannot write {os.fspath(path)}: {folder} is a symbolic link inside the "
                    f"output folder {base} (ropekit never follows a link there)",
                    path=path,
                    code=errno.ELOOP,
                )


# ----------------------------------------------------------------------------- the lock
@dataclass
class _Held:
    fd: int
    count: int  # handles sharing this lock in this process
    folder: Path | None  # the out folder lock_out_dir created, removed again if left empty


_HELD: dict[str, _Held] = {}  # absolute lock-file path -> the lock this process holds
_HELD_GUARD = threading.RLock()


class OutDirLock:
    """A lock on an output folder (or any lock file). `held` is False on a non-main process,
    whose lock does nothing. Release it with `release()` or by leaving a `with` block."""

    def __init__(self, path: Path, *, held: bool, previous: LockHolder | None = None):
        self.path = path  # the lock file
        # the key hold_lock filed it under: the absolute path now, so that a lock taken by a
        # relative path (an --out given relative) is found again at release
        self._key = str(path.absolute())
        self.held = held
        self.previous = previous  # the dead process whose lock this one took over, if any
        self._released = False

    def __enter__(self) -> OutDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Give the lock back (the last handle of this process unlinks the file); idempotent."""
        if not self.held or self._released:
            return
        self._released = True
        _release(self._key)


def held_root(path: str | os.PathLike[str]) -> Path | None:
    """The outermost folder holding `path` whose lock this process holds, or None."""
    target = Path(os.path.abspath(path))
    with _HELD_GUARD:
        folders = [Path(key).parent for key in _HELD if Path(key).name == LOCK_FILE]
    inside = [f for f in folders if target == f or target.is_relative_to(f)]
    return min(inside, key=lambda f: len(f.parts)) if inside else None


def has_outputs(folder: str | os.PathLike[str]) -> bool:
    """True if `folder` exists and holds anything but the lock file."""
    folder = Path(folder)
    return folder.is_dir() and any(p.name != LOCK_FILE for p in folder.iterdir())


def lock_out_dir(
    out: str | os.PathLike[str], *, main: bool | None = None, command: str = ""
) -> OutDirLock:
    """Create `out` if needed and lock it for this run (see the module docstring).

    Raises OutputError (a ValueError) when `out` is a file, cannot be created or written, or
    its name is too long; OutDirLocked when another live process holds it.
    """
    out = Path(out)
    if main is None:
        main = int(os.environ.get("RANK", "0")) == 0
    path = out / LOCK_FILE
    if not main:
        return OutDirLock(path, held=False)
    with writing(out):
        if out.exists() and not out.is_dir():
            raise OutputError(
                f"cannot write {out}: it is a file, not a folder", path=out, code=errno.ENOTDIR
            )
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
    try:
        lock = hold_lock(path, command=command, what=f"{out} is in use by another run")
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    if created:
        with _HELD_GUARD:
            _HELD[str(path.absolute())].folder = out.absolute()
    return lock


def hold_lock(path: str | os.PathLike[str], *, command: str = "", what: str = "") -> OutDirLock:
    """Take the lock whose file is `path` (created if needed; its folder must exist).

    `what` starts the OutDirLocked message ("<what> (pid N on host, since T: command)");
    by default "<path> is held by another process".
    """
    path = Path(path)
    key = str(path.absolute())
    with _HELD_GUARD:
        if key in _HELD:
            _HELD[key].count += 1
            return OutDirLock(path, held=True)
        fd, previous = _acquire(path, command, what or f"{path} is held by another process")
        _HELD[key] = _Held(fd, 1, None)
        _register_atexit()
    if previous is not None and previous.pid != os.getpid():
        warnings.warn(
            f"{path}: took over the lock left by {previous.describe()} (that run is gone)",
            stacklevel=2,
        )
    return OutDirLock(path, held=True, previous=previous)


def _acquire(path: Path, command: str, what: str) -> tuple[int, LockHolder | None]:
    """Lock `path`; returns the open file (kept open while held) and the stale holder."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):  # another run may unlink the file between our open and our flock
        with writing(path):
            fd = os.open(path, flags, 0o644)
        try:
            locked = _flock(fd)
            if locked is False:
                holder = _read_holder(fd, wait=True)
                raise _locked(path, what, holder)
            if locked and not _same_file(fd, path):
                os.close(fd)
                continue
            previous = _read_holder(fd)
            # No flock on this file system: the record decides.
            ours = previous is None or previous.pid == os.getpid()
            if locked is None and not ours and previous.alive() is not False:
                raise _locked(path, what, previous)
            record = LockHolder(
                pid=os.getpid(),
                host=socket.gethostname(),
                command=command,
                since=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            )
            with writing(path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(asdict(record)) + "\n").encode(), 0)
                os.fsync(fd)
            return fd, previous
        except BaseException:
            os.close(fd)
            raise
    raise OutputError(f"cannot lock {path}: it keeps being replaced", path=path)  # pragma: no cover


def _flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: no flock on this file system."""
    if fcntl is None:  # pragma: no cover
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return None
        raise
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        here = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def _read_holder(fd: int, wait: bool = False) -> LockHolder | None:
    """The record in the lock file; with `wait`, give a holder that has just created the file
    a moment to write it."""
    for _ in range(20 if wait else 1):
        raw = os.pread(fd, 4096, 0)
        try:
            fields = json.loads(raw)
            return LockHolder(
                pid=int(fields["pid"]),
                host=str(fields["host"]),
                command=str(fields.get("command", "")),
                since=str(fields.get("since", "?")),
            )
        except (ValueError, KeyError, TypeError):
            if wait:
                time.sleep(0.01)
    return None


def holder_of(path: str | os.PathLike[str]) -> LockHolder | None:
    """The record in the lock file ``path``, read without taking the lock (so it changes
    nothing): who holds it, or last held it if that process is gone (`LockHolder.alive`);
    None when there is no readable record."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        return _read_holder(fd)
    finally:
        os.close(fd)


def _locked(path: Path, what: str, holder: LockHolder | None) -> OutDirLocked:
    who = holder.describe() if holder else "a process that has not written its record yet"
    return OutDirLocked(
        f"{what} ({who}); wait for it to finish or choose another folder (if no such process "
        f"exists, delete {path})",
        path=path,
        holder=holder,
    )


def _release(key: str) -> None:
    with _HELD_GUARD:
        held = _HELD.get(key)
        if held is None:
            return
        held.count -= 1
        if held.count > 0:
            return
        del _HELD[key]
        try:
            # Unlinked while still locked: a run waiting on this file sees it gone and retries.
            if _same_file(held.fd, Path(key)):
                os.unlink(key)
        except OSError:
            pass  # the record stays; the next run sees the flock free and takes it over
        finally:
            os.close(held.fd)
        if held.folder is not None:
            with contextlib.suppress(OSError):  # not empty: the run wrote something
                held.folder.rmdir()


_ATEXIT = False


def _register_atexit() -> None:
    global _ATEXIT
    if not _ATEXIT:
        atexit.register(_release_all)
        _ATEXIT = True


def _release_all() -> None:
    with _HELD_GUARD:
        for key in list(_HELD):
            _HELD[key].count = 1
            _release(key)


# ----------------------------------------------------------------------------- signals
@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit(128 + 15) in the main thread, so `finally`
    blocks run (temporary files are removed, locks released) as for Ctrl-C. A handler someone
    else installed is left alone, as is any thread but the main one."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if previous is not signal.SIG_DFL:
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


_TEMPORARIES: set[str] = set()  # temporary files being written now (removed by stop_within)


@contextlib.contextmanager
def temporary(path: str | os.PathLike[str]) -> Iterator[None]:
    """Register ``path`` as a temporary file for the span of the block: a process ended by
    `stop_within` while it exists removes it (its owner's `finally` never runs then)."""
    key = os.path.abspath(path)
    with _HELD_GUARD:
        _TEMPORARIES.add(key)
    try:
        yield
    finally:
        with _HELD_GUARD:
            _TEMPORARIES.discard(key)


# A signal's Python handler runs only between bytecodes, so in the middle of one long C call
# (a prefill's attention over millions of keys took 80 s here) SIGTERM and Ctrl-C wait for it.
STOP_GRACE_S = 3.0


@contextlib.contextmanager
def stop_within(grace_s: float = STOP_GRACE_S) -> Iterator[None]:
    """While inside (main thread only), SIGTERM and SIGINT stop the process within about
    ``grace_s`` seconds however long the C call it is in. The signal is seen at once through
    `signal.set_wakeup_fd` (written by the C-level handler, even mid-call) by a watchdog
    thread; torch releases the GIL in its kernels, so the thread runs beside them. If the main
    thread has not left the block ``grace_s`` seconds later (acting on the signal: SystemExit,
    KeyboardInterrupt and their `finally` blocks), the watchdog gives back every lock this
    process holds, removes the temporary files being written (`temporary`), prints one line
    and ends the process with 128 + the signal's number, as the signal itself would have."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # pragma: no cover - not the main interpreter
        os.close(read), os.close(write)
        yield
        return
    left = threading.Event()
    stopping = {signal.SIGTERM.value, signal.SIGINT.value}

    def watch() -> None:
        while not left.is_set():
            try:
                data = os.read(read, 1)
            except OSError:
                return
            if not data or left.is_set():
                return
            if data[0] in stopping and not left.wait(grace_s):
                _end_now(data[0], grace_s)

    watchdog = threading.Thread(target=watch, name="ropekit-stop-within", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        left.set()
        signal.set_wakeup_fd(previous)
        with contextlib.suppress(OSError):
            os.write(write, b"\0")  # wake the watchdog so that it sees `left`
        watchdog.join(timeout=1.0)
        os.close(write)
        os.close(read)


def _end_now(signum: int, grace_s: float) -> None:
    """The watchdog's way out: what the main thread's `finally` blocks would have done for
    locks and temporary files, then exit without waiting for the C call."""
    with _HELD_GUARD:
        for path in list(_TEMPORARIES):
            with contextlib.suppress(OSError):
                os.unlink(path)
    _release_all()
    name = signal.Signals(signum).name
    with contextlib.suppress(OSError):
        os.write(
            2,
            f"\nropekit: stopped by {name} in the middle of a long computation (it did not "
            f"return within {grace_s:g} s); locks given back, temporary files removed\n".encode(),
        )
    os._exit(128 + signum)
