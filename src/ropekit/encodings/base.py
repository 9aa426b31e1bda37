"""The encoding interface and the config base class every encoding's options derive from.

Shape legend: B batch · H query heads · K key/value heads · T query length · S key length ·
D head dim · d model width.

Holds: PositionEncoding (the one interface: embed, rotate_q, rotate_k, score_bias),
EncodingConfig (frozen options parsed from spec strings, validated in ``__post_init__``),
check_positive / check_choice helpers that word errors the same way everywhere.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, ClassVar

import torch
from torch import Tensor, nn


def check_positive(name: str, value: float, *, minimum: float = 0.0, strict: bool = True) -> None:
    """Raise ValueError naming the field, the value and what is allowed."""
    ok = value > minimum if strict else value >= minimum
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ValueError(f"{name}={value!r} is not allowed; it must be a finite number {bound}")


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(
            f"{name}={value!r} is not allowed; use one of {', '.join(map(str, allowed))}"
        )


def _parse_scalar(text: str, kind: type, field: str) -> Any:
    if kind is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{field}={text!r} is not a boolean; use true or false")
    if kind is int:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{field}={text!r} is not an integer") from None
        if not value.is_integer():
            raise ValueError(f"{field}={text!r} is not an integer")
        return int(value)
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{field}={text!r} is not a number") from None
    return text


@dataclasses.dataclass(frozen=True)
class EncodingConfig:
    """Base of every encoding's options. Subclasses are frozen dataclasses whose fields carry
    their units and paper defaults in comments; ``__post_init__`` validates them."""

    # Fields that the surrounding model can supply when the spec leaves them out (the base of
    # a Hugging Face model, its original context length).
    CONTEXT_FIELDS: ClassVar[tuple[str, ...]] = ()
    name: ClassVar[str] = ""  # the registered encoding name

    def __post_init__(self) -> None:
        pass

    @classmethod
    def field_types(cls) -> dict[str, type]:
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    @classmethod
    def from_options(cls, options: dict[str, str], context: dict[str, Any] | None = None):
        """Build from spec options (strings), filling CONTEXT_FIELDS from ``context``."""
        types_ = cls.field_types()
        unknown = sorted(set(options) - set(types_))
        if unknown:
            raise ValueError(
                f"unknown option {unknown[0]!r} for {cls.__name__}; allowed: {', '.join(types_)}"
            )
        kwargs: dict[str, Any] = {}
        for name in cls.CONTEXT_FIELDS:
            if context and context.get(name) is not None and name in types_:
                kwargs[name] = context[name]
        for name, text in options.items():
            kwargs[name] = cls.parse_value(name, text, types_[name])
        return cls(**kwargs)

    @staticmethod
    def parse_value(name: str, text: str, annotation: Any) -> Any:
        args = typing.get_args(annotation)
        optional = type(None) in args
        if optional:
            if text.lower() in ("none", "null", ""):
                return None
            annotation = next(a for a in args if a is not type(None))
        origin = typing.get_origin(annotation)
        if origin is tuple:
            inner = typing.get_args(annotation)[0]
            body = text.strip()
            if body.startswith("[") and body.endswith("]"):
                body = body[1:-1]
            items = [t for t in body.replace(";", ",").split(",") if t.strip()]
            if not items:
                raise ValueError(f"{name}={text!r} is an empty list")
            return tuple(_parse_scalar(t.strip(), inner, name) for t in items)
        if isinstance(annotation, types.UnionType):  # pragma: no cover - configs avoid these
            raise TypeError(f"unsupported field type {annotation} for {name}")
        return _parse_scalar(text.strip(), annotation, name)

    def options(self) -> dict[str, Any]:
        """Fields that differ from their defaults (what a spec string must say)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else None
            if value != default:
                out[f.name] = value
        return out


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


class PositionEncoding(nn.Module):
    """One module per model; ``layer`` selects per-layer parameters.

    Default methods are identities, so each encoding overrides only what it changes:
    absolute encodings ``embed``, rotary encodings ``rotate_q``/``rotate_k``, bias encodings
    ``score_bias``. ``positions`` is a LongTensor (B, T) of absolute positions; packed and
    offset batches are allowed.
    """

    # True when frequencies depend on the current length (dynamic NTK, LongRoPE's switch):
    # integrations must then cache *unrotated* keys and rotate them again as the cache grows.
    dynamic: ClassVar[bool] = False

    def __init__(
        self,
        config: EncodingConfig,
        *,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        n_layers: int,
        d_model: int,
    ) -> None:
        super().__init__()
        self.config = config
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim, self.n_layers, self.d_model = head_dim, n_layers, d_model

    @property
    def spec(self) -> str:
        """The spec string that rebuilds this encoding (non-default options only)."""
        opts, name = self.config.options(), self.config.name
        if not opts:
            return name
        return name + ":" + ",".join(f"{k}={format_value(v)}" for k, v in opts.items())

    def extra_repr(self) -> str:
        return (
            f"spec={self.spec!r}, heads={self.n_heads}/{self.n_kv_heads}, head_dim={self.head_dim}"
        )

    def embed(self, h: Tensor, positions: Tensor) -> Tensor:
        """Add absolute position information to token states h (B, T, d)."""
        return h

    def rotate_q(self, q: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        """q (B, H, T, D) -> (B, H, T, D); positions (B|1, T), default 0..T-1."""
        return q

    def rotate_k(self, k: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        """k (B, K, S, D) -> (B, K, S, D); keys are cached after this."""
        return k

    def score_bias(self, q_pos: Tensor, k_pos: Tensor, layer: int = 0) -> Tensor | None:
        """Additive logit bias (1|B, H, T, S), or None."""
        return None

    def positional_parameters(self) -> dict[str, nn.Parameter]:
        """The trainable parameters of this encoding (what an adapter saves)."""
        return {n: p for n, p in self.named_parameters() if p.requires_grad}


def resolve_positions(x: Tensor, positions: Tensor | None, what: str) -> Tensor:
    """The (B|1, T) integer positions for x (B, H, T, D); None means 0..T-1."""
    if positions is None:
        return torch.arange(x.shape[-2], device=x.device)[None]
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer tensor, got {positions.dtype}")
    if positions.dim() != 2 or positions.shape[-1] != x.shape[-2]:
        raise ValueError(
            f"positions {tuple(positions.shape)} must be (B, T) with T = {what} length "
            f"{x.shape[-2]} (x {tuple(x.shape)})"
        )
    return positions
