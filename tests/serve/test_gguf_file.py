"""The GGUF writer: metadata llama.cpp reads, rope_freqs, the q/k row order, and the mapping
from transformers' rope_parameters to llama.cpp's rules (``ropekit.serve.engines``), exact for
every type it writes. Tiny models; the real llama.cpp runs in ``make test-serving``."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ropekit.encodings import schedules
from ropekit.encodings.rotary import rotate
from ropekit.hf import ExportRefused, patch
from ropekit.serve.engines import llamacpp_rope, transformers_rope
from ropekit.serve.exporting import export
from ropekit.serve.gguf_file import GGUF_NAME, gguf_rope, interleave_rows
from tests.tiny import L0, perturb, tiny_config, tiny_model

SHARED = "adarope:init=yarn,factor=2,share_heads=true,share_layers=true,scale=false"


def _fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items()}, {t.name: t for t in reader.tensors}


def test_interleaved_rows_rotate_like_rotate_half() -> None:
    """llama.cpp rotates (2i, 2i+1) pairs, transformers (i, i + D/2): projecting with the
    reordered rows and rotating interleaved gives the same rotated vector, reordered."""
    g = torch.Generator().manual_seed(0)
    heads, d, width = 3, 8, 5
    weight = torch.randn(heads * d, width, generator=g, dtype=torch.float64)
    x = torch.randn(width, generator=g, dtype=torch.float64)
    theta, _ = schedules.rope(d, 10000.0)
    phi = 7.0 * theta  # position 7
    cos, sin = phi.cos().view(1, 1, 1, -1), phi.sin().view(1, 1, 1, -1)  # (1, 1, 1, F)
    half = rotate((weight @ x).view(1, heads, 1, d), cos, sin, "half")  # (1, H, 1, D)
    inter = rotate(
        (interleave_rows(weight, heads) @ x).view(1, heads, 1, d), cos, sin, "interleaved"
    )
    reordered = half.view(heads, 2, d // 2).transpose(1, 2).reshape(1, heads, 1, d)
    torch.testing.assert_close(inter, reordered, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="heads of even size"):
        interleave_rows(weight[:-1], heads)


@pytest.mark.parametrize(
    ("spec", "kind"),
    [("yarn:factor=2", "yarn"), ("linear:factor=2", "linear"), ("rope", "none")],
)
def test_metadata_carries_llama_cpp_rope_keys(
    spec: str, kind: str, tmp_path: Path, tiny_llama
) -> None:
    model = tiny_llama()
    patch(model, spec)
    out = export(model, None, tmp_path / "g", format="gguf")
    fields, tensors = _fields(out / GGUF_NAME)
    assert fields["general.architecture"] == "llama"
    assert fields["llama.rope.scaling.type"] == kind
    assert fields["llama.rope.scaling.original_context_length"] == L0
    assert fields["llama.rope.freq_base"] == pytest.approx(10000.0)
    factor = 2.0 if kind != "none" else 1.0
    assert fields["llama.rope.scaling.factor"] == pytest.approx(factor)
    assert fields["llama.context_length"] == round(L0 * factor)  # the target
    # 1 for every type: YaRN's default 0.1 ln s + 1 is divided back out (llama.cpp multiplies
    # it in again).
    assert fields["llama.rope.scaling.attn_factor"] == pytest.approx(1.0, rel=1e-6)
    assert "rope_freqs.weight" not in tensors
    assert fields["tokenizer.ggml.model"] == "none"  # tiny models have no tokenizer
    q = np.asarray(tensors["blk.0.attn_q.weight"].data)
    expected = interleave_rows(model.model.layers[0].self_attn.q_proj.weight.detach(), 4)
    np.testing.assert_array_equal(q.reshape(expected.shape), expected.numpy())


@pytest.mark.parametrize("spec", ["llama3:factor=2,low_freq_factor=1,high_freq_factor=4", SHARED])
def test_per_pair_schedules_travel_as_rope_freqs(spec: str, tmp_path: Path, tiny_llama) -> None:
    model = tiny_llama()
    encoding = patch(model, spec)
    if spec.startswith("adarope"):
        perturb(encoding, scale=False)
    out = export(model, None, tmp_path / "g", format="gguf")
    fields, tensors = _fields(out / GGUF_NAME)
    assert fields["llama.rope.scaling.type"] == "none"
    freqs = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64)
    # RotaryEncoding.frequencies(length) / AdaRoPE.inv_freq(layer): theta (F,) or (1, F)
    theta, factor = (
        encoding.inv_freq(0) if spec.startswith("adarope") else encoding.frequencies(None)
    )
    rope, _ = schedules.rope(16, 10000.0)
    np.testing.assert_allclose(
        freqs, (rope / theta.detach().double().reshape(-1)).numpy(), rtol=1e-6
    )
    assert fields["llama.rope.scaling.attn_factor"] == pytest.approx(float(factor), rel=1e-6)


PARAMS = [
    {"rope_type": "default", "rope_theta": 1e5},
    {"rope_type": "linear", "rope_theta": 1e5, "factor": 4.0},
    {
        "rope_type": "yarn",
        "rope_theta": 1e5,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 1e5,
        "factor": 3.0,
        "original_max_position_embeddings": 512,
        "attention_factor": 1.3,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
    {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "original_max_position_embeddings": 512,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    {
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "short_factor": [1.0 + 0.1 * i for i in range(32)],
        "long_factor": [1.0 + 0.1 * i for i in range(32)],
        "original_max_position_embeddings": 512,
        "factor": 4.0,
    },
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p["rope_type"])
def test_gguf_mapping_is_exact_under_llama_cpp_rules(params: dict) -> None:
    """For every type the writer maps, llama.cpp's rules (engines.llamacpp_rope) applied to the
    written metadata give transformers' frequencies and attention factor (float32 storage of
    rope_freqs aside)."""
    config = tiny_config("llama", rope_parameters=params, head_dim=64, max_position_embeddings=2048)
    as_dict = {**config.to_dict(), "rope_parameters": params}
    rope = gguf_rope(params, config, 2048)
    for length in (100, 2048):
        ref = transformers_rope(as_dict, length)
        got = llamacpp_rope(rope, 64, length)
        torch.testing.assert_close(got.inv_freq, ref.inv_freq, rtol=2e-7, atol=0)
        assert got.attention_factor == pytest.approx(ref.attention_factor, rel=1e-7)


def test_llama_cpp_yarn_attention_is_the_written_factor_times_its_own_mscale() -> None:
    """The cancellation llama-context.cpp performs: transformers' 1.3 becomes 1.3 / (1 + 0.1 ln 3)
    in the file, and llama.cpp multiplies (1 + 0.1 ln 3) back in rope_yarn."""
    params = PARAMS[3]
    config = tiny_config("llama", rope_parameters=params, head_dim=64, max_position_embeddings=2048)
    assert gguf_rope(params, config, 2048).attn_factor == pytest.approx(
        1.3 / (1 + 0.1 * math.log(3))
    )


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "no length-following"),
        (
            {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "beta_fast": 16.0},
            "reads no yarn_beta",
        ),
        ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "truncate": False}, "floorf"),
        (
            {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "factor": 2.0,
            },
            "different short and long",
        ),
    ],
)
def test_what_llama_cpp_cannot_compute_is_refused(params: dict, match: str) -> None:
    with pytest.raises(ExportRefused, match=match):
        gguf_rope(params, tiny_config("llama"), 64)


def test_models_with_attention_biases_are_refused(tmp_path: Path) -> None:
    model = tiny_model("qwen2")
    patch(model, "yarn:factor=2")
    with pytest.raises(ExportRefused, match="qwen2"):
        export(model, None, tmp_path / "g", format="gguf")
    assert not (tmp_path / "g").exists()
