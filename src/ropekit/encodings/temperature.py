"""Fixed length-dependent query temperatures, on their own or over any fixed schedule or
distance remap: the controls a learned AdaScale is measured against.

Shape legend: B batch · H query heads · T query length · D head dim · L layers.

Each rule multiplies the query of a token at position p by t(n), n = p + 1 the keys a causal
query sees (as AdaScale measures it, so training, packing and cached decoding agree), i.e.
every logit of that query by t(n):

- ``logn`` (Su 2021, kexue.fm/archives/8823; Qwen's ``use_logn_attn``, modeling_qwen.py:
  ``logn_list = [log(i, seq_length) if i > seq_length else 1 ...]``):
  t(n) = max(1, ln n / ln L0), L0 = ``l_ref``;
- ``ssmax``, Scalable-Softmax (Nakanishi 2025, arXiv 2501.19399, eq. 2: softmax(s ln n z)):
  t(n) = s ln n, per query head; s = 1 / ln L0 by default, so a pretrained model keeps its
  logits at n = L0 (the paper trains s from scratch; ``learn=true`` makes s a parameter per
  layer and query head, stored as ln(s / s0), 0 at init). At n = 1 the one key takes all the
  weight whatever the scale, so t(1) = 1 there (not s ln 1 = 0): the same attention, and the
  query keeps its values for caches and probes;
- ``llama4``, Llama 4's attention temperature tuning (transformers, modeling_llama4.py,
  Llama4TextAttention.forward, on its NoPE layers; the same SSMax paper):
  t(n) = ln(1 + floor(n / floor_scale)) x attn_scale + 1, floor_scale = ``l_ref`` (Llama 4:
  8192, its attention chunk), attn_scale 0.1 (Llama 4's): 1 below L0, then steps up.

Composition, one mechanism: ``temperature:rule=R,method=M,<M's options>`` wraps any encoding
whose frequencies are fixed (``WRAPPABLE``: the schedules, CoPE, HARPE, the remaps, NoPE...;
not AdaRoPE, whose AdaScale is the learned counterpart): queries are rotated by M, then
scaled (``rotate_q``); for a remap every band's ``q_scale`` carries t of the *true* query
position (``bands``), so the remap's own scale (ReRoPE's log-n, DCA's, STRING's) multiplies
in. ``temperature:rule=logn`` alone is plain RoPE with log-n scaling; ``method=nope`` is
Llama 4's NoPE layers. ``l_ref`` defaults to M's original length, else the model's.

Holds: RULES, WRAPPABLE, logn_temperature, ssmax_temperature, llama4_temperature,
TemperatureConfig, Temperature.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .bands import Band
from .base import (
    EncodingConfig,
    Extension,
    HeadRows,
    PositionEncoding,
    check_choice,
    check_positive,
    resolve_positions,
)
from .catalog import ENTRIES, Entry
from .rope import RopeConfig

RULES = ("logn", "ssmax", "llama4")

# What a fixed temperature may wrap: every encoding whose frequencies are not learned.
WRAPPABLE: dict[str, Entry] = {e.name: e for e in ENTRIES if not e.module.learned_frequencies}


def _keys_seen(positions: Tensor) -> Tensor:
    """n = position + 1 in float64 (B|1, T)."""
    return (positions + 1).to(torch.float64)


def logn_temperature(positions: Tensor, l_ref: int) -> Tensor:
    """max(1, ln n / ln L0) for positions (B|1, T): float64 (B|1, T)."""
    return (torch.log(_keys_seen(positions)) / math.log(l_ref)).clamp(min=1.0)


def ssmax_temperature(positions: Tensor, s: Tensor) -> Tensor:
    """s ln n, 1 at n = 1, for positions (B|1, T) and s (H|1,): float64 (B|1, H|1, T)."""
    n = _keys_seen(positions)[:, None, :]  # (B|1, 1, T)
    scaled = s.to(torch.float64)[None, :, None] * torch.log(n)
    return torch.where(n == 1, torch.ones_like(scaled), scaled)


def llama4_temperature(positions: Tensor, floor_scale: int, attn_scale: float) -> Tensor:
    """ln(1 + floor(n / floor_scale)) attn_scale + 1 for positions (B|1, T): float64."""
    steps = torch.div(positions + 1, floor_scale, rounding_mode="floor")  # exact, in int64
    return torch.log1p(steps.to(torch.float64)) * attn_scale + 1.0


def _original_length(config: EncodingConfig) -> int | None:
    try:
        return config.extension().original_length
    except ValueError:  # nothing rotates (nope, alibi...): no original length of its own
        return None


@dataclasses.dataclass(frozen=True)
class TemperatureConfig(EncodingConfig):
    """A fixed query temperature ``rule`` over ``method`` (module docstring); every option it
    does not own goes to ``method``."""

    name: ClassVar[str] = "temperature"
    rule: str | None = None  # logn, ssmax or llama4 (RULES)
    method: str = "rope"  # the encoding whose queries are scaled: any of WRAPPABLE
    l_ref: int | None = (
        None  # L0 (tokens) t is 1 at; default method's original length, else model's
    )
    s: float | None = None  # ssmax's s; default 1 / ln L0 (t = 1 at n = L0)
    learn: bool = False  # ssmax: s per (layer, query head) learned, from s
    attn_scale: float = 0.1  # llama4's slope per step of L0 (Llama 4: 0.1)
    schedule: EncodingConfig = dataclasses.field(default_factory=RopeConfig)  # method's options

    CONTEXT_FIELDS: ClassVar[tuple[str, ...]] = RopeConfig.CONTEXT_FIELDS
    REQUIRED_OPTIONS: ClassVar[tuple[str, ...]] = ("rule",)
    OWN: ClassVar[tuple[str, ...]] = ("rule", "method", "l_ref", "s", "learn", "attn_scale")

    def __post_init__(self) -> None:
        if self.rule is None:
            raise ValueError(f"rule is required for temperature; use one of {', '.join(RULES)}")
        check_choice("rule", self.rule, RULES)
        check_choice("method", self.method, tuple(WRAPPABLE))
        if type(self.schedule) is not WRAPPABLE[self.method].config:
            raise ValueError(
                f"schedule {type(self.schedule).__name__} does not match method={self.method!r}"
            )
        if self.l_ref is None:
            object.__setattr__(self, "l_ref", _original_length(self.schedule))
        if self.l_ref is None:
            raise ValueError(
                "l_ref is required for temperature (L0, the length its factor is 1 at), or a "
                "method with original_length, or a model that supplies it"
            )
        if isinstance(self.l_ref, bool) or not isinstance(self.l_ref, int) or self.l_ref < 2:
            raise ValueError(f"l_ref={self.l_ref!r} is not allowed; it must be an integer >= 2")
        if self.s is not None:
            check_positive("s", self.s)
        check_positive("attn_scale", self.attn_scale, strict=False)
        if self.rule != "ssmax" and (self.learn or self.s is not None):
            raise ValueError(
                f"{'learn' if self.learn else 's'} is not allowed with rule={self.rule}; "
                "only ssmax has s"
            )

    @property
    def s_init(self) -> float:
        """ssmax's s at init: the given s, else 1 / ln L0."""
        return self.s if self.s is not None else 1.0 / math.log(self.l_ref)

    @classmethod
    def option_types(cls, options: dict[str, str]) -> dict[str, Any]:
        method = options.get("method", "rope")
        check_choice("method", method, tuple(WRAPPABLE))
        inner = WRAPPABLE[method].config.option_types(options)
        return {**super().option_types(options), **inner}

    @classmethod
    def from_options(cls, options: dict[str, str], context: dict[str, Any] | None = None):
        types_ = cls.field_types()
        own = {k: v for k, v in options.items() if k in cls.OWN}
        rest = {k: v for k, v in options.items() if k not in cls.OWN}
        method = own.get("method", "rope")
        check_choice("method", method, tuple(WRAPPABLE))
        try:
            schedule = WRAPPABLE[method].config.from_options(rest, context)
        except ValueError as e:
            raise ValueError(f"{e} (temperature with method={method})") from None
        kwargs = {k: cls.parse_value(k, v, types_[k]) for k, v in own.items()}
        length = (context or {}).get("original_length")
        if "l_ref" not in kwargs and _original_length(schedule) is None and length:
            kwargs["l_ref"] = int(length)
        return cls(schedule=schedule, **kwargs)

    def options(self) -> dict[str, Any]:
        own = {k: v for k, v in super().options().items() if k not in ("schedule", "rule")}
        if self.l_ref == _original_length(self.schedule):
            own.pop("l_ref", None)
        return {"rule": self.rule, **own, **self.schedule.options()}

    @property
    def base_schedule(self) -> EncodingConfig | None:
        return self.schedule.base_schedule

    def extension(self) -> Extension:
        return self.schedule.extension()


class Temperature(PositionEncoding):
    """``method``'s encoding with its queries multiplied by a fixed temperature."""

    config: TemperatureConfig

    def __init__(self, config: TemperatureConfig, **dims: int) -> None:
        super().__init__(config, **dims)
        inner = WRAPPABLE[config.method].module(config.schedule, **dims)
        self.inner = inner
        # What the wrapped encoding declares, it declares here: the scale changes none of it.
        self.adds_to_embeddings = inner.adds_to_embeddings
        self.has_score_bias = inner.has_score_bias
        self.layer_independent_bias = inner.layer_independent_bias
        self.remaps_distance = inner.remaps_distance
        self.dynamic = inner.dynamic
        self.rotary_dim, self.n_pairs, self.pairing = inner.rotary_dim, inner.n_pairs, inner.pairing
        self.l_ref = config.l_ref
        if config.learn:
            self.log_s = nn.Parameter(torch.zeros(self.n_layers, self.n_heads))  # (L, H) ln(s/s0)

    def s(self, layer: int) -> Tensor:
        """ssmax's s (H|1,) float64 of one layer."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(
                f"layer={layer} is out of range; this model has 0..{self.n_layers - 1}"
            )
        s0 = torch.tensor([self.config.s_init], dtype=torch.float64)
        if not self.config.learn:
            return s0
        return s0.to(self.log_s.device) * self.log_s[layer].double().exp()

    def temperature(self, positions: Tensor, layer: int = 0) -> Tensor:
        """t(n) for n = position + 1: (B|1, H|1, T, 1) float64."""
        c = self.config
        if c.rule == "ssmax":
            return ssmax_temperature(positions, self.s(layer))[..., None]
        if c.rule == "logn":
            t = logn_temperature(positions, c.l_ref)
        else:
            t = llama4_temperature(positions, c.l_ref, c.attn_scale)
        return t[:, None, :, None]

    # ------------------------------------------------------------------ the interface
    def embed(self, h: Tensor, positions: Tensor) -> Tensor:
        return self.inner.embed(h, positions)

    def rotate_q(self, q: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        positions = resolve_positions(q, positions, "query")
        out = self.inner.rotate_q(q, positions, layer)
        return out * self.temperature(positions, layer).to(out.dtype)

    def rotate_k(self, k: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        return self.inner.rotate_k(k, positions, layer)

    def score_bias(self, q_pos: Tensor, k_pos: Tensor, layer: int = 0) -> Tensor | None:
        return self.inner.score_bias(q_pos, k_pos, layer)

    def bands(self, q_pos: Tensor, k_pos: Tensor, layer: int = 0) -> list[Band]:
        """The wrapped encoding's bands, each query scaled by t of its true position."""
        t = self.temperature(q_pos, layer)  # (B|1, H|1, T, 1)
        return [
            dataclasses.replace(band, q_scale=t if band.q_scale is None else band.q_scale * t)
            for band in self.inner.bands(q_pos, k_pos, layer)
        ]

    def rotate_band(self, x: Tensor, positions: Tensor, query: bool, layer: int = 0) -> Tensor:
        return self.inner.rotate_band(x, positions, query, layer)  # t is in the bands' q_scale

    def band_tables(
        self, positions: Tensor, query: bool, layer: int = 0, dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor, Tensor] | None:
        return self.inner.band_tables(positions, query, layer, dtype)

    # ------------------------------------------------------------------ the typed surface
    def inv_freq(self, layer: int = 0, length: int | None = None) -> tuple[Tensor, Any]:
        return self.inner.inv_freq(layer, length)

    def log_frequencies(self, layer: int = 0, length: int | None = None) -> Tensor:
        return self.inner.log_frequencies(layer, length)

    def query_temperature(self, positions: Tensor, layer: int = 0) -> Tensor | None:
        return self.temperature(positions, layer)

    def head_rows(self, kind: str) -> HeadRows | None:
        check_choice("kind", kind, ("freq", "scale"))
        if kind == "scale" and self.config.learn:
            return HeadRows((self.log_s,), shared_layers=False, shared_heads=False)
        return self.inner.head_rows(kind)

    def learned_state(self) -> dict[str, Any] | None:
        """The wrapped encoding's (None for a fixed schedule): analysis files describe learned
        frequencies and AdaScale; a learned s is read per layer with ``s(layer)`` and reverted
        by head influence through ``head_rows("scale")``."""
        return self.inner.learned_state()
