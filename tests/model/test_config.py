"""DecoderConfig: the SwiGLU width default, bad values refused naming the field, a round
trip through its dict."""

from __future__ import annotations

import pytest

from ropekit.model import DecoderConfig


def test_ffn_default_rounds_8_thirds_up_to_32():
    assert DecoderConfig(d_model=192, n_heads=6).ffn_hidden == 512
    assert DecoderConfig(d_model=128, n_heads=4).ffn_hidden == 352  # 341.3 -> 352
    assert DecoderConfig(d_model=128, n_heads=4, ffn_hidden=100).ffn_hidden == 100


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"d_model": 0}, "d_model"),
        ({"d_model": 30, "n_heads": 4}, "d_model"),
        ({"n_kv_heads": 4, "n_heads": 6}, "n_kv_heads"),
        ({"n_layers": 2.0}, "n_layers"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"init_std": float("nan")}, "init_std"),
        ({"ffn_hidden": -1}, "ffn_hidden"),
        ({"tie_embeddings": 1}, "tie_embeddings"),
        ({"encoding": "rope:bsae=10"}, "bsae"),
        ({"encoding": "nonsense"}, "unknown encoding"),
        ({"encoding": "adarope:init=yarn"}, "factor"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**fields)


def test_config_round_trips_through_its_dict():
    config = DecoderConfig(d_model=64, n_heads=4, n_kv_heads=2, encoding="alibi")
    assert DecoderConfig(**config.to_dict()) == config
