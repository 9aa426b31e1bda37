"""A remap's attention over a paged KV cache (ropekit.serve.paged_attention, what the vLLM
plugin runs), checked without vLLM: requests whose tokens sit in shuffled cache blocks, fed as
vLLM feeds them (a prompt in chunks, two requests in one step, single decoded tokens), give what
``banded_attention`` gives over the same keys held contiguously. The real engine is held to the
patched model in tests/serve/engines/test_vllm_remaps.py (``make test-serving``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ropekit.encodings import build
from ropekit.encodings.bands import banded_attention
from ropekit.serve import paged_attention
from ropekit.serve.paged_attention import (
    Step,
    _pieces,
    gather_paged,
    paged_banded_attention,
    rotate_for_cache,
    rotations_compose,
    steps,
    write_paged,
)

H, K, D, B = 4, 2, 16, 8  # query heads, kv heads, head dim, tokens per cache block
L0 = 64
REMAPS = (
    "rerope:window=16",
    "rerope:window=16,leaky=4",
    "self-extend:group=4,window=16",
    "self-extend:group=4,window=16,mode=llama.cpp",
    "dca:chunk_size=40,local_size=8,scale=none",
    "dca:chunk_size=40,local_size=8,scale=chunkllama",  # follows the attended length
    "string:shift=40,window=8,scale=authors",
    "string:window=8,shift_of=length,scale=authors",  # follows the attended length
)


def _encoding(spec: str):
    return build(spec, n_heads=H, n_kv_heads=K, head_dim=D, original_length=L0)


def test_steps_place_each_requests_new_tokens_last() -> None:
    # Request 0 decodes one token after 40 cached; request 1 prefills a chunk of 5 after 10;
    # rows past num_tokens are padding.
    plan = steps(torch.tensor([0, 1, 6, 6]), torch.tensor([41, 15, 3]), num_tokens=6)
    assert plan == [Step(0, 0, 1, 41), Step(1, 1, 6, 15)]
    assert [s.first_position for s in plan] == [40, 10]
    with pytest.raises(ValueError, match="new tokens"):
        steps(torch.tensor([0, 5]), torch.tensor([3]), num_tokens=5)


@pytest.mark.parametrize(
    "how", ["torch", "compiled, two caches", "compiled, vLLM's one array", "bfloat16"]
)
def test_write_then_gather_returns_each_requests_tokens_in_order(how: str) -> None:
    """Each token's key and value land at its slot and nowhere else, written by torch's
    indexing (gradients recorded, or bfloat16) or by the compiled loop (inference, float32:
    separate caches or the row ranges of vLLM's one array per layer)."""
    g = torch.Generator().manual_seed(0)
    n_blocks = 12
    dtype = torch.bfloat16 if how == "bfloat16" else torch.float32
    if how.endswith("one array"):
        cache_k, cache_v = torch.zeros(n_blocks, K, 2 * B, D).chunk(2, 2)
    else:
        cache_k = torch.zeros(n_blocks, K, B, D, dtype=dtype)
        cache_v = torch.zeros(n_blocks, K, B, D, dtype=dtype)
    grad = how == "torch"
    table = torch.randperm(n_blocks, generator=g).view(2, 6)  # each request's blocks, shuffled
    lengths = (37, 20)
    tokens = [torch.randn(n, K, D, generator=g).to(dtype) for n in lengths]
    written = torch.zeros(n_blocks * B, dtype=torch.bool)
    for r, (n, x) in enumerate(zip(lengths, tokens, strict=True)):
        slots = table[r, torch.arange(n) // B] * B + torch.arange(n) % B
        padded = torch.cat([slots, torch.tensor([-1])])  # a padding row writes nothing
        with torch.set_grad_enabled(grad):
            write_paged(cache_k, cache_v, torch.cat([x, x[:1]]), -torch.cat([x, x[:1]]), padded)
        written[slots] = True
    untouched = ~written.view(n_blocks, 1, B, 1).expand_as(cache_k)
    assert not cache_k[untouched].any() and not cache_v[untouched].any()
    for r, (n, x) in enumerate(zip(lengths, tokens, strict=True)):
        got = gather_paged(cache_k, table[r], n)  # (1, K, S, D)
        torch.testing.assert_close(got[0].transpose(0, 1), x, rtol=0, atol=0)
        torch.testing.assert_close(gather_paged(cache_v, table[r], n)[0].transpose(0, 1), -x)
    with pytest.raises(ValueError, match="blocks"):
        gather_paged(cache_k, table[0, :2], 37)


def _reference(encoding, q, k, v, first: int, length: int) -> torch.Tensor:
    """banded_attention of queries at positions [first, length) over contiguous keys [0,
    length): q (T, H, D), k, v (S, K, D) -> (T, H, D)."""
    pos = torch.arange(length)[None]
    out = banded_attention(
        q.transpose(0, 1)[None], k[:length].transpose(0, 1)[None],
        v[:length].transpose(0, 1)[None], encoding.bands(pos[:, first:], pos), pos,
        encoding.rotate_band, causal_offset=length - q.shape[0],
    )  # fmt: skip
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("held", [True, False], ids=["keys held rotated", "keys unrotated"])
@pytest.mark.parametrize("spec", REMAPS)
def test_paged_attention_is_banded_attention_over_the_requests_keys(spec: str, held: bool) -> None:
    """Two requests (150 and 97 tokens) in shuffled blocks: prompts in chunks of unequal size,
    both requests' chunks in one step, then decoded tokens; every step's output equals the
    banded attention of its queries over the request's keys laid out contiguously, with the
    cache holding the keys rotated as the far band reads them (the plugin's, where rotations
    compose: ``rotate_for_cache``) or unrotated. For the remaps that do not follow the
    attended length that is also one forward over the whole prompt (the positions of chunks
    and decoded tokens are their true ones)."""
    encoding = _encoding(spec)
    assert rotations_compose(encoding, K, D, layers=1)
    g = torch.Generator().manual_seed(1)
    lengths = (150, 97)
    q = [torch.randn(n, H, D, generator=g, dtype=torch.float64) for n in lengths]
    k = [torch.randn(n, K, D, generator=g, dtype=torch.float64) for n in lengths]
    v = [torch.randn(n, K, D, generator=g, dtype=torch.float64) for n in lengths]
    n_blocks = 40
    cache_k = torch.zeros(n_blocks, K, B, D, dtype=torch.float64)
    cache_v = torch.zeros_like(cache_k)
    # Request 0's blocks in order (read in place), request 1's shuffled (copied).
    table = torch.stack([torch.arange(20), 20 + torch.randperm(20, generator=g)])
    # (request, first, stop) per step: chunked prefill (request 1 joins while 0 is mid-way),
    # then one decoded token per request per step.
    schedule = [
        [(0, 0, 64)],
        [(0, 64, 130), (1, 0, 41)],
        [(1, 41, 95), (0, 130, 148)],
        [(0, 148, 149), (1, 95, 96)],
        [(1, 96, 97), (0, 149, 150)],
    ]
    static = not encoding.dynamic
    full = [_reference(encoding, q[r], k[r], v[r], 0, n) for r, n in enumerate(lengths)]
    for step in schedule:
        rows = torch.cat([q[r][a:b] for r, a, b in step])  # (N, H, D)
        keys = torch.cat([k[r][a:b] for r, a, b in step])  # (N, K, D)
        if held:  # as vLLM's cache gets them from the plugin's rotary
            pos = torch.cat([torch.arange(a, b) for _, a, b in step])[None]  # (1, N)
            keys = rotate_for_cache(encoding, keys.transpose(0, 1)[None], pos, 0)[0]
            keys = keys.transpose(0, 1)
        values = torch.cat([v[r][a:b] for r, a, b in step])
        slots = torch.cat([table[r, torch.arange(a, b) // B] * B + torch.arange(a, b) % B
                           for r, a, b in step])  # fmt: skip
        write_paged(cache_k, cache_v, keys, values, slots)
        starts = torch.tensor([0, *torch.tensor([b - a for _, a, b in step]).cumsum(0).tolist()])
        # The block table's rows in this step's order, as vLLM's metadata gives them.
        plan = steps(starts, torch.tensor([b for _, _, b in step]), rows.shape[0])
        step_table = table[[r for r, _, _ in step]]
        out = paged_banded_attention(
            rows, cache_k, cache_v, step_table, plan, encoding, 0, D**-0.5,
            torch.empty_like(rows), keys_held=held,
        )  # fmt: skip
        for (r, a, b), s in zip(step, plan, strict=True):
            want = _reference(encoding, q[r][a:b], k[r], v[r], a, b)
            torch.testing.assert_close(out[s.start : s.stop], want, rtol=1e-10, atol=1e-10)
            if static:
                torch.testing.assert_close(out[s.start : s.stop], full[r][a:b])


def test_pieces_cover_a_bands_keys_once_in_their_blocks() -> None:
    """A decoded token's band over keys [a, c) is read as rows of cache blocks (``_pieces``):
    every key once, each piece's rows inside its blocks, whatever a, c and the block size."""
    for b in (1, 3, 8):
        for a in range(40):
            for c in range(a + 1, 41):
                pieces = _pieces(a, c, b)
                assert all(0 <= r0 < r1 <= b and lo < hi for lo, hi, r0, r1 in pieces), pieces
                keys = [x * b + r for lo, hi, r0, r1 in pieces for x in range(lo, hi)
                        for r in range(r0, r1)]  # fmt: skip
                assert sorted(keys) == list(range(a, c)), (a, c, b, pieces)


@pytest.mark.parametrize("spec", REMAPS)
def test_the_rotarys_bands_leave_a_decoding_steps_bands_cached(spec: str) -> None:
    """vLLM calls the plugin's rotary (``rotate_for_cache``: the new key's bands) before each
    layer's attention (the step's bands): the next layer's attention finds the very same
    bands again, so its layout and rotation tables are made once per step, not per layer."""
    encoding = _encoding(spec)
    q_pos, k_pos = torch.arange(140, 141)[None], torch.arange(141)[None]
    step = encoding.bands(q_pos, k_pos)
    rotate_for_cache(encoding, torch.randn(1, K, 1, D), q_pos.clone(), 1)  # the next layer's
    assert encoding.bands(q_pos, k_pos) is step


class _LargestNew(TorchDispatchMode):
    """The most elements of any tensor an op makes (views and in-place results are not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if all(r.alias_info is None for r in func._schema.returns):
            sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.most = max([self.most, *sizes])
        return out


def _decoded_token(spec: str, runs: int, one_array: bool, dtype=torch.float64):
    """A decoded token over 601 keys held rotated in blocks of B, in ``runs`` runs of
    consecutive block ids (as a cache that has recycled blocks hands them out), the rows past
    the last key NaN: (its query, the caches, the block table, the step, the encoding, and the
    banded attention of the query over the keys held contiguously). ``one_array``: keys and
    values are row ranges of one (P, K, 2 B, D) array, as in vLLM's CPU cache
    (``vllm_plugin._split_cache``), else two arrays. Learned theta and temperatures get a
    nudge from their initial values."""
    encoding = _encoding(spec)
    with torch.no_grad():
        for p in encoding.parameters():  # learned (none for the plain remaps)
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    g = torch.Generator().manual_seed(3)
    n = 601  # the last block holds one key: its other rows are never read
    q = torch.randn(1, H, D, generator=g, dtype=dtype)
    k = torch.randn(n, K, D, generator=g, dtype=dtype)
    v = torch.randn(n, K, D, generator=g, dtype=dtype)
    P = n // B + 3
    if one_array:
        cache_k, cache_v = torch.full((P, K, 2 * B, D), float("nan"), dtype=dtype).chunk(2, 2)
    else:
        cache_k = torch.full((P, K, B, D), float("nan"), dtype=dtype)
        cache_v = torch.full_like(cache_k, float("nan"))  # rows past the last key: never read
    pos = torch.arange(n)[None]
    with torch.no_grad():
        held = rotate_for_cache(encoding, k.transpose(0, 1)[None], pos, 0)[0].transpose(0, 1)
    table = torch.arange(1, n // B + 3)  # from block 1 on, cut in ``runs`` runs, last first
    table = torch.cat(table.tensor_split(runs)[::-1])[None]
    write_paged(cache_k, cache_v, held, v, table[0, pos[0] // B] * B + pos[0] % B)
    plan = steps(torch.tensor([0, 1]), torch.tensor([n]), 1)
    with torch.no_grad():
        want = _reference(encoding, q.double(), k.double(), v.double(), n - 1, n)
    return q, cache_k, cache_v, table, plan, encoding, want


def _serve(q, cache_k, cache_v, table, plan, encoding) -> torch.Tensor:
    return paged_banded_attention(
        q, cache_k, cache_v, table, plan, encoding, 0, D**-0.5, torch.empty_like(q),
        keys_held=True,
    )  # fmt: skip


@pytest.mark.parametrize("runs", [1, 3], ids=["consecutive blocks", "blocks in 3 runs"])
@pytest.mark.parametrize("spec", [*REMAPS, "adarope-remap:remap=rerope,window=16,leaky=4"])
def test_a_decoding_step_reads_the_cache_in_place(spec: str, runs: int, monkeypatch) -> None:
    """The torch step (what serves where the compiled pass does not run): a decoded token's
    banded attention, made without any tensor as large as the request's keys (the cache read
    where it holds them, not copied into token order; the few keys another band turns are
    copied), blocks consecutive or in 3 runs. adarope-remap: learned theta and a temperature
    per query head in every band's factor."""
    monkeypatch.setattr(paged_attention, "_kernel_arrays", lambda *_: None)
    q, cache_k, cache_v, table, plan, encoding, want = _decoded_token(spec, runs, False)
    with _LargestNew() as largest:
        out = _serve(q, cache_k, cache_v, table, plan, encoding)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    assert largest.most < 601 * K * D // 2, (largest.most, 601 * K * D)


KERNEL_SPECS = (
    *REMAPS,
    "adarope-remap:remap=rerope,window=16,leaky=4",
    "rerope:window=16,leaky=4,pairing=interleaved,fraction=0.5",  # other pairs, partial
    "self-extend:group=4,window=16,proportion=0.5",
)


@pytest.mark.parametrize("one_array", [True, False], ids=["vLLM's one array", "two caches"])
@pytest.mark.parametrize("spec", KERNEL_SPECS)
def test_the_compiled_decoding_pass_is_the_banded_attention(
    spec: str, one_array: bool, monkeypatch
) -> None:
    """The compiled pass (``serve.paged_kernels``, what a decoded token runs on the CPU in
    float32 and float64) gives the banded attention of its query, for every remap, AdaRoPE's
    learned theta and temperatures, interleaved pairs and a partial rotation: each band's query
    and a window's turned keys rotated in the kernel from the encoding's tables, over vLLM's
    CPU cache layout (keys and values row ranges of one array) and two caches, blocks in 3
    runs; the torch step never runs."""

    def refused(*_):
        raise AssertionError("the torch step ran")

    monkeypatch.setattr(paged_attention, "_torch_decoding_step", refused)
    q, cache_k, cache_v, table, plan, encoding, want = _decoded_token(spec, 3, one_array)
    out = _serve(q, cache_k, cache_v, table, plan, encoding)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    q, cache_k, cache_v, table, plan, encoding, want = _decoded_token(
        spec, 3, one_array, torch.float32
    )
    out = _serve(q, cache_k, cache_v, table, plan, encoding)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


def test_what_the_compiled_pass_cannot_read_goes_to_the_torch_step(monkeypatch) -> None:
    """bfloat16 caches (numba has no bfloat16) and a process without numba are served by the
    torch step, with the same answer."""
    spec = "rerope:window=16,leaky=4"
    calls = []
    torch_step = paged_attention._torch_decoding_step
    monkeypatch.setattr(
        paged_attention, "_torch_decoding_step", lambda *a: calls.append(1) or torch_step(*a)
    )
    q, cache_k, cache_v, table, plan, encoding, want = _decoded_token(spec, 1, True, torch.bfloat16)
    out = _serve(q, cache_k, cache_v, table, plan, encoding)
    torch.testing.assert_close(out.double(), want, rtol=0.05, atol=0.05)
    assert calls == [1]
    monkeypatch.setattr(paged_attention, "_kernels", lambda: None)
    q, cache_k, cache_v, table, plan, encoding, want = _decoded_token(spec, 1, True)
    torch.testing.assert_close(_serve(q, cache_k, cache_v, table, plan, encoding), want)
    assert calls == [1, 1]


@pytest.mark.parametrize("spec", [s for s in REMAPS if _encoding(s).dynamic])
def test_a_length_following_remaps_chunk_is_not_its_single_forward(spec: str) -> None:
    """Why the plugin refuses chunked prefill and prefix caching for DCA's and STRING's
    length-following variants (``vllm_plugin.check_scheduling``): a prompt served in one step
    is the single forward, but its first chunk attends at the chunk's length, not the
    prompt's."""
    encoding = _encoding(spec)
    g = torch.Generator().manual_seed(2)
    n, chunk = 150, 64
    q = torch.randn(n, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(n, K, D, generator=g, dtype=torch.float64)
    v = torch.randn(n, K, D, generator=g, dtype=torch.float64)
    cache_k = torch.zeros(n // B + 1, K, B, D, dtype=torch.float64)
    cache_v = torch.zeros_like(cache_k)
    table = torch.arange(n // B + 1)[None]
    write_paged(cache_k, cache_v, k, v, torch.arange(n))

    def served(stop: int) -> torch.Tensor:
        plan = steps(torch.tensor([0, stop]), torch.tensor([stop]), stop)
        return paged_banded_attention(
            q[:stop],
            cache_k,
            cache_v,
            table,
            plan,
            encoding,
            0,
            D**-0.5,
            torch.empty_like(q[:stop]),
        )

    whole = _reference(encoding, q, k, v, 0, n)
    torch.testing.assert_close(served(n), whole, rtol=1e-10, atol=1e-10)
    assert (served(chunk) - whole[:chunk]).abs().max() > 1e-3


class _WithAttentionFactor:
    """An encoding whose rotation carries a factor (YaRN's mscale on its tables): rotating at
    a then b is not rotating at a + b, so its keys cannot be held rotated."""

    def __init__(self, encoding, factor: float) -> None:
        self.encoding, self.factor = encoding, factor

    def rotate_band(self, x, positions, query, layer=0):
        return self.factor * self.encoding.rotate_band(x, positions, query, layer)


def test_rotations_compose_for_every_remap_and_adarope_remap_not_with_a_factor() -> None:
    """Every remap's and adarope-remap's (learned theta per layer) rotations compose, the
    condition for the plugin's cache holding rotated keys; a rotation with a factor does not."""
    for spec in REMAPS:
        assert rotations_compose(_encoding(spec), K, D, layers=1), spec
    ada = build(
        "adarope-remap:remap=rerope,window=16,leaky=4", n_heads=H, n_kv_heads=K, head_dim=D,
        n_layers=2, original_length=L0,
    )  # fmt: skip
    with torch.no_grad():
        for p in ada.parameters():
            p.add_(0.05 * torch.randn_like(p))  # learned theta, other in each layer
    assert rotations_compose(ada, K, D, layers=2)
    assert not rotations_compose(_WithAttentionFactor(_encoding(REMAPS[0]), 1.1), K, D, 1)
