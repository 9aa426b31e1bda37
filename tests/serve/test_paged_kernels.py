"""The compiled decoding pass's parts (ropekit.serve.paged_kernels) that the attention tests
(tests/serve/test_paged_attention.py) do not pin down on their own: its float32 exponential,
and the rotation tables it reads (``band_tables``), which must be what ``rotate_band`` turns
by."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ropekit.encodings import build
from ropekit.encodings.rotary import rotate
from ropekit.serve import paged_attention
from ropekit.serve.paged_kernels import _exp_shifted


def test_the_float32_exponential_is_within_a_few_rounding_errors() -> None:
    """exp(x - top) in float32 (a 2^x polynomial, vectorisable): within 3e-7 relative of the
    float64 exponential down to -87 (float32's smallest normal), at most that normal below it
    (the softmax's largest term is 1), and the sum it returns is the sum of what it wrote."""
    x = np.linspace(-100.0, 0.0, 200_001, dtype=np.float32)
    y = x.copy()
    bits = np.empty(y.shape, dtype=np.int32)
    total = _exp_shifted(y, 0, y.shape[0], np.float32(0.0), bits)
    want = np.exp(x.astype(np.float64))
    normal = x >= -87.0
    assert np.max(np.abs(y[normal] - want[normal]) / want[normal]) < 3e-7
    assert np.all(np.abs(y[~normal]) <= np.finfo(np.float32).tiny * 1.5)
    assert total == pytest.approx(float(y.astype(np.float64).sum()), rel=1e-6)


def test_the_float64_exponential_is_numpys() -> None:
    x = np.linspace(-700.0, 0.0, 10_001)
    y = x.copy()
    total = _exp_shifted(y, 0, y.shape[0], 0.0, np.empty(y.shape, dtype=np.int32))
    np.testing.assert_array_equal(y, np.exp(x))
    assert total == pytest.approx(np.exp(x).sum(), rel=1e-12)


@pytest.mark.parametrize(
    "spec",
    ["rerope:window=16,leaky=4",
     "self-extend:group=4,window=16,pairing=interleaved,fraction=0.5",
     "dca:chunk_size=40,local_size=8", "string:window=8,shift=40",
     "adarope-remap:remap=rerope,window=16,leaky=4",
     "temperature:rule=logn,method=rerope,window=16"],
)  # fmt: skip
@pytest.mark.parametrize("query", [True, False], ids=["queries", "keys"])
def test_band_tables_are_what_rotate_band_turns_by(spec: str, query: bool) -> None:
    """``rotate(x, *band_tables(...), pairing)`` is ``rotate_band(x, ...)`` for every encoding
    the vLLM plugin serves with keys held rotated, at integer and fractional positions, in
    every layer (AdaRoPE's theta is learned per layer and kv head: nudged here)."""
    H, K, D = 4, 2, 16
    encoding = build(spec, n_heads=H, n_kv_heads=K, head_dim=D, original_length=64, n_layers=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in encoding.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    x = torch.randn(1, H if query else K, 5, D, generator=g, dtype=torch.float64)
    positions = torch.tensor([[0.0, 3.0, 17.5, 300.0, 9000.25]], dtype=torch.float64)
    for layer in range(2):
        with torch.no_grad():
            cos, sin = encoding.band_tables(positions, query, layer, torch.float64)
            got = rotate(x, cos, sin, encoding.pairing)
            want = encoding.rotate_band(x, positions, query, layer)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "spec",
    ["rerope:window=16,leaky=4", "self-extend:group=4,window=16,pairing=interleaved,fraction=0.5",
     "adarope-remap:remap=rerope,window=16,leaky=4"],
)  # fmt: skip
def test_the_compiled_held_rotation_is_rotate_band(spec: str, monkeypatch) -> None:
    """The plugin's rotary for new keys (``rotate_for_cache``) in inference, on vLLM's rows
    (N, K, D), is the compiled loop (``paged_kernels.rotate_rows``), and it rotates as
    ``rotate_band`` does at the held band's positions."""
    H, K, D = 4, 2, 16
    encoding = build(spec, n_heads=H, n_kv_heads=K, head_dim=D, original_length=64)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in encoding.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    rows = torch.randn(7, K, D, generator=g, dtype=torch.float64)  # vLLM's (N, K, D)
    positions = torch.arange(290, 297)[None]
    keys = rows.transpose(0, 1)[None]  # (1, K, N, D), a view of the rows
    with torch.no_grad():
        bands = encoding.bands(positions, positions, 0)
        want = encoding.rotate_band(
            keys, bands[paged_attention.held_band(bands)].k_positions, False, 0
        )
        monkeypatch.setattr(encoding, "rotate_band", lambda *_: pytest.fail("not compiled"))
        got = paged_attention.rotate_for_cache(encoding, keys, positions, 0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
