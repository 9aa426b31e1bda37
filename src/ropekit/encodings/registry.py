"""Spec strings and the registry that turns them into encoding modules.

A spec names an encoding and its options: ``rope:base=10000``,
``yarn:factor=8,original_length=512``, ``adarope:init=yarn,factor=8,l_ref=512``,
``longrope:long_factor=[1,1.5,2],factor=4,original_length=512``. Bad specs raise ValueError
naming the field, the value and what is allowed.

Holds: Entry, REGISTRY, Spec (a spec parsed once), names, describe, build.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from .base import (
    LAYERS,
    EncodingConfig,
    PositionEncoding,
    check_layers,
    format_value,
    parse_options,
    split_options,
)
from .catalog import ENTRIES, Entry
from .mixed import MixedConfig, MixedWindow
from .temperature import Temperature, TemperatureConfig

REGISTRY: dict[str, Entry] = {
    e.name: e
    for e in (
        *ENTRIES,
        Entry(
            MixedWindow,
            MixedConfig,
            "original RoPE within the original window, any schedule or adapter beyond it",
            "Shang et al. 2025 (LongRoPE2)",
        ),
        Entry(
            Temperature,
            TemperatureConfig,
            "a fixed query temperature (log-n, Scalable-Softmax, Llama 4) over any fixed "
            "schedule or remap",
            "Su 2021; Nakanishi 2025; Meta 2025",
        ),
    )
}


_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


@dataclasses.dataclass(frozen=True)
class Spec:
    """An encoding spec parsed once: the registered name and the options its text gives, in
    order, values still text (the encoding's config types them when it is built for a model,
    which supplies the context fields the spec leaves out: ``config``).

    Parse at the edge (``Spec.parse``: the CLI, a config file, compare) and pass this object
    down; a rule that completes a spec (the factor ``extend`` and ``compare`` derive as N / L0)
    asks ``takes``/``gives`` and adds with ``with_options``, never by editing the text.
    ``str(spec)`` is the text again, and ``Spec.parse(str(spec)) == spec``.
    """

    name: str
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, spec: str | Spec) -> Spec:
        """``"name:k=v,k=v"`` -> Spec (a Spec is returned as it is). ValueError names what is
        malformed and what is allowed."""
        if isinstance(spec, Spec):
            return spec
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(
                f"encoding spec {spec!r} is empty; e.g. 'rope' or "
                "'yarn:factor=8,original_length=512'"
            )
        name, _, body = spec.strip().partition(":")
        name = name.strip().lower()
        if not _NAME.match(name):
            raise ValueError(
                f"encoding name {name!r} in spec {spec!r} is malformed; known: {', '.join(names())}"
            )
        if name not in REGISTRY:
            raise ValueError(f"unknown encoding {name!r}; known: {', '.join(names())}")
        return cls(name, tuple(parse_options(body, spec).items()))

    def __str__(self) -> str:
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.options)

    @property
    def entry(self) -> Entry:
        return REGISTRY[self.name]

    @property
    def given(self) -> dict[str, str]:
        """The options the spec gives: {name: text}."""
        return dict(self.options)

    def gives(self, option: str) -> bool:
        return option in self.given

    @property
    def layers(self) -> str | None:
        """The layer types the spec covers (``layers=``; read by models with several types)."""
        value = self.given.get(LAYERS)
        return None if value is None else check_layers(value)

    def without(self, *options: str) -> Spec:
        """This spec without ``options``."""
        return Spec(self.name, tuple((k, v) for k, v in self.options if k not in options))

    def takes(self, option: str) -> bool:
        """Whether ``option`` is one this encoding accepts, given the spec's ``init`` or
        ``method`` (AdaRoPE and the remaps pass options to their init schedule)."""
        return option in self.entry.config.option_types(self.given)

    def with_options(self, **values: Any) -> Spec:
        """This spec with ``values`` added (or replacing the ones it gives), each written as a
        spec writes it (``format_value``)."""
        merged = {**self.given, **{k: format_value(v) for k, v in values.items()}}
        return Spec(self.name, tuple(merged.items()))

    def config(self, **context: Any) -> EncodingConfig:
        """The validated config, context fields (base, original_length...) filled from
        ``context`` where the spec leaves them out (``layers=`` belongs to the module)."""
        try:
            return self.entry.config.from_options(self.without(LAYERS).given, context)
        except (TypeError, ValueError) as e:  # TypeError: a required dataclass field missing
            raise ValueError(f"spec {str(self)!r}: {e}") from None


def names() -> list[str]:
    """Every registered encoding name."""
    return list(REGISTRY)


_OPTION = re.compile(r"[A-Za-z_]\w*\s*=")  # key=value: an option of the spec before it


def split_specs(text: str) -> tuple[str, ...]:
    """A comma-separated list of specs, ``"rope,yarn:factor=4,beta_fast=16,adarope"`` ->
    ("rope", "yarn:factor=4,beta_fast=16", "adarope"): a comma outside brackets starts a new
    spec unless what follows is an option (``key=value``) of the spec before, so a spec's own
    options and lists keep their commas, and a word that is neither (``rope,bogus``) is a
    spec of its own, which ``Spec.parse`` refuses by its name."""
    specs: list[str] = []
    for part in (p.strip() for p in split_options(text, text)):
        if not part:
            continue
        if specs and _OPTION.match(part):
            specs[-1] += "," + part
        else:
            specs.append(part)
    return tuple(specs)


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


def build(
    spec: Spec | str,
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
    spec = Spec.parse(spec)
    config = spec.config(**context)
    try:
        module = spec.entry.module(
            config,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            n_layers=n_layers,
            d_model=d_model or n_heads * head_dim,
        )
        module.layers = spec.layers
    except ValueError as e:
        raise ValueError(f"spec {str(spec)!r}: {e}") from None
    return module
