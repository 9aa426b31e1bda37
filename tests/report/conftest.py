"""Fixtures for the report tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run on one thread: on a shared 2-core machine a second OpenMP thread
    waiting for a descheduled first makes millisecond ops take far longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
