"""Table caches key on the positions' values (PositionsKey), not on the tensor's identity; the
band kernels keep their last layout for the very same call only (LastCall)."""

from __future__ import annotations

import pytest
import torch

from ropekit.encodings import build
from ropekit.encodings.positions import LastCall, PositionsKey

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


def test_many_positions_are_keyed_by_identity_and_version():
    """More than BY_VALUE positions (a prefill) are not copied: the same tensor at the same
    version is a match, an in-place write or another tensor is not."""
    pos = torch.arange(PositionsKey.BY_VALUE + 1)[None]
    key = PositionsKey(pos)
    assert key.values is None and key.matches(pos)
    assert not key.matches(pos.clone())
    pos[0, 3] = 99  # an in-place write through indexing bumps the version
    assert not key.matches(pos)
    enc = build("rope", **SHAPE)
    first = enc.tables(pos)[0]
    pos += 1
    torch.testing.assert_close(enc.tables(pos)[0], enc.tables(pos.clone())[0], rtol=0, atol=0)
    assert not torch.equal(enc.tables(pos)[0], first)


def test_up_to_by_value_positions_are_keyed_by_their_values():
    """At most BY_VALUE positions (a decoding step's) are copied and compared by value: a
    fresh tensor with the same values matches, other values, shape or dtype do not."""
    pos = torch.arange(PositionsKey.BY_VALUE)[None]
    key = PositionsKey(pos)
    assert key.values is not None and key.matches(pos.clone())
    assert not key.matches(pos + 1)
    assert not key.matches(pos.reshape(2, -1))
    assert not key.matches(pos.int())
    pos += 1  # the copy keeps the values the key was made from
    assert not key.matches(pos)


def test_the_last_call_is_given_back_only_for_the_same_key_bands_objects_and_positions():
    memo = LastCall()
    positions = torch.arange(100)[None]
    bands = [object(), object()]
    assert memo.get((1,), bands, positions) is None  # nothing kept yet
    layout = object()
    assert memo.put((1,), bands, positions, layout) is layout
    assert memo.get((1,), bands, positions) is layout
    assert memo.get((1,), list(bands), positions) is layout  # the same objects in a new list
    assert memo.get((2,), bands, positions) is None  # another key
    assert memo.get((1,), [bands[0], object()], positions) is None  # another band object
    assert memo.get((1,), bands[:1], positions) is None  # fewer bands
    assert memo.get((1,), [*bands, bands[0]], positions) is None  # more bands
    assert memo.get((1,), bands, positions.clone()) is None  # other positions
    positions += 0  # the same tensor, a new version
    assert memo.get((1,), bands, positions) is None
    other = object()
    memo.put((1,), bands, positions, other)
    assert memo.get((1,), bands, positions) is other  # the last call's replaced the one before
