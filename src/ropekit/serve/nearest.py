"""The closest exportable schedule to a per-head AdaRoPE: one frequency per rotary pair and one
query temperature for the whole model, which ``rope_parameters`` (longrope) and GGUF
(``rope_freqs`` + attention factor) can carry.

AdaRoPE learns log-frequencies ``xi[layer, kv_head, f]`` and per-head temperatures
``lambda_h(L) = (1/tau_h) ln(1 + max(L, L_ref)/L_ref)^gamma_h`` (DESIGN.md, "AdaRoPE"). The
nearest shared schedule is the least-squares fit in the spaces AdaRoPE learns in:

    xi*_f      = mean over (layer, kv head) of xi[layer, kv_head, f]
    ln lambda* = mean over (layer, head) of ln lambda_h(L*)

with every (layer, head) weighted alike and the temperature frozen at one length ``L*`` (the
target length by default), since no engine scales queries by position. The fit is an
approximation: ``export(..., nearest=True)`` records it, and its perplexity cost is measured
against the per-head model in the serving tests (README, "Serve it").

Holds: NearestFit, nearest_shared, head_frequencies.
"""

from __future__ import annotations

import dataclasses

import torch

from ropekit.encodings import PositionEncoding


@dataclasses.dataclass(frozen=True)
class NearestFit:
    """The shared schedule and how far the per-head one is from it."""

    theta: torch.Tensor  # (F,) float64: the fitted per-pair frequencies
    attention_factor: float  # the init schedule's cos/sin factor (YaRN's mscale), unchanged
    temperature: float  # lambda*: the one query multiplier, folded into the attention factor
    max_log_freq_spread: float  # max over pairs of max |xi - xi*| (nats of frequency)
    temperature_range: tuple[float, float]  # min and max lambda_h(L*) over heads and layers
    notes: tuple[str, ...]


def head_frequencies(encoding: PositionEncoding) -> tuple[torch.Tensor, list[float]]:
    """Every (layer, kv head)'s per-pair frequencies, (L, K, F) float64 radians per token (a
    shared schedule repeats one row), and each layer's cos/sin factor."""
    rows, factors = [], []
    with torch.no_grad():
        for layer in range(encoding.n_layers):
            theta, factor = encoding.inv_freq(layer)  # (K|1, F)
            rows.append(theta.double().cpu().expand(encoding.n_kv_heads, -1))
            factors.append(float(factor))
    return torch.stack(rows), factors


def nearest_shared(encoding: PositionEncoding, *, length: int) -> NearestFit:
    """Fit one shared schedule to ``encoding`` (a learned schedule, shared or per head, such
    as AdaRoPE); the temperature is evaluated at ``length`` tokens (L = position + 1)."""
    if not encoding.learned_frequencies or encoding.dynamic:
        raise ValueError(
            f"nearest_shared fits learned fixed-length schedules (AdaRoPE); got {encoding.spec!r}"
        )
    if length < 1:
        raise ValueError(f"length={length} is not allowed; give a positive number of tokens")
    with torch.no_grad():
        xi = torch.stack(
            [
                encoding.log_frequencies(layer).double().cpu().expand(encoding.n_kv_heads, -1)
                for layer in range(encoding.n_layers)
            ]
        )  # (L, K, F)
        xi_star = xi.mean(dim=(0, 1))  # (F,)
        spread = float((xi - xi_star).abs().max())
        temperature, low, high = 1.0, 1.0, 1.0
        device = next(encoding.parameters()).device
        position = torch.tensor([[length - 1]], device=device)  # (1, 1)
        scaled = encoding.query_temperature(position) is not None  # AdaScale on
        if scaled:
            lam = torch.stack(
                [
                    encoding.query_temperature(position, layer)[0, :, 0, 0]
                    .double()
                    .cpu()
                    .expand(encoding.n_heads)
                    for layer in range(encoding.n_layers)
                ]
            )  # (L, H)
            temperature = float(lam.log().mean().exp())
            low, high = float(lam.min()), float(lam.max())
    notes = (
        f"approximate (nearest shared schedule): per-(layer, kv head) log-frequencies averaged "
        f"per pair; the largest move is {spread:.4f} in ln(theta)",
        f"approximate (nearest shared schedule): AdaScale's per-head temperatures "
        f"({low:.4f}..{high:.4f} at L={length}) replaced by their geometric mean "
        f"{temperature:.6f}, folded into attention_factor",
    )
    return NearestFit(
        theta=xi_star.exp(),
        attention_factor=float(encoding.inv_freq(0)[1]),
        temperature=temperature,
        max_log_freq_spread=spread,
        temperature_range=(low, high),
        notes=notes if scaled else notes[:1],
    )
