"""Open any model ropekit works on.

- ``open_backbone(path_or_name, adapter=None, dtype=None)``: a ropekit decoder folder (or a run
  folder holding one in ``model/``), a local Hugging Face folder, or an installed known model
  such as ``smollm2-135m``; in eval mode, optionally with an adapter on top and cast to a
  compute dtype.
Holds: open_backbone, is_decoder_dir.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ropekit.data.tokenizers import ByteTokenizer, load_tokenizer
from ropekit.hf.models import load_model, resolve_model
from ropekit.model import load_decoder

from .adapters import load_adapter
from .base import COMPUTE_DTYPES, Backbone
from .kinds import as_backbone


def is_decoder_dir(path: Path) -> bool:
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("format") == "ropekit-decoder"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def open_backbone(
    path_or_name: str | os.PathLike[str],
    *,
    adapter: str | os.PathLike[str] | None = None,
    trust_remote_code: bool = False,
    dtype: str | None = None,
) -> Backbone:
    """The model and its tokenizer, in eval mode, with ``adapter`` loaded when given, cast
    to ``dtype`` (a ``COMPUTE_DTYPES`` name; None: as stored) after it (``Backbone.cast``);
    ``backbone.source`` is the folder the model came from."""
    if dtype is not None and dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed; allowed: {', '.join(COMPUTE_DTYPES)}")
    path = Path(path_or_name)
    for candidate in (path, path / "model"):
        if is_decoder_dir(candidate):
            backbone = as_backbone(load_decoder(candidate).eval(), ByteTokenizer())
            backbone.source = candidate
            break
    else:
        folder = resolve_model(path_or_name)
        model = load_model(folder, trust_remote_code=trust_remote_code)
        model.config.use_cache = False  # training and scoring build no cache unless asked
        backbone = as_backbone(model, load_tokenizer(folder))
        backbone.source = folder
    if adapter is not None:
        load_adapter(backbone, adapter)
    if dtype is not None:
        backbone.cast(COMPUTE_DTYPES[dtype])
    return backbone
