"""Fixtures for the training-loop tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Run the tiny models on one thread: on a shared 2-core machine, a second OpenMP thread
    waiting for a descheduled first makes a 5 ms step take most of a second."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
