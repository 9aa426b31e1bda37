"""Per-head statistics reduced layer by layer from captured rotated queries and keys.

Shape legend: B windows in a batch · L layers measured (``layers``, in that order) · H query
heads · K key/value heads · T queries = S keys (one window, no cache) · D head dim · F rotary
pairs · P sampled query-key pairs · R relative distances · n_b betas.

``HeadStatistics.update(layer, q, k)`` is the ``on_layer`` consumer of ``capture.capture_qk``:
it runs inside the forward, one layer at a time, and keeps only running sums, so neither every
layer's attention nor every layer's q and k is held at once. Per layer it accumulates

- effective length E_beta per query position (paper, Theorems 2-5; Figure 2 left, Figures 6-7 and
  12): causal softmax(q k^T / sqrt(D) + score_bias) in query chunks of at most
  ``chunk_elements`` logits, E_beta per query, summed over windows;
- frequency utilization (paper, Figure 2 right, Figures 3 left, 8, 9 bottom): the mean absolute
  contribution of each rotary pair to the logit, (q_f1 k_f1 + q_f2 k_f2) / sqrt(D), over P
  query-key pairs drawn uniformly from the causal pairs (j <= i) of each window;
- the per-pair contribution against relative distance (paper, Figure 1): the signed mean over
  every query i >= Delta of the contribution between query i and key i - Delta, Delta =
  0..R-1, computed for all distances at once as a cross-correlation by FFT.

``begin_batch`` draws the query-key pairs of a batch once, so every layer is measured on the
same pairs.

Holds: HeadStatistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .metrics import (
    BiasFn,
    fold_pairs,
    iter_log_attention,
    kv_head_index,
    log_effective_lengths,
    pair_contributions,
)
from .schedules import RotaryLayout


class HeadStatistics:
    """Running sums of the per-head statistics of one run length (module docstring)."""

    def __init__(
        self,
        *,
        layers: Sequence[int],
        n_heads: int,
        n_kv_heads: int,
        length: int,
        betas: Sequence[float],
        bias: Callable[[int], BiasFn | None] | None = None,
        layout: RotaryLayout | None = None,
        qk_pairs: int = 2048,
        max_distance: int = 128,
        chunk_elements: int = 2**22,
        seed: int = 0,
    ) -> None:
        # The model's layer indices whose q and k are reduced, row r of every sum holding
        # layers[r]: the layers the encoding rotates (``Backbone.encoded_layers``).
        self.layers = tuple(layers)
        self._row = {layer: row for row, layer in enumerate(self.layers)}
        n_layers = len(self.layers)
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.length, self.betas = length, tuple(float(b) for b in betas)
        self.bias = bias
        self.layout = layout  # None: effective length only (no rotary pairs to measure)
        self.qk_pairs, self.chunk_elements = qk_pairs, chunk_elements
        self.kv_index = kv_head_index(n_heads, n_kv_heads)  # (H,)
        self.generator = torch.Generator().manual_seed(seed)
        n_b = len(self.betas)
        # Sums over windows of E_beta at each query position: (L, n_b, H, T), windows per layer.
        self.e_sum = torch.zeros(n_layers, n_b, n_heads, length, dtype=torch.float64)
        self.e_windows = torch.zeros(n_layers, dtype=torch.long)
        self.distances = torch.arange(min(max_distance, length))  # (R,)
        F = layout.n_pairs if layout is not None else 0
        # Sums of |contribution| over sampled pairs: (L, H, F), pairs per layer.
        self.util_sum = torch.zeros(n_layers, n_heads, F, dtype=torch.float64)
        self.util_count = torch.zeros(n_layers, dtype=torch.long)
        R = len(self.distances)
        # Sums of signed contribution by distance: (L, H, F, R), and queries per distance (L, R).
        self.profile_sum = torch.zeros(n_layers, n_heads, F, R, dtype=torch.float64)
        self.profile_count = torch.zeros(n_layers, R, dtype=torch.long)
        self.seen: set[int] = set()  # layers captured in the current batch
        self._pairs: tuple[Tensor, Tensor] | None = None

    def begin_batch(self, batch: int) -> None:
        """Draw this batch's query-key pairs (B, P), the same for every layer."""
        self.seen = set()
        if self.layout is None:
            return
        T, g = self.length, self.generator
        # Uniform over the T (T + 1) / 2 causal pairs: query i with probability (i + 1) / sum,
        # then its key uniformly among 0..i.
        weights = torch.arange(1, T + 1, dtype=torch.float64)
        qi = torch.multinomial(weights, batch * self.qk_pairs, replacement=True, generator=g)
        kj = (torch.rand(qi.shape, generator=g, dtype=torch.float64) * (qi + 1)).long()
        kj = torch.minimum(kj, qi)
        self._pairs = (qi.view(batch, -1), kj.view(batch, -1))  # 2 x (B, P)

    def update(self, layer: int, q: Tensor, k: Tensor) -> None:
        """Reduce one layer's rotated q (B, H, T, D) and k (B, K, T, D) into the sums."""
        if layer not in self._row:
            raise ValueError(
                f"layer {layer} is not allowed: these statistics measure layers "
                f"{list(self.layers)} (those the encoding rotates)"
            )
        H, T = q.shape[1], q.shape[2]
        if (H, k.shape[1], T) != (self.n_heads, self.n_kv_heads, self.length) or k.shape[2] != T:
            raise ValueError(
                f"layer {layer}: q {tuple(q.shape)}, k {tuple(k.shape)} do not match "
                f"H={self.n_heads}, K={self.n_kv_heads}, T=S={self.length}"
            )
        self.seen.add(layer)
        row = self._row[layer]
        self._effective_length(row, layer, q, k)
        if self.layout is not None:
            kv = self.kv_index.to(k.device)  # (H,)
            kh = k.float()[:, kv]  # (B, H, S, D): the key head each query head reads
            self._utilization(row, q.float(), kh)
            self._profile(row, q.float(), kh)

    __call__ = update

    def _effective_length(self, row: int, layer: int, q: Tensor, k: Tensor) -> None:
        B, H = q.shape[:2]
        chunk = max(1, self.chunk_elements // (B * H * k.shape[2]))
        bias = self.bias(layer) if self.bias is not None else None
        for start, log_alpha in iter_log_attention(q, k, bias=bias, chunk=chunk):
            stop = start + log_alpha.shape[2]  # log_alpha (B, H, Tc, S_c)
            e = log_effective_lengths(log_alpha, self.betas).exp()  # (n_b, B, H, Tc)
            self.e_sum[row, :, :, start:stop] += e.sum(1).cpu()
        self.e_windows[row] += B

    def _scale(self, q: Tensor) -> float:
        return q.shape[-1] ** -0.5  # contributions in logit units: q.k / sqrt(D)

    def _utilization(self, row: int, q: Tensor, kh: Tensor) -> None:
        assert self._pairs is not None and self.layout is not None, "call begin_batch first"
        B, H, _, D = q.shape
        qi, kj = (t.to(q.device) for t in self._pairs)  # (B, P)
        qs = q.gather(2, qi[:, None, :, None].expand(B, H, -1, D))  # (B, H, P, D)
        ks = kh.gather(2, kj[:, None, :, None].expand(B, H, -1, D))  # (B, H, P, D)
        c = pair_contributions(qs, ks, self.layout.n_pairs, self.layout.pairing)  # (B, H, P, F)
        self.util_sum[row] += (c.abs() * self._scale(q)).double().sum((0, 2)).cpu()
        self.util_count[row] += B * qi.shape[1]

    def _profile(self, row: int, q: Tensor, kh: Tensor) -> None:
        assert self.layout is not None
        B, _, T, _ = q.shape
        R = len(self.distances)
        # corr[r] = sum_u q[u + r] * k[u], query i = u + r against its key i - r, for every
        # distance at once: a cross-correlation along time, by FFT in float64. Zero-padding to
        # 2T keeps the circular correlation from wrapping (u + r < 2T).
        fq = torch.fft.rfft(q.double(), n=2 * T, dim=2)  # (B, H, T + 1, D)
        fk = torch.fft.rfft(kh.double(), n=2 * T, dim=2)
        corr = torch.fft.irfft(fq * fk.conj(), n=2 * T, dim=2)[:, :, :R]  # (B, H, R, D)
        # The pair sum is linear, so fold channels into pairs after summing over windows.
        c = fold_pairs(corr.sum(0), self.layout.n_pairs, self.layout.pairing)  # (H, R, F)
        self.profile_sum[row] += c.transpose(1, 2).cpu() * self._scale(q)
        self.profile_count[row] += B * (T - self.distances)  # (R,): queries i >= r

    def _check_complete(self, counts: Tensor, what: str) -> None:
        missing = [layer for layer, n in zip(self.layers, counts.tolist(), strict=True) if n == 0]
        if missing:
            raise RuntimeError(f"no {what} was captured for layers {missing}")

    def effective_length_by_position(self) -> Tensor:
        """Mean E_beta over windows: (L, n_b, H, T), query position on the last dim."""
        self._check_complete(self.e_windows, "attention")
        return self.e_sum / self.e_windows[:, None, None, None]

    def utilization(self) -> Tensor:
        """Mean |contribution| per pair: (L, H, F)."""
        self._check_complete(self.util_count, "query-key pair")
        return self.util_sum / self.util_count[:, None, None]

    def distance_profile(self) -> Tensor:
        """Signed mean contribution per pair and distance: (L, H, F, R)."""
        self._check_complete(self.profile_count[:, 0], "profile")
        return self.profile_sum / self.profile_count[:, None, None, :]
