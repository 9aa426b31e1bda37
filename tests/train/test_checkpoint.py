"""Checkpoints: atomic under failure, newest-intact lookup, manifests and fallback from damaged
checkpoints, pruning, RNG and weight loading."""

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from torch import nn

from ropekit.outdir import OutputError
from ropekit.train import TrainConfig, causal_lm_loss, latest_checkpoint, load_checkpoint, train
from ropekit.train import checkpoint as checkpoint_module
from ropekit.train.checkpoint import (
    CheckpointError,
    CheckpointState,
    CheckpointWarning,
    restore_rng,
    save_checkpoint,
    verify_checkpoint,
)
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
    for step in (2, 10):
        save(tmp_path, nn.Linear(2, 2), step, keep_last=5)
    for name in (".tmp-step-00000020", "step-00000030-old", "damaged-step-00000040"):
        shutil.copytree(root / "step-00000010", root / name)  # intact, but not a step-* name
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


# ----------------------------------------------------------------------------- manifests
def test_the_manifest_lists_every_file_and_is_written_last_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_write, real_fsync, real_replace = (
        checkpoint_module._write_manifest,
        checkpoint_module._fsync,
        os.replace,
    )

    def write_manifest(folder, *layout):
        events.append(("manifest", folder.name, sorted(p.name for p in folder.iterdir())))
        real_write(folder, *layout)

    def fsync(path):
        events.append(("fsync", path.name))
        real_fsync(path)

    def replace(src, dst):
        events.append(("rename", Path(src).name))
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint_module, "_write_manifest", write_manifest)
    monkeypatch.setattr(checkpoint_module, "_fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = save(tmp_path, nn.Linear(3, 2), step=1)
    monkeypatch.undo()

    files = ["config.json", "model.safetensors", "optimizer.pt", "rng-0.pt"]
    files += ["scheduler.pt", "state.json"]
    tmp = ".tmp-step-00000001"
    i = events.index(("manifest", tmp, files))  # every other file is there when it is written
    assert {e[1] for e in events[:i] if e[0] == "fsync"} == set(files)  # ... and on disk
    assert events[i + 1 :] == [("fsync", tmp), ("rename", tmp), ("fsync", "checkpoints")]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 1 and sorted(manifest["files"]) == files
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    verify_checkpoint(path)


def _flip_bit(path, offset_fraction=0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * offset_fraction)] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path, keep=None):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2 if keep is None else keep])


# name -> (damage done to a checkpoint folder, what the warning says)
DAMAGE = {
    "truncated weights": (
        lambda c: _truncate(c / "model.safetensors"),
        r"model\.safetensors is \d+ bytes, manifest\.json says \d+",
    ),
    "flipped bit in the weights": (
        lambda c: _flip_bit(c / "model.safetensors", 0.9),
        r"model\.safetensors does not match its sha256",
    ),
    "damaged optimizer state": (
        lambda c: _flip_bit(c / "optimizer.pt"),
        r"optimizer\.pt does not match its sha256",
    ),
    "missing file": (lambda c: (c / "scheduler.pt").unlink(), r"scheduler\.pt missing"),
    "missing manifest": (lambda c: (c / "manifest.json").unlink(), r"manifest\.json missing"),
    "garbled manifest": (
        lambda c: (c / "manifest.json").write_text('{"format": 1, "fil'),
        r"manifest\.json unreadable",
    ),
    "foreign file": (
        lambda c: (c / "rng-1.pt").write_bytes((c / "rng-0.pt").read_bytes()),
        r"rng-1\.pt is not in manifest\.json",
    ),
    # Files that match their manifest but cannot be read: they once stopped the resume.
    "planted pickle, manifest updated": (
        lambda c: _plant_pickle(c / "optimizer.pt"),
        r"optimizer\.pt cannot be read \(UnpicklingError",
    ),
    "legacy checkpoint, damaged header": (
        lambda c: (_make_legacy(c), _truncate(c / "model.safetensors", 40)),
        r"model\.safetensors cannot be read",
    ),
}


class _Planted:
    """What a malicious optimizer.pt would hold: an object weights_only refuses to build."""


def _plant_pickle(path):
    torch.save({"state": _Planted()}, path)
    manifest_path = path.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = path.read_bytes()
    manifest["files"][path.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


class Interrupted(Exception):
    pass


def _stopped_after_8_steps(out_dir):
    """A 12-step run stopped in its 9th step: checkpoints step-4 and step-8 exist."""
    calls = 0

    def crash_in_step_9(model, batch):
        nonlocal calls
        calls += 1
        if calls == 9:
            raise Interrupted
        return causal_lm_loss(model, batch)

    with pytest.raises(Interrupted):
        train(tiny_llama(), CountingData(), tiny_config(out_dir), loss_fn=crash_in_step_9)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 12-step run: the parameters every resumed run must end with."""
    torch.set_num_threads(1)
    model = tiny_llama()
    train(model, CountingData(), tiny_config(tmp_path_factory.mktemp("reference")))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(
    tmp_path, reference, damage
):
    _stopped_after_8_steps(tmp_path)
    root = tmp_path / "checkpoints"
    harm, problem = DAMAGE[damage]
    harm(root / "step-00000008")
    damaged = {p.name: p.read_bytes() for p in (root / "step-00000008").iterdir()}

    with pytest.warns(CheckpointWarning, match=rf"step-00000008 is damaged \({problem}"):
        assert latest_checkpoint(tmp_path) == root / "step-00000004"
    with pytest.raises(CheckpointError, match=problem):
        load_checkpoint(root / "step-00000008", tiny_llama())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = tiny_llama()
        result = train(resumed, CountingData(), tiny_config(tmp_path, resume=True))
    [warning] = [w for w in caught if w.category is CheckpointWarning]
    message = str(warning.message)
    assert "\n" not in message and re.search(problem, message)
    assert "moved to damaged-step-00000008" in message and "resuming from step-00000004" in message

    # Nothing deleted: the damaged checkpoint is kept, byte for byte, beside the new ones.
    kept = root / "damaged-step-00000008"
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == damaged
    assert result.steps == 12 and latest_checkpoint(tmp_path).name == "step-00000012"
    for name, param in resumed.named_parameters():
        assert torch.equal(param, reference[name]), name  # resumed from 4 as if never stopped


def test_no_intact_checkpoint_is_one_line_naming_each_and_changes_nothing(tmp_path):
    _stopped_after_8_steps(tmp_path)
    root = tmp_path / "checkpoints"
    _flip_bit(root / "step-00000008" / "model.safetensors")
    (root / "step-00000004" / "state.json").unlink()
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))

    with pytest.raises(CheckpointError) as caught:
        train(tiny_llama(), CountingData(), tiny_config(tmp_path, resume=True))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"no intact checkpoint in {root}")
    assert "step-00000008 is damaged (model.safetensors does not match its sha256" in message
    assert "step-00000004 is damaged (state.json missing" in message
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def _make_legacy(checkpoint):
    """What a ropekit from before manifests wrote: no manifest, no format in state.json."""
    (checkpoint / "manifest.json").unlink()
    state = json.loads((checkpoint / "state.json").read_text())
    del state["checkpoint_format"]
    (checkpoint / "state.json").write_text(json.dumps(state))


def test_a_checkpoint_from_before_manifests_resumes_with_a_warning(tmp_path, reference):
    _stopped_after_8_steps(tmp_path)
    for checkpoint in (tmp_path / "checkpoints").iterdir():
        _make_legacy(checkpoint)
    resumed = tiny_llama()
    with pytest.warns(CheckpointWarning, match="step-00000008 has no manifest.json .* cannot be"):
        train(resumed, CountingData(), tiny_config(tmp_path, resume=True))
    for name, param in resumed.named_parameters():
        assert torch.equal(param, reference[name]), name


def test_load_checkpoint_says_in_one_line_what_is_damaged(tmp_path):
    model = nn.Linear(3, 2)
    path = save(tmp_path, model, step=1)
    _truncate(path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is \d+ bytes, manifest"):
        load_checkpoint(path, nn.Linear(3, 2))
    # Unverified (an old checkpoint, or verify=False), the parsers' errors are one line too.
    with pytest.raises(CheckpointError, match=r"model\.safetensors cannot be read") as caught:
        load_checkpoint(path, nn.Linear(3, 2), verify=False)
    assert "\n" not in str(caught.value)

    path = save(tmp_path / "b", model, step=1)
    optimizer, scheduler = build_optimizer(model, TrainConfig(tmp_path, steps=100, warmup_steps=0))
    _flip_bit(path / "optimizer.pt", 0.3)
    _truncate(path / "scheduler.pt")
    with pytest.raises(CheckpointError, match=r"optimizer\.pt does not match its sha256"):
        load_checkpoint(path, model, optimizer, scheduler)
    with pytest.raises(CheckpointError, match=r"scheduler\.pt cannot be read") as caught:
        load_checkpoint(path, model, scheduler=scheduler, verify=False)
    assert "\n" not in str(caught.value)
    (path / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"state\.json cannot be read"):
        load_checkpoint(path, model, verify=False)


def test_weights_of_another_shape_are_one_line(tmp_path):
    path = save(tmp_path, nn.Linear(3, 2), step=1)
    with pytest.raises(ValueError, match=r"other shapes .* weight \(2, 3\) vs \(4, 3\)"):
        load_checkpoint(path, nn.Linear(3, 4))


def test_a_linked_checkpoints_folder_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(OutputError, match="checkpoints: it is a symbolic link"):
        save(tmp_path / "run", nn.Linear(2, 2), step=1)
    assert list(elsewhere.iterdir()) == []


_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from ropekit.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_loses_nothing(tmp_path):
    """A full disk, made real with a file-size limit (RLIMIT_FSIZE: every write past it fails
    as on a full disk): one line, exit 2, the older checkpoint intact, and the run resumes."""
    import subprocess
    import sys

    tiny = ["pretrain", "--layers", "1", "--d-model", "32", "--heads", "2", "--batch-size", "2",
            "--warmup", "1", "--context", "32", "--checkpoint-interval", "2", "--out",
            str(tmp_path)]  # fmt: skip

    def run(limit: int, steps: int, *extra: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-c", _LIMITED, str(limit), *tiny, "--steps", str(steps), *extra]
        return subprocess.run(argv, capture_output=True, text=True)

    # A run stopped after its step-2 checkpoint: what a kill in step 3 leaves (the finished
    # run's step-4 checkpoint and summary removed).
    assert run(1 << 30, 4).returncode == 0
    shutil.rmtree(tmp_path / "checkpoints/step-00000004")
    (tmp_path / "summary.json").unlink(missing_ok=True)
    kept = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints/step-00000002").iterdir()}
    failed = run(60_000, 4, "--resume")
    assert failed.returncode == 2, failed.stderr[-2000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("ropekit pretrain: error: could not write checkpoint step-00000004")
    assert "Traceback" not in failed.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002"]
    after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints/step-00000002").iterdir()}
    assert after == kept
    assert run(1 << 30, 4, "--resume").returncode == 0
