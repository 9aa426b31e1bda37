"""What an encoding's frequency schedule looks like per layer and head, and what training moved.

Shape legend: L layers · K key/value heads · H query heads · F rotary pairs. A learned
parameter may have one row for all layers or heads (AdaRoPE ``share_layers`` /
``share_heads``); such rows are written as 1 here and broadcast where a full table is asked for.

- Frequencies live per key/value head (AdaFreq, paper sec. 3.2): ``head_log_frequencies``
  gives ln theta (K, F) of one layer for any rotary encoding (fixed schedules repeat one row).
- Effective base (paper, Figure 3 middle): ``effective_bases`` fits
  ln theta_f = -(2f/d) ln Theta + c per layer and key head. The per-layer base is the pooled fit
  over the layer's heads, which equals the geometric mean of the heads' bases (every head
  shares the abscissae 2f/d, so the pooled slope is the mean slope).
- Learned minus initial (paper, Figure 4 right; Figures 6, 11): ``learned_schedule`` reports
  AdaRoPE's dxi = xi - xi_init (L|1, K|1, F), gamma and tau = exp(log_tau) (L|1, H|1), or
  tuned-yarn's four knobs and its change in ln theta (F,).

Holds: RotaryLayout, rotary_layout, head_log_frequencies, effective_bases, learned_schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ropekit.encodings import PositionEncoding

from .metrics import fit_effective_base


@dataclasses.dataclass(frozen=True)
class RotaryLayout:
    """How an encoding rotates: rotated channels, pairs and pairing."""

    rotary_dim: int  # d: channels that rotate (head_dim * fraction)
    n_pairs: int  # F
    pairing: str  # "half" or "interleaved"


def rotary_layout(encoding: PositionEncoding) -> RotaryLayout | None:
    """The layout of a rotary encoding; None for encodings that do not rotate (NoPE, ALiBi,
    absolute)."""
    if encoding.rotary_dim == 0 or encoding.pairing is None:
        return None
    return RotaryLayout(encoding.rotary_dim, encoding.n_pairs, encoding.pairing)


def head_log_frequencies(
    encoding: PositionEncoding, layer: int, length: int | None = None
) -> Tensor | None:
    """ln theta (K, F) float64 of one layer, one row per key/value head; None when the
    encoding does not rotate. ``length`` is the sequence length a dynamic schedule follows."""
    if encoding.rotary_dim == 0:
        return None
    with torch.no_grad():
        log_theta = encoding.inv_freq(layer, length)[0].double().log()  # (K|1, F)
    return log_theta.cpu().expand(encoding.n_kv_heads, -1)  # (K, F)


def effective_bases(
    encoding: PositionEncoding, length: int | None = None, layers: Sequence[int] | None = None
) -> dict[str, Any] | None:
    """Effective RoPE base per layer and key head (module docstring) of ``layers`` (None: every
    layer of the encoding); None for encodings that do not rotate. Values: ``per_head`` (L, K),
    ``per_layer`` (L,), ``intercept`` (L, K), ``fit_rms`` (L, K) residual of the fit in
    ln theta units."""
    layout = rotary_layout(encoding)
    if layout is None or layout.n_pairs < 2:
        return None
    layers = range(encoding.n_layers) if layers is None else layers
    log_theta = torch.stack(
        [head_log_frequencies(encoding, layer, length) for layer in layers]
    )  # (L, K, F)
    base, intercept, rms = fit_effective_base(log_theta, layout.rotary_dim)  # 3 x (L, K)
    per_layer = base.log().mean(-1).exp()  # (L,): geometric mean = pooled fit
    return {
        "per_head": base.tolist(),
        "per_layer": per_layer.tolist(),
        "intercept": intercept.tolist(),
        "fit_rms": rms.tolist(),
        "rotary_dim": layout.rotary_dim,
    }


def learned_schedule(encoding: PositionEncoding) -> dict[str, Any] | None:
    """Learned-versus-initial parameters of AdaRoPE or tuned-yarn (module docstring); None for
    encodings with nothing learned in their schedule (``PositionEncoding.learned_state``)."""
    return encoding.learned_state()
