"""The mixed window (LongRoPE2, Shang et al. 2025): the original RoPE for sequences within the
original window, any other rotary schedule or learned encoding beyond it.

Shape legend: B batch · H query heads · K key/value heads · T length · D head dim.

LongRoPE2 (sec. 3.3, "mixed context window training") keeps short inputs on the model's own
RoPE, so extending the window costs nothing inside it, and uses the rescaled frequencies only
when the input is longer than the original window L0 (transformers does the same for its
``longrope`` type by sequence length). Here that rule wraps any rotary encoding:

    length L = max(position) + 1 of the call (as dynamic schedules measure it)
    L <= window: rotate with plain RoPE at the wrapped encoding's base, pairing and fraction
    L >  window: rotate with the wrapped encoding (a schedule, or AdaRoPE / tuned-yarn with
                 its learned parameters, which live in this module as ``schedule_encoding``)

So the rotation depends on the current length: the encoding is ``dynamic``, and integrations
cache unrotated keys and rotate every cached key again at each step. When generation crosses
the boundary the cached keys are re-rotated with the long schedule, not discarded, and every
layer attends exactly as a full forward would from the same layer inputs (the inputs of layers
above the first were computed for earlier tokens at their own step's length, as for any
dynamic schedule: ``ropekit.model.cache``).

Spec: ``mixed:method=<name>,<that encoding's options>[,window=L0]``, e.g.
``mixed:method=yarn,factor=2``, ``mixed:method=longrope,long_factor=[...],factor=2``,
``mixed:method=adarope,init=yarn,factor=2``. ``window`` defaults to the wrapped schedule's
original length, else the model's.

Holds: MIXABLE, MixedConfig, MixedWindow.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from torch import Tensor

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
from .rope import RopeConfig, RotaryEncoding

# What the window may switch to: every registered encoding that declares itself ``mixable``
# (the rotary schedules and the learned rotary encodings, not the distance remaps).
MIXABLE: dict[str, Entry] = {e.name: e for e in ENTRIES if e.config.mixable}


@dataclasses.dataclass(frozen=True)
class MixedConfig(EncodingConfig):
    """Original RoPE within ``window``, ``method`` beyond it; other options go to ``method``."""

    name: ClassVar[str] = "mixed"
    method: str | None = None  # the encoding used beyond the window: any of MIXABLE
    window: int | None = None  # L0 (tokens); default: the method's original length, or the model's
    schedule: EncodingConfig = dataclasses.field(default_factory=RopeConfig)  # method's options

    CONTEXT_FIELDS: ClassVar[tuple[str, ...]] = RopeConfig.CONTEXT_FIELDS
    REQUIRED_OPTIONS: ClassVar[tuple[str, ...]] = ("method",)

    def __post_init__(self) -> None:
        if self.method is None:
            _method_required()
        check_choice("method", self.method, tuple(MIXABLE))
        if not isinstance(self.schedule, MIXABLE[self.method].config) or (
            self.schedule.name != self.method
        ):
            raise ValueError(
                f"schedule {type(self.schedule).__name__} does not match method={self.method!r}"
            )
        if self.window is None:
            default = self._default_window()
            if default is None:
                raise ValueError(
                    "window is required for mixed (the original length L0), or a method with "
                    "original_length, or a model that supplies it"
                )
            object.__setattr__(self, "window", default)
        if isinstance(self.window, bool) or not isinstance(self.window, int):
            raise ValueError(f"window={self.window!r} is not an integer")
        check_positive("window", self.window, minimum=1, strict=False)

    def _default_window(self) -> int | None:
        return self.schedule.extension().original_length

    @classmethod
    def option_types(cls, options: dict[str, str]) -> dict[str, Any]:
        method = options.get("method")
        if method is None:
            _method_required()
        check_choice("method", method, tuple(MIXABLE))
        inner = MIXABLE[method].config.option_types(options)
        return {**super().option_types(options), **inner}

    @classmethod
    def from_options(cls, options: dict[str, str], context: dict[str, Any] | None = None):
        own = {k: v for k, v in options.items() if k in ("method", "window")}
        rest = {k: v for k, v in options.items() if k not in own}
        method = own.get("method")
        if method is None:
            _method_required()
        check_choice("method", method, tuple(MIXABLE))
        schedule_cls = MIXABLE[method].config
        try:
            schedule = schedule_cls.from_options(rest, context)
        except ValueError as e:
            raise ValueError(f"{e} (mixed with method={method})") from None
        window = None
        if "window" in own:
            window = cls.parse_value("window", own["window"], int)
        elif schedule.extension().original_length is None and (context or {}).get(
            "original_length"
        ):
            window = int(context["original_length"])
        return cls(method=method, window=window, schedule=schedule)

    def options(self) -> dict[str, Any]:
        own: dict[str, Any] = {"method": self.method}
        if self.window != self._default_window():
            own["window"] = self.window
        return {**own, **self.schedule.options()}

    @property
    def base_schedule(self) -> EncodingConfig | None:
        return self.schedule.base_schedule

    def extension(self) -> Extension:
        inner = self.schedule.extension()
        return Extension(inner.base, inner.factor, self.window)


def _method_required() -> None:
    raise ValueError(
        f"method is required for mixed; e.g. mixed:method=yarn,factor=2 (allowed: "
        f"{', '.join(MIXABLE)})"
    )


class MixedWindow(PositionEncoding):
    """Plain RoPE for calls whose length is within ``window``; the wrapped encoding beyond."""

    config: MixedConfig
    dynamic = True

    def __init__(self, config: MixedConfig, **dims: int) -> None:
        super().__init__(config, **dims)
        module_cls = MIXABLE[config.method].module
        self.schedule_encoding = module_cls(config.schedule, **dims)
        base = config.schedule.base_schedule
        original = RopeConfig(
            base=base.base,
            pairing=base.pairing,
            fraction=base.fraction,
            proportion=base.proportion,
        )
        self.original = RotaryEncoding(original, **dims)
        self.window = config.window
        inner = self.schedule_encoding
        self.rotary_dim, self.n_pairs, self.pairing = inner.rotary_dim, inner.n_pairs, inner.pairing
        self.learned_frequencies = inner.learned_frequencies
        self.l_ref = inner.l_ref

    def active(self, length: int | None) -> PositionEncoding:
        """The encoding a call of ``length`` positions rotates with (None: beyond the window)."""
        return (
            self.original
            if length is not None and length <= self.window
            else self.schedule_encoding
        )

    def _length(self, positions: Tensor) -> int:
        return int(positions.max()) + 1

    def rotate_q(self, q: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        positions = resolve_positions(q, positions, "query")
        return self.active(self._length(positions)).rotate_q(q, positions, layer)

    def rotate_k(self, k: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        positions = resolve_positions(k, positions, "key")
        return self.active(self._length(positions)).rotate_k(k, positions, layer)

    def inv_freq(self, layer: int = 0, length: int | None = None) -> tuple[Tensor, Any]:
        return self.active(length).inv_freq(layer, length)

    def log_frequencies(self, layer: int = 0, length: int | None = None) -> Tensor:
        return self.active(length).log_frequencies(layer, length)

    def query_temperature(self, positions: Tensor, layer: int = 0) -> Tensor | None:
        return self.active(self._length(positions)).query_temperature(positions, layer)

    def head_rows(self, kind: str) -> HeadRows | None:
        return self.schedule_encoding.head_rows(kind)

    def learned_state(self) -> dict[str, Any] | None:
        return self.schedule_encoding.learned_state()
