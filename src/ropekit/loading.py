"""Open any model ropekit works on: a ropekit decoder folder (or a run folder holding one in
``model/``), a local Hugging Face folder, or an installed known model such as
``smollm2-135m``; optionally with a positional adapter on top.

Holds: LoadedModel, is_decoder_dir, load_any.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from torch import nn


@dataclasses.dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # a ropekit Tokenizer ("bytes" models get ByteTokenizer)
    kind: str  # "decoder" or "hf"
    path: Path


def is_decoder_dir(path: Path) -> bool:
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("format") == "ropekit-decoder"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def load_any(
    path_or_name: str | os.PathLike[str],
    *,
    adapter: str | os.PathLike[str] | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """The model and its tokenizer, in eval mode, with ``adapter`` loaded when given."""
    from ropekit.data import ByteTokenizer, load_tokenizer

    path = Path(path_or_name)
    for candidate in (path, path / "model"):
        if is_decoder_dir(candidate):
            from ropekit.model import load_decoder

            model = load_decoder(candidate).eval()
            loaded = LoadedModel(model, ByteTokenizer(), "decoder", candidate)
            break
    else:
        from ropekit.hf import load_model
        from ropekit.hf.models import resolve_model

        folder = resolve_model(path_or_name)
        model = load_model(folder, trust_remote_code=trust_remote_code)
        model.config.use_cache = False  # training and scoring build no cache unless asked
        loaded = LoadedModel(model, load_tokenizer(folder), "hf", folder)
    if adapter is not None:
        from ropekit.train.extend import load_adapter

        load_adapter(loaded.model, adapter)
    return loaded
