"""llama.cpp's rule, without llama.cpp: theta from the GGUF's base, rope_freqs divisors, linear
and YaRN scaling (the ramp between the correction dims, attn_factor times 1 + 0.1 ln s); the
reach of Self-Extend in its blocks; which remaps the recipe serves. The rule against the real
llama.cpp: make test-serving."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ropekit.encodings import build, schedules
from ropekit.hf.rope_config import ExportRefused
from ropekit.serve.engines.llamacpp import llamacpp_recipe, llamacpp_rope, self_extend_reach
from ropekit.serve.gguf_file import GgufRope

DIM, BASE = 64, 10000.0


def _rope(kind: str = "none", factor: float = 1.0, freqs=None) -> GgufRope:
    return GgufRope(BASE, kind, factor, 512, 1.0, freqs, context_length=2048)


def test_plain_linear_and_rope_freqs_divide_thetas():
    plain, _ = schedules.rope(DIM, BASE)
    view = llamacpp_rope(_rope(), DIM, 100)
    torch.testing.assert_close(view.inv_freq, plain, rtol=0, atol=0)
    assert (view.attention_factor, view.max_length) == (1.0, 2048)
    linear = llamacpp_rope(_rope("linear", 4.0), DIM, 100)
    torch.testing.assert_close(linear.inv_freq, plain / 4, rtol=1e-15, atol=0)
    divisors = np.linspace(1, 3, DIM // 2, dtype=np.float32)
    freqs = llamacpp_rope(_rope(freqs=divisors), DIM, 100)
    torch.testing.assert_close(freqs.inv_freq, plain / torch.from_numpy(divisors).double())


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_scales_attention():
    s = 4.0
    plain, _ = schedules.rope(DIM, BASE)
    view = llamacpp_rope(_rope("yarn", s), DIM, 100)
    assert view.inv_freq[0] == plain[0]  # fastest pair: extrapolated, as it was
    assert view.inv_freq[-1] == pytest.approx(float(plain[-1]) / s, rel=1e-12)  # slowest: / s
    assert ((view.inv_freq >= plain / s - 1e-18) & (view.inv_freq <= plain)).all()
    assert view.attention_factor == pytest.approx(1 + 0.1 * math.log(s))


def test_a_length_past_the_context_is_noted_not_refused():
    view = llamacpp_rope(_rope(), DIM, 4096)
    assert view.error is None and any("4096 > context_length" in n for n in view.notes)


@pytest.mark.parametrize(("group", "window", "l0"), [(2, 4, 32), (4, 8, 64), (3, 6, 50)])
def test_self_extend_reach_is_the_most_whole_blocks_whose_distances_stay_below_l0(
    group, window, l0
):
    """Brute force over llama.cpp's blocks: the query at true position i (block i // W) sits at
    (i // W) W / G + i mod W; key 0 stays at 0. The reach counts whole blocks of W tokens (a
    block the prompt starts is filled by what is generated after it)."""

    def largest_distance(tokens: int) -> float:
        return max((i // window) * window / group + i % window for i in range(tokens))

    reach = self_extend_reach(group, window, l0)
    assert reach % window == 0
    assert largest_distance(reach) < l0 <= largest_distance(reach + window)
    assert self_extend_reach(group, l0, l0) == l0  # a window as long as L0: no grouping


def test_only_llama_cpp_mode_self_extend_on_an_unscaled_base_has_a_recipe():
    shape = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "n_layers": 1, "original_length": 32}
    recipe = llamacpp_recipe(build("self-extend:group=2,window=4,mode=llama.cpp", **shape), "gguf")
    assert (recipe["group"], recipe["window"], recipe["engine"]) == (2, 4, "llama.cpp")
    refused = {
        ("rerope:window=8", "gguf"): "only Self-Extend has a llama.cpp route",
        ("self-extend:group=2,window=4", "gguf"): "the paper's Self-Extend",
        ("self-extend:group=2,window=4,mode=llama.cpp", "hf"): "export --format gguf",
        ("self-extend:group=2,window=4,mode=llama.cpp,init=yarn,factor=2", "gguf"):
            "scales cos/sin",
    }  # fmt: skip
    for (spec, format), words in refused.items():
        with pytest.raises(ExportRefused, match=words):
            llamacpp_recipe(build(spec, **shape), format)
