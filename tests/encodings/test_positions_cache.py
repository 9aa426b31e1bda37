"""Table caches key on the positions' values, not on the tensor's identity; the compile switch
is read at first use, not at import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ropekit.encodings import build, rotary
from ropekit.encodings.positions import PositionsKey

from .conftest import ROTARY_SPECS, SHAPE, perturb


@pytest.mark.parametrize("spec", ROTARY_SPECS)
def test_positions_advanced_in_place_get_fresh_rotations(spec):
    """A decoding loop that does ``pos += 1`` keeps one tensor and changes its values."""
    enc = perturb(build(spec, **SHAPE))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, SHAPE["n_heads"], 1, SHAPE["head_dim"], generator=g)
    k = torch.randn(2, SHAPE["n_kv_heads"], 1, SHAPE["head_dim"], generator=g)
    pos = torch.tensor([[5], [40]])
    for _ in range(3):
        got_q, got_k = enc.rotate_q(q, pos, 1), enc.rotate_k(k, pos, 1)
        fresh = pos.clone()
        torch.testing.assert_close(got_q, enc.rotate_q(q, fresh, 1), rtol=0, atol=0)
        torch.testing.assert_close(got_k, enc.rotate_k(k, fresh, 1), rtol=0, atol=0)
        pos += 1
    pos[1:, :] = 7  # a write through a view bumps the same version counter
    torch.testing.assert_close(enc.rotate_k(k, pos, 1), enc.rotate_k(k, pos.clone(), 1))


def test_the_cache_still_serves_every_layer_of_one_step():
    enc = build("rope", **SHAPE)
    pos = torch.arange(6)[None]
    first = enc.tables(pos)
    assert enc.tables(pos)[0] is first[0]  # same tensor, unchanged: one computation per step
    pos += 1
    assert enc.tables(pos)[0] is not first[0]


def test_inference_tensors_are_compared_by_value():
    with torch.inference_mode():
        pos = torch.arange(4)[None]
        key = PositionsKey(pos)
        assert key.matches(pos)
        pos += 1
        assert not key.matches(pos)
        enc = build("rope", **SHAPE)
        q = torch.randn(1, SHAPE["n_heads"], 4, SHAPE["head_dim"])
        before = enc.rotate_q(q, pos)
        pos += 3
        assert not torch.equal(enc.rotate_q(q, pos), before)
        torch.testing.assert_close(enc.rotate_q(q, pos), enc.rotate_q(q, pos.clone()))


# ----------------------------------------------------------------------------- ROPEKIT_COMPILE
def test_a_bad_compile_mode_is_a_one_line_value_error_at_first_use(monkeypatch):
    """First use is building an encoding (a program stops when it makes its model) or, for
    code that calls the kernels directly, the first rotation."""
    enc = build("rope", **SHAPE)
    q = torch.randn(1, SHAPE["n_heads"], 3, SHAPE["head_dim"])
    cos, sin = enc.tables(torch.arange(3)[None])
    monkeypatch.setenv("ROPEKIT_COMPILE", "banana")
    monkeypatch.setitem(rotary._settings, "mode", None)  # as in a fresh process
    for first_use in (lambda: build("rope", **SHAPE), lambda: rotary.rotate(q, cos, sin)):
        with pytest.raises(ValueError, match="ROPEKIT_COMPILE='banana'") as info:
            first_use()
        message = str(info.value)
        assert "\n" not in message and "auto" in message and "never" in message
    monkeypatch.setenv("ROPEKIT_COMPILE", "never")
    assert torch.equal(enc.rotate_q(q), enc.rotate_q(q))  # read again once it is fixed
    assert rotary.compile_settings()["mode"] == "never"


def test_importing_with_a_bad_compile_mode_succeeds():
    env = {**os.environ, "ROPEKIT_COMPILE": "banana"}
    code = "import ropekit.encodings, ropekit.model; print('ok')"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-500:]
