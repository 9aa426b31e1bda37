"""ropekit.serve: what ropekit makes, served by engines that do not run ropekit.

Modules:

- ``exporting``: ``export(model_or_path, adapter, out_dir, format="hf"|"gguf"|"vllm")``, a plain
  Hugging Face folder whose ``rope_parameters`` (and length fields) make transformers and
  vLLM compute the encoding, or a GGUF file for llama.cpp (``gguf_file``).
- ``gguf_file``: the GGUF writer (llama architecture, llama.cpp's rope keys, ``rope_freqs``).
- ``engines``: each engine's rules for a rope config, written from its source: the per-pair
  frequencies, the attention factor and the longest length it accepts.
- ``inspection``: ``inspect_folder(path)``, what every engine will do with a folder and the
  config change that removes each disagreement (``ropekit inspect``).
- ``nearest``: the closest exportable shared schedule to a per-head one.
- ``vllm_plugin``: vLLM's out-of-tree model that serves per-head AdaRoPE adapters (entry point
  ``vllm.general_plugins``); imports vLLM, so only the vLLM environment loads it.
- ``lm_eval_model``: the ``ropekit`` model of lm-evaluation-harness (imports lm_eval).
- ``llamacpp_self_extend``: Self-Extend (``mode=llama.cpp``) served by llama.cpp's group
  attention through llama-cpp-python; imports only llama_cpp and numpy, so a user copies the
  file (``export --format gguf`` names it in the record, ``inspect`` prints the command).

Attributes load on first use, so ``import ropekit.serve`` imports neither transformers nor
the engines (the vLLM environment pins another transformers and imports only the plugin).
The module is ``exporting``, not ``export``: a submodule named like the function would
replace ``ropekit.serve.export`` with the module once anything imported it.
"""

from __future__ import annotations

import importlib
from typing import Any

_ATTRS = {
    "export": "exporting",
    "export_rope_parameters": "exporting",
    "length_fields": "exporting",
    "target_length": "exporting",
    "EXPORT_RECORD": "exporting",
    "export_gguf": "gguf_file",
    "inspect_folder": "inspection",
    "nearest_shared": "nearest",
}

__all__ = sorted(_ATTRS)


def __getattr__(name: str) -> Any:
    if name not in _ATTRS:
        raise AttributeError(f"module 'ropekit.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ropekit.serve.{_ATTRS[name]}"), name)
