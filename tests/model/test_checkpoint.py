"""save / load: exact round trip through safetensors + config.json, clear errors on bad files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open

from ropekit.model import Decoder

from .tiny import SPECS, random_ids, tiny_model


@pytest.mark.parametrize(
    "spec, tied", [("rope", True), (SPECS["adarope"], False), ("alibi", True), ("learned", True)]
)
def test_round_trip_reproduces_logits_exactly(tmp_path, spec, tied):
    model = tiny_model(spec, tie_embeddings=tied)  # learnable encodings perturbed off init
    folder = model.save(tmp_path / "model")
    loaded = Decoder.load(folder)
    assert loaded.config == model.config
    assert loaded.encoding.spec == model.encoding.spec
    assert (loaded.lm_head.weight is loaded.embed.weight) == tied
    ids = random_ids(2, 10)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_files_are_safetensors_and_json_with_the_tied_head_stored_once(tmp_path):
    model = tiny_model("rope")
    model.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "embed.weight" in keys and "lm_head.weight" not in keys
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["config"] == model.config.to_dict()
    assert record["encoding"] == model.encoding.spec


def test_saving_again_replaces_the_files_atomically(tmp_path):
    tiny_model("rope", seed=0).save(tmp_path)
    second = tiny_model("rope", seed=1)
    second.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    ids = random_ids(1, 5)
    torch.testing.assert_close(Decoder.load(tmp_path)(ids).logits, second(ids).logits)


def test_corrupted_weights_raise_value_error_naming_the_file(tmp_path):
    tiny_model("rope").save(tmp_path)
    path = tmp_path / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside a tensor
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors is corrupted"):
        Decoder.load(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_unreadable_safetensors_raise_value_error_without_a_checksum(tmp_path, damage):
    # A hand-written config.json may carry no checksum: safetensors' own checks then speak.
    tiny_model("rope").save(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())
    del record["weights"]["sha256"]
    (tmp_path / "config.json").write_text(json.dumps(record))
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncate":
        data = data[: len(data) - 100]
    else:
        data = struct.pack("<Q", 40) + b"{not json at all, surely not a header!}" + data[48:]
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file"):
        Decoder.load(tmp_path)


def test_missing_files_and_bad_config_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        Decoder.load(tmp_path)
    tiny_model("rope").save(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        Decoder.load(tmp_path)

    tiny_model("rope").save(tmp_path)
    (tmp_path / "config.json").write_text("{ truncated")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        Decoder.load(tmp_path)

    tiny_model("rope").save(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())
    record["config"]["n_heads"] = 3  # 32 channels do not split into 3 heads
    (tmp_path / "config.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"config\.json holds an invalid decoder config"):
        Decoder.load(tmp_path)


def test_weights_of_another_shape_are_refused(tmp_path):
    tiny_model("rope").save(tmp_path / "a")
    tiny_model("rope", n_layers=3).save(tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").replace(tmp_path / "a" / "model.safetensors")
    record = json.loads((tmp_path / "a" / "config.json").read_text())
    del record["weights"]["sha256"]
    (tmp_path / "a" / "config.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="does not fit the model"):
        Decoder.load(tmp_path / "a")
