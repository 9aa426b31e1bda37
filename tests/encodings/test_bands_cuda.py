"""Banded attention on CUDA (``make cuda-check``; skipped where there is no GPU), through each
of its two fused paths: FlexAttention (``bands_flex``, the default) and the pieces on the
memory-efficient op (``bands_fused``, where FlexAttention does not compile). Both are held to
the float64 reference on the CPU: within plain RoPE's own error in float32 and half precision
forward and backward, with transformers' masks, over a growing cache, and in a decoder's
training step and decoding; float64 falls back to the reference kernel."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
import torch.nn.functional as F

from ropekit.encodings import bands, bands_flex, bands_fused

from .conftest import output_and_grads
from .test_bands_fused import LONG, TOL64, _attend, _decode, _enc, _qkv, _rows_of, left_padded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PATHS = ("flex", "pieces")


@pytest.fixture(params=PATHS)
def path(request, monkeypatch) -> tuple[str, collections.Counter]:
    """The path under test and its kernel calls on CUDA ("forward", and "backward" for the
    pieces: FlexAttention's backward runs inside its own autograd), counted so that a result
    that fell back to another path or to the reference cannot pass unnoticed."""
    calls: collections.Counter = collections.Counter()

    def spy(module, name: str, label: str):
        op = getattr(module, name)

        def run(*args, **kwargs):
            if args[0].is_cuda:
                calls[label] += 1
            return op(*args, **kwargs)

        monkeypatch.setattr(module, name, run)

    if request.param == "flex":
        spy(bands_flex, "_attend", "forward")
    else:
        monkeypatch.setattr(bands_flex, "supported", lambda q: "pieces under test")
        spy(bands_fused, "_cuda_efficient", "forward")
        spy(bands_fused, "_cuda_efficient_backward", "backward")
    return request.param, calls


def _ran(path: tuple[str, collections.Counter], backward: bool) -> bool:
    name, calls = path
    return calls["forward"] > 0 and (not backward or name == "flex" or calls["backward"] > 0)


def _plain(rope, positions):
    """Plain RoPE through ordinary fused attention (CUDA's memory-efficient kernel, keys
    repeated per query head): the error of ordinary attention on this device in the inputs'
    precision."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(q, k, v):
        group = q.shape[1] // k.shape[1]
        q, k = rope.rotate_q(q, positions), rope.rotate_k(k, positions)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        backend = SDPBackend.EFFICIENT_ATTENTION if q.is_cuda else SDPBackend.MATH
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return attend


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).pow(2).mean().sqrt())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", LONG)
def test_cuda_is_within_plain_ropes_own_error_forward_and_backward(spec, dtype, path):
    """Output and q/k/v gradients on CUDA, offset rows (the pieces: blocks of 64 rows and the
    default), against the float64 reference: RMS error within 2x (max within 4x) of plain
    RoPE's own through ordinary fused attention in the same dtype against float64. Except dq
    and dk in half precision: within 3x (max 6x), since each band rotates (and scales) the
    queries, and each distinct key position set the keys, in that precision, and their
    gradients come back through every rotation (measured on an H200 with the pieces: dq
    2.1-2.2x and dk 2.0x for STRING over YaRN, whose attention factor scales the rotations;
    at most 2x elsewhere)."""
    T = 300
    q, k, v = _qkv(T, T, seed=11)
    positions = torch.arange(T)[None] + torch.tensor([[0], [13]])
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    exact = output_and_grads(lambda *a: _attend(_enc(spec), *a, positions, "fused"), q, k, v, w)
    rope_exact = output_and_grads(_plain(_enc("rope"), positions), q, k, v, w)
    low = [t.to("cuda", dtype) for t in (q, k, v, w)]
    rope_low = output_and_grads(_plain(_enc("rope", dtype).cuda(), positions.cuda()), *low)
    enc = _enc(spec, dtype).cuda()
    for rows in (64, None) if path[0] == "pieces" else (None,):
        path[1].clear()
        attend = lambda *a, rows=rows: _attend(enc, *a, positions.cuda(), "fused", rows)  # noqa: E731
        got = output_and_grads(attend, *low)
        assert _ran(path, backward=True)
        names = ("out", "dq", "dk", "dv")
        for name, g, e, r, re in zip(names, got, exact, rope_low, rope_exact, strict=True):
            assert g.device.type == "cuda" and g.dtype == dtype, name
            assert torch.isfinite(g).all(), name
            bound = 3 if name in ("dq", "dk") and dtype != torch.float32 else 2
            assert _rms(g, e) <= bound * _rms(r, re), (name, rows, _rms(g, e), _rms(r, re))
            own = float((r.double().cpu() - re).abs().max())
            assert float((g.double().cpu() - e).abs().max()) <= 2 * bound * own, (name, rows)


def test_cuda_caller_masks_padding_and_additive_agree_with_the_reference(path):
    """transformers' boolean and additive masks with left padding on CUDA: rows that see no
    key give zeros, the rest the float64 reference's output and gradients in float32."""
    enc = _enc("string:shift=30,window=4")
    q, k, v, positions, keep, allowed = left_padded()
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    w = w * keep[:, None, :, None]
    gpu = [t.to("cuda", torch.float32) for t in (q, k, v, w)]
    enc32 = _enc("string:shift=30,window=4", torch.float32).cuda()
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -1e30)
    for full in (allowed, additive):
        mask = _rows_of(full)
        exact = output_and_grads(
            lambda *a, m=mask: _attend(enc, *a, positions, "reference", None, m), q, k, v, w
        )
        on = _rows_of(full.cuda() if full.dtype == torch.bool else full.to("cuda", torch.float32))
        path[1].clear()
        got = output_and_grads(
            lambda *a, m=on: _attend(enc32, *a, positions.cuda(), "fused", 32, m), *gpu
        )
        assert _ran(path, backward=True)
        assert torch.isfinite(got[0]).all()
        if full.dtype == torch.bool:  # an additive -1e30 leaves rows a softmax over equals
            assert not got[0][1, :, :17].any()
        rows = keep[:, None, :, None]
        torch.testing.assert_close(got[0].cpu().double() * rows, exact[0] * rows, rtol=1e-4,
                                   atol=1e-5)  # fmt: skip
        for grad, expected in zip(got[1:], exact[1:], strict=True):
            torch.testing.assert_close(grad.cpu().double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", ["rerope:window=16,leaky=4", "dca", "string:window=8"])
def test_cuda_cached_decoding_equals_one_call_over_each_prefix(spec, path):
    """Token by token and in chunks over a growing CUDA cache with the rotated-key memo."""
    enc = _enc(spec, torch.float32).cuda()
    T = 150
    q, k, v = (t.to("cuda", torch.float32) for t in _qkv(T, T, seed=7))
    positions = (torch.arange(T)[None] + torch.tensor([[0], [3]])).cuda()
    schedules = ([1] * 12, [37, 1, 1, 30, 2])
    for _, _, got, prefix in _decode(enc, q, k, v, positions, schedules, "fused"):
        torch.testing.assert_close(got, prefix, rtol=1e-5, atol=1e-5)
    assert _ran(path, backward=False)


def test_cuda_float64_falls_back_to_the_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(bands, "_FALLBACKS", set())
    enc = _enc("self-extend:group=2,window=5")
    q, k, v = _qkv(40, 40, B=1, seed=9)
    positions = torch.arange(40)[None]
    expected = _attend(enc, q, k, v, positions, "reference")
    with pytest.warns(RuntimeWarning, match="on CUDA does not take torch.float64"):
        got = _attend(enc.cuda(), q.cuda(), k.cuda(), v.cuda(), positions.cuda(), "fused")
    torch.testing.assert_close(got.cpu(), expected, **TOL64)


def test_cuda_decoder_trains_and_decodes_on_the_fused_kernel(path):
    """A small decoder with Leaky ReRoPE past its trained length on CUDA: its logits and
    weight gradients equal the CPU's (both float32), and cached decoding equals the forward."""
    from ropekit.model import Decoder, DecoderConfig, KVCache

    config = DecoderConfig(encoding="rerope:window=32,leaky=4", d_model=64, n_heads=4,
                           n_kv_heads=2, n_layers=2, context_length=64)  # fmt: skip
    torch.manual_seed(0)
    models = {"cpu": Decoder(config)}
    models["cuda"] = Decoder(config).cuda()
    models["cuda"].load_state_dict(models["cpu"].state_dict())
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(1))
    results = {}
    with warnings.catch_warnings():
        # no fallback to another kernel (ropekit's warnings; the compiler's own may come)
        warnings.filterwarnings("error", message="ropekit:", category=RuntimeWarning)
        for device, model in models.items():
            out = model(ids.to(device), labels=ids.to(device))
            out.loss.backward()
            grads = [p.grad.cpu() for p in model.parameters()]
            results[device] = (out.logits.detach().cpu(), grads)
    assert _ran(path, backward=True)
    torch.testing.assert_close(results["cuda"][0], results["cpu"][0], rtol=1e-4, atol=1e-4)
    for g, e in zip(results["cuda"][1], results["cpu"][1], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-5)
    model, cache = models["cuda"], KVCache()
    with torch.no_grad():
        whole = model(ids.cuda()).logits
        model(ids[:, :250].cuda(), cache=cache)
        steps = [model(ids[:, t : t + 1].cuda(), cache=cache).logits for t in range(250, 300)]
    torch.testing.assert_close(torch.cat(steps, 1), whole[:, 250:], rtol=1e-4, atol=1e-4)
