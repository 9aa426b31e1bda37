"""The llama.cpp Self-Extend recipe's bookkeeping (ropekit.serve.llamacpp_self_extend), checked
without llama.cpp: its memory calls and batch positions are played on a model of llama.cpp's
KV cells (src/llama-kv-cells.h in llama-cpp-python 0.3.36's tree: pos_add and pos_div, and the
K-shift that rotates each cached key by its recorded shift), and every query-key pair must then
see the distance ropekit's ``self-extend:mode=llama.cpp`` bands give it. The same model with
llama.cpp's own seq_div shows where those keys end up instead. The real engine is held to the
patched model in tests/serve/engines/test_engines.py (``make test-serving``)."""

from __future__ import annotations

import random

import pytest
import torch

from ropekit.encodings import build
from ropekit.serve.llamacpp_self_extend import block_position, decode_steps, group_calls


class Cells:
    """One sequence's KV cells as llama.cpp 0.3.36 keeps them: each cell's position (what the
    causal mask and seq_pos_max read) and the position its key is rotated at (what the logits
    see: the position at decode plus every shift the K-shift applied since)."""

    def __init__(self) -> None:
        self.pos: list[int] = []
        self.rot: list[int] = []

    def add(self, p0: int, p1: int, d: int) -> None:  # pos_add: pos += d, shift += d
        for c, p in enumerate(self.pos):
            if p0 <= p < p1:
                self.pos[c], self.rot[c] = p + d, self.rot[c] + d

    def div(self, p0: int, p1: int, d: int) -> None:  # pos_div: shift += p_old - pos (sic)
        for c, p in enumerate(self.pos):
            if p0 <= p < p1:
                self.pos[c], self.rot[c] = p // d, self.rot[c] + (p - p // d)

    def apply(self, calls) -> None:
        for kind, p0, p1, value in calls:
            (self.add if kind == "add" else self.div)(p0, p1, value)

    def decode(self, positions: list[int]) -> None:
        # llama_batch_allocr: a sequence's batch must start at seq_pos_max + 1.
        assert not self.pos or positions[0] == max(self.pos) + 1, (positions[0], max(self.pos))
        self.pos += positions
        self.rot += positions


def band_distance(G: int, W: int, T: int) -> torch.Tensor:
    """(T, T) int64: the distance query i sees to key j <= i under ropekit's
    self-extend:mode=llama.cpp (its bands' rotation positions; -1 above the diagonal)."""
    enc = build(f"self-extend:group={G},window={W},mode=llama.cpp", head_dim=8, n_heads=1)
    pos = torch.arange(T)[None]
    out = torch.full((T, T), -1, dtype=torch.int64)
    j = torch.arange(T)
    for band in enc.bands(pos, pos):
        lo = torch.zeros(T, dtype=torch.int64) if band.lo is None else band.lo[0]
        hi = torch.full((T,), T, dtype=torch.int64) if band.hi is None else band.hi[0]
        covers = (j[None] >= lo[:, None]) & (j[None] < hi[:, None]) & (j[None] <= j[:, None])
        d = band.q_positions[0][:, None] - band.k_positions[0][None, :]
        out[covers] = d.long()[covers]
    return out


def play(G: int, W: int, T: int, chunks: list[int], n_batch: int, seq_div: bool):
    """Feed T tokens in ``chunks`` through the recipe's steps on Cells; per query, its position
    and the rotation positions of keys 0..i when it was decoded."""
    cells, seen, fed = Cells(), {}, 0
    for size in chunks:
        for calls, positions in decode_steps(fed, size, n_batch, G, W, seq_div):
            cells.apply(calls)
            cells.decode(positions)
            n = len(cells.pos)
            for k, q in enumerate(positions):  # query at true position i sees keys 0..i
                i = n - len(positions) + k
                assert max(cells.pos[: i + 1]) <= q  # the causal mask by position hides none
                seen[i] = (q, list(cells.rot[: i + 1]))
        fed += size
    assert sorted(seen) == list(range(T))
    return seen


def _chunks(T: int, rng: random.Random) -> list[int]:
    out = []
    while sum(out) < T:
        out.append(min(rng.choice([1, 3, 7, 16, 50]), T - sum(out)))
    return out


@pytest.mark.parametrize(("G", "W", "T", "n_batch"), [(2, 4, 23, 3), (4, 8, 40, 8), (4, 16, 70, 5)])
def test_recipe_gives_every_pair_the_self_extend_distance(G, W, T, n_batch) -> None:
    """Prompt and generated tokens alike (random chunk sizes, batches smaller than W): every
    query-key pair sees exactly the distance ropekit's mode=llama.cpp defines."""
    ref = band_distance(G, W, T)
    for seed in range(3):
        seen = play(G, W, T, _chunks(T, random.Random(seed)), n_batch, seq_div=False)
        for i, (q, rot) in seen.items():
            assert q == block_position(i, G, W)
            assert [q - r for r in rot] == ref[i, : i + 1].tolist(), (seed, i)


def test_seq_div_rotates_divided_keys_at_twice_the_old_minus_the_new_position() -> None:
    """llama.cpp's own calls (seq_add back, seq_div by G) leave each grouped key's cell at
    floor(j / G), as Self-Extend wants, but pos_div records the K-shift as p_old - p_new, so
    the key is rotated at 2 p_old - p_new: every query past the first block sees its grouped
    keys at the wrong distances (the first block's queries see none)."""
    G, W, T = 4, 8, 40
    exact = play(G, W, T, [T], W, seq_div=False)
    div = play(G, W, T, [T], W, seq_div=True)
    for i in range(W):
        assert div[i] == exact[i]
    i = T - 1
    q, rot = div[i]
    assert q == exact[i][0]
    # Key 0 is never moved; key j of block 0 was at j, divided to j // G: rotated at 2 j - j // G.
    for j in range(1, W):
        assert rot[j] == 2 * j - j // G != exact[i][1][j]


def test_group_calls_move_one_cell_per_call_and_skip_what_stays() -> None:
    assert group_calls(0, 1, 8) == []  # G = 1: plain RoPE, nothing moves
    calls = group_calls(2, 4, 8)  # block 2: cached at 4 + m, grouped to 4 + m // 4
    assert calls[0] == ("add", 5, 6, -1) and len(calls) == 7
    assert group_calls(2, 4, 8, seq_div=True) == [("add", 4, 12, 12), ("div", 16, 24, 4)]
    with pytest.raises(ValueError, match="multiple"):
        group_calls(0, 3, 8)
