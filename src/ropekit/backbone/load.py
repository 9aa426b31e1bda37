"""Open any model ropekit works on, and see an in-memory model through the seam.

- ``open_backbone(path_or_name, adapter=None)``: a ropekit decoder folder (or a run folder
  holding one in ``model/``), a local Hugging Face folder, or an installed known model such as
  ``smollm2-135m``; in eval mode, optionally with an adapter on top.
- ``as_backbone(model, tokenizer=None)``: the Backbone of a model object. This is the one place
  that asks what kind a model is (a transformers ``PreTrainedModel``, possibly PEFT-wrapped, is
  ``HFBackbone``; any other module ``DecoderBackbone``). A model keeps its Backbone for its
  lifetime, so what was applied to it (an adapter's sha256, the cached weight digest) is
  remembered across calls.

Holds: open_backbone, as_backbone, is_decoder_dir.
"""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

from torch import nn

from ropekit.data.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer
from ropekit.hf.archs import unwrap
from ropekit.hf.models import load_model, resolve_model
from ropekit.model import load_decoder

from .adapters import load_adapter
from .base import Backbone
from .decoder import DecoderBackbone
from .hf import HFBackbone

_BACKBONES: weakref.WeakKeyDictionary[nn.Module, Backbone] = weakref.WeakKeyDictionary()


def as_backbone(
    model: Backbone | nn.Module, tokenizer: Tokenizer | str | os.PathLike[str] | None = None
) -> Backbone:
    """The Backbone of ``model`` (module docstring); ``tokenizer`` (a ropekit Tokenizer or a
    name/path for ``load_tokenizer``) is set on it when given."""
    if isinstance(model, Backbone):
        backbone = model
    elif not isinstance(model, nn.Module):
        raise ValueError(
            f"model={type(model).__name__} is not allowed; allowed: a ropekit Decoder, a "
            "transformers causal LM, or a Backbone"
        )
    elif model in _BACKBONES:
        backbone = _BACKBONES[model]
    else:
        from transformers import PreTrainedModel

        cls = HFBackbone if isinstance(unwrap(model), PreTrainedModel) else DecoderBackbone
        backbone = cls(model, None)
        _BACKBONES[model] = backbone
    if tokenizer is not None:
        backbone.tokenizer = (
            tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        )
    return backbone


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
) -> Backbone:
    """The model and its tokenizer, in eval mode, with ``adapter`` loaded when given;
    ``backbone.source`` is the folder the model came from."""
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
    return backbone
