"""Fixtures every test folder shares.

Holds:
    tiny_llama      the one tiny-Llama factory (tests/tiny.py's ``tiny_model`` for
                    ``arch="llama"``): call it with what the test varies.
"""

from __future__ import annotations

from functools import partial

import pytest


@pytest.fixture
def tiny_llama():
    """``tiny_llama(rope_parameters=None, *, seed=0, small=False, like=None,
    attn_implementation="sdpa", **config_overrides)``: a float32 Llama in eval mode, the same
    weights for the same arguments."""
    from .tiny import tiny_model  # transformers: a slow import, only for tests that ask

    return partial(tiny_model, "llama")
