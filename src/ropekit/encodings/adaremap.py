"""AdaRoPE over a distance remap: AdaRoPE's learned frequencies (AdaFreq) and temperatures
(AdaScale) in the attention of a remap's bands (Leaky ReRoPE, ReRoPE, Self-Extend;
``REMAPS``), so the positional parameters train with the remap in the forward, not on plain RoPE
positions (issue 58: what learns over what wins at 4x in experiment E).

Shape legend: B batch · H query heads · K key/value heads · T query length · S key length ·
D head dim · F rotary pairs.

The remap decides which positions each band rotates queries and keys at (``remap.py``:
e.g. Leaky ReRoPE's far band at (i + w (k - 1)) / k and j / k); AdaRoPE decides how a position
becomes an angle: theta[layer, kv head, f] = theta_init exp(dxi). So a pair (i, j) in a band
sees the remapped distance d'(i, j) at the learned frequencies of its head:

    logit(i, j) = lambda_h(i + 1) <R(theta_h d'(i, j)) q_i, k_j> (x the remap's own q scale)

AdaScale's lambda_h follows the *true* query position (the keys it sees), as without a remap:
it rides in every band's ``q_scale`` (``bands``), and ``rotate_band`` rotates at the band's
positions with the learned theta and nothing else. Outside banded attention (``rotate_q``,
``rotate_k``) it is AdaRoPE at the true positions, the identity band. At init (dxi = 0,
gamma = 0, tau = 1) it equals the remap exactly.

Spec: ``adarope-remap:remap=rerope,window=W,leaky=k,<AdaRoPE's options>,<init's options>``;
the remap's options and AdaRoPE's share the init schedule and its L0 (``l_ref`` defaults to
the remap's L0, the model's training length).

Holds: REMAPS, AdaRemapConfig, AdaRemap.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import Tensor

from .adarope import AdaRoPE, AdaRoPEConfig
from .bands import Band
from .base import check_choice
from .remap import (
    RemapConfig,
    RemapEncoding,
    ReRope,
    ReRopeConfig,
    SelfExtend,
    SelfExtendConfig,
)
from .rotary import angles, tables

# The remaps whose bands AdaRoPE can rotate: name -> (config, module). DCA and STRING are not
# among them: their option ``scale`` (the authors' logit scale) would collide with AdaRoPE's
# ``scale`` (AdaScale on or off) in one spec.
REMAPS: dict[str, tuple[type[RemapConfig], type[RemapEncoding]]] = {
    c.name: (c, m) for c, m in ((ReRopeConfig, ReRope), (SelfExtendConfig, SelfExtend))
}


def _remap_config(name: str | None) -> type[RemapConfig]:
    if name is None:
        raise ValueError(
            f"remap is required for adarope-remap; e.g. remap=rerope,leaky=16 (allowed: "
            f"{', '.join(REMAPS)})"
        )
    check_choice("remap", name, tuple(REMAPS))
    return REMAPS[name][0]


@dataclasses.dataclass(frozen=True)
class AdaRemapConfig(AdaRoPEConfig):
    """AdaRoPE's options, and ``remap``: the remap (its config, parsed from ``remap=<name>``
    and that remap's options) whose bands the attention computes."""

    name: ClassVar[str] = "adarope-remap"
    remap: RemapConfig | None = None  # rerope, self-extend, dca or string, with its options

    REQUIRED_OPTIONS: ClassVar[tuple[str, ...]] = ("remap",)
    mixable: ClassVar[bool] = False  # a remap: the mixed window switches schedules only
    ADA_OWN: ClassVar[tuple[str, ...]] = ("l_ref", "share_heads", "share_layers", "freq", "scale")

    def __post_init__(self) -> None:
        if not isinstance(self.remap, RemapConfig):
            _remap_config(None)
        if self.remap.schedule != self.schedule or self.remap.init != self.init:
            raise ValueError(
                f"the remap's init schedule ({self.remap.init}) differs from AdaRoPE's "
                f"({self.init}); give one init and its options"
            )
        super().__post_init__()

    def _default_l_ref(self) -> int:
        return int(self.remap.original_length or super()._default_l_ref())

    @classmethod
    def option_types(cls, options: dict[str, str]) -> dict[str, Any]:
        remap = _remap_config(options.get("remap"))
        own = {k: v for k, v in cls.field_types().items() if k in cls.ADA_OWN}
        return {"remap": str, **own, **remap.option_types(options)}

    @classmethod
    def from_options(cls, options: dict[str, str], context: dict[str, Any] | None = None):
        remap_cls = _remap_config(options.get("remap"))
        types_ = cls.field_types()
        own = {k: v for k, v in options.items() if k in cls.ADA_OWN}
        rest = {k: v for k, v in options.items() if k not in cls.ADA_OWN and k != "remap"}
        try:
            remap = remap_cls.from_options(rest, context)
        except ValueError as e:
            raise ValueError(f"{e} (adarope-remap with remap={remap_cls.name})") from None
        kwargs = {k: cls.parse_value(k, v, types_[k]) for k, v in own.items()}
        return cls(init=remap.init, schedule=remap.schedule, remap=remap, **kwargs)

    def options(self) -> dict[str, Any]:
        own = {
            k: v
            for k, v in super().options().items()
            if k in self.ADA_OWN  # AdaRoPE's: the init and its options are the remap's
        }
        return {"remap": self.remap.name, **own, **self.remap.options()}


class AdaRemap(AdaRoPE):
    """AdaRoPE whose attention is the remap's bands (module docstring)."""

    config: AdaRemapConfig
    remaps_distance: ClassVar[bool] = True

    def __init__(self, config: AdaRemapConfig, **dims: int) -> None:
        super().__init__(config, **dims)
        # The band rule only: its rotation (the base schedule) is replaced by AdaRoPE's.
        self.remap = REMAPS[config.remap.name][1](config.remap, **dims)
        self.dynamic = self.remap.dynamic

    def bands(self, q_pos: Tensor, k_pos: Tensor, layer: int = 0) -> list[Band]:
        """The remap's bands, each query scaled by AdaScale's lambda_h of its true position."""
        bands = self.remap.bands(q_pos, k_pos, layer)
        if not self.config.scale:
            return bands
        t = self.temperature(q_pos, layer).double()  # (B|1, H, T, 1)
        return [
            dataclasses.replace(band, q_scale=t if band.q_scale is None else band.q_scale * t)
            for band in bands
        ]

    def rotate_band(self, x: Tensor, positions: Tensor, query: bool, layer: int = 0) -> Tensor:
        """x rotated at a band's positions (int or fractional) with the learned theta; the
        temperature is in the bands' ``q_scale``."""
        return self._rotate(x, positions, query, layer)

    def band_tables(
        self, positions: Tensor, query: bool, layer: int = 0, dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor, Tensor]:
        """The tables ``rotate_band`` rotates with: (B|1, K|1, N, F) per key head, a query's
        repeated over the g query heads of each key head (B|1, H|1, N, F)."""
        theta, factor = self.inv_freq(layer)  # (K|1, F) float64
        phi = angles(positions[:, None, :], theta.to(positions.device)[None])  # (B|1, K|1, N, F)
        cos, sin = tables(phi, factor, dtype)
        if query and cos.shape[1] > 1:
            g = self.n_heads // cos.shape[1]
            cos, sin = cos.repeat_interleave(g, 1), sin.repeat_interleave(g, 1)
        return cos, sin
