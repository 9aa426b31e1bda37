"""The math of head analysis as pure functions: effective attention length, causal attention in
query chunks, per-pair logit contributions and their summaries, the effective RoPE base.

Shape legend: B batch · H query heads · K key/value heads · g = H/K query heads per key head ·
T queries · S keys · Tc queries in one chunk · D head dim · F rotary pairs · P sampled
query-key pairs.

Effective length (AdaRoPE paper, Theorems 2-5; Huggins & Roy 2019; Renyi 1961): for one query's
attention weights alpha over the keys,
    E_beta(alpha) = (sum_i alpha_i^beta)^(1/(1 - beta)),   beta > 0,
the exponential of the Renyi entropy of order beta. beta -> 1 gives exp(H) with H the Shannon
entropy, beta -> inf gives 1/max_i alpha_i. Uniform attention over n keys gives n for every
beta, one-hot attention gives 1, and E_beta does not increase with beta. It is computed from
log-weights (log E = logsumexp(beta log alpha) / (1 - beta)), so masked keys (log alpha = -inf)
and very peaked heads stay exact.

Rotary pair contributions (paper, Figure 1 and Figure 9 bottom): after rotation the logit is
q.k / sqrt(D) = sum_f (q_f1 k_f1 + q_f2 k_f2) / sqrt(D) + (non-rotary channels), so each pair f
contributes its own term. ``half`` pairs channel f with f + F, ``interleaved`` 2f with 2f + 1.

Effective base (paper, Figure 3 middle): fit log theta_f = -(2f/d) ln Theta + c by least squares
over the pairs; plain RoPE with base b gives Theta = b and c = 0 exactly.

Holds: PAIRINGS, BiasFn, check_beta, log_effective_lengths, log_effective_length,
effective_length, kv_head_index, iter_log_attention, fold_pairs, pair_contributions,
coefficient_of_variation, weighted_mean, fit_effective_base.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

PAIRINGS = ("half", "interleaved")  # as ropekit.encodings.rotary

# Called as bias(q_pos (1, Tc), k_pos (1, S)) -> additive logit bias (1|B, H, Tc, S) or None.
BiasFn = Callable[[Tensor, Tensor], Tensor | None]


def check_beta(beta: float) -> float:
    """beta as a float, or ValueError naming the value and what is allowed."""
    try:
        value = float(beta)
    except (TypeError, ValueError):
        value = math.nan
    if not value > 0:  # also rejects NaN
        raise ValueError(
            f"beta={beta!r} is not allowed; it must be a number > 0 (1 = the entropy limit "
            "exp(H), inf = 1/max alpha)"
        )
    return value


def log_effective_lengths(log_alpha: Tensor, betas: Sequence[float]) -> Tensor:
    """ln E_beta for several betas at once: log_alpha (..., S) -> (n_b, ...) float64.

    ``log_alpha`` are log attention weights (each row sums to 1 after exp), -inf where a key
    is masked. The common orders take one pass in log_alpha's dtype: beta = 1 is the Shannon
    entropy (entr(0) = 0 for masked keys), beta = 2 is -ln sum alpha^2, beta = inf is
    -max ln alpha. Other orders use logsumexp(beta ln alpha) / (1 - beta) in float64, since
    1/(1 - beta) magnifies rounding for beta near 1.
    """
    values, alpha = [], None
    for beta in (check_beta(b) for b in betas):
        if beta in (1.0, 2.0) and alpha is None:
            alpha = log_alpha.exp()
        if beta == 1.0:
            value = torch.special.entr(alpha).sum(-1)
        elif beta == 2.0:
            value = -torch.linalg.vecdot(alpha, alpha).log()
        elif math.isinf(beta):
            value = -log_alpha.amax(-1)
        else:
            value = torch.logsumexp(beta * log_alpha.double(), dim=-1) / (1.0 - beta)
        values.append(value.double())
    return torch.stack(values)


def log_effective_length(log_alpha: Tensor, beta: float) -> Tensor:
    """ln E_beta of the distributions along the last dim of log_alpha (..., S) -> (...)."""
    return log_effective_lengths(log_alpha, (beta,))[0]


def effective_length(alpha: Tensor, beta: float = 2.0) -> Tensor:
    """E_beta(alpha) = (sum_i alpha_i^beta)^(1/(1-beta)) along the last dim: (..., S) -> (...).

    alpha are attention weights (non-negative, summing to 1 along the last dim); computed in
    float64.
    """
    if alpha.dim() == 0 or alpha.shape[-1] == 0:
        raise ValueError(f"alpha {tuple(alpha.shape)} must have at least one key on its last dim")
    if bool((alpha < 0).any()):
        raise ValueError("alpha holds negative weights; attention weights must be >= 0")
    return log_effective_length(alpha.double().log(), beta).exp()


def kv_head_index(n_heads: int, n_kv_heads: int) -> Tensor:
    """The key/value head each query head reads: h // (H / K), as grouped-query attention."""
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(
            f"n_kv_heads={n_kv_heads} is not allowed; it must divide n_heads={n_heads}"
        )
    return torch.arange(n_heads) // (n_heads // n_kv_heads)  # (H,)


def iter_log_attention(
    q: Tensor,
    k: Tensor,
    *,
    bias: BiasFn | None = None,
    scale: float | None = None,
    chunk: int = 256,
) -> Iterator[tuple[int, Tensor]]:
    """Causal attention log-weights, ``chunk`` queries at a time.

    q (B, H, T, D) rotated queries, k (B, K, S, D) rotated keys, S >= T: query i sits at key
    index S - T + i and sees keys 0..S - T + i. Query head h reads key head h // (H/K).
    Logits are ``q k^T * scale (+ bias)`` with scale 1/sqrt(D) by default, in float32 as
    attention kernels form them. Yields (first query index t0, log alpha (B, H, Tc, S_c)
    float32) where S_c = S - T + t0 + Tc: the keys that some query of the chunk can see (keys
    past them are masked for the whole chunk, so they are not formed). Only one chunk is alive
    at a time.
    """
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D or S < T or H % K:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must be (B, H, T, D) and (B, K, S, D) "
            "with S >= T and K dividing H"
        )
    if chunk < 1:
        raise ValueError(f"chunk={chunk} is not allowed; it must be >= 1")
    scale = D**-0.5 if scale is None else scale
    keys = k.float()[:, :, None]  # (B, K, 1, S, D)
    grouped = q.float().unflatten(1, (K, H // K))  # (B, K, g, T, D): the heads of one key head
    past = S - T
    k_pos = torch.arange(S, device=q.device)
    for start in range(0, T, chunk):
        stop = min(start + chunk, T)
        visible = past + stop  # S_c
        logits = grouped[:, :, :, start:stop] @ keys[:, :, :, :visible].transpose(-1, -2)
        logits = logits.flatten(1, 2) * scale  # (B, H, Tc, S_c)
        q_pos = torch.arange(past + start, visible, device=q.device)
        if bias is not None:
            extra = bias(q_pos[None], k_pos[None, :visible])
            if extra is not None:
                logits = logits + extra.float()  # (B|1, H, Tc, S_c)
        hidden = k_pos[None, :visible] > q_pos[:, None]  # (Tc, S_c): the future
        yield start, torch.log_softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)


def fold_pairs(x: Tensor, n_pairs: int, pairing: str = "half") -> Tensor:
    """Sum the two channels of each rotary pair: x (..., D) -> (..., F).

    ``half`` pairs channel f with f + F, ``interleaved`` 2f with 2f + 1; channels past the
    first 2F (partial RoPE) are not pairs and are left out.
    """
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing={pairing!r} is not allowed; use one of {', '.join(PAIRINGS)}")
    if n_pairs < 1 or 2 * n_pairs > x.shape[-1]:
        raise ValueError(
            f"n_pairs={n_pairs} is not allowed for head dim {x.shape[-1]}; it must be >= 1 with "
            "2 * n_pairs <= head dim"
        )
    if pairing == "half":
        return x[..., :n_pairs] + x[..., n_pairs : 2 * n_pairs]
    return x[..., 0 : 2 * n_pairs : 2] + x[..., 1 : 2 * n_pairs : 2]


def pair_contributions(q: Tensor, k: Tensor, n_pairs: int, pairing: str = "half") -> Tensor:
    """Each rotary pair's term of q.k: q_f1 k_f1 + q_f2 k_f2, (..., D) x (..., D) -> (..., F).

    q and k are rotated vectors (broadcastable, sharing the head dim D).
    """
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share the head dim")
    return fold_pairs(q * k, n_pairs, pairing)


def coefficient_of_variation(values: Tensor) -> Tensor:
    """std / mean along the last dim (population std), (..., F) -> (...).

    For non-negative values it lies in [0, sqrt(F - 1)]: 0 for equal values, sqrt(F - 1) when
    a single entry is non-zero (paper, Figure 3 left). NaN when the mean is 0.
    """
    values = values.double()
    return values.std(-1, correction=0) / values.mean(-1)


def weighted_mean(values: Tensor, weights: Tensor) -> Tensor:
    """sum_f w_f v_f / sum_f w_f along the last dim (broadcasting), -> (...)."""
    weights = weights.double()
    return (weights * values.double()).sum(-1) / weights.sum(-1)


def fit_effective_base(
    log_theta: Tensor, rotary_dim: int, exponents: Sequence[float] | Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Least-squares fit of log theta_f = -(2f/d) ln Theta + c along the last dim (..., F).

    d is the number of rotated channels (``rotary_dim``); x_f = 2f/d as ``schedules.rope``
    forms it unless ``exponents`` are given. Returns (Theta, c, rms of the residuals), each
    (...), float64.
    """
    log_theta = log_theta.double()
    n = log_theta.shape[-1]
    if n < 2:
        raise ValueError(
            f"log_theta {tuple(log_theta.shape)} has {n} pair(s); fitting a base needs >= 2"
        )
    if exponents is None:
        if rotary_dim < 2 * n - 1:
            raise ValueError(f"rotary_dim={rotary_dim} is too small for {n} rotary pairs")
        x = torch.arange(0, 2 * n, 2, dtype=torch.float64) / rotary_dim
    else:
        x = torch.as_tensor(exponents, dtype=torch.float64)
    x = x.to(log_theta.device)
    xc = x - x.mean()
    slope = (xc * (log_theta - log_theta.mean(-1, keepdim=True))).sum(-1) / (xc * xc).sum()
    intercept = log_theta.mean(-1) - slope * x.mean()
    residual = log_theta - (slope[..., None] * x + intercept[..., None])
    rms = residual.pow(2).mean(-1).sqrt()
    return torch.exp(-slope), intercept, rms
