"""The encoding interface and the config base class every encoding's options derive from.

Shape legend: B batch · H query heads · K key/value heads · T query length · S key length ·
D head dim · d model width.

Holds: PositionEncoding (the one interface: embed, rotate_q, rotate_k, score_bias, and the
typed surface that says what an encoding does, so no caller has to ask ``getattr``/``hasattr``
or compare methods: see "What an encoding declares" below), EncodingConfig (frozen options
parsed from spec strings, validated in ``__post_init__``), HeadRows,
split_options / parse_options (the option grammar of spec strings), check_positive /
check_choice helpers that word errors the same way everywhere.

What an encoding declares (class attributes, overridden where they differ; read them, never
probe for methods):
- ``adds_to_embeddings``: ``embed`` changes the token states (sinusoidal, learned);
- ``has_score_bias``: ``score_bias`` returns a tensor (ALiBi); ``layer_independent_bias``: that
  bias is the same in every layer, so a model may build it once per forward;
- ``dynamic``: the frequencies follow the current length (dynamic NTK, LongRoPE's switch), so
  caches must keep keys unrotated;
- ``learned_frequencies``: the frequencies are parameters (AdaRoPE, tuned-yarn);
- the rotary layout ``rotary_dim`` (0 when nothing rotates), ``n_pairs`` (F, 0) and
  ``pairing`` (None); ``l_ref`` (AdaScale's reference length, None without AdaScale).
Typed accessors: ``base_schedule`` (the fixed schedule config the encoding starts from),
``base``, ``factor``, ``original_length``, ``inv_freq(layer, length)``,
``log_frequencies(layer, length)``, ``query_temperature(positions, layer)``,
``head_rows(kind)`` and ``learned_state()``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from . import rotary
from .bands import Band


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
        try:  # exact, however large (through a float, 2**63 - 1 would read as 2**63)
            return int(text)
        except ValueError:  # "1e4", "2048.0": integral numbers written as floats
            pass
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


class Extension(NamedTuple):
    """The knobs that place a rotary schedule: base b, stretch factor s and original length L0
    (None where the schedule has none: plain RoPE has neither s nor L0, PI and NTK no L0)."""

    base: float
    factor: float | None
    original_length: int | None


@dataclasses.dataclass(frozen=True)
class EncodingConfig:
    """Base of every encoding's options. Subclasses are frozen dataclasses whose fields carry
    their units and paper defaults in comments; ``__post_init__`` validates them."""

    # Fields that the surrounding model can supply when the spec leaves them out (the base of
    # a Hugging Face model, its original context length).
    CONTEXT_FIELDS: ClassVar[tuple[str, ...]] = ()
    # Fields with a None default that a spec must still give (listed as required)
    REQUIRED_OPTIONS: ClassVar[tuple[str, ...]] = ()
    name: ClassVar[str] = ""  # the registered encoding name
    # Whether the mixed window (LongRoPE2) may switch to this encoding beyond L0: the rotary
    # schedules and learned rotary encodings, not the distance remaps or absolute encodings.
    mixable: ClassVar[bool] = False

    def __post_init__(self) -> None:
        pass

    @classmethod
    def field_types(cls) -> dict[str, type]:
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    @classmethod
    def option_types(cls, options: dict[str, str]) -> dict[str, Any]:
        """Every option a spec giving ``options`` may name, with its annotation (encodings
        that pass options to an inner schedule, picked by ``init`` or ``method``, add that
        schedule's)."""
        return {k: v for k, v in cls.field_types().items() if k != "schedule"}

    @classmethod
    def from_options(cls, options: dict[str, str], context: dict[str, Any] | None = None):
        """Build from spec options (strings), filling CONTEXT_FIELDS from ``context``."""
        types_ = cls.field_types()
        unknown = sorted(set(options) - set(types_))
        if unknown:
            allowed = ", ".join(types_) or "none (it takes no options)"
            raise ValueError(
                f"unknown option {unknown[0]!r} for {cls.__name__}; allowed: {allowed}"
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

    @property
    def base_schedule(self) -> EncodingConfig | None:
        """The fixed rotary schedule (a ``RopeConfig``) this encoding starts from; None for
        encodings that do not rotate. Rotary configs return themselves, AdaRoPE its init."""
        return None

    def extension(self) -> Extension:
        """Base, factor and original length of a rotary schedule (``Extension``)."""
        raise ValueError(f"{self.name!r} is not a rotary schedule; it has no base or factor")

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


# The option every spec may give: the layer types the encoding covers (read by the model).
LAYERS = "layers"
_LAYER_TYPES = re.compile(r"^[a-z][a-z0-9_]*(\+[a-z][a-z0-9_]*)*$")


def check_layers(value: str) -> str:
    """A ``layers=`` value: layer type names joined by '+' (or all, rope, global, local)."""
    if not _LAYER_TYPES.match(value):
        raise ValueError(
            f"layers={value!r} is not allowed; name layer types joined by '+' (e.g. "
            "layers=full_attention, layers=global, layers=all)"
        )
    return value


def split_options(body: str, spec: str) -> list[str]:
    """Split a spec's option text on commas outside brackets, so lists like [1,2,3] stay
    whole."""
    parts, depth, current = [], 0, []
    for ch in body:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"spec {spec!r} has an unmatched ']'")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise ValueError(f"spec {spec!r} has an unmatched '['")
    parts.append("".join(current))
    return parts


def parse_options(body: str, spec: str) -> dict[str, str]:
    """``"k=v,k=v"`` -> {k: v} with values still strings (the part of a spec after ':')."""
    options: dict[str, str] = {}
    if not body.strip():
        return options
    for part in split_options(body, spec):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not key or not value.strip():
            raise ValueError(f"option {part!r} in spec {spec!r} must look like key=value")
        if key in options:
            raise ValueError(f"option {key!r} appears twice in spec {spec!r}")
        options[key] = value.strip()
    return options


def spec_of(config: EncodingConfig) -> str:
    """The spec string of a config: its name and its non-default options."""
    opts = config.options()
    if not opts:
        return config.name
    return config.name + ":" + ",".join(f"{k}={format_value(v)}" for k, v in opts.items())


def check_rebuilds_from_spec(config: EncodingConfig) -> None:
    """Refuse a config that its own spec string does not rebuild (e.g. ``original_length=512.5``
    given in Python, where a spec needs an integer, or a list where a tuple is meant): such an
    encoding would save a spec that loads as another encoding, or not at all. ValueError naming
    the option."""
    spec = spec_of(config)
    _, _, body = spec.partition(":")
    try:
        rebuilt = type(config).from_options(parse_options(body, spec))
    except (TypeError, ValueError) as e:
        raise ValueError(f"this config cannot be written as a spec ({spec!r}: {e})") from None
    if rebuilt == config:
        return
    mine, theirs = config.options(), rebuilt.options()
    for key in [*mine, *(k for k in theirs if k not in mine)]:
        a, b = mine.get(key), theirs.get(key)
        if a != b or type(a) is not type(b):
            raise ValueError(
                f"{key}={a!r} does not survive its spec: {spec!r} rebuilds {key}={b!r}; give "
                f"{key} as {type(b).__name__ if b is not None else 'its default'}"
            )
    raise ValueError(f"this config is not rebuilt by its spec {spec!r}")


@dataclasses.dataclass(frozen=True)
class HeadRows:
    """Per-head parameters a head-influence analysis reverts one row at a time.

    Each parameter is (L|1, X|1, ...): row [i, j] belongs to layer i and head j (a key/value
    head for frequencies, a query head for temperatures); a dimension of 1 is shared by every
    layer (``shared_layers``) or head (``shared_heads``). Every parameter is 0 at init.
    """

    parameters: tuple[nn.Parameter, ...]
    shared_layers: bool
    shared_heads: bool


class PositionEncoding(nn.Module):
    """One module per model; ``layer`` selects per-layer parameters.

    Default methods are identities, so each encoding overrides only what it changes:
    absolute encodings ``embed``, rotary encodings ``rotate_q``/``rotate_k``, bias encodings
    ``score_bias``. ``positions`` is a LongTensor (B, T) of absolute positions; packed and
    offset batches are allowed. What an encoding does is declared below (module docstring):
    integrations read these declarations, they never probe the class.
    """

    # embed() adds to the token states (absolute encodings).
    adds_to_embeddings: ClassVar[bool] = False
    # score_bias() returns an additive logit bias (ALiBi).
    has_score_bias: ClassVar[bool] = False
    # That bias is the same in every layer: a model may build it once per forward and share it.
    layer_independent_bias: ClassVar[bool] = False
    # True when frequencies depend on the current length (dynamic NTK, LongRoPE's switch):
    # integrations must then cache *unrotated* keys and rotate them again as the cache grows.
    dynamic: bool = False
    # The rotation frequencies are trainable parameters (AdaRoPE, tuned-yarn).
    learned_frequencies: ClassVar[bool] = False
    # The distance each query-key pair sees is remapped (ReRoPE, Self-Extend, DCA, STRING):
    # attention must be computed from ``bands`` (``bands.banded_attention``) over cached
    # *unrotated* keys; rotate_q/rotate_k alone give only the identity band.
    remaps_distance: ClassVar[bool] = False
    # Rotary layout: channels that rotate (0: none), pairs F, pairing ("half"/"interleaved").
    rotary_dim: int = 0
    n_pairs: int = 0
    pairing: str | None = None
    # AdaScale's reference length L_ref (tokens); None when queries carry no temperature.
    l_ref: int | None = None
    # The layer types this encoding covers in a model that has several (Gemma 3's local and
    # global layers; ``layers=`` of a spec, read by ropekit.hf); None: the model's default.
    layers: str | None = None

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
        check_rebuilds_from_spec(config)
        # The first use of the rotation machinery: a bad ROPEKIT_COMPILE stops the program
        # when it builds its model, not midway through a run.
        rotary.check_environment()
        self.config = config
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim, self.n_layers, self.d_model = head_dim, n_layers, d_model

    @property
    def spec(self) -> str:
        """The spec string that rebuilds this encoding (non-default options only)."""
        spec = spec_of(self.config)
        if self.layers is None:
            return spec
        return f"{spec}{',' if ':' in spec else ':'}{LAYERS}={self.layers}"

    def extra_repr(self) -> str:
        return (
            f"spec={self.spec!r}, heads={self.n_heads}/{self.n_kv_heads}, head_dim={self.head_dim}"
        )

    # ------------------------------------------------------------------ the interface
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

    # ------------------------------------------------------------------ the attention-level hook
    def bands(self, q_pos: Tensor, k_pos: Tensor, layer: int = 0) -> list[Band]:
        """The attention as bands (``bands.Band``) for queries at q_pos (B|1, T) over keys at
        k_pos (B|1, S). Every encoding is one band at the true positions; distance remaps
        (``remaps_distance``) return several. (``banded_attention`` rotates queries block by
        block, so a dynamic schedule, whose length comes from each call's positions, belongs
        in ordinary attention, not in this kernel.)"""
        return [Band(q_pos, k_pos)]

    def rotate_band(self, x: Tensor, positions: Tensor, query: bool, layer: int = 0) -> Tensor:
        """Rotate queries (B, H, R, D) (``query``) or keys (B, K, S, D) at a band's positions
        (B|1, R) or (B|1, S): the ``rotate`` that ``bands.banded_attention`` calls."""
        if query:
            return self.rotate_q(x, positions, layer)
        return self.rotate_k(x, positions, layer)

    def band_tables(
        self, positions: Tensor, query: bool, layer: int = 0, dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor, Tensor] | None:
        """cos and sin (B|1, H|K|1, N, F) of the rotation ``rotate_band`` applies at
        ``positions`` (B|1, N) (``rotary.rotate`` with this encoding's ``pairing``: its pairs
        are the first 2 F dims), for a kernel that rotates on its own (the vLLM plugin's
        decoding, ``serve.paged_kernels``); None where ``rotate_band`` is not such a rotation
        (the default)."""
        return None

    # ------------------------------------------------------------------ the typed surface
    @property
    def base_schedule(self) -> EncodingConfig | None:
        """The fixed rotary schedule this encoding starts from (a ``RopeConfig``): itself for
        fixed schedules, AdaRoPE's init schedule, tuned-yarn's untruncated YaRN; None when it
        does not rotate."""
        return self.config.base_schedule

    def _extension(self) -> Extension | None:
        return None if self.base_schedule is None else self.config.extension()

    @property
    def base(self) -> float | None:
        """The RoPE base b of the base schedule; None when the encoding does not rotate."""
        ext = self._extension()
        return None if ext is None else ext.base

    @property
    def factor(self) -> float | None:
        """The stretch factor s of the schedule; None where it has none (plain RoPE)."""
        ext = self._extension()
        return None if ext is None else ext.factor

    @property
    def original_length(self) -> int | None:
        """The original length L0 (tokens) the encoding is placed by (a schedule's L0, a
        remap's, the mixed window); None where it has none."""
        ext = self._extension()
        return None if ext is None else ext.original_length

    def inv_freq(self, layer: int = 0, length: int | None = None) -> tuple[Tensor, float | Tensor]:
        """theta (K|1, F) float64 of one layer and the cos/sin attention factor; ``length`` is
        the sequence length a dynamic schedule follows. ValueError when nothing rotates."""
        raise ValueError(f"encoding {self.spec!r} does not rotate; it has no frequencies")

    def log_frequencies(self, layer: int = 0, length: int | None = None) -> Tensor:
        """ln theta (K|1, F) float64 of one layer (see ``inv_freq``)."""
        return self.inv_freq(layer, length)[0].log()

    def query_temperature(self, positions: Tensor, layer: int = 0) -> Tensor | None:
        """The factor ``rotate_q`` multiplies queries by after rotating them, (B|1, H|1, T, 1)
        for positions (B|1, T) (AdaScale); None when queries are not scaled."""
        return None

    def head_rows(self, kind: str) -> HeadRows | None:
        """Per-head parameters of ``kind`` ("freq" or "scale") for head-influence analysis;
        None when the encoding has none of that kind."""
        return None

    def learned_state(self) -> dict[str, Any] | None:
        """What training moved in the schedule, as plain lists for analysis files (AdaRoPE's
        dxi, gamma and tau; tuned-yarn's knobs); None when nothing in it is learned."""
        return None


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
