"""Head influence (paper, Figures 10 and 11): revert one head's learned positional parameters
to their initial values and measure how much the held-out NLL at the target length rises.

Shape legend: N windows · T window length · B windows per forward · V vocabulary.

Units (the encoding's ``head_rows``: AdaRoPE's; every parameter is 0 at init, so reverting a
row means zeroing it):
- ``freq`` (AdaFreq): one row ``dxi[layer, kv_head]`` (F pairs). Frequencies live per
  key/value head, so the unit is the kv head; all of its g query heads read those keys.
- ``scale`` (AdaScale): one query head's ``log_tau[layer, head]`` and ``gamma[layer, head]``.
With ``share_layers`` / ``share_heads`` the rows are shared, and the unit is the shared row
(``layer`` / ``head`` reported as None).

delta_h = NLL(with unit h reverted) - NLL(as trained), in nats per token, on the same N windows
for every unit (one set of held-out windows, batched B at a time). A unit already at its initial
value has delta exactly 0; ``skip_unchanged`` then skips its forward passes.

Holds: INFLUENCE_KINDS, Unit, influence_units, at_init, reverted, mean_nll, head_influence.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ropekit.backbone import Backbone, as_backbone
from ropekit.encodings import PositionEncoding
from ropekit.encodings.base import check_choice

from .capture import forward_logits

INFLUENCE_KINDS = ("freq", "scale")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One revertible set of parameter rows."""

    kind: str  # "freq" or "scale"
    row: tuple[int, int]  # (layer row, head row) in the parameters
    layer: int | None  # None: a row shared by every layer (share_layers)
    head: int | None  # kv head (freq) or query head (scale); None: shared (share_heads)

    @property
    def label(self) -> str:
        layer = "all layers" if self.layer is None else f"L{self.layer}"
        head = "all heads" if self.head is None else ("K" if self.kind == "freq" else "H")
        return f"{layer}/{head}{'' if self.head is None else self.head}"


def influence_units(encoding: PositionEncoding, kind: str) -> list[Unit]:
    """Every unit of ``kind`` the encoding has; [] when it has no such per-head parameters."""
    check_choice("kind", kind, INFLUENCE_KINDS)
    head_rows = encoding.head_rows(kind)
    if head_rows is None:
        return []
    rows = head_rows.parameters[0].shape[:2]  # (L|1, K|1) or (L|1, H|1)
    shared_layers, shared_heads = head_rows.shared_layers, head_rows.shared_heads
    return [
        Unit(kind, (i, j), None if shared_layers else i, None if shared_heads else j)
        for i in range(rows[0])
        for j in range(rows[1])
    ]


def _parameters(encoding: PositionEncoding, unit: Unit) -> tuple[nn.Parameter, ...]:
    head_rows = encoding.head_rows(unit.kind)
    if head_rows is None:
        raise ValueError(f"encoding {encoding.spec!r} has no {unit.kind!r} rows to revert")
    return head_rows.parameters


def at_init(encoding: PositionEncoding, unit: Unit) -> bool:
    """True when the unit's rows already hold their initial value (0)."""
    return all(not bool(p[unit.row].any()) for p in _parameters(encoding, unit))


@contextlib.contextmanager
def reverted(encoding: PositionEncoding, unit: Unit) -> Iterator[None]:
    """Within the block the unit's rows are 0 (their initial value); restored exactly after."""
    params = _parameters(encoding, unit)
    saved = [p.detach()[unit.row].clone() for p in params]
    with torch.no_grad():
        for p in params:
            p[unit.row] = 0
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved, strict=True):
                p[unit.row] = value


@torch.no_grad()
def mean_nll(model: Backbone | nn.Module, windows: Tensor, batch_size: int) -> float:
    """Mean next-token NLL (nats) over windows (N, T): token t+1 given tokens <= t, every
    window from position 0, summed in float64."""
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows {tuple(windows.shape)} must be (N, T) with T >= 2")
    total, count = 0.0, 0
    device = as_backbone(model).device
    for b in range(0, windows.shape[0], batch_size):
        ids = windows[b : b + batch_size].to(device)  # (B, T)
        logits = forward_logits(model, ids)[:, :-1]  # (B, T-1, V)
        nll = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
        total += float(nll.double().sum())
        count += nll.numel()
    return total / count


def head_influence(
    model: Backbone | nn.Module,
    encoding: PositionEncoding,
    windows: Tensor,
    kind: str,
    *,
    batch_size: int = 1,
    baseline: float | None = None,
    skip_unchanged: bool = True,
    progress: bool = False,
    layers: Collection[int] | None = None,
) -> dict[str, Any]:
    """delta NLL for every unit of ``kind`` (module docstring) on windows (N, T).

    Returns {"kind", "baseline_nll", "units": [{"layer", "head", "label", "delta_nll",
    "computed"}]} in parameter-row order (an encoding without such units gives an empty list).
    ``baseline`` reuses an NLL already measured on the same windows. ``layers`` (None: all)
    keeps the units of those layers and the shared ones: a layer the encoding does not rotate
    (a layer type its spec leaves) never reads its rows.
    """
    units = [
        unit
        for unit in influence_units(encoding, kind)
        if layers is None or unit.layer is None or unit.layer in layers
    ]
    if baseline is None:
        baseline = mean_nll(model, windows, batch_size)
    rows = []
    for unit in tqdm(units, desc=f"influence ({kind})", unit="head", disable=not progress):
        computed = not (skip_unchanged and at_init(encoding, unit))
        delta = 0.0
        if computed:
            with reverted(encoding, unit):
                delta = mean_nll(model, windows, batch_size) - baseline
        rows.append(
            {
                "layer": unit.layer,
                "head": unit.head,
                "label": unit.label,
                "delta_nll": delta,
                "computed": computed,
            }
        )
    return {"kind": kind, "baseline_nll": baseline, "units": rows}
