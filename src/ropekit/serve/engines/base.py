"""What every serving engine is: a rule for what it computes from a served folder, the export
format that writes a folder for it, and its measured noise floor.

Holds: Engine, EngineRoPE, ServedFolder, rotary_dims, original_length, EXPORT_RECORD.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

EXPORT_RECORD = "ropekit_export.json"  # what ropekit writes beside every export: spec, rule, notes


@dataclasses.dataclass(frozen=True)
class EngineRoPE:
    """One engine's RoPE for one config at one sequence length."""

    engine: str
    source: str  # the engine file and function the rule comes from
    inv_freq: torch.Tensor | None  # (F,) float64, None when the engine refuses the config
    attention_factor: float | None  # multiplies cos and sin (q.k by its square)
    max_length: int | None  # longest accepted sequence; None: the engine enforces none
    error: str | None = None
    notes: tuple[str, ...] = ()
    # What the engine says when asked for the folder's target length, where it refuses it
    # but serves a shorter one (this view is then the shorter one's).
    target_refused: str | None = None
    # (L, K, F) float64: per (layer, kv head) frequencies, for an engine that serves a per-head
    # schedule (ropekit's plugin); ``inv_freq`` is then layer 0, head 0's.
    per_head: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class ServedFolder:
    """A folder as the engines read it: config.json (``rope_parameters`` defaulted), the
    tokenizer's config, the transformers config, and the length the export was made for; or
    a GGUF file."""

    path: Path
    config: dict[str, Any]
    hf_config: Any  # transformers' PretrainedConfig of the same config.json
    target: int
    tokenizer_config: dict[str, Any] | None = None
    record: dict[str, Any] | None = None  # ropekit_export.json, when ropekit wrote the folder
    # A GGUF file (``ropekit.serve.gguf_file.GgufModel``): then ``config`` is built from its
    # shapes and the record's rope_parameters (what it was converted from), ``hf_config`` is
    # None, and only llama.cpp reads the file itself.
    gguf: Any = None
    files: tuple[Path, ...] = ()  # what was read, for provenance
    # The encoding itself, for a folder not written yet (``ropekit.serve.serving``): the
    # plugin serves it instead of reading ropekit_adapter/.
    encoding: Any = None

    @property
    def rope_parameters(self) -> dict[str, Any]:
        return self.config["rope_parameters"]

    @property
    def rope_type(self) -> str:
        return self.rope_parameters.get("rope_type", "default")


class Engine:
    """One serving engine. Subclasses set the class attributes and ``rope``; the ``*_fix``
    methods say which config change removes a disagreement of that kind (the defaults say no
    rule is known). Registered in ``ropekit.serve.engines.ENGINES``."""

    name: ClassVar[str]  # as users and reports spell it: "vllm", "llama.cpp"
    label: ClassVar[str]  # the engine and the version its rule was written from
    export_format: ClassVar[str]  # ``ropekit export --format`` that writes its folder
    # The tolerance on |d log p| (max and mean over a prompt) against ropekit's patched model,
    # by prompt length: 5 x the largest float32 noise of the engine, measured by
    # ``make test-serving`` (docs/serving/serving.json "tolerance"; a test holds these to it).
    floor: ClassVar[Mapping[int, Mapping[str, float]]]

    def rope(self, folder: ServedFolder, length: int) -> EngineRoPE | None:
        """What the engine computes for ``folder`` at ``length`` tokens; None when this engine
        does not apply to the folder (e.g. the plugin for a folder that does not name it)."""
        raise NotImplementedError

    def frequencies_fix(self, folder: ServedFolder) -> str:
        return f"no rule here for {self.name} {folder.rope_type}; compare the engine's source"

    def attention_fix(self, folder: ServedFolder, value: float) -> str:
        return f"make {self.name}'s attention factor {value:.6f}"

    def refusal_fix(self, folder: ServedFolder) -> str:
        return "serve at a length the engine accepts, or change the length fields"

    def length_fix(self, folder: ServedFolder) -> str:
        return f"serve at most the accepted length, or raise it to {folder.target}"

    def caveats(self, folder: ServedFolder) -> list[tuple[str, str]]:
        """Where the engine departs from ropekit's patched model although its rope view
        agrees (what it does and the fix), e.g. in its KV cache."""
        return []

    def per_head_fix(self, folder: ServedFolder) -> str:
        """What serves a per-head adapter instead of this engine's one shared schedule."""
        return (
            f"{self.name} computes one schedule for every head: serve the folder with vLLM and "
            "ropekit's plugin (ropekit installed in vLLM's environment), or with ropekit"
        )

    def __repr__(self) -> str:
        return f"<engine {self.name}: {self.label}>"


def rotary_dims(config: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    """The rotated channels of one head and the config's ``rope_parameters``."""
    params = dict(config.get("rope_parameters") or {})
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
    return dim, params


def original_length(params: Mapping[str, Any], config: Mapping[str, Any]) -> int:
    """L0 of a rope config: ``original_max_position_embeddings``, else the window."""
    return int(params.get("original_max_position_embeddings") or config["max_position_embeddings"])
