"""vLLM with ropekit's plugin, without vLLM: which folders are the plugin's, and the reach of
the remaps whose largest distance grows with the length, read from the remap's own bands.
Folders exported for the plugin: tests/serve/test_vllm_remap_export.py; served by vLLM:
make test-serving."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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


@pytest.mark.parametrize("spec", ["rerope:window=8", "dca:chunk_size=24,local_size=4",
                                  "string:window=4", "yarn:factor=2"])  # fmt: skip
def test_bounded_or_proportional_remaps_have_no_reach(spec):
    assert remap_reach(build(spec, **SHAPE), L0) is None


def _largest_distance(spec: str, length: int) -> float:
    """The largest distance a remap shows any pair of a ``length``-token prompt: every query
    against key 0 (the farthest), read from the band that covers key 0 for that query."""
    encoding = build(spec, n_heads=2, head_dim=8, original_length=L0)
    q_pos, k_pos = torch.arange(length)[None], torch.tensor([[0]])
    largest = torch.full((length,), float("nan"), dtype=torch.float64)
    for band in encoding.bands(q_pos, k_pos):
        covers = torch.ones(length, dtype=torch.bool)
        if band.lo is not None:
            covers &= band.lo[0] <= 0
        if band.hi is not None:
            covers &= band.hi[0] > 0
        distance = (band.q_positions[0] - band.k_positions[0, 0]).double()
        largest = torch.where(covers, distance.expand(length), largest)
    assert not largest.isnan().any(), f"some query of {spec} has no band over key 0"
    return float(largest.max())


@pytest.mark.parametrize(
    "spec",
    [
        "self-extend:group=4,window=8",
        "self-extend:group=4,window=12",
        "self-extend:group=4,window=8,mode=llama.cpp",
        "rerope:window=8,leaky=4",
        "rerope:window=5,leaky=2.5",
    ],
)
def test_the_reach_is_the_longest_prompt_whose_distances_stay_below_L0(spec: str) -> None:
    encoding = build(spec, n_heads=2, head_dim=8, original_length=L0)
    reach = remap_reach(encoding, L0)
    assert reach is not None and reach > L0
    assert _largest_distance(spec, reach) <= L0 - 1
    # One token more (llama.cpp's blocks: one block more) passes L0.
    more = encoding.config.window if "llama.cpp" in spec else 1
    assert _largest_distance(spec, reach + more) > L0 - 1
