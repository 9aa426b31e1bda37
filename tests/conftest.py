"""Fixtures every test folder shares.

Holds:
    tiny_llama      the one tiny-Llama factory (tests/tiny.py's ``tiny_model`` for
                    ``arch="llama"``): call it with what the test varies.
"""

from __future__ import annotations

import threading
from functools import partial

import pytest
from tqdm import tqdm

# tqdm's default lock holds a multiprocessing lock, which every process forked from this one
# shares: a mutation-testing worker killed while drawing a bar (mutmut kills one past its CPU
# limit) leaves it held, and every later worker that draws a bar blocks on it forever (seen with
# mutmut 3.8.1 on the search's mutants, each then recorded as a timeout; reproduced with two
# forks). A thread lock is copied into each fork instead, so one killed worker holds only its own.
tqdm.set_lock(threading.RLock())


@pytest.fixture
def tiny_llama():
    """``tiny_llama(rope_parameters=None, *, seed=0, small=False, like=None,
    attn_implementation="sdpa", **config_overrides)``: a float32 Llama in eval mode, the same
    weights for the same arguments."""
    from .tiny import tiny_model  # transformers: a slow import, only for tests that ask

    return partial(tiny_model, "llama")
