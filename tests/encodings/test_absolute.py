"""The absolute encodings: the sinusoidal table of Vaswani et al. added to token states, and a
learned table that refuses positions past its last row."""

from __future__ import annotations

import math
import re

import pytest
import torch

from ropekit.encodings import build
from ropekit.encodings.absolute import LearnedConfig, SinusoidalConfig


def test_sinusoidal_adds_the_vaswani_table():
    enc = build("sinusoidal:scale=1", n_heads=2, head_dim=4)
    h = torch.zeros(1, 3, 8)
    out = enc.embed(h, torch.tensor([[0, 1, 7]]))
    assert torch.allclose(out[0, 0], torch.tensor([0.0, 1.0] * 4))
    p, i = 7, 1
    assert math.isclose(out[0, 2, 2 * i].item(), math.sin(p / 10000 ** (2 * i / 8)), rel_tol=1e-6)
    assert math.isclose(
        out[0, 2, 2 * i + 1].item(), math.cos(p / 10000 ** (2 * i / 8)), rel_tol=1e-6
    )


def test_learned_table_errors_past_its_last_row():
    enc = build("learned:max_length=16", n_heads=2, head_dim=4)
    h = torch.zeros(1, 3, 8)
    assert enc.embed(h, torch.tensor([[0, 5, 15]])).shape == (1, 3, 8)
    with pytest.raises(ValueError, match="past the learned table of 16 rows"):
        enc.embed(h, torch.tensor([[14, 15, 16]]))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("sinusoidal:base=0.5", "base=0.5 is not allowed; it must be a finite number > 1"),
        ("sinusoidal:base=1", "base=1.0 is not allowed; it must be a finite number > 1"),
        ("sinusoidal:scale=0", "scale=0.0 is not allowed; it must be a finite number > 0"),
        ("sinusoidal:scale=-1", "scale=-1.0 is not allowed; it must be a finite number > 0"),
        ("learned:max_length=0", "max_length=0 is not allowed; it must be a finite number >= 1"),
        ("learned:max_length=1048577", "max_length=1048577 is not allowed; a learned table"),
    ],
)
def test_absolute_configs_refuse_bad_values_naming_the_field_and_the_bound(spec, message):
    """A sinusoidal base must exceed 1 (base^(-2i/d) must fall with i), a scale must be
    positive, a learned table needs a row and at most 2^20 of them; each refusal names the
    field, its value and what is allowed."""
    with pytest.raises(ValueError, match=re.escape(message)):
        build(spec, n_heads=2, head_dim=4)


def test_absolute_configs_accept_the_edges_of_what_is_allowed():
    """Any base above 1 (1.5 included), and a learned table of exactly 2^20 rows (the config
    alone: the table is only allocated when the encoding is built)."""
    assert SinusoidalConfig(base=1.5).base == 1.5
    assert LearnedConfig(max_length=1 << 20).max_length == LearnedConfig.MAX_ROWS
    assert LearnedConfig(max_length=1).max_length == 1


def test_sinusoidal_default_amplitude_is_one_over_sqrt_d():
    """Without a scale, the table is added at amplitude 1/sqrt(d): position 0 adds
    (0, 1, 0, 1, ...) / sqrt(d)."""
    d = 8
    enc = build("sinusoidal", n_heads=2, head_dim=4)
    out = enc.embed(torch.zeros(1, 1, d, dtype=torch.float64), torch.tensor([[0]]))
    torch.testing.assert_close(
        out[0, 0], torch.tensor([0.0, 1.0] * 4, dtype=torch.float64) / d**0.5
    )


def test_sinusoidal_angles_are_exact_at_large_positions():
    """PE(p, 2i) = sin(p / base^(2i/d)) holds to float64 precision at p = 10^6: frequencies
    computed in float32 would put the angle off by ~0.1 rad there."""
    d, p = 8, 1_000_000
    enc = build("sinusoidal:scale=1", n_heads=2, head_dim=4)
    out = enc.embed(torch.zeros(1, 1, d, dtype=torch.float64), torch.tensor([[p]]))
    expected = []
    for i in range(d // 2):
        angle = p / 10000 ** (2 * i / d)
        expected += [math.sin(angle), math.cos(angle)]
    torch.testing.assert_close(out[0, 0], torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("spec", ["sinusoidal", "learned:max_length=8"])
def test_absolute_embed_works_on_an_unbatched_sequence(spec):
    """A single sequence (T, d) with positions (T,) gets the same vectors as in a batch."""
    enc = build(spec, n_heads=2, head_dim=4)
    h = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 2, 5])
    torch.testing.assert_close(enc.embed(h, pos), enc.embed(h[None], pos[None])[0])


@pytest.mark.parametrize("spec", ["sinusoidal", "learned:max_length=8"])
def test_absolute_embed_keeps_device_and_dtype(spec):
    """The added table is built on h's device (meta here: a table on another device fails) and
    cast to h's dtype (bfloat16 states stay bfloat16)."""
    enc = build(spec, n_heads=2, head_dim=4)
    if spec == "sinusoidal":
        out = enc.embed(torch.zeros(1, 2, 8, device="meta"), torch.zeros(1, 2, device="meta"))
        assert out.device.type == "meta" and out.shape == (1, 2, 8)
    h = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    assert enc.embed(h, torch.tensor([[0, 1]])).dtype == torch.bfloat16


def test_learned_adds_the_row_of_each_position():
    """GPT-2: the state at position p gains row p of the table."""
    enc = build("learned:max_length=8", n_heads=2, head_dim=4)
    h = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[0, 1, 7], [3, 3, 2]])
    out = enc.embed(h, pos)
    for b in range(2):
        for t in range(3):
            torch.testing.assert_close(out[b, t], h[b, t] + enc.table[pos[b, t]])


def test_learned_table_starts_at_gpt2_init():
    """Rows are drawn from N(0, 0.02^2), GPT-2's initialisation."""
    enc = build("learned:max_length=2048", n_heads=2, head_dim=4)
    assert enc.table.shape == (2048, 8)
    assert 0.019 < enc.table.std().item() < 0.021
    assert abs(enc.table.mean().item()) < 0.001


@pytest.mark.parametrize("max_length", [1, 4])
def test_learned_embeds_an_empty_sequence(max_length):
    """No positions, nothing to look up: the (empty) states come back unchanged."""
    enc = build(f"learned:max_length={max_length}", n_heads=2, head_dim=4)
    h = torch.zeros(1, 0, 8)
    assert enc.embed(h, torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, 8)


@pytest.mark.parametrize("positions", [[[0, 15, 16]], [[-1, 0, 3]]])
def test_learned_refusal_names_the_allowed_range_and_the_remedy(positions):
    """Past the last row, or before the first, the error says which positions are allowed and
    how to run longer."""
    enc = build("learned:max_length=16", n_heads=2, head_dim=4)
    with pytest.raises(ValueError) as info:
        enc.embed(torch.zeros(1, 3, 8), torch.tensor(positions))
    assert "positions must lie in [0, 15]" in str(info.value)
    assert "build with a larger max_length, or use a relative encoding" in str(info.value)
