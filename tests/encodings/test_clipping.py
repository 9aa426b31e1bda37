"""CoPE's soft clip and the hard clip: float64 parity with a definition written here from the
authors' code (hrlics/CoPE, modeling_cope.py), the default cut-off, and what a clipped pair
does to a rotation. (The properties every rotary encoding has run over ``cope`` and
``hardclip`` in test_properties.py through conftest.ROTARY_SPECS.)"""

from __future__ import annotations

import math

import pytest
import torch

from ropekit.encodings import build

from .conftest import SHAPE


def authors_inv_freq(head_dim: int, base: float, clip: int, soft: bool) -> torch.Tensor:
    """LlamaRotaryEmbedding.__init__ of modeling_cope.py in float64: the default inv_freq, then
    its last ``min(clip, F)`` entries times 0.5 (1 + cos(linspace(0, pi, clip))) (use_cope), or
    set to 0 (use_hardclip)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    clip = min(clip, inv_freq.numel())
    start = inv_freq.numel() - clip
    if soft:
        theta = torch.linspace(0.0, math.pi, steps=clip, dtype=torch.float64)
        inv_freq[start:] = inv_freq[start:] * (0.5 * (1.0 + torch.cos(theta)))
    else:
        inv_freq[start:] = 0.0
    return inv_freq


@pytest.mark.parametrize("name", ["cope", "hardclip"])
@pytest.mark.parametrize(
    ("head_dim", "base", "clip"),
    [(128, 5e5, 20), (64, 1e5, 10), (16, 1e4, 1), (16, 1e4, 8), (16, 1e4, 30)],
)
def test_frequencies_equal_the_authors_code_in_float64(name, head_dim, base, clip):
    enc = build(f"{name}:clip={clip},base={base}", n_heads=2, head_dim=head_dim)
    theta, factor = enc.inv_freq()
    expected = authors_inv_freq(head_dim, base, clip, soft=name == "cope")
    # linspace and j * pi / (c - 1) may round the angle apart by an ulp
    torch.testing.assert_close(theta[0], expected, rtol=4e-16, atol=0)
    assert factor == 1.0


def test_the_default_cut_off_is_the_authors_share_of_the_pairs():
    """20 of Llama-3-8B's 64 pairs (clip_low_n = 20): the same count there, 10 of SmolLM2's
    32, and at least one pair."""
    for head_dim, clipped in [(128, 20), (64, 10), (16, 2), (4, 1)]:
        theta, _ = build("hardclip", n_heads=1, head_dim=head_dim).inv_freq()
        assert int((theta == 0).sum()) == clipped, head_dim


def test_one_clipped_pair_in_cope_is_plain_rope_and_the_hard_clip_freezes_its_pairs():
    rope = build("rope", **SHAPE)
    cope = build("cope:clip=1", **SHAPE)  # linspace(0, pi, 1) = [0]: the taper is 1
    torch.testing.assert_close(cope.inv_freq()[0], rope.inv_freq()[0], rtol=0, atol=0)
    hard = build("hardclip:clip=3", **SHAPE).double()
    k = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    pos = torch.tensor([[0, 7, 99, 4_000, 123_456]])
    out = hard.rotate_k(k, pos)  # half pairing: pair f is channels f and f + 8
    frozen = [5, 6, 7, 13, 14, 15]
    torch.testing.assert_close(out[..., frozen], k[..., frozen], rtol=0, atol=0)
    assert (out[..., 1:, :5] - k[..., 1:, :5]).abs().max() > 1e-3


@pytest.mark.parametrize("spec", ["cope:clip=0", "hardclip:clip=-2", "cope:clip=true"])
def test_a_bad_cut_off_is_refused_naming_it(spec):
    with pytest.raises(ValueError, match="clip="):
        build(spec, **SHAPE)
