"""The pure math of head analysis on constructed inputs with known answers.

Tolerances: E_beta is computed in float64 from float64 weights, so closed forms agree to ~1e-12
relative; attention logits are formed in float32 (as attention kernels do), so chunked and
reference attention agree to float32 noise (~1e-6).
"""

from __future__ import annotations

import math

import pytest
import torch

from ropekit.analysis.metrics import (
    coefficient_of_variation,
    effective_length,
    fit_effective_base,
    iter_log_attention,
    kv_head_index,
    log_effective_length,
    log_effective_lengths,
    pair_contributions,
    weighted_mean,
)
from ropekit.encodings import build, schedules

from .tiny import attention

BETAS = (0.25, 0.5, 1.0, 2.0, 3.0, math.inf)


# --------------------------------------------------------------------------- effective length
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_uniform_attention_over_n_keys_has_effective_length_n(beta: float, n: int) -> None:
    alpha = torch.full((n,), 1.0 / n, dtype=torch.float64)
    assert effective_length(alpha, beta).item() == pytest.approx(n, rel=1e-12)
    # Masked keys (weight 0) do not count: uniform over n of 3n keys is still n.
    padded = torch.cat([alpha, torch.zeros(2 * n, dtype=torch.float64)])
    assert effective_length(padded, beta).item() == pytest.approx(n, rel=1e-12)


@pytest.mark.parametrize("beta", BETAS)
def test_one_hot_attention_has_effective_length_one(beta: float) -> None:
    alpha = torch.zeros(4, 50, dtype=torch.float64)
    alpha[torch.arange(4), torch.tensor([0, 7, 31, 49])] = 1.0
    assert torch.allclose(effective_length(alpha, beta), torch.ones(4, dtype=torch.float64))


def test_effective_length_closed_forms() -> None:
    alpha = torch.distributions.Dirichlet(torch.ones(30, dtype=torch.float64)).sample((5,))
    # E_2 = 1 / sum alpha^2 (the importance-sampling effective sample size).
    assert torch.allclose(effective_length(alpha, 2.0), 1 / alpha.pow(2).sum(-1), rtol=1e-12)
    # E_1 = exp(Shannon entropy).
    entropy = -(alpha * alpha.log()).sum(-1)
    assert torch.allclose(effective_length(alpha, 1.0), entropy.exp(), rtol=1e-12)
    # E_inf = 1 / max alpha.
    assert torch.allclose(effective_length(alpha, math.inf), 1 / alpha.amax(-1), rtol=1e-12)
    # beta -> 1 approaches the entropy limit continuously.
    for beta in (1 - 1e-6, 1 + 1e-6):
        assert torch.allclose(effective_length(alpha, beta), entropy.exp(), rtol=1e-5)


def test_effective_length_does_not_increase_with_beta() -> None:
    g = torch.Generator().manual_seed(0)
    concentration = torch.rand(64, 40, generator=g, dtype=torch.float64) * 2 + 0.05
    alpha = torch.distributions.Dirichlet(concentration).sample()
    alpha[:8, 20:] = 0  # some rows with masked keys
    alpha = alpha / alpha.sum(-1, keepdim=True)
    betas = [0.1, 0.5, 0.9, 1.0, 1.1, 2.0, 4.0, 16.0, math.inf]
    values = torch.stack([effective_length(alpha, b) for b in betas])  # (n_b, 64)
    assert bool((values[1:] <= values[:-1] * (1 + 1e-12)).all())
    support = (alpha > 0).sum(-1).double()
    assert bool((values >= 1 - 1e-12).all()) and bool((values <= support * (1 + 1e-12)).all())
    # A non-uniform distribution is strictly monotone somewhere.
    assert bool((values[0] > values[-1] * 1.01).all())


def test_one_pass_orders_on_float32_log_weights_match_float64_closed_forms() -> None:
    # The capture path hands float32 log-weights with masked (-inf) keys; beta = 1, 2, inf take
    # one-pass forms, the others go through float64 logsumexp.
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g, dtype=torch.float64) * 3
    logits[:, 35:] = -math.inf
    log_alpha = logits.log_softmax(-1)
    alpha = log_alpha.exp()
    betas = (1.0, 2.0, math.inf, 0.5, 3.0)
    got = log_effective_lengths(log_alpha.float(), betas).exp()  # (n_b, 6)
    assert got.dtype == torch.float64 and got.shape == (5, 6)
    expected = [
        (-(alpha * log_alpha.nan_to_num(neginf=0.0)).sum(-1)).exp(),
        1 / alpha.pow(2).sum(-1),
        1 / alpha.amax(-1),
        alpha.pow(0.5).sum(-1).pow(2.0),
        alpha.pow(3.0).sum(-1).pow(-0.5),
    ]
    assert torch.allclose(got, torch.stack(expected), rtol=1e-5)  # float32 inputs


@pytest.mark.parametrize("beta", [0, -1.0, math.nan, "two"])
def test_bad_beta_is_refused_by_name(beta: object) -> None:
    with pytest.raises(ValueError, match="beta="):
        log_effective_length(torch.zeros(3), beta)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- chunked attention
def _reference_log_attention(q, k, bias=None):
    """Plain per-head loop: softmax(q k^T / sqrt(D) + bias) with the causal mask, float64."""
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    out = torch.empty(B, H, T, S, dtype=torch.float64)
    for h in range(H):
        logits = (q[:, h].double() @ k[:, h // (H // K)].double().transpose(-1, -2)) / D**0.5
        if bias is not None:
            logits = logits + bias[:, h].double()
        future = torch.ones(T, S, dtype=torch.bool).triu(diagonal=S - T + 1)
        out[:, h] = logits.masked_fill(future, -math.inf).log_softmax(-1)
    return out


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("past", [0, 5])
def test_chunked_causal_attention_matches_reference_with_gqa(chunk: int, past: int) -> None:
    g = torch.Generator().manual_seed(0)
    B, H, K, T, D = 2, 6, 2, 11, 8
    q = torch.randn(B, H, T, D, generator=g) * 2
    k = torch.randn(B, K, T + past, D, generator=g) * 2
    pieces = list(iter_log_attention(q, k, chunk=chunk))
    # Each chunk holds just the keys its queries can see: up to its last query's position.
    for start, log_alpha in pieces:
        stop = start + log_alpha.shape[2]
        assert log_alpha.dtype == torch.float32 and log_alpha.shape[-1] == past + stop
        assert bool(torch.isneginf(log_alpha[:, :, 0, past + start + 1 :]).all())  # the future
    got = attention(q, k, chunk=chunk)
    assert got.shape == (B, H, T, T + past)
    assert torch.allclose(got, _reference_log_attention(q, k).exp(), atol=1e-6)


def test_chunked_attention_adds_the_score_bias() -> None:
    alibi = build("alibi", n_heads=4, head_dim=8)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 9, 8, generator=g), torch.randn(1, 4, 9, 8, generator=g)
    pos = torch.arange(9)[None]
    got = attention(q, k, bias=lambda qp, kp: alibi.score_bias(qp, kp), chunk=4)
    expected = _reference_log_attention(q, k, alibi.score_bias(pos, pos))
    assert torch.allclose(got, expected.exp(), atol=1e-6)


def test_kv_head_index_maps_query_heads_to_their_group() -> None:
    assert kv_head_index(6, 2).tolist() == [0, 0, 0, 1, 1, 1]
    assert kv_head_index(4, 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="n_kv_heads=4"):
        kv_head_index(6, 4)


# --------------------------------------------------------------------------- pair contributions
@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_pair_contributions_sum_to_the_dot_product(pairing: str) -> None:
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    c = pair_contributions(q, k, 8, pairing)  # (5, 8)
    assert torch.allclose(c.sum(-1), (q * k).sum(-1), atol=1e-5)
    # Partial RoPE: the 4 rotated pairs plus the 8 pass-through channels make up q.k.
    c4 = pair_contributions(q, k, 4, pairing)
    rest = (q * k)[..., 8:].sum(-1)  # both pairings rotate channels 0..7
    assert torch.allclose(c4.sum(-1) + rest, (q * k).sum(-1), atol=1e-5)


@pytest.mark.parametrize(("pairing", "channels"), [("half", (2, 6)), ("interleaved", (4, 5))])
def test_pair_contributions_follow_the_pairing(pairing: str, channels: tuple[int, int]) -> None:
    q = torch.zeros(8)
    q[list(channels)] = torch.tensor([1.0, 2.0])
    c = pair_contributions(q, q, 4, pairing)
    assert c.tolist() == [0.0, 0.0, 5.0, 0.0]


def test_pair_contributions_refuse_bad_arguments() -> None:
    with pytest.raises(ValueError, match="pairing='zigzag'"):
        pair_contributions(torch.zeros(4), torch.zeros(4), 2, "zigzag")
    with pytest.raises(ValueError, match="n_pairs=3"):
        pair_contributions(torch.zeros(4), torch.zeros(4), 3)
    with pytest.raises(ValueError, match="share the head dim"):
        pair_contributions(torch.zeros(4), torch.zeros(6), 2)


def test_coefficient_of_variation_bounds() -> None:
    assert coefficient_of_variation(torch.ones(8)).item() == pytest.approx(0.0)
    one_pair = torch.zeros(8)
    one_pair[3] = 2.5
    assert coefficient_of_variation(one_pair).item() == pytest.approx(math.sqrt(7), rel=1e-12)
    u = torch.rand(100, 8, generator=torch.Generator().manual_seed(0))
    assert bool((coefficient_of_variation(u) <= math.sqrt(7)).all())


def test_weighted_mean() -> None:
    values = torch.tensor([1.0, 2.0, 4.0])
    assert weighted_mean(values, torch.tensor([0.0, 1.0, 0.0])).item() == 2.0
    assert weighted_mean(values, torch.ones(3)).item() == pytest.approx(7 / 3)


# --------------------------------------------------------------------------- effective base
@pytest.mark.parametrize("base", [10.0, 1e4, 5e5, 1e6])
@pytest.mark.parametrize("dim", [4, 16, 64, 128, 12])
def test_effective_base_of_plain_rope_is_its_base(base: float, dim: int) -> None:
    inv_freq, _ = schedules.rope(dim, base)
    theta, intercept, rms = fit_effective_base(inv_freq.log(), dim)
    assert theta.item() == pytest.approx(base, rel=1e-12)
    assert abs(intercept.item()) < 1e-12 and rms.item() < 1e-12


def test_effective_base_reads_a_shifted_and_scaled_schedule() -> None:
    # ln theta_f = -(2f/d) ln b + c for a batch of (b, c): recovered exactly, any leading shape.
    dim = 32
    x = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    bases = torch.tensor([[100.0, 1e4], [3e5, 7.0]], dtype=torch.float64)
    shifts = torch.tensor([[0.0, -1.5], [0.3, 2.0]], dtype=torch.float64)
    log_theta = -x * bases.log()[..., None] + shifts[..., None]  # (2, 2, F)
    theta, intercept, _ = fit_effective_base(log_theta, dim)
    assert torch.allclose(theta, bases, rtol=1e-12)
    assert torch.allclose(intercept, shifts, atol=1e-12)


def test_effective_base_needs_two_pairs() -> None:
    with pytest.raises(ValueError, match="needs >= 2"):
        fit_effective_base(torch.zeros(1), 2)
