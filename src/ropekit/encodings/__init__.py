"""ropekit.encodings: every positional encoding behind one interface.

``Spec.parse(text)`` parses a spec once; ``build(spec, n_heads=, n_kv_heads=, head_dim=,
n_layers=)`` returns a ``PositionEncoding``;
``names()`` lists the registered encodings; ``split_specs`` splits a comma-separated list of
specs; ``schedules`` holds the pure frequency functions;
``rotary`` the rotation itself; ``bands`` the attention of distance-remapping encodings
(``banded_attention``). This package imports nothing from the rest of ropekit.
"""

from . import bands, rotary, schedules
from .adarope import AdaRoPE, TunedYarn
from .bands import Band, banded_attention
from .base import EncodingConfig, PositionEncoding
from .registry import REGISTRY, Spec, build, describe, names, split_specs
from .rope import RotaryEncoding

__all__ = [
    "REGISTRY",
    "AdaRoPE",
    "Band",
    "EncodingConfig",
    "PositionEncoding",
    "RotaryEncoding",
    "Spec",
    "TunedYarn",
    "banded_attention",
    "bands",
    "build",
    "describe",
    "names",
    "rotary",
    "schedules",
    "split_specs",
]
