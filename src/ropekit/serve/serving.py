"""Which engines serve an encoding exactly, before anything is exported: the question
``compare`` asks of every method it ranks, answered by the rules ``inspect`` applies.

For each export format (``engines.FORMATS``) the folder's config is built in memory
(``exporting.served_config``: what ``ropekit export`` would write, nothing written) and each
engine that serves the format is held to the reference at the lengths inspect checks: the
original window's first 1024 tokens (or all of it) and the target. An engine serves the
encoding exactly when the export is not refused and inspect would find no disagreement:
per-pair frequencies within 1e-6 relative, the same attention factor, the target length
accepted, no caveat (e.g. transformers' dynamic NTK through its KV cache). "Exactly" means
within the engine's measured noise floor (``Engine.floor``), not bit for bit.

Holds: served_by, Served.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ropekit.backbone import Backbone
from ropekit.encodings import PositionEncoding
from ropekit.hf.rope_config import ExportRefused

from .engines import ENGINES, FORMATS, ServedFolder
from .exporting import served_config
from .inspection import layer_type_folders, lengths_checked, rope_disagreements


@dataclasses.dataclass(frozen=True)
class Served:
    """One engine's answer for one encoding: exact, or why not (one line)."""

    engine: str
    exact: bool
    why: str  # "" when exact


def served_by(
    backbone: Backbone, target: int | None = None, encoding: PositionEncoding | None = None
) -> dict[str, Served]:
    """For every registered engine, whether it serves ``backbone``'s encoding (or
    ``encoding``, not attached) on its model exactly at ``target`` tokens (default: the length
    the export would be made for)."""
    model = getattr(backbone, "model", None)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "rope_parameters"):
        why = "not a Hugging Face model: no engine serves ropekit's own decoder"
        return {name: Served(name, False, why) for name in ENGINES}
    return encoding_served_by(encoding or backbone.encoding, config, target)


def encoding_served_by(
    encoding: PositionEncoding, model_config: Any, target: int | None = None
) -> dict[str, Served]:
    """``served_by`` for an encoding and the HF config of the model it is attached to."""
    out: dict[str, Served] = {}
    for fmt, names in FORMATS.items():
        try:
            hf_config, record = served_config(model_config, encoding, fmt, max_length=target)
        except ExportRefused as e:
            why = f"export --format {fmt} refused: {_first_sentence(str(e))}"
            out.update({name: Served(name, False, why) for name in names})
            continue
        config = {**hf_config.to_dict(), "rope_parameters": dict(hf_config.rope_parameters)}
        folder = ServedFolder(
            path=Path("<not written>"), config=config, hf_config=hf_config,
            target=int(record["target_length"]), record=record, encoding=encoding,
        )  # fmt: skip
        found = [  # per layer type where rope_parameters nest by type
            d
            for part in layer_type_folders(folder).values()
            for d in rope_disagreements(part, lengths_checked(part))
        ]
        for name in names:
            mine = [d for d in found if d.engine == name]
            why = f"{mine[0].what} (at {mine[0].length})" if mine else ""
            out[name] = Served(name, not mine, why)
    return {name: out[name] for name in ENGINES}


def _first_sentence(text: str) -> str:
    head = text.split(". ", 1)[0]
    return head if head.endswith(".") else head + "."
