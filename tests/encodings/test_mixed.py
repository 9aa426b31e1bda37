"""The mixed window's list of what it wraps: every rotary entry of the registry but the remaps."""

from __future__ import annotations

import torch

from ropekit.encodings import REGISTRY, Spec, build
from ropekit.encodings.mixed import MIXABLE
from ropekit.encodings.remap import RemapConfig

from .conftest import SHAPE


def test_the_mixed_window_wraps_every_rotary_entry_of_the_registry_but_the_remaps():
    def rotates(name: str) -> bool:
        spec = Spec.parse(name)
        if spec.takes("factor"):
            spec = spec.with_options(factor=2)
        return build(spec, **SHAPE, original_length=64).rotary_dim > 0

    remaps = {n for n, e in REGISTRY.items() if issubclass(e.config, RemapConfig)}
    rotary = {n for n in REGISTRY if n != "mixed" and n not in remaps and rotates(n)}
    assert set(MIXABLE) == rotary and len(rotary) == 9


def test_plain_rope_within_the_window_and_the_wrapped_schedule_beyond_it():
    """LongRoPE2's rule: a call whose length (max position + 1) is within the window rotates
    with the original RoPE; a longer one with the method, at every position of the call."""
    mixed = build("mixed:method=yarn,factor=4", **SHAPE, original_length=16)
    rope = build("rope", **SHAPE)
    yarn = build("yarn:factor=4", **SHAPE, original_length=16)
    q = torch.randn(1, SHAPE["n_heads"], 16, SHAPE["head_dim"], dtype=torch.float64)
    inside = torch.arange(16)[None]  # length 16 = the window
    torch.testing.assert_close(mixed.rotate_q(q, inside), rope.rotate_q(q, inside))
    beyond = torch.arange(1, 17)[None]  # length 17: past the window, early positions included
    torch.testing.assert_close(mixed.rotate_q(q, beyond), yarn.rotate_q(q, beyond))
    assert not torch.allclose(mixed.rotate_q(q, beyond), rope.rotate_q(q, beyond))
