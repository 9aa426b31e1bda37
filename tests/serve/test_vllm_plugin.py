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


@pytest.mark.parametrize(
    "spec", ["dca:chunk_size=24,local_size=4,scale=chunkllama", "string:window=4,shift_of=length"]
)
def test_length_following_remaps_refuse_chunked_prefill_and_prefix_caching(spec: str) -> None:
    """DCA's and STRING's parameters follow the attended length: vLLM may serve them only with
    each prompt in one step (no chunked prefill, no prefix caching); the other remaps with
    both."""
    from ropekit.encodings import build
    from ropekit.serve.vllm_plugin import check_scheduling

    def encoding(s: str):
        return build(s, n_heads=4, n_kv_heads=2, head_dim=16, original_length=32)

    dynamic = encoding(spec)
    assert dynamic.dynamic
    for chunked, cached, named in (
        (True, False, "chunked prefill hands"),
        (False, True, "prefix caching hands"),
        (True, True, "chunked prefill and prefix caching"),
    ):
        with pytest.raises(ValueError, match=named) as info:
            check_scheduling(dynamic, chunked_prefill=chunked, prefix_caching=cached)
        assert "--no-enable-chunked-prefill --no-enable-prefix-caching" in str(info.value)
    check_scheduling(dynamic, chunked_prefill=False, prefix_caching=False)
    for static in ("rerope:window=8,leaky=4", "self-extend:group=4,window=8", "dca:scale=none"):
        check_scheduling(encoding(static), chunked_prefill=True, prefix_caching=True)


@pytest.mark.parametrize("spec", ["rerope:window=8,leaky=4", "self-extend:group=4,window=8", "dca"])
def test_held_rotary_hands_the_cache_keys_as_the_far_band_reads_them(spec: str) -> None:
    """A remap's rotary on vLLM's flat rows: queries untouched (the attention rotates them per
    band), keys rotated at the key positions of the band that reaches back to the first key
    (Leaky ReRoPE's j / k, Self-Extend's floor(j / G), DCA's j mod c), any order of positions."""
    from ropekit.encodings import build
    from ropekit.serve.vllm_plugin import HeldRotary

    n, heads, kv, d = 11, 4, 2, 16
    encoding = build(spec, n_heads=heads, n_kv_heads=kv, head_dim=d, original_length=32)
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 200, (n,), generator=g)
    q = torch.randn(n, heads * d, generator=g)
    k = torch.randn(n, kv * d, generator=g)
    got_q, got_k = HeldRotary(encoding, 0, d)(positions, q, k)
    assert got_q is q
    bands = encoding.bands(positions[None], positions[None])
    far = next(band for band in bands if band.lo is None)
    want = encoding.rotate_band(k.view(n, kv, d).transpose(0, 1)[None], far.k_positions, False)
    torch.testing.assert_close(got_k, want[0].transpose(0, 1).reshape(n, -1), rtol=0, atol=0)
