"""transformers' rope_parameters <-> ropekit specs, on configs alone: spec_from_config names the
schedule a config's RoPE computes; rope_parameters_for writes back parameters whose spec
computes the same frequencies; what transformers' attention cannot rotate is refused.
(Logits of patched models against transformers' own rope types: test_patching.py.)"""

from __future__ import annotations

import pytest
import torch

from ropekit.hf import build_for_model
from ropekit.hf.rope_config import ExportRefused, rope_parameters_for, spec_from_config

from ..tiny import L0, tiny_config


@pytest.mark.parametrize(
    ("params", "spec"),
    [
        ({"rope_type": "default", "rope_theta": 5e5}, "rope:base=500000"),
        ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
         "rope:base=10000,fraction=0.5"),
        ({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, "linear:base=10000,factor=2"),
        # transformers' dynamic NTK measures the stretch against max_position_embeddings.
        ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
         f"dynamic-ntk:base=10000,factor=2,original_length={L0}"),
    ],
)  # fmt: skip
def test_spec_from_config_names_the_schedule_of_the_configs_rope(params, spec):
    assert str(spec_from_config(tiny_config("llama", params))) == spec


def test_a_rope_type_without_an_equivalent_is_refused_naming_the_supported_ones():
    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "axial", "rope_theta": 1e4}
    with pytest.raises(ValueError, match=r"rope_type='axial'.*supported: default"):
        spec_from_config(config)


@pytest.mark.parametrize(
    "spec",
    ["rope", "linear:factor=3", "ntk:factor=2", "yarn:factor=4", "llama3:factor=4",
     "dynamic-ntk:factor=2", "longrope:factor=4,long_factor=[2],short_factor=[1.5]"],
)  # fmt: skip
def test_written_parameters_read_back_as_the_same_frequencies(spec):
    """Round trip: encoding -> rope_parameters -> spec_from_config -> encoding (ntk comes back
    as plain RoPE at the NTK base, the same frequencies under another name)."""
    config = tiny_config("llama")
    encoding = build_for_model(config, spec)
    params, extra = rope_parameters_for(encoding, config)
    served = tiny_config("llama", params, **extra)
    again = build_for_model(served, spec_from_config(served))
    for length in (L0, 4 * L0):
        ours, _ = encoding.inv_freq(0, length)
        theirs, _ = again.inv_freq(0, length)
        torch.testing.assert_close(theirs, ours, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("rope:pairing=interleaved", "rotate_half"),
        ("rope:fraction=0.5", "rotates 8 of 16 channels"),
        ("mixed:method=yarn,factor=2", "no rope_type does both"),
        ("alibi", "does not rotate"),
    ],
)
def test_what_transformers_cannot_rotate_is_refused_saying_why(spec, words):
    config = tiny_config("llama")
    with pytest.raises(ExportRefused, match=words):
        rope_parameters_for(build_for_model(config, spec), config)
