"""The one place that tells the kinds of model apart.

``as_backbone(model, tokenizer=None)`` is the Backbone of a model object: a transformers
``PreTrainedModel`` (possibly PEFT-wrapped) is an ``HFBackbone``, any other module a
``DecoderBackbone`` (ropekit's Decoder, or a module with its forward contract). A model keeps
its Backbone for its lifetime (an attribute of the module, so the two are collected together
and a deep copy of the model gets a copy of its Backbone), so what was applied to it (an
adapter's sha256, the cached weight digest) is remembered across calls.

Holds: as_backbone.
"""

from __future__ import annotations

import os
import sys

from torch import nn

from ropekit.data.tokenizers import Tokenizer, load_tokenizer
from ropekit.hf.archs import unwrap

from .base import Backbone
from .decoder import DecoderBackbone

_ATTR = "_ropekit_backbone"  # where a module keeps its Backbone


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
    elif isinstance(model.__dict__.get(_ATTR), Backbone):
        backbone = model.__dict__[_ATTR]
    else:
        cls = DecoderBackbone
        if _is_transformers_model(model):
            from .hf import HFBackbone  # imports transformers, here loaded already

            cls = HFBackbone
        backbone = cls(model, None)
        model.__dict__[_ATTR] = backbone  # a plain attribute: not a submodule, not state
    if tokenizer is not None:
        backbone.tokenizer = (
            tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        )
    return backbone


def _is_transformers_model(model: nn.Module) -> bool:
    # Where transformers was never imported no transformers model exists, and importing it
    # to find that out would cost a Decoder-only process about 4 s (ropekit.backbone's doc).
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(unwrap(model), transformers.PreTrainedModel)
