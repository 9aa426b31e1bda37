"""HeadStatistics on constructed queries and keys whose answers are known in closed form."""

from __future__ import annotations

import math

import pytest
import torch

from ropekit.analysis.heads import HeadStatistics
from ropekit.analysis.metrics import pair_contributions
from ropekit.analysis.schedules import RotaryLayout
from ropekit.encodings import build


def _stats(length: int, *, heads: int = 4, kv: int = 2, layout=None, **kwargs) -> HeadStatistics:
    return HeadStatistics(
        layers=(0,),
        n_heads=heads,
        n_kv_heads=kv,
        length=length,
        betas=(1.0, 2.0, math.inf),
        layout=layout,
        **kwargs,
    )


def test_zero_queries_attend_uniformly_so_query_i_sees_i_plus_1_keys() -> None:
    T = 20
    stats = _stats(T, chunk_elements=50)  # a few queries per chunk
    stats.begin_batch(2)
    k = torch.randn(2, 2, T, 8, generator=torch.Generator().manual_seed(0))
    stats.update(0, torch.zeros(2, 4, T, 8), k)
    e = stats.effective_length_by_position()  # (1, n_b, H, T)
    expected = torch.arange(1, T + 1, dtype=torch.float64).expand_as(e)
    assert torch.allclose(e, expected, rtol=1e-6)  # float32 attention weights


def test_a_sharp_head_has_effective_length_near_one() -> None:
    # Every query matches only the key at its own position, with a large margin.
    T, D = 16, 16
    basis = torch.eye(D)[:T] * 40.0  # (T, D) orthogonal keys
    q = basis[None, None].expand(1, 2, T, D)
    k = basis[None, None].expand(1, 1, T, D)
    stats = _stats(T, heads=2, kv=1)
    stats.begin_batch(1)
    stats.update(0, q, k)
    e = stats.effective_length_by_position()
    assert torch.allclose(e, torch.ones_like(e), atol=1e-6)


def _one_pair(pairing: str, pair: int, n_pairs: int, T: int, seed: int = 0) -> torch.Tensor:
    """(1, 2, T, 2F): random values in the two channels of one pair, zeros elsewhere."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(1, 2, T, 2 * n_pairs)
    channels = (pair, pair + n_pairs) if pairing == "half" else (2 * pair, 2 * pair + 1)
    x[..., list(channels)] = torch.randn(1, 2, T, 2, generator=g) + 1.0
    return x


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_utilization_of_a_single_pair_is_concentrated_there(pairing: str) -> None:
    F, T, pair = 8, 32, 5
    layout = RotaryLayout(rotary_dim=2 * F, n_pairs=F, pairing=pairing)
    stats = _stats(T, heads=2, kv=2, layout=layout, qk_pairs=300)
    stats.begin_batch(1)
    stats.update(0, _one_pair(pairing, pair, F, T, 0), _one_pair(pairing, pair, F, T, 1))
    u = stats.utilization()[0]  # (H, F)
    assert bool((u[:, pair] > 0).all())
    assert torch.count_nonzero(u[:, [f for f in range(F) if f != pair]]) == 0
    cov = u.std(-1, correction=0) / u.mean(-1)
    assert torch.allclose(cov, torch.full_like(cov, math.sqrt(F - 1)))  # the largest possible

    # Read with the other pairing, the same channels belong to two different pairs.
    other = "interleaved" if pairing == "half" else "half"
    wrong = _stats(T, heads=2, kv=2, layout=RotaryLayout(2 * F, F, other), qk_pairs=300)
    wrong.begin_batch(1)
    wrong.update(0, _one_pair(pairing, pair, F, T, 0), _one_pair(pairing, pair, F, T, 1))
    assert bool(((wrong.utilization()[0] > 0).sum(-1) == 2).all())


def test_sampled_query_key_pairs_are_causal_and_cover_the_window() -> None:
    T = 12
    stats = _stats(T, layout=RotaryLayout(8, 4, "half"), qk_pairs=4000)
    stats.begin_batch(3)
    qi, kj = stats._pairs
    assert qi.shape == (3, 4000) and bool((kj <= qi).all()) and bool((kj >= 0).all())
    seen = {(int(i), int(j)) for i, j in zip(qi.flatten(), kj.flatten(), strict=True)}
    assert len(seen) == T * (T + 1) // 2  # every causal pair is drawn
    # Uniform over causal pairs: query i is drawn with probability (i + 1) / (T (T + 1) / 2).
    share_last = float((qi == T - 1).double().mean())
    assert share_last == pytest.approx(T / (T * (T + 1) / 2), abs=0.02)


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_distance_profile_of_rotated_unit_vectors_is_cos_of_distance_times_theta(
    pairing: str,
) -> None:
    # q_i = R(i theta) e1 and k_j = R(j theta) e1 in every pair, so pair f contributes
    # cos((i - j) theta_f): the profile (Figure 1) depends on the distance only.
    D, T, R = 8, 40, 10
    rope = build(f"rope:base=100,pairing={pairing}", n_heads=1, head_dim=D)
    e1 = torch.zeros(1, 1, T, D)
    first = list(range(D // 2)) if pairing == "half" else list(range(0, D, 2))
    e1[..., first] = 1.0
    q, k = rope.rotate_q(e1.clone()), rope.rotate_k(e1.clone())
    layout = RotaryLayout(D, D // 2, pairing)
    stats = _stats(T, heads=1, kv=1, layout=layout, max_distance=R)
    stats.begin_batch(1)
    stats.update(0, q, k)
    profile = stats.distance_profile()[0, 0]  # (F, R)
    theta = rope.frequencies(None)[0]  # (F,)
    expected = torch.cos(torch.arange(R)[None] * theta[:, None]) / math.sqrt(D)
    assert torch.allclose(profile, expected, atol=1e-6)


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_fft_distance_profile_matches_a_direct_loop_over_queries(pairing: str) -> None:
    g = torch.Generator().manual_seed(4)
    B, H, K, T, D, R = 2, 4, 2, 30, 8, 12
    q, k = torch.randn(B, H, T, D, generator=g), torch.randn(B, K, T, D, generator=g)
    stats = _stats(T, heads=H, kv=K, layout=RotaryLayout(D, D // 2, pairing), max_distance=R)
    stats.begin_batch(B)
    stats.update(0, q, k)
    kh = k.repeat_interleave(H // K, dim=1)  # query head h reads key head h // 2
    expected = torch.stack(
        [
            pair_contributions(q[:, :, r:], kh[:, :, : T - r], D // 2, pairing).mean((0, 2))
            for r in range(R)
        ],
        dim=-1,
    ) / math.sqrt(D)  # (H, F, R): mean over every query i >= r and both windows
    assert torch.allclose(stats.distance_profile()[0].float(), expected, atol=1e-5)


def test_update_refuses_mismatched_shapes_and_reports_missing_layers() -> None:
    stats = HeadStatistics(layers=(0, 1), n_heads=4, n_kv_heads=2, length=8, betas=(2.0,))
    stats.begin_batch(1)
    with pytest.raises(ValueError, match="do not match"):
        stats.update(0, torch.zeros(1, 4, 9, 8), torch.zeros(1, 2, 9, 8))
    stats.update(0, torch.zeros(1, 4, 8, 8), torch.zeros(1, 2, 8, 8))
    with pytest.raises(RuntimeError, match=r"layers \[1\]"):
        stats.effective_length_by_position()
