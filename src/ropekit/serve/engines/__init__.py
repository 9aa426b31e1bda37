"""The serving engines ropekit exports to, as one type (``Engine``, in ``base``): each says
what it computes from a served folder (the rule ``ropekit inspect`` applies, written from the
engine's source and citing the file and function), which ``ropekit export --format`` writes a
folder for it, and its measured noise floor.

- ``transformers``: the reference meaning of ``rope_parameters``;
- ``vllm``: stock vLLM 0.32;
- ``vllm_ropekit``: vLLM with ropekit's plugin, for folders that name it (per-head AdaRoPE);
- ``llamacpp``: llama.cpp through a GGUF file.

Adding an engine is one module here with an ``Engine`` subclass, its entry in ``ENGINES``,
and its tests; ``inspect``, ``export --format`` and the CLI's choices follow from the registry.

Holds: ENGINES, FORMATS, engine, Engine, EngineRoPE, ServedFolder, transformers_rope,
vllm_rope, vllm_max_length, llamacpp_rope, llamacpp_from_config, is_plugin_folder.
"""

from __future__ import annotations

from .base import EXPORT_RECORD, Engine, EngineRoPE, ServedFolder
from .llamacpp import LlamaCpp, llamacpp_from_config, llamacpp_rope
from .transformers import Transformers, transformers_rope
from .vllm import Vllm, vllm_max_length, vllm_rope
from .vllm_ropekit import VllmRopekit, is_plugin_folder

# Reports list engines in this order; transformers, the reference, first.
ENGINES: dict[str, Engine] = {
    e.name: e for e in (Transformers(), Vllm(), VllmRopekit(), LlamaCpp())
}
# Each export format and the engines that serve what it writes.
FORMATS: dict[str, tuple[str, ...]] = {}
for _e in ENGINES.values():
    FORMATS[_e.export_format] = (*FORMATS.get(_e.export_format, ()), _e.name)
del _e


def engine(name: str) -> Engine:
    """The engine registered as ``name``; a ValueError naming the allowed ones otherwise."""
    if name not in ENGINES:
        raise ValueError(f"engine={name!r} is not known; allowed: {', '.join(ENGINES)}")
    return ENGINES[name]


__all__ = [
    "ENGINES", "EXPORT_RECORD", "FORMATS", "Engine", "EngineRoPE", "ServedFolder", "engine",
    "is_plugin_folder", "llamacpp_from_config", "llamacpp_rope", "transformers_rope",
    "vllm_max_length", "vllm_rope",
]  # fmt: skip
