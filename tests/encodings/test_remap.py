"""Distance-remapping encodings (rerope, self-extend, dca, string) and the banded attention
kernel: each against a brute-force definition written from its paper (the full logit matrix
with the remapped distance computed pair by pair), forward and backward; equal to plain RoPE
where the remap is the identity; blocks, packed rows and llama.cpp's group attention."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from ropekit.encodings import banded_attention, build
from ropekit.encodings.bands import band_membership
from ropekit.encodings.base import spec_of
from ropekit.encodings.remap import DCAConfig, ReRopeConfig, dca_logit_scale
from ropekit.encodings.rope import YarnConfig

from .conftest import output_and_grads, perturb

SHAPE = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "n_layers": 2}
T = 40
TOL = {"rtol": 1e-10, "atol": 1e-10}  # float64 throughout: the two paths differ by rounding


# ----------------------------------------------------------------------------- the definitions
# d'(i, j) for query position i and key position j, written from each paper, pair by pair.
def rerope_distance(w: int, k: float | None):
    def remap(i: int, j: int) -> float:
        d = i - j
        if d < w:
            return float(d)
        return float(w) if k is None else w + (d - w) / k

    return remap


def self_extend_distance(G: int, W: int):
    def remap(i: int, j: int) -> float:
        if i - j < W:
            return float(i - j)
        return float((i // G + W - W // G) - j // G)

    return remap


def dca_distance(chunk_size: int, local_size: int):
    c = chunk_size - local_size

    def remap(i: int, j: int) -> float:
        if i // c == j // c:  # intra-chunk
            return float(i % c - j % c)
        if j // c == i // c - 1:  # successive chunk
            return float(min(i % c + c, chunk_size) - j % c)
        return float(min(2 * c - 1, chunk_size) - j % c)  # inter-chunk

    return remap


def string_distance(S: int, W: int):
    def remap(i: int, j: int) -> float:
        d = i - j
        return float(d if d < S else d - S + W)

    return remap


def rotate_pairs(x, cos, sin, pairing: str):
    """x (..., D) rotated pair by pair (RoPE paper, eq. 13) by broadcast tables (..., F)."""
    n = cos.shape[-1]
    if pairing == "half":
        x1, x2 = x[..., :n], x[..., n : 2 * n]
        pairs = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    else:
        x1, x2 = x[..., 0 : 2 * n : 2], x[..., 1 : 2 * n : 2]
        pairs = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    tail = x[..., 2 * n :].expand(*pairs.shape[:-1], -1)  # channels that do not rotate
    return torch.cat((pairs, tail), -1)


def brute_force(enc, q, k, v, positions, remap, *, q_scale=None, mask=None):
    """softmax_j(scale * a^2 <R(d'(i, j)) q_i, k_j>) v_j, the rotation by the remapped distance
    applied to the query alone (RoPE logits depend on P_q - P_k only), pair by pair."""
    H, D = q.shape[1], q.shape[3]
    theta, factor = enc.inv_freq(0)
    theta = theta[0]
    d = torch.tensor(
        [[[remap(int(i), int(j)) for j in row] for i in row] for row in positions],
        dtype=torch.float64,
    )  # (B, T, S)
    phi = d[..., None] * theta  # (B, T, S, F)
    if q_scale is not None:
        q = q * q_scale(positions)[:, None, :, None]
    rotated = rotate_pairs(q[:, :, :, None, :], phi.cos()[:, None], phi.sin()[:, None], enc.pairing)
    keys = k.repeat_interleave(H // k.shape[1], dim=1)[:, :, None]  # (B, H, 1, S, D)
    logits = (rotated * keys).sum(-1) * float(factor) ** 2 / math.sqrt(D)  # (B, H, T, S)
    if mask is None:
        mask = torch.ones(d.shape[-2:], dtype=torch.bool).tril()
    logits = logits.masked_fill(~mask, float("-inf"))
    return logits.softmax(-1) @ v.repeat_interleave(H // v.shape[1], dim=1)


def banded(enc, q, k, v, positions, block_entries=1 << 19, mask=None):
    return banded_attention(
        q,
        k,
        v,
        enc.bands(positions, positions),
        positions,
        enc.rotate_band,
        causal_offset=0 if mask is None else None,
        mask=None if mask is None else (lambda a, b, n: mask[..., a:b, :n]),
        block_entries=block_entries,
    )


def _inputs(seed: int = 0, B: int = 2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, SHAPE["n_heads"], T, SHAPE["head_dim"], generator=g, dtype=torch.float64)
    k = torch.randn(B, SHAPE["n_kv_heads"], T, SHAPE["head_dim"], generator=g, dtype=torch.float64)
    v = torch.randn(B, SHAPE["n_kv_heads"], T, SHAPE["head_dim"], generator=g, dtype=torch.float64)
    positions = torch.arange(T)[None] + torch.tensor([[0], [5]])[:B]  # offset rows
    return q, k, v, positions


def _logn(L0: int):
    return lambda p: (torch.log((p + 1).double()) / math.log(L0)).clamp(min=1)


def _constant(factor: float):
    """A logit factor for every query (the call's own, as the authors' scales are)."""
    return lambda p: torch.full(p.shape, factor, dtype=torch.float64)


# The authors' logit scales, written from their code for a call over L = 45 keys (positions
# up to 44, _inputs): ChunkLlama multiplies the cos and sin of q and k by 0.05 ln(L / L0) + 1
# (get_mscale, L > L0), vLLM's dual-chunk backend the keys and the softmax scale by
# max(0.1 ln(L / L0) + 1, 1); STRING the cos and sin of q and k by 0.1 ln 2 + 1.
L = 45
CHUNKLLAMA_16 = (0.05 * math.log(L / 16) + 1) ** 2
VLLM_16 = max(0.1 * math.log(L / 16) + 1, 1) ** 2
STRING_FACTOR = (0.1 * math.log(2) + 1) ** 2


CASES = [
    ("rerope:window=6", rerope_distance(6, None), None),
    ("rerope:window=6,leaky=3", rerope_distance(6, 3), None),
    ("rerope:window=5,leaky=2.5,logn=true,original_length=16", rerope_distance(5, 2.5), _logn(16)),
    ("rerope:window=7,init=linear,factor=2", rerope_distance(7, None), None),
    ("self-extend:group=3,window=7", self_extend_distance(3, 7), None),  # W not a multiple of G
    ("self-extend:group=4,window=8,init=ntk,factor=2", self_extend_distance(4, 8), None),
    ("dca:chunk_size=12,local_size=3,scale=none", dca_distance(12, 3), None),
    ("dca:chunk_size=10,local_size=0,scale=none", dca_distance(10, 0), None),
    # ChunkLlama's defaults: chunk 3 L0 / 4, local L0 / 8, its q and k scale beyond L0
    ("dca:original_length=16", dca_distance(12, 2), _constant(CHUNKLLAMA_16)),
    ("dca:original_length=16,scale=vllm", dca_distance(12, 2), _constant(VLLM_16)),
    ("dca:original_length=16,local_size=1,scale=none", dca_distance(12, 1), None),  # 1st release
    ("dca:chunk_size=13,local_size=9,scale=none", dca_distance(13, 9), None),  # 2c - 1 < chunk
    (
        "dca:chunk_size=12,local_size=2,init=yarn,factor=2,original_length=16",
        dca_distance(12, 2),
        _constant(CHUNKLLAMA_16),
    ),
    ("string:shift=9,window=3,scale=none", string_distance(9, 3), None),
    ("string:shift=9,window=3", string_distance(9, 3), _constant(STRING_FACTOR)),
    # S = int(0.33 L0) (ropekit's first STRING) and S = int(0.33 L) (the authors': L = 45)
    (
        "string:original_length=30,window=2,shift_of=original,scale=none",
        string_distance(9, 2),
        None,
    ),
    ("string:window=2", string_distance(14, 2), _constant(STRING_FACTOR)),
    ("string:window=2,shift_ratio=0.5", string_distance(22, 2), _constant(STRING_FACTOR)),
]


@pytest.mark.parametrize(("spec", "remap", "q_scale"), CASES, ids=[c[0] for c in CASES])
def test_banded_attention_equals_the_pairwise_definition_forward_and_backward(spec, remap, q_scale):
    enc = build(spec, **SHAPE).double()
    q, k, v, positions = _inputs()
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    grads = []
    for fn in (
        lambda *a: banded(enc, *a, positions, block_entries=200),  # many blocks of a few rows
        lambda *a: brute_force(enc, *a, positions, remap, q_scale=q_scale),
    ):
        grads.append(output_and_grads(fn, q, k, v, w))
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected, **TOL)


def test_remaps_change_what_plain_rope_computes():
    """The brute force is not trivially plain RoPE: at T = 40 every case differs from it."""
    q, k, v, positions = _inputs()
    for spec, _, _ in CASES:
        enc = build(spec, **SHAPE).double()
        plain = brute_force(enc, q, k, v, positions, lambda i, j: float(i - j))
        assert (banded(enc, q, k, v, positions) - plain).abs().max() > 1e-3, spec


def _plain(spec: str, q, k, v, positions):
    rope = build(spec, **SHAPE).double()
    return F.scaled_dot_product_attention(
        rope.rotate_q(q, positions), rope.rotate_k(k, positions), v, is_causal=True, enable_gqa=True
    )


@pytest.mark.parametrize(
    ("spec", "plain"),
    [
        ("rerope:window=45", "rope"),  # T + offset within the window
        ("rerope:window=3,leaky=1", "rope"),  # k = 1: the far band is the identity
        ("rerope:window=3,leaky=1,logn=true,original_length=64", "rope"),  # log-n <= 1 inside L0
        ("self-extend:group=1,window=5", "rope"),
        ("self-extend:group=4,window=45,init=linear,factor=2", "linear:factor=2"),
        ("dca:chunk_size=50,local_size=5,scale=none", "rope"),  # one chunk: positions 0..44
        ("dca:chunk_size=50,local_size=5,original_length=64", "rope"),  # and L <= L0: no scale
        ("string:shift=45,window=8,scale=none", "rope"),
        ("string:shift=6,window=6,scale=none", "rope"),  # W = S
        ("string:window=16,scale=none", "rope"),  # int(0.33 L) = 14 < W: S = W, the identity
        (
            "string:shift=50,window=8,init=yarn,factor=2,original_length=16,scale=none",
            "yarn:factor=2,original_length=16",
        ),
    ],
)
def test_an_identity_remap_equals_its_base_schedule(spec, plain):
    enc = build(spec, **SHAPE).double()
    q, k, v, positions = _inputs(1)
    torch.testing.assert_close(
        banded(enc, q, k, v, positions), _plain(plain, q, k, v, positions), **TOL
    )


@pytest.mark.parametrize("spec", ["rope", "adarope:init=yarn,factor=2,original_length=16", "alibi"])
def test_every_encoding_is_one_band(spec):
    """Plain RoPE (and AdaRoPE with its temperature) through the kernel as its single band is
    ordinary attention; so is an encoding that does not rotate (ALiBi's bias aside, none)."""
    enc = perturb(build(spec, **SHAPE)).double()
    q, k, v, positions = _inputs(2)
    assert len(enc.bands(positions, positions)) == 1
    expected = F.scaled_dot_product_attention(
        enc.rotate_q(q, positions), enc.rotate_k(k, positions), v, is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(banded(enc, q, k, v, positions, block_entries=300), expected, **TOL)


@pytest.mark.parametrize("spec", [c[0] for c in CASES[::3]])
def test_blocks_and_key_ranges_do_not_change_the_result(spec):
    enc = build(spec, **SHAPE).double()
    q, k, v, positions = _inputs(3)
    whole = banded(enc, q, k, v, positions, block_entries=1 << 30)
    for entries in (1, 97, 4 * 40 * 7):
        torch.testing.assert_close(
            banded(enc, q, k, v, positions, block_entries=entries), whole, **TOL
        )


def test_default_blocks_hold_as_many_logits_as_the_queries_have_entries(monkeypatch):
    """Without ``block_entries`` a reference block may hold as many logits as q has entries: D
    query rows in self-attention (T = S), however long the sequence, so each block is a matmul
    of D rows (a fixed budget made 3-row blocks at 16k on SmolLM2); the result is unchanged."""
    from ropekit.encodings import bands

    monkeypatch.setattr(bands, "BLOCK_ENTRIES", 1)  # the floor out of the way
    enc = build("rerope:window=6", **SHAPE).double()
    q, k, v, positions = _inputs(5)
    rows = []
    block = bands._block
    monkeypatch.setattr(bands, "_block", lambda q, *a: rows.append(q.shape[2]) or block(q, *a))
    got = banded_attention(q, k, v, enc.bands(positions, positions), positions, enc.rotate_band,
                           causal_offset=0, kernel="reference")  # fmt: skip
    assert rows == [SHAPE["head_dim"]] * (T // SHAPE["head_dim"]) + [T % SHAPE["head_dim"]]
    torch.testing.assert_close(got, banded(enc, q, k, v, positions, 1 << 30), **TOL)


def test_packed_rows_fall_back_to_full_key_ranges_and_stay_exact():
    """Positions that restart (packed documents) cannot be searched; with a document mask the
    result still equals the pairwise definition."""
    enc = build("self-extend:group=2,window=5", **SHAPE).double()
    q, k, v, _ = _inputs(4, B=1)
    positions = torch.cat((torch.arange(25), torch.arange(15)))[None]  # (1, 40): two documents
    doc = torch.cat((torch.zeros(25), torch.ones(15))).long()
    mask = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    got = banded(enc, q, k, v, positions, block_entries=160, mask=mask)
    expected = brute_force(enc, q, k, v, positions, self_extend_distance(2, 5), mask=mask)
    torch.testing.assert_close(got, expected, **TOL)


def test_rows_that_see_no_key_give_zeros_not_nan():
    enc = build("string:shift=4,window=2,scale=none", **SHAPE)
    q, k, v, positions = (t.float() if t.is_floating_point() else t for t in _inputs(5, B=1))
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    mask[:3] = False  # three padding rows
    out = banded(enc, q, k, v, positions, mask=mask)
    assert torch.isfinite(out).all() and not out[:, :, :3].any()


# ----------------------------------------------------------------------------- llama.cpp
def llama_cpp_group_attention(n_tokens: int, ga_n: int, ga_w: int) -> list[tuple[int, list[int]]]:
    """What llama.cpp's main example does with --grp-attn-n ga_n --grp-attn-w ga_w when it
    decodes one token at a time: before each decode, while the cache has a full block past
    ga_i, it shifts and divides the cached cells' positions (llama_kv_cache_seq_add /
    llama_kv_cache_seq_div, which re-rotate the cached keys); the new token takes position
    n_past. Returns, per token, (its query position, the positions of cells 0..i)."""
    cells: list[int] = []
    n_past, ga_i = 0, 0

    def seq_add(p0: int, p1: int, delta: int) -> None:
        for c, pos in enumerate(cells):
            if p0 <= pos < p1:
                cells[c] = pos + delta

    def seq_div(p0: int, p1: int, d: int) -> None:
        for c, pos in enumerate(cells):
            if p0 <= pos < p1:
                cells[c] = pos // d

    steps = []
    for _ in range(n_tokens):
        while n_past >= ga_i + ga_w:
            ib = (ga_n * ga_i) // ga_w
            bd = (ga_w // ga_n) * (ga_n - 1)
            dd = (ga_w // ga_n) - ib * bd - ga_w
            seq_add(ga_i, n_past, ib * bd)
            seq_div(ga_i + ib * bd, ga_i + ib * bd + ga_w, ga_n)
            seq_add(ga_i + ib * bd + ga_w, n_past + ib * bd, dd)
            n_past -= bd
            ga_i += ga_w // ga_n
        cells.append(n_past)
        steps.append((n_past, list(cells)))
        n_past += 1
    return steps


@pytest.mark.parametrize(("G", "W"), [(2, 4), (4, 8), (3, 6)])
def test_self_extend_llama_cpp_mode_matches_llama_cpp_group_attention(G, W):
    """Logits of every decoding step, with plain RoPE at the positions llama.cpp's cache holds,
    equal self-extend:mode=llama.cpp's; the paper's definition differs from both."""
    enc = build(f"self-extend:group={G},window={W},mode=llama.cpp", **SHAPE).double()
    paper = build(f"self-extend:group={G},window={W}", **SHAPE).double()
    q, k, v, positions = _inputs(6, B=1)
    steps = llama_cpp_group_attention(T, G, W)
    reference = []
    for i, (q_pos, cells) in enumerate(steps):
        remap = {j: float(q_pos - p) for j, p in enumerate(cells)}
        row = brute_force(
            enc,
            q[:, :, : i + 1],
            k[:, :, : i + 1],
            v[:, :, : i + 1],
            positions[:, : i + 1],
            lambda a, b, r=remap: r[b],
        )
        reference.append(row[:, :, -1])
    reference = torch.stack(reference, dim=2)  # (1, H, T, D)
    torch.testing.assert_close(banded(enc, q, k, v, positions), reference, **TOL)
    assert (banded(paper, q, k, v, positions) - reference).abs().max() > 1e-3


# ----------------------------------------------------------------------------- specs
@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("rerope:window=0", ["window=0 is not allowed", ">= 1"]),
        ("rerope:leaky=0.5", ["leaky=0.5 is not allowed", ">= 1"]),
        ("rerope:logn=true", ["original_length is required"]),
        ("rerope:logn=true,original_length=1", ["original_length is required", ">= 2, got 1"]),
        ("self-extend:group=0", ["group=0 is not allowed", ">= 1"]),
        ("self-extend:window=0", ["window=0 is not allowed", ">= 1"]),
        ("self-extend:mode=vllm", ["mode='vllm'", "paper", "llama.cpp"]),
        ("self-extend:group=3,window=8,mode=llama.cpp", ["multiple", "grp-attn"]),
        ("dca:scale=none", ["chunk_size is required", "the model's training length"]),
        (
            "dca",
            [
                "original_length is required for dca with scale=chunkllama",
                "it scales logits by ln(L / L0)",
                "or scale=none",
            ],
        ),
        ("dca:chunk_size=8,local_size=8,scale=none", ["local_size", "[0, chunk_size=8)"]),
        ("dca:chunk_size=0,local_size=0,scale=none", ["chunk_size=0 is not allowed", ">= 1"]),
        (
            "dca:original_length=16,scale=yarn",
            ["scale='yarn' is not allowed", "chunkllama, vllm, none"],
        ),
        ("string:shift_of=original", ["shift is required"]),
        ("string:shift_of=l0", ["shift_of='l0' is not allowed", "length, original"]),
        ("string:shift_ratio=1.5", ["shift_ratio=1.5 is not allowed", "(0, 1]"]),
        ("string:shift_ratio=0", ["shift_ratio=0.0 is not allowed", "(0, 1]"]),
        ("string:window=0", ["window=0 is not allowed", ">= 1"]),
        ("string:shift=0,window=1", ["shift=0 is not allowed", ">= 1"]),
        ("string:scale=yes", ["scale='yes' is not allowed", "authors, none"]),
        (
            "string:shift=4,window=5",
            ["window=5 is not allowed", "not exceed shift=4 (window = shift is the identity)"],
        ),
        ("dca:chunk_size=8,init=dynamic-ntk", ["init", "rope", "yarn"]),
        ("string:shift=8,original_length=16,init=yarn,factor=2,bogus=1", ["bogus", "shift"]),
    ],
)
def test_bad_remap_specs_name_the_problem(spec, words):
    """The message names the option with the value refused (``window=0 is not allowed``), not
    only the spec it quotes, and what is allowed."""
    with pytest.raises(ValueError) as info:
        build(spec, **SHAPE)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    "spec",
    [
        "rerope:window=512,leaky=16",
        "self-extend:group=16,window=2048,mode=llama.cpp",
        "dca:original_length=32768",
        "dca:original_length=32768,scale=vllm,local_size=2048",
        "dca:chunk_size=262144,local_size=8192,base=10000000,scale=none",  # Qwen2.5-1M's config
        "string:original_length=131072,init=yarn,factor=2",
        "string:original_length=131072,shift_of=original,scale=none",
        "string:shift=200,shift_ratio=0.5",
        # a given shift that happens to equal int(0.33 L0) = 5: not shift_of=original's default
        "string:original_length=16,shift=5,window=2",
    ],
)
def test_remap_specs_round_trip(spec):
    enc = build(spec, **SHAPE)
    assert build(enc.spec, **SHAPE).config == enc.config


def test_context_supplies_the_original_length_defaults_derive_from():
    """A patched model supplies L0; the defaults follow it and the spec then records L0, so
    the spec rebuilds the same encoding without the model."""
    dca = build("dca", **SHAPE, original_length=4096)
    assert (dca.config.chunk_size, dca.config.local_size) == (3072, 512)  # 3/4, 1/8 of L0
    assert dca.spec == "dca:original_length=4096,scale=chunkllama"
    string = build("string:shift_of=original", **SHAPE, original_length=131072)
    assert string.config.shift == 43253  # the authors' README: 131072 * 0.33
    assert build("string", **SHAPE, original_length=131072).config.shift_at(131072) == 43253
    yarn_based = build(
        "string:init=yarn,factor=2,window=8,shift_of=original", **SHAPE, original_length=64
    )
    assert yarn_based.config.shift == 21 and yarn_based.config.schedule.original_length == 64
    assert build(yarn_based.spec, **SHAPE).config == yarn_based.config
    assert (
        build("dca:chunk_size=100,local_size=10", **SHAPE, original_length=64).config.chunk_len
        == 90
    )


@pytest.mark.parametrize(
    ("rule", "length", "expected"),
    [
        # ChunkLlama's get_mscale: 0.05 ln(L / L0) + 1 beyond L0, 1 within; squared on logits
        ("chunkllama", 24, (0.05 * math.log(24 / 16) + 1) ** 2),  # 1 < L / L0 < 2
        ("chunkllama", 64, (0.05 * math.log(64 / 16) + 1) ** 2),
        ("chunkllama", 16, 1.0),
        ("chunkllama", 8, 1.0),
        ("chunkllama", 0, 1.0),  # a call over no keys
        # vLLM's dual-chunk backend: max(0.1 ln(L / L0) + 1, 1)
        ("vllm", 24, (0.1 * math.log(24 / 16) + 1) ** 2),
        ("vllm", 8, 1.0),
        ("vllm", 0, 1.0),  # no keys: the max is 1 for every L <= L0 (ln 0 = -inf)
        ("none", 64, 1.0),
        ("none", 8, 1.0),
    ],
)
def test_dca_logit_scale_follows_each_authors_rule(rule, length, expected):
    """The factor on DCA's logits for a call over L keys with L0 = 16, from each rule's
    formula (module docstring; the CASES above check it inside the attention at L = 45)."""
    assert dca_logit_scale(rule, length, 16) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("L0", [2, 3])
def test_rerope_log_n_scaling_takes_any_training_length_from_2(L0):
    """Su's log-n scaling multiplies queries by max(1, ln(i + 1) / ln L0), defined for every
    L0 >= 2 (ln L0 > 0): the smallest such L0 builds and scales each band's queries so."""
    enc = build(f"rerope:window=3,logn=true,original_length={L0}", **SHAPE)
    positions = torch.arange(T)[None]
    expected = [max(1.0, math.log(i + 1) / math.log(L0)) for i in range(T)]
    for band in enc.bands(positions, positions):
        torch.testing.assert_close(
            band.q_scale[0, 0, :, 0], torch.tensor(expected, dtype=torch.float64), **TOL
        )


@pytest.mark.parametrize("local_size", [2.5, True])
def test_dca_refuses_a_local_size_that_is_not_an_integer(local_size):
    """local_size counts tokens: a float or a bool given to the config directly is refused
    by name, not taken as a number of tokens."""
    with pytest.raises(ValueError, match=re.escape(f"local_size={local_size!r} is not an integer")):
        DCAConfig(chunk_size=8, local_size=local_size, scale="none")


def test_string_takes_a_shift_ratio_of_1():
    """shift_ratio lies in (0, 1]: S = int(1.0 x L) = L, every distance keeps its position."""
    enc = build("string:shift_ratio=1,window=2", **SHAPE)
    assert enc.config.shift_at(45) == 45


@pytest.mark.parametrize(
    "spec",
    [
        "rerope:window=4",
        "self-extend:group=2,window=4",
        "dca:original_length=16",
        "dca:original_length=16,scale=vllm",
        "dca:chunk_size=8,local_size=1,scale=none",
        "string:window=2",
        "string:shift=9,window=3",
    ],
)
def test_a_call_over_no_keys_gives_zeros(spec):
    """Queries that attend over no keys at all (L = 0: an empty cache) get zeros, as rows that
    see no key do, with every remap and scale (vLLM's max(0.1 ln(L / L0) + 1, 1) is 1 there)."""
    enc = build(spec, **SHAPE).double()
    q, _, _, _ = _inputs(B=1)
    empty = torch.zeros(1, SHAPE["n_kv_heads"], 0, SHAPE["head_dim"], dtype=torch.float64)
    q_pos, k_pos = torch.arange(T)[None], torch.zeros(1, 0, dtype=torch.long)
    out = banded_attention(q, empty, empty, enc.bands(q_pos, k_pos), k_pos, enc.rotate_band)
    assert torch.equal(out, torch.zeros_like(q))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ["dca:original_length=16", "string:window=2"])
def test_the_logit_scales_live_on_the_device_of_the_positions(spec):
    """DCA's and STRING's logit scale (each band's q_scale) is made on the positions' device:
    on CUDA the attention gives what it gives on the CPU."""
    q, k, v, positions = _inputs()
    results = []
    for device in ("cpu", "cuda"):
        enc = build(spec, **SHAPE).double().to(device)
        p = positions.to(device)
        out = banded_attention(
            q.to(device), k.to(device), v.to(device), enc.bands(p, p), p, enc.rotate_band,
            kernel="reference", causal_offset=0,
        )  # fmt: skip
        results.append(out.cpu())
    torch.testing.assert_close(results[1], results[0], **TOL)


@pytest.mark.parametrize(
    "spec", ["rerope:window=6", "self-extend:group=4,window=8,init=linear,factor=2", "dca"]
)
def test_rotate_q_and_rotate_k_rotate_at_the_true_positions(spec):
    """Outside ``bands``, a remap rotates queries and keys as its base schedule does at their
    own positions (the identity band): pair by pair, by the base schedule's frequencies."""
    enc = build(spec, **SHAPE, original_length=16).double()
    q, k, _, positions = _inputs()
    theta, factor = enc.inv_freq(0)
    phi = positions[:, None, :, None].double() * theta[0]  # (B, 1, T, F)
    cos, sin = phi.cos() * float(factor), phi.sin() * float(factor)
    for layer in range(SHAPE["n_layers"]):
        torch.testing.assert_close(
            enc.rotate_q(q, positions, layer), rotate_pairs(q, cos, sin, enc.pairing), **TOL
        )
        torch.testing.assert_close(
            enc.rotate_k(k, positions, layer), rotate_pairs(k, cos, sin, enc.pairing), **TOL
        )


def llama_cpp_distance(G: int, W: int):
    """self-extend:mode=llama.cpp's d'(i, j) in closed form (module docstring; the decoding
    test above holds it to llama.cpp's cache): keys of completed blocks of W at floor(j / G),
    the query's own block continuing from floor(i / W) * W / G."""

    def remap(i: int, j: int) -> float:
        block = i // W
        if j >= block * W:
            return float(i - j)
        return float(block * (W // G) + i % W - j // G)

    return remap


BIG = 1 << 25  # past 2^24: float32 no longer holds every integer position


@pytest.mark.parametrize(
    ("spec", "remap"),
    [
        ("rerope:window=6", rerope_distance(6, None)),
        ("rerope:window=6,leaky=4", rerope_distance(6, 4)),
        ("self-extend:group=3,window=7", self_extend_distance(3, 7)),
        ("self-extend:group=4,window=8,mode=llama.cpp", llama_cpp_distance(4, 8)),
        ("self-extend:group=2,window=6,mode=llama.cpp", llama_cpp_distance(2, 6)),
        ("dca:chunk_size=12,local_size=3,scale=none", dca_distance(12, 3)),
        ("string:shift=9,window=3,scale=none", string_distance(9, 3)),
    ],
)
def test_bands_give_every_pair_its_remapped_distance_exactly_at_large_positions(spec, remap):
    """Each causal pair is covered by exactly one band, and that band's query position minus
    key position is d'(i, j) of the definition, exactly, also at positions past 2^24 (the
    bands hold int64 or float64 positions, never float32)."""
    enc = build(spec, **SHAPE)
    positions = torch.arange(T)[None] + BIG
    covered = torch.zeros(T, T, dtype=torch.long)
    got = torch.zeros(T, T, dtype=torch.float64)
    for band in enc.bands(positions, positions):
        assert band.q_positions.dtype in (torch.int64, torch.float64), spec
        assert band.k_positions.dtype in (torch.int64, torch.float64), spec
        member = band_membership(band, positions, 0, T)
        member = torch.ones(T, T, dtype=torch.bool) if member is None else member[0, 0]
        dist = band.q_positions[0].double()[:, None] - band.k_positions[0].double()[None, :]
        covered += member.long()
        got = torch.where(member, dist, got)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert torch.equal(covered[causal], torch.ones(int(causal.sum()), dtype=torch.long))
    expected = torch.tensor(
        [[remap(BIG + i, BIG + j) if j <= i else 0.0 for j in range(T)] for i in range(T)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got[causal], expected[causal], rtol=0, atol=1e-6)


def test_an_original_length_other_than_the_schedules_is_refused_naming_both():
    """A remap over a schedule with its own L0 (yarn) takes that L0; a different one given
    beside it is refused, naming both values and the schedule."""
    yarn = YarnConfig(factor=2.0, original_length=64)
    assert ReRopeConfig(init="yarn", schedule=yarn).original_length == 64
    assert ReRopeConfig(init="yarn", original_length=64, schedule=yarn).original_length == 64
    message = "original_length=32 differs from the yarn schedule's original_length=64"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ReRopeConfig(init="yarn", original_length=32, schedule=yarn)


def test_original_length_is_an_integer_from_1():
    """L0 = 1 is allowed (the smallest training length); 0 and below are refused naming the
    option and the bound."""
    assert ReRopeConfig(original_length=1).original_length == 1
    for bad in (0, -4):
        message = f"original_length={bad} is not allowed; it must be a finite number >= 1"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            ReRopeConfig(original_length=bad)


@pytest.mark.parametrize("window", [True, 2.5, 0])
def test_a_window_that_is_not_a_whole_number_from_1_is_refused(window):
    """``window`` must be an int >= 1: a bool (an int to Python) and a fraction are refused
    as 0 is."""
    message = f"window={window!r} is not allowed; it must be an integer >= 1"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ReRopeConfig(window=window)


def test_a_schedules_original_length_is_spelled_once_among_the_schedules_options():
    """The spec is the remap's own options, then the base schedule's as that schedule spells
    them (its L0 among them, once): what rebuilds the same encoding."""
    enc = build("rerope:window=6,init=yarn,factor=2,original_length=64", **SHAPE)
    schedule_spec = spec_of(enc.config.schedule)
    assert schedule_spec == "yarn:factor=2,original_length=64"
    assert enc.spec == "rerope:init=yarn,window=6," + schedule_spec.partition(":")[2]


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_rotate_band_rotates_pair_by_pair_in_the_schedules_pairing(pairing):
    """A band's rotation at any positions (fractional ones too: leaky ReRoPE's) is the base
    schedule's rotation, pair by pair, in its pairing."""
    enc = build(f"rerope:window=6,leaky=4,pairing={pairing}", **SHAPE).double()
    q = _inputs()[0]
    positions = torch.arange(T, dtype=torch.float64)[None] / 4 + 1.5
    theta, factor = enc.inv_freq(0)
    phi = positions[:, None, :, None] * theta[0]
    cos, sin = phi.cos() * float(factor), phi.sin() * float(factor)
    got = enc.rotate_band(q, positions, query=True)
    torch.testing.assert_close(got, rotate_pairs(q, cos, sin, pairing), **TOL)


def test_bands_are_reused_for_the_same_positions_and_remade_for_other_queries():
    """One forward computes its bands once: the same query and key positions tensors give the
    very same bands again; other query positions (here the keys' own) give their own bands."""
    enc = build("rerope:window=6", **SHAPE)
    keys = torch.arange(T)[None] + 100
    queries = keys[:, -8:].clone()
    bands = enc.bands(queries, keys)
    assert enc.bands(queries, keys) is bands
    assert torch.equal(bands[0].q_positions, queries)
    again = enc.bands(keys, keys)
    assert again is not bands and torch.equal(again[0].q_positions, keys)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "rerope:init=yarn,factor=0,original_length=64",
            "factor=0.0 is not allowed; it must be a finite number >= 1 (rerope with init=yarn "
            "allows: init, original_length, window, leaky, logn, base, pairing, fraction, "
            "proportion, factor, "
            "beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate)",
        ),
        (
            "self-extend:init=linear,factor=abc",
            "factor='abc' is not a number (self-extend with init=linear allows: init, "
            "original_length, group, window, mode, base, pairing, fraction, proportion, factor)",
        ),
        ("rerope:window=abc", "window='abc' is not an integer"),
    ],
)
def test_a_bad_option_value_is_refused_naming_it_and_what_the_remap_allows(spec, message):
    """A schedule option the base schedule refuses is named with every option the remap with
    that init allows (each once: yarn's original_length is the remap's too); a remap option is
    named itself."""
    with pytest.raises(ValueError, match=f"^spec {re.escape(repr(spec))}: {re.escape(message)}$"):
        build(spec, **SHAPE)


@pytest.mark.parametrize(
    "spec", ["rerope:original_length=100", "rerope:init=yarn,factor=2,original_length=100"]
)
def test_an_original_length_in_the_spec_wins_over_the_models(spec):
    """The model's L0 (context) fills only an original_length the spec leaves out, for the
    remap and for a base schedule with its own (yarn)."""
    config = build(spec, **SHAPE, original_length=200).config
    assert config.original_length == 100
    assert build("rerope", **SHAPE, original_length=200).config.original_length == 200
    yarn = build("rerope:init=yarn,factor=2", **SHAPE, original_length=200).config
    assert yarn.original_length == yarn.schedule.original_length == 200
