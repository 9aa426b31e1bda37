"""open_backbone on ropekit decoder folders: the folder itself or a run folder holding it in
``model/``, in eval mode with the byte tokenizer, cast on request; a folder is a decoder's only
when its config says so; a compute dtype outside the list is refused before anything loads."""

from __future__ import annotations

import json

import pytest
import torch

from ropekit.backbone import open_backbone
from ropekit.backbone.decoder import DecoderBackbone
from ropekit.backbone.load import is_decoder_dir
from ropekit.data import ByteTokenizer
from ropekit.model import save_decoder

from ..model.tiny import tiny_model as tiny_decoder


def test_a_decoder_folder_or_a_run_folder_holding_one_opens_as_that_decoder(tmp_path):
    model = tiny_decoder("yarn:factor=2").train()
    save_decoder(model, tmp_path / "run" / "model")
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    for folder in (tmp_path / "run" / "model", tmp_path / "run"):
        backbone = open_backbone(folder)
        assert isinstance(backbone, DecoderBackbone) and not backbone.model.training
        assert isinstance(backbone.tokenizer, ByteTokenizer)
        assert backbone.source == tmp_path / "run" / "model"
        with torch.no_grad():
            torch.testing.assert_close(backbone.model(ids).logits, model.eval()(ids).logits)
    assert open_backbone(tmp_path / "run", dtype="bfloat16").dtype == torch.bfloat16


def test_only_a_config_that_says_ropekit_decoder_marks_a_decoder_folder(tmp_path):
    assert not is_decoder_dir(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not is_decoder_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"format": ')
    assert not is_decoder_dir(tmp_path)  # unreadable: not a decoder, not a crash
    (tmp_path / "config.json").write_text(json.dumps({"format": "ropekit-decoder"}))
    assert is_decoder_dir(tmp_path)


def test_an_unknown_compute_dtype_is_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match="dtype='float8' is not allowed; allowed: "):
        open_backbone(tmp_path / "missing", dtype="float8")
