"""RotaryEncoding: a dynamic schedule's frequencies follow the call's length, a static
one's do not."""

from __future__ import annotations

import torch

from ropekit.encodings import build

from .conftest import SHAPE


def test_dynamic_frequencies_follow_the_length_static_ones_do_not():
    dyn = build("dynamic-ntk:factor=4,original_length=16", **SHAPE)
    assert torch.equal(dyn.inv_freq(0, 16)[0], build("rope", **SHAPE).inv_freq(0)[0])
    assert not torch.equal(dyn.inv_freq(0, 64)[0], dyn.inv_freq(0, 16)[0])
    yarn = build("yarn:factor=4,original_length=16", **SHAPE)
    assert torch.equal(yarn.inv_freq(0, 16)[0], yarn.inv_freq(0, 1000)[0])
