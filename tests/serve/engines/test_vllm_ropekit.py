"""vLLM with ropekit's plugin, without vLLM: which folders are the plugin's, and the reach of
the remaps whose largest distance grows with the length (brute force over the remap's own
distances). Folders exported for the plugin: tests/serve/test_vllm_remap_export.py; served by
vLLM: make test-serving."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ropekit.encodings import build
from ropekit.serve.engines import ENGINES, ServedFolder, is_plugin_folder
from ropekit.serve.engines.vllm_ropekit import remap_reach
from ropekit.serve.vllm_plugin import ARCHITECTURE

L0 = 32
SHAPE = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "n_layers": 1, "original_length": L0}


def test_a_folder_is_the_plugins_when_its_config_names_the_plugins_model():
    def folder(architectures):
        return ServedFolder(Path("x"), {"architectures": architectures}, None, 64)

    assert is_plugin_folder(folder([ARCHITECTURE]))
    assert not is_plugin_folder(folder(["LlamaForCausalLM"])) and not is_plugin_folder(folder(None))
    assert ENGINES["vllm+ropekit"].rope(folder(["LlamaForCausalLM"]), 64) is None  # stock vLLM's


@pytest.mark.parametrize(
    ("spec", "largest"),
    [
        # The paper's Self-Extend: a neighbour window W, then floor(d / G) + W - floor(W / G).
        ("self-extend:group=4,window=8", lambda d: d if d < 8 else d // 4 + 8 - 8 // 4),
        # Leaky ReRoPE: w, then slope 1 / k: w + (d - w) / k. A fractional distance past the
        # largest trained one (L0 - 1) counts as beyond it, so the reach keeps <= L0 - 1.
        ("rerope:window=8,leaky=4", lambda d: d if d < 8 else math.ceil(8 + (d - 8) / 4)),
    ],
)
def test_the_reach_is_the_longest_prompt_whose_remapped_distances_stay_below_l0(spec, largest):
    reach = remap_reach(build(spec, **SHAPE), L0)
    assert largest(reach - 1) < L0 <= largest(reach)  # the longest distance is T - 1


@pytest.mark.parametrize("spec", ["rerope:window=8", "dca:chunk_size=24,local_size=4",
                                  "string:window=4", "yarn:factor=2"])  # fmt: skip
def test_bounded_or_proportional_remaps_have_no_reach(spec):
    assert remap_reach(build(spec, **SHAPE), L0) is None
