"""One intra-op thread per model test: the tiny models gain nothing from a second thread, and
on shared cores OpenMP's barrier waits on a descheduled thread (the folder ran 4x slower)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
