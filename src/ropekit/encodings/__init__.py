"""ropekit.encodings: every positional encoding behind one interface.

``build(spec, n_heads=, n_kv_heads=, head_dim=, n_layers=)`` returns a ``PositionEncoding``;
``names()`` lists the registered encodings; ``schedules`` holds the pure frequency functions;
``rotary`` the rotation itself. This package imports nothing from the rest of ropekit.
"""

from . import rotary, schedules
from .adarope import AdaRoPE, TunedYarn
from .base import EncodingConfig, PositionEncoding
from .registry import REGISTRY, build, config_from_spec, describe, names, parse_spec
from .rope import RotaryEncoding

__all__ = [
    "REGISTRY",
    "AdaRoPE",
    "EncodingConfig",
    "PositionEncoding",
    "RotaryEncoding",
    "TunedYarn",
    "build",
    "config_from_spec",
    "describe",
    "names",
    "parse_spec",
    "rotary",
    "schedules",
]
