"""Fixtures for the analysis tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    """Tiny models run on one thread: on shared cores an idle second OpenMP thread turns a
    millisecond matmul into tens of milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
