"""ropekit.backbone: the seam between what ropekit does to a language model (train its
positional parameters, score it, analyse its heads) and which kind of model it is.

- ``base``: ``Backbone``, the one interface (encoding, identity, training, scoring).
- ``decoder``, ``hf``: its two implementations, ropekit's reference decoder and Hugging Face
  causal LMs (every family of ``ropekit.hf.archs.ARCHS``; PEFT-wrapped or not).
- ``adapters``: positional adapters and LoRA weights, checked by sha256, for any kind.
- ``kinds``: ``as_backbone`` (an in-memory model): the only place that tells the kinds apart.
- ``load``: ``open_backbone`` (a folder or an installed model name).

Everything above this package (train, evals, analysis, the CLI) talks to models through it.

``HFBackbone`` loads on first use (``hf`` imports transformers, about 4 s of CPU), so a process
that only ever holds a ropekit ``Decoder`` never imports transformers; ``kinds`` and ``load``
reach for it only when a transformers model is in hand.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LORA_CONFIG,
    LORA_WEIGHTS,
    AdapterError,
    add_lora,
    load_adapter,
    load_lora,
    read_adapter,
    save_adapter,
    save_lora,
    write_adapter,
)
from .base import COMPUTE_DTYPES, Backbone, parameter_digest
from .decoder import DecoderBackbone
from .kinds import as_backbone
from .load import is_decoder_dir, open_backbone

if TYPE_CHECKING:
    from .hf import HFBackbone

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "COMPUTE_DTYPES",
    "LORA_CONFIG",
    "LORA_WEIGHTS",
    "AdapterError",
    "Backbone",
    "DecoderBackbone",
    "HFBackbone",
    "add_lora",
    "as_backbone",
    "is_decoder_dir",
    "load_adapter",
    "load_lora",
    "open_backbone",
    "parameter_digest",
    "read_adapter",
    "save_adapter",
    "save_lora",
    "write_adapter",
]


def __getattr__(name: str) -> Any:
    if name != "HFBackbone":
        raise AttributeError(f"module 'ropekit.backbone' has no attribute {name!r}")
    return importlib.import_module("ropekit.backbone.hf").HFBackbone
