"""A CPU-time limit for code that must end: a loop that runs away fails its test in seconds
instead of hanging the run (and a mutant that never returns is killed, not timed out).

Holds:
    cpu_limit   a context manager: pytest.fail once the process has used ``seconds`` of CPU.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def cpu_limit(seconds: float) -> Iterator[None]:
    """Fail the test once the code inside has used ``seconds`` of CPU time (the process's, all
    threads together: a loaded machine slows the wall clock, not this). A no-op off the main
    thread or where the platform has no profiling timer (signals reach the main thread only)."""
    if (
        not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def stop(signum, frame):
        pytest.fail(f"over {seconds:g} s of CPU: a loop that must end did not", pytrace=True)

    previous = signal.signal(signal.SIGPROF, stop)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
