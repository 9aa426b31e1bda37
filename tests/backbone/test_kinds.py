"""as_backbone: the kind of model decides the Backbone (transformers -> HFBackbone, any other
module -> DecoderBackbone); a model keeps one Backbone for its lifetime, and a deep copy gets
its own; what is not a module is refused."""

from __future__ import annotations

import copy

import pytest
from torch import nn

from ropekit.backbone import as_backbone
from ropekit.backbone.decoder import DecoderBackbone
from ropekit.backbone.hf import HFBackbone
from ropekit.data import ByteTokenizer

from ..model.tiny import tiny_model as tiny_decoder


def test_the_kind_of_model_decides_the_backbone(tiny_llama):
    assert isinstance(as_backbone(tiny_llama()), HFBackbone)
    assert isinstance(as_backbone(tiny_decoder()), DecoderBackbone)
    assert isinstance(as_backbone(nn.Linear(2, 2)), DecoderBackbone)  # the forward contract


def test_a_model_keeps_its_backbone_and_a_copy_gets_its_own():
    model = tiny_decoder()
    backbone = as_backbone(model)
    assert as_backbone(model) is backbone and as_backbone(backbone) is backbone
    tokenizer = ByteTokenizer()
    assert as_backbone(model, tokenizer) is backbone and backbone.tokenizer is tokenizer
    twin = copy.deepcopy(model)
    assert as_backbone(twin) is not backbone and as_backbone(twin).model is twin
    assert not any("backbone" in name for name, _ in model.named_modules())  # not a submodule
    assert not any("backbone" in k for k in model.state_dict())  # not state


def test_what_is_not_a_module_is_refused():
    with pytest.raises(ValueError, match="model=str is not allowed"):
        as_backbone("smollm2-135m")
