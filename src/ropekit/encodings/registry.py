"""Spec strings and the registry that turns them into encoding modules.

A spec names an encoding and its options: ``rope:base=10000``,
``yarn:factor=8,original_length=512``, ``adarope:init=yarn,factor=8,l_ref=512``,
``longrope:long_factor=[1,1.5,2],factor=4,original_length=512``. Bad specs raise ValueError
naming the field, the value and what is allowed.

Holds: Entry, REGISTRY, parse_spec, names, describe, build.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from .absolute import Learned, LearnedConfig, NoPE, NoPEConfig, Sinusoidal, SinusoidalConfig
from .adarope import AdaRoPE, AdaRoPEConfig, TunedYarn, TunedYarnConfig
from .alibi import ALiBi, ALiBiConfig
from .base import EncodingConfig, PositionEncoding, parse_options
from .mixed import MixedConfig, MixedWindow
from .remap import (
    DCA,
    DCAConfig,
    ReRope,
    ReRopeConfig,
    SelfExtend,
    SelfExtendConfig,
    String,
    StringConfig,
)
from .rope import (
    DynamicNTKConfig,
    LinearConfig,
    Llama3Config,
    LongRopeConfig,
    NTKConfig,
    RopeConfig,
    RotaryEncoding,
    YarnConfig,
)


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered encoding: its module class, config class, one-line summary and source."""

    module: type[PositionEncoding]
    config: type[EncodingConfig]
    summary: str
    source: str

    @property
    def name(self) -> str:
        return self.config.name


REGISTRY: dict[str, Entry] = {
    e.name: e
    for e in [
        Entry(NoPE, NoPEConfig, "no positional encoding", "Haviv et al. 2022"),
        Entry(
            Sinusoidal,
            SinusoidalConfig,
            "fixed sinusoids added to embeddings",
            "Vaswani et al. 2017",
        ),
        Entry(Learned, LearnedConfig, "learned absolute position table", "GPT-2 (2019)"),
        Entry(ALiBi, ALiBiConfig, "linear distance penalty per head", "Press et al. 2022"),
        Entry(
            RotaryEncoding,
            RopeConfig,
            "rotary embedding; fraction<1 = partial RoPE",
            "Su et al. 2021",
        ),
        Entry(
            RotaryEncoding,
            LinearConfig,
            "position interpolation (PI)",
            "Chen et al. 2023",
        ),
        Entry(RotaryEncoding, NTKConfig, "NTK-aware base rescaling", "bloc97 2023"),
        Entry(
            RotaryEncoding,
            DynamicNTKConfig,
            "NTK base following the length",
            "emozilla 2023",
        ),
        Entry(
            RotaryEncoding,
            YarnConfig,
            "NTK-by-parts + attention temperature",
            "Peng et al. 2023",
        ),
        Entry(RotaryEncoding, Llama3Config, "Llama 3.1 band-wise scaling", "Meta 2024"),
        Entry(
            RotaryEncoding,
            LongRopeConfig,
            "searched per-pair rescale factors",
            "Ding et al. 2024",
        ),
        Entry(
            AdaRoPE,
            AdaRoPEConfig,
            "per-head learnable frequencies (AdaFreq) and temperature (AdaScale)",
            "Wang et al. 2026",
        ),
        Entry(
            TunedYarn,
            TunedYarnConfig,
            "YaRN with learnable global knobs",
            "ropekit (review's control)",
        ),
        Entry(
            MixedWindow,
            MixedConfig,
            "original RoPE within the original window, any schedule or adapter beyond it",
            "Shang et al. 2025 (LongRoPE2)",
        ),
        Entry(
            ReRope,
            ReRopeConfig,
            "distances clipped at a window (leaky: slowed by 1/k beyond it)",
            "Su 2023",
        ),
        Entry(
            SelfExtend,
            SelfExtendConfig,
            "neighbour window with normal positions, grouped positions floor(p/G) beyond",
            "Jin et al. 2024",
        ),
        Entry(
            DCA,
            DCAConfig,
            "dual chunk attention: intra-, successive- and inter-chunk positions",
            "An et al. 2024",
        ),
        Entry(
            String,
            StringConfig,
            "large distances shifted onto well-trained small ones (shift S, window W)",
            "An et al. 2025",
        ),
    ]
}

_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"name:k=v,k=v"`` -> (name, {k: v}) with values still strings."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"encoding spec {spec!r} is empty; e.g. 'rope' or 'yarn:factor=8,original_length=512'"
        )
    name, _, body = spec.strip().partition(":")
    name = name.strip().lower()
    if not _NAME.match(name):
        raise ValueError(
            f"encoding name {name!r} in spec {spec!r} is malformed; known: {', '.join(names())}"
        )
    if name not in REGISTRY:
        raise ValueError(f"unknown encoding {name!r}; known: {', '.join(names())}")
    return name, parse_options(body, spec)


def names() -> list[str]:
    """Every registered encoding name."""
    return list(REGISTRY)


REQUIRED = "required"  # describe: the spec must give it
FROM_MODEL = "from the model"  # describe: filled from the model it is built for (base, L0...)
FROM_TARGET = "N / L0 (extend, compare)"  # describe: a factor those commands derive if omitted


def describe(name: str) -> list[tuple[str, str, Any]]:
    """(option, type, default) for each option of an encoding (AdaRoPE lists its own). The
    default is the value itself (None: the encoding's own rule, e.g. DCA's chunk size from L0,
    ReRoPE's clip), or says where the value comes from when the spec omits it: ``FROM_MODEL``
    (the model's base, original length... ``CONTEXT_FIELDS``), ``FROM_TARGET`` (a scaling
    factor, which ``extend`` and ``compare`` take as N / L0), or ``REQUIRED``."""
    entry = REGISTRY[name]
    context = set(entry.config.CONTEXT_FIELDS)
    out = []
    for field in dataclasses.fields(entry.config):
        if field.name == "schedule":
            continue
        if field.name in context:
            default: Any = FROM_MODEL
        elif field.default is dataclasses.MISSING or field.name in entry.config.REQUIRED_OPTIONS:
            default = REQUIRED
        elif field.name == "factor" and field.default is None:
            default = FROM_TARGET
        else:
            default = field.default
        out.append((field.name, str(field.type), default))
    return out


def config_from_spec(spec: str, **context: Any) -> tuple[Entry, EncodingConfig]:
    """Parse and validate a spec, filling context fields (base, original_length...) the spec
    leaves out."""
    name, options = parse_spec(spec)
    entry = REGISTRY[name]
    try:
        config = entry.config.from_options(options, context)
    except TypeError as e:  # a required dataclass field missing
        raise ValueError(f"spec {spec!r}: {e}") from None
    except ValueError as e:
        raise ValueError(f"spec {spec!r}: {e}") from None
    return entry, config


def build(
    spec: str,
    *,
    n_heads: int,
    head_dim: int,
    n_kv_heads: int | None = None,
    n_layers: int = 1,
    d_model: int | None = None,
    **context: Any,
) -> PositionEncoding:
    """The encoding module named by ``spec`` for a model of the given shape.

    ``context`` supplies defaults the spec may omit, e.g. ``base=`` and ``original_length=``
    of a Hugging Face model being patched.
    """
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    for field, value in (
        ("n_heads", n_heads),
        ("head_dim", head_dim),
        ("n_kv_heads", n_kv_heads),
        ("n_layers", n_layers),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}={value!r} is not allowed; it must be an integer >= 1")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
    entry, config = config_from_spec(spec, **context)
    try:
        return entry.module(
            config,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            n_layers=n_layers,
            d_model=d_model or n_heads * head_dim,
        )
    except ValueError as e:
        raise ValueError(f"spec {spec!r}: {e}") from None
