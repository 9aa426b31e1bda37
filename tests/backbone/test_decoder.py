"""DecoderBackbone: an encoding built for a decoder takes its shape, context length and base;
setting one records its spec in the config; the fingerprint an adapter must match; prompts
grouped by length (the decoder has no padding mask). (Cropping its cache: test_crop.py.)"""

from __future__ import annotations

from ropekit.backbone import as_backbone

from ..model.tiny import CONTEXT
from ..model.tiny import tiny_model as tiny_decoder


def test_an_encoding_built_for_the_decoder_takes_its_shape_length_and_base():
    backbone = as_backbone(tiny_decoder("rope:base=500"))
    encoding = backbone.build_encoding("yarn:factor=4")
    assert (encoding.n_heads, encoding.n_kv_heads, encoding.head_dim) == (4, 2, 8)
    assert (encoding.base, encoding.original_length) == (500.0, CONTEXT)
    backbone.set_encoding(encoding)
    assert backbone.encoding is encoding and backbone.decoder.encoding is encoding
    assert backbone.config.encoding == encoding.spec  # saved with the model, rebuilt on load
    assert backbone.training_length == CONTEXT


def test_the_fingerprint_names_what_an_adapter_must_match():
    backbone = as_backbone(tiny_decoder("rope:base=500"))
    assert backbone.fingerprint() == {
        "architecture": "ropekit-decoder", "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
        "head_dim": 8, "base": 500.0, "original_length": CONTEXT,
    }  # fmt: skip


def test_prompts_are_grouped_by_length_in_order():
    backbone = as_backbone(tiny_decoder())
    prompts = [[1, 2], [3], [4, 5], [6, 7, 8], [9]]
    assert backbone.group_prompts(prompts) == [[0, 2], [1, 4], [3]]
