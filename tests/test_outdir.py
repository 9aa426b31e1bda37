"""Output folders: the run lock (live, dead and foreign holders; release on every exit), the
symlink rule and OS errors as one line (ropekit.outdir)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ropekit import outdir
from ropekit.outdir import (
    LOCK_FILE,
    LockHolder,
    OutDirLocked,
    OutputError,
    check_target,
    exit_on_sigterm,
    has_outputs,
    lock_out_dir,
    output_error,
)

SRC = Path(__file__).parents[1] / "src"
HOLD = textwrap.dedent(
    """
    import sys, time
    from ropekit.outdir import lock_out_dir
    lock = lock_out_dir(sys.argv[1], command="holder for the test")
    print("locked", flush=True)
    time.sleep(120)
    """
)


def _env() -> dict[str, str]:
    return os.environ | {
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    }


@pytest.fixture
def holder(tmp_path):
    """A live process holding tmp_path/run; yields (process, folder)."""
    out = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], env=_env(), stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "locked"
    yield child, out
    if child.poll() is None:
        child.kill()
        child.wait()


def _record(out: Path) -> dict:
    return json.loads((out / LOCK_FILE).read_text())


# ----------------------------------------------------------------------------- the lock
def test_a_second_run_fails_at_once_naming_the_pid_that_holds_the_folder(holder):
    child, out = holder
    started = time.monotonic()
    with pytest.raises(OutDirLocked) as caught:
        lock_out_dir(out)
    assert time.monotonic() - started < 1.0  # no waiting
    message = str(caught.value)
    assert f"pid {child.pid} on {socket.gethostname()}" in message and str(out) in message
    assert "holder for the test" in message and "\n" not in message
    assert isinstance(caught.value, ValueError)  # the CLI's one-line, exit-2 path
    assert caught.value.holder.pid == child.pid
    assert _record(out)["pid"] == child.pid  # the refused run left the lock alone


def test_a_lock_left_by_a_killed_process_is_taken_over_with_a_warning(holder):
    child, out = holder
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (out / LOCK_FILE).exists()  # kill -9 left the file behind
    with pytest.warns(UserWarning, match=rf"took over the lock left by pid {child.pid}\b"):
        lock = lock_out_dir(out)
    assert lock.previous.pid == child.pid
    assert _record(out)["pid"] == os.getpid()
    lock.release()
    assert not (out / LOCK_FILE).exists()


def test_the_lock_is_released_on_exceptions_and_ctrl_c(tmp_path):
    out = tmp_path / "run"
    for error in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(error), lock_out_dir(out):
            (out / "result.json").write_text("{}")
            raise error
        assert not (out / LOCK_FILE).exists()
        lock_out_dir(out).release()  # free again


def test_a_lock_taken_by_a_relative_path_is_released_by_it(tmp_path, monkeypatch):
    """A lock taken by a relative path (an --out given relative; compare's job claims in it)
    is given back when its holder releases it, not only at the process's exit: its file is
    gone and another process takes it at once."""
    monkeypatch.chdir(tmp_path)
    with lock_out_dir("run"):
        (tmp_path / "run" / "result.json").write_text("{}")
    with outdir.hold_lock(Path("run") / "job.lock"):
        pass
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    assert not (tmp_path / "run" / "job.lock").exists()
    run = tmp_path / "run"
    script = "from ropekit.outdir import hold_lock, lock_out_dir; "
    script += f"lock_out_dir({str(run)!r}); hold_lock({str(run / 'job.lock')!r})"
    subprocess.run([sys.executable, "-c", script], env=_env(), check=True)


def test_the_lock_is_released_when_the_process_exits(tmp_path):
    out = tmp_path / "run"
    script = f"from ropekit.outdir import lock_out_dir; lock_out_dir({str(out)!r}); "
    script += f"open({str(out / 'result.json')!r}, 'w').close()"
    subprocess.run([sys.executable, "-c", script], env=_env(), check=True)
    assert (out / "result.json").is_file() and not (out / LOCK_FILE).exists()  # atexit


def test_sigterm_inside_exit_on_sigterm_unwinds_and_releases(tmp_path):
    out = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import time
        from ropekit.outdir import exit_on_sigterm, lock_out_dir
        with exit_on_sigterm(), lock_out_dir({str(out)!r}):
            open({str(out / "partial")!r}, "w").close()
            print("locked", flush=True)
            time.sleep(60)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], env=_env(), stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "locked"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
    assert not (out / LOCK_FILE).exists()


def test_exit_on_sigterm_leaves_another_handler_alone():
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with exit_on_sigterm():
            assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
    with exit_on_sigterm():
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, mine)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_one_process_may_lock_a_folder_it_holds_and_the_outer_lock_survives(tmp_path):
    out = tmp_path / "run"
    with lock_out_dir(out):
        with lock_out_dir(out):  # e.g. the CLI holds --out and train() locks it again
            pass
        assert _record(out)["pid"] == os.getpid()  # the inner release kept the lock
        (out / "x").write_text("")
    assert not (out / LOCK_FILE).exists()


def test_only_the_main_process_takes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    lock = lock_out_dir(tmp_path / "run")
    assert not lock.held and not (tmp_path / "run").exists()
    monkeypatch.setenv("RANK", "0")
    with lock_out_dir(tmp_path / "run") as lock:
        assert lock.held and (tmp_path / "run" / LOCK_FILE).is_file()
    assert lock_out_dir(tmp_path / "other", main=False).held is False


def test_a_folder_the_lock_created_is_removed_if_it_stays_empty(tmp_path):
    with lock_out_dir(tmp_path / "a" / "run"):
        pass
    assert not (tmp_path / "a" / "run").exists()
    (tmp_path / "mine").mkdir()
    with lock_out_dir(tmp_path / "mine"):
        pass
    assert (tmp_path / "mine").is_dir()  # the user's folder stays, empty or not
    with lock_out_dir(tmp_path / "b"):
        (tmp_path / "b" / "out.json").write_text("{}")
    assert has_outputs(tmp_path / "b") and not has_outputs(tmp_path / "a")


def test_a_symlinked_lock_file_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("keep")
    (out / LOCK_FILE).symlink_to(elsewhere)
    with pytest.raises(OutputError, match="symbolic link"):
        lock_out_dir(out)
    assert elsewhere.read_text() == "keep"


def _write_record(out: Path, pid: int, host: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"pid": pid, "host": host, "command": "old run", "since": "2026-01-01T00:00:00"}
    (out / LOCK_FILE).write_text(json.dumps(record))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def no_flock(monkeypatch):
    """A file system without flock (some FUSE and old NFS mounts): the record decides."""

    def unsupported(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(outdir.fcntl, "flock", unsupported)


def test_without_flock_a_live_or_foreign_holder_keeps_the_lock(tmp_path, no_flock, holder):
    child, out = holder  # holds it with a real flock; this process now cannot see flocks
    with pytest.raises(OutDirLocked, match=rf"pid {child.pid}\b"):
        lock_out_dir(out)
    other = tmp_path / "other"
    _write_record(other, 1, "another-host")  # that host's processes are invisible here
    with pytest.raises(OutDirLocked, match="pid 1 on another-host"):
        lock_out_dir(other)


def test_without_flock_a_dead_pid_is_detected_and_taken_over(tmp_path, no_flock):
    out, pid = tmp_path / "run", _dead_pid()
    _write_record(out, pid, socket.gethostname())
    with pytest.warns(UserWarning, match=rf"left by pid {pid}\b"):
        lock = lock_out_dir(out)
    assert _record(out)["pid"] == os.getpid()
    lock.release()


def test_with_flock_a_dead_holder_on_another_host_is_taken_over(tmp_path):
    # The kernel (or NFS's lock manager) says nobody holds it: the record is history.
    out = tmp_path / "run"
    _write_record(out, 1, "container-that-is-gone")
    with pytest.warns(UserWarning, match="container-that-is-gone"):
        lock_out_dir(out).release()


def test_holder_liveness():
    assert LockHolder(os.getpid(), socket.gethostname(), "", "").alive() is True
    assert LockHolder(_dead_pid(), socket.gethostname(), "", "").alive() is False
    assert LockHolder(os.getpid(), "another-host", "", "").alive() is None


def test_errors_survive_pickling_between_processes():
    error = OutDirLocked("busy", path="/x", holder=LockHolder(7, "h", "c", "t"))
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is OutDirLocked and str(again) == "busy"
    assert again.holder == error.holder and again.path == "/x"


# ----------------------------------------------------------------------------- bad --out
def test_an_out_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(OutputError, match=r"file: it is a file, not a folder$"):
        lock_out_dir(tmp_path / "file")
    with pytest.raises(OutputError, match=f"{tmp_path / 'file'} is a file, not a folder$"):
        lock_out_dir(tmp_path / "file" / "run")
    assert (tmp_path / "file").read_text() == "mine"


def test_a_name_too_long_is_one_line_naming_the_limit(tmp_path):
    out = tmp_path / ("x" * 300)
    with pytest.raises(OutputError, match=r"a name in it is 300 bytes long; .* at most 255") as e:
        lock_out_dir(out)
    assert isinstance(e.value, ValueError) and e.value.errno == errno.ENAMETOOLONG


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (errno.EACCES, "permission denied"),
        (errno.EROFS, "the file system is read-only"),
        (errno.ENOSPC, "no space left"),
    ],
)
def test_os_errors_on_out_are_one_line(tmp_path, monkeypatch, code, reason):
    # Injected: the tests run as root, which may write anywhere, and no disk here is full.
    def refuse(path, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(OutputError, match=f"cannot write {tmp_path / 'run'}: {reason}") as e:
        lock_out_dir(tmp_path / "run")
    assert "\n" not in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_a_read_only_out_is_one_line(tmp_path):  # pragma: no cover - CI runs as root
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="permission denied"):
            lock_out_dir(tmp_path / "run")
    finally:
        tmp_path.chmod(0o700)


def test_output_error_keeps_unknown_reasons_to_one_line():
    error = output_error("/x", OSError(errno.EXDEV, "Invalid cross-device link\nmore"))
    assert str(error) == "cannot write /x: Invalid cross-device link"


# ----------------------------------------------------------------------------- symlinks
def test_check_target_refuses_links_inside_the_out_folder(tmp_path):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    with lock_out_dir(out):
        (out / "metrics.jsonl").symlink_to(elsewhere / "metrics.jsonl")
        with pytest.raises(OutputError, match=r"metrics\.jsonl: it is a symbolic link"):
            check_target(out / "metrics.jsonl")
        (out / "eval").symlink_to(elsewhere, target_is_directory=True)
        with pytest.raises(OutputError, match=r"eval is a symbolic link inside the output"):
            check_target(out / "eval" / "ppl" / "ppl.json")
        check_target(out / "fine" / "ppl.json")  # a folder yet to be made is fine
    # Without a lock around it only the target itself is checked ...
    check_target(out / "eval" / "ppl.json")
    # ... unless the out folder is named.
    with pytest.raises(OutputError, match="eval is a symbolic link"):
        check_target(out / "eval" / "ppl.json", root=out)


def test_an_out_folder_that_is_itself_a_link_is_the_users_choice(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "latest").symlink_to(real, target_is_directory=True)
    with lock_out_dir(tmp_path / "latest"):
        check_target(tmp_path / "latest" / "summary.json")
        assert (real / LOCK_FILE).is_file()


def test_a_lock_file_released_between_open_and_flock_is_opened_again(tmp_path, monkeypatch):
    # The race the inode check closes: another run unlinks the file (its release) after this
    # one opened it; locking the unlinked file would leave the path free for a third run.
    out = tmp_path / "run"
    out.mkdir()
    real_flock, calls = outdir._flock, []

    def released_meanwhile(fd):
        calls.append(fd)
        if len(calls) == 1:
            (out / LOCK_FILE).unlink()
        return real_flock(fd)

    monkeypatch.setattr(outdir, "_flock", released_meanwhile)
    with lock_out_dir(out):
        assert len(calls) == 2  # tried again on a fresh file
        assert _record(out)["pid"] == os.getpid()  # the file at the path is the one held


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_stop_a_long_c_call_within_seconds(tmp_path, signum):
    """A Python handler runs only when the current C call returns: a prefill's attention over
    65k keys (here about 10-30 s on one core) once held SIGTERM off for all of that. Under
    stop_within a watchdog thread ends the process about a second later, giving back the lock
    and removing the temporary file being written, without waiting for the call."""
    out = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import signal, torch, torch.nn.functional as F
        from ropekit.outdir import exit_on_sigterm, lock_out_dir, stop_within, temporary
        # Ctrl-C as a terminal delivers it: a shell starts background jobs (CI's, pytest's
        # workers) with SIGINT ignored, and a process that ignores SIGINT is not stopped by it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        torch.set_num_threads(1)
        q = torch.randn(1, 1, 65536, 64)
        with exit_on_sigterm(), stop_within(1.0), lock_out_dir({str(out)!r}):
            part = {str(out / ".result.json.tmp")!r}
            open(part, "w").close()
            with temporary(part):
                print("computing", flush=True)
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout.readline().strip() == "computing"
    time.sleep(0.5)  # inside the call
    sent = time.monotonic()
    child.send_signal(signum)
    code = child.wait(timeout=60)
    waited = time.monotonic() - sent
    err = child.stderr.read()
    assert code == 128 + signum and waited < 6, (code, waited, err)
    assert f"stopped by {signum.name} in the middle of a long computation" in err, err
    assert not out.exists() or list(out.iterdir()) == []  # no lock, no temporary file
