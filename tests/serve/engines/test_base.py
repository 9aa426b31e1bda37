"""What every engine shares: the rotated channels and L0 read from a config as transformers
reads them, a folder's rope type defaulted, and the fixes an engine without its own rule names.
Pure: runs in the default suite."""

from __future__ import annotations

from pathlib import Path

from ropekit.serve.engines import ENGINES, ServedFolder
from ropekit.serve.engines.base import Engine, original_length, rotary_dims


def test_rotary_dims_take_head_dim_or_the_hidden_size_over_heads_times_the_fraction():
    config = {"hidden_size": 256, "num_attention_heads": 4, "rope_parameters": {"rope_theta": 1}}
    assert rotary_dims(config) == (64, {"rope_theta": 1})
    partial = {**config, "head_dim": 32, "rope_parameters": {"partial_rotary_factor": 0.5}}
    assert rotary_dims(partial)[0] == 16
    assert rotary_dims({"hidden_size": 8, "num_attention_heads": 2}) == (4, {})


def test_l0_is_the_original_length_of_a_scaled_config_else_its_window():
    config = {"max_position_embeddings": 4096}
    assert original_length({"rope_type": "default"}, config) == 4096
    assert original_length({"original_max_position_embeddings": 1024}, config) == 1024


def test_a_folder_without_a_rope_type_is_default_and_every_engine_is_registered_by_name():
    folder = ServedFolder(Path("x"), {"rope_parameters": {"rope_theta": 1e4}}, None, 64)
    assert folder.rope_type == "default"
    assert all(name == e.name and isinstance(e, Engine) for name, e in ENGINES.items())
    generic = Engine.frequencies_fix(ENGINES["vllm"], folder)
    assert "no rule here for vllm default" in generic
    assert "vLLM and ropekit's plugin" in Engine.per_head_fix(ENGINES["llama.cpp"], folder)
