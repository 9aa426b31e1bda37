"""Checkpoints: atomic under failure, newest-complete lookup, pruning, RNG and weight loading."""

import json
import random
import warnings

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from torch import nn

from ropekit.train import TrainConfig, latest_checkpoint, load_checkpoint, train
from ropekit.train import checkpoint as checkpoint_module
from ropekit.train.checkpoint import CheckpointState, restore_rng, save_checkpoint
from ropekit.train.optim import build_optimizer

from .tiny import CountingData, tiny_config, tiny_llama


def test_a_failed_write_leaves_the_previous_checkpoint_and_nothing_partial(tmp_path, monkeypatch):
    real_save_file = checkpoint_module.save_file
    written = []

    def disk_full_on_second_checkpoint(tensors, path, *args, **kwargs):
        real_save_file(tensors, path, *args, **kwargs)  # a complete-looking file lands first
        written.append({name: t.clone() for name, t in tensors.items()})
        if len(written) == 2:
            raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint_module, "save_file", disk_full_on_second_checkpoint)
    with pytest.raises(OSError, match="No space left"):
        train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=8, checkpoint_interval=4))

    root = tmp_path / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step-00000004"]  # no .tmp-*, no step-8
    assert latest_checkpoint(tmp_path) == root / "step-00000004"
    saved = load_file(root / "step-00000004" / "model.safetensors")
    assert saved.keys() == written[0].keys()
    assert all(torch.equal(saved[name], written[0][name]) for name in saved)
    assert load_checkpoint(root / "step-00000004", tiny_llama()).step == 4


def test_latest_checkpoint_sees_only_complete_step_folders(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    root = tmp_path / "checkpoints"
    for name in ("step-00000002", "step-00000010", ".tmp-step-00000020", "step-00000030-old"):
        (root / name).mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == root / "step-00000010"


def save(tmp_path, model, step, keep_last=2):
    config = TrainConfig(tmp_path, steps=100, warmup_steps=0)
    optimizer, scheduler = build_optimizer(model, config)
    state = CheckpointState(step, step * 32, 0, 1.0, 0.0, 1, 10, config.to_dict())
    return save_checkpoint(
        tmp_path,
        state,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        accelerator=Accelerator(),
        save_frozen=False,
        keep_last=keep_last,
    )


def test_old_checkpoints_and_leftovers_are_removed(tmp_path):
    model = nn.Linear(3, 2)
    (tmp_path / "checkpoints" / ".tmp-step-00000007").mkdir(parents=True)  # a crashed save
    for step in (5, 10, 15):
        save(tmp_path, model, step)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000010", "step-00000015"]
    state = json.loads((tmp_path / "checkpoints" / names[-1] / "state.json").read_text())
    assert state["step"] == 15 and state["samples_seen"] == 15 * 32


def test_rng_streams_come_back(tmp_path):
    path = save(tmp_path, nn.Linear(2, 2), step=1)
    drawn = (random.random(), np.random.rand(3), torch.rand(3))
    restore_rng(path, rank=0)
    again = (random.random(), np.random.rand(3), torch.rand(3))
    assert drawn[0] == again[0]
    assert np.array_equal(drawn[1], again[1]) and torch.equal(drawn[2], again[2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restore_rng(path, rank=1)  # written by one process: rank 1 keeps its fresh seeds
    assert "rng-1.pt not found" in str(caught[0].message)


def test_loading_into_a_different_model_is_an_error(tmp_path):
    path = save(tmp_path, nn.Linear(3, 2), step=1)
    with pytest.raises(ValueError, match="does not have"):
        load_checkpoint(path, nn.Sequential(nn.Linear(3, 2)))
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path, nn.Linear(3, 2))


def test_persistent_buffers_are_saved_and_scratch_buffers_are_not(tmp_path):
    model = nn.BatchNorm1d(3)  # running_mean, running_var, num_batches_tracked are state
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    saved = load_file(save(tmp_path, model, step=1) / "model.safetensors")
    assert set(saved) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
