"""ropekit's vLLM plugin without vLLM: its rotary on vLLM's flat (N, H*D) rows and (N,) positions
is what the patched model computes on (B, H, T, D). Served by vLLM: make test-serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ropekit.hf import ExportRefused, patch
from ropekit.serve.exporting import export
from tests.tiny import perturb


def test_vllm_plugin_rotary_on_flat_rows_is_ropekit_on_heads(tmp_path: Path, tiny_llama) -> None:
    """vLLM hands the rotary (N, H*D) rows and (N,) positions; the plugin's reshape must give
    exactly what the patched model computes on (B, H, T, D) (no vLLM needed for this)."""
    from ropekit.serve.vllm_plugin import ADAPTER_DIR, RopekitRotary, load_adapter_encoding

    model = tiny_llama()
    encoding = perturb(patch(model, "adarope:init=yarn,factor=2"))
    out = export(model, None, tmp_path / "v", format="vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["RopekitLlamaForCausalLM"]
    assert (out / ADAPTER_DIR / "adapter.safetensors").is_file()
    loaded = load_adapter_encoding(out, model.config)
    g = torch.Generator().manual_seed(1)
    n, heads, kv, d = 11, 4, 2, 16
    positions = torch.randint(0, 200, (n,), generator=g)  # any order: chunked prefill, decode
    q = torch.randn(n, heads * d, generator=g)
    k = torch.randn(n, kv * d, generator=g)
    for layer in range(2):
        got_q, got_k = RopekitRotary(loaded, layer, d)(positions, q, k)
        want_q = encoding.rotate_q(
            q.view(n, heads, d).transpose(0, 1)[None], positions[None], layer
        )
        want_k = encoding.rotate_k(k.view(n, kv, d).transpose(0, 1)[None], positions[None], layer)
        torch.testing.assert_close(got_q, want_q[0].transpose(0, 1).reshape(n, -1), rtol=0, atol=0)
        torch.testing.assert_close(got_k, want_k[0].transpose(0, 1).reshape(n, -1), rtol=0, atol=0)
    with pytest.raises(ExportRefused, match="sequence length"):
        patch(model, "dynamic-ntk:factor=2")
        export(model, None, tmp_path / "dyn", format="vllm")
