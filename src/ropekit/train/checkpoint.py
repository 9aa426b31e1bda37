"""Atomic, self-verifying training checkpoints.

Holds:
    CheckpointState     the numbers a checkpoint records besides tensors (step, data position...).
    CheckpointError     a checkpoint is damaged, incomplete or unreadable (a ValueError, one line).
    save_checkpoint     write one checkpoint atomically (temp dir, fsync, rename); keep the last K.
    load_checkpoint     verify, then load weights (and optimizer and scheduler state) into objects.
    read_checkpoint_state   what a checkpoint records besides tensors (step, config, provenance).
    verify_checkpoint   check every file of a checkpoint against its manifest.
    latest_checkpoint   the newest intact checkpoint of a run folder, or None.
    resume_checkpoint   the same, for resuming: damaged newer ones are moved aside, not deleted.
    restore_rng         put this process's python/numpy/torch RNG streams back as they were saved.

Layout, under `<out_dir>/checkpoints/`:

    step-00000500/
        model.safetensors   trainable parameters and persistent buffers (all weights with
                            save_frozen); frozen weights otherwise come from the model passed in
        optimizer.pt        AdamW state_dict
        scheduler.pt        LambdaLR state_dict
        rng-<rank>.pt       python, numpy, torch (and CUDA) RNG states of each process
        state.json          CheckpointState without its config, and "checkpoint_format": 2
        config.json         the TrainConfig, as TrainConfig.to_dict()
        manifest.json       {"format": 1, "files": {name: {"bytes": n, "sha256": hex}}} of every
                            other file; written last
    damaged-step-00000700/  a damaged checkpoint a resumed run moved aside (never deleted)

A sharded run (``TrainConfig.fsdp``) writes the weights and optimizer state with
``torch.distributed.checkpoint`` (DCP) instead: every process writes its own shards, so no
process ever holds the whole model or optimizer state, and the folder holds

        .metadata           DCP's index of every tensor's shards (which file, where)
        __<rank>_0.distcp   process <rank>'s shards of {"model": trainable parameters and
                            persistent buffers, "optimizer": AdamW's per-parameter state}
        optimizer-groups.pt AdamW's param_groups (lr, betas... and parameter names)
        scheduler.pt, rng-<rank>.pt, state.json, config.json   as above
        manifest.json       as above, with "layout": "sharded"

and is made atomic the same way (every process writes into the temporary folder; the main
process fsyncs, writes the manifest and renames once all have finished). Loading it needs no
particular number of processes: DCP reads the shards each process needs, so a run resumes on
another number of processes, and one process loads it into an unsharded model.
DCP's ``.metadata`` is a pickle and its reader unpickles anything; ropekit reads it with an
unpickler that admits only DCP's own metadata classes, torch.Size, dtypes and paths, and
refuses a checkpoint that stores anything but tensors (DCP loads non-tensor values with
``torch.load(weights_only=False)``).

Weights are safetensors (no pickle). The `.pt` files hold only tensors, numbers, strings,
lists, tuples and dicts, and are always read with `torch.load(..., weights_only=True)`, which
refuses anything else. A checkpoint is complete the moment its folder is renamed from
`.tmp-step-*` to `step-*`; readers look only at `step-*` names, so a crash mid-write leaves
nothing that looks like a checkpoint.

Why a manifest as well: the rename protects against a crash while writing, not against what
happens to the files afterwards (a truncated copy, a flipped bit on disk, a file deleted by
hand). A flipped bit in the weights would resume silently, and one in the optimizer state can
turn the loss to NaN hundreds of steps later. So every file's sha256 is recorded, last, and
checked before a checkpoint is used: resuming falls back to the newest checkpoint that
verifies, with a one-line warning, and loading a damaged one is a one-line CheckpointError.

Checkpoints written before manifests existed (no manifest.json, and a state.json without
"checkpoint_format") are accepted with a warning that they cannot be verified: the atomic
rename made them complete when written, and refusing them would strand every run in progress
when ropekit is upgraded. A checkpoint whose state.json says it has a manifest but has none
lost it after it was written, and is damaged.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ropekit.outdir import check_target

CHECKPOINTS = "checkpoints"
MODEL_FILE = "model.safetensors"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# In state.json: 2 = the checkpoint has a manifest. Absent: written before manifests existed.
CHECKPOINT_FORMAT = 2
_REQUIRED = (MODEL_FILE, "state.json", "config.json")
# The manifest's "layout": absent or FULL = whole files written by the main process; SHARDED
# = torch.distributed.checkpoint shards written by every process (module docstring).
FULL, SHARDED = "full", "sharded"
DCP_METADATA = ".metadata"
OPTIMIZER_GROUPS = "optimizer-groups.pt"
_REQUIRED_SHARDED = (DCP_METADATA, OPTIMIZER_GROUPS, "state.json", "config.json")
_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(ValueError):
    """A checkpoint is damaged, incomplete or unreadable; the message names it and what."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped, or an old one cannot be verified."""


@dataclass(frozen=True)
class CheckpointState:
    """What a checkpoint records besides tensors."""

    step: int  # optimizer steps completed
    samples_seen: int  # data position: global-batch items consumed, step * batch_size
    tokens: int  # input tokens trained on, all processes together
    loss: float  # loss of the last step taken
    elapsed_s: float  # wall-clock seconds of training so far, all sessions together
    num_processes: int  # processes that wrote it (each wrote its own rng-<rank>.pt)
    dataset_len: int  # the data order depends on it, so resuming checks it
    config: dict[str, Any]  # TrainConfig.to_dict() of the run
    # What the run trains (model, encoding, data, tokenizer...: ropekit.results provenance);
    # resuming refuses a checkpoint whose provenance differs, naming the field.
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The intact checkpoint with the highest step in `out_dir`, or None if there is none.

    Damaged newer checkpoints are skipped with one warning line naming them and what is wrong
    with each (nothing is deleted or moved). Raises CheckpointError, naming every checkpoint
    and its problem, when checkpoints exist but none is intact.
    """
    chosen, damaged = _newest_intact(Path(out_dir) / CHECKPOINTS)
    if damaged:
        warnings.warn(f"{_damaged_list(damaged)}; using {chosen}", CheckpointWarning, stacklevel=2)
    return chosen


def resume_checkpoint(out_dir: str | Path) -> Path | None:
    """The checkpoint a resumed run continues from: `latest_checkpoint`, except that the
    damaged checkpoints newer than it are renamed to `damaged-step-*` (kept for inspection,
    and out of the way of the checkpoints the resumed run writes at those steps)."""
    root = Path(out_dir) / CHECKPOINTS
    chosen, damaged = _newest_intact(root)
    if damaged:
        moved = [_set_aside(path) for path, _ in damaged]
        warnings.warn(
            f"{_damaged_list(damaged)}; moved to {', '.join(p.name for p in moved)} in {root} "
            f"and resuming from {chosen.name}",
            CheckpointWarning,
            stacklevel=2,
        )
    return chosen


def verify_checkpoint(path: str | Path) -> None:
    """Raise CheckpointError unless every file of checkpoint `path` matches its manifest.

    A checkpoint from before manifests (see the module docstring) passes with a warning.
    """
    path = Path(path)
    problems, legacy = _problems(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}")
    if legacy:
        _warn_legacy(path)


def save_checkpoint(
    out_dir: Path,
    state: CheckpointState,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    accelerator: Accelerator,
    save_frozen: bool,
    keep_last: int,
    sharded: bool = False,
) -> Path:
    """Write `state` and the objects' state as `<out_dir>/checkpoints/step-<step>`; returns it.

    Every process must call it (each saves its own RNG streams); the main process writes the
    rest, which DDP keeps identical on every process. `model` is the unwrapped module. With
    `sharded` (`model` sharded by FSDP2), every process writes its shards of the weights and
    optimizer state with torch.distributed.checkpoint (module docstring).
    """
    root = out_dir / CHECKPOINTS
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-{final.name}"
    # Every process looks (and so every one raises): checkpoints/ must not be a link.
    check_target(root, out_dir)
    if accelerator.is_main_process:
        _remove_leftovers(root)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        _written(root, final, torch.save, _rng_state(), tmp / f"rng-{accelerator.process_index}.pt")
        groups = _save_sharded(tmp, model, optimizer, save_frozen) if sharded else None
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if sharded:
                _written(root, final, torch.save, groups, tmp / OPTIMIZER_GROUPS)
            else:
                # "format": "pt" is what Hugging Face loaders expect of a PyTorch safetensors
                # file.
                tensors = _model_tensors(model, save_frozen)
                _written(root, final, save_file, tensors, tmp / MODEL_FILE, {"format": "pt"})
                _written(root, final, torch.save, optimizer.state_dict(), tmp / "optimizer.pt")
            _written(root, final, torch.save, scheduler.state_dict(), tmp / "scheduler.pt")
            fields = dataclasses.asdict(state)
            (tmp / "config.json").write_text(json.dumps(fields.pop("config"), indent=2))
            fields["checkpoint_format"] = CHECKPOINT_FORMAT
            (tmp / "state.json").write_text(json.dumps(fields, indent=2))
            # Data first, then the manifest of it, then the folder entry, then the rename,
            # then the parent's entry: after a power cut the rename is either absent or points
            # at complete files and a manifest that describes them.
            for path in tmp.iterdir():
                _fsync(path)
            _write_manifest(tmp, SHARDED if sharded else FULL)
            _fsync(tmp)
            os.replace(tmp, final)
            _fsync(root)
            _prune(root, keep_last)
    except BaseException:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()
    return final


def _written(root: Path, final: Path, save: Any, *args: Any) -> None:
    """``save(*args)``; a write that fails (a full disk: torch and safetensors report it as
    their own RuntimeError) is an OSError naming the checkpoint and the free space, which the
    command line prints as one line. The caller removes the partial folder; the checkpoints
    written before stay as they are."""
    try:
        save(*args)
    except (RuntimeError, SafetensorError) as e:
        free = shutil.disk_usage(root).free
        detail = (str(e).strip().splitlines() or [""])[0][:160]
        if free < 2**20:  # torch says "unexpected pos 64 vs 0" for a full disk
            detail = f"no space left on the device (torch: {detail})"
        raise OSError(
            f"could not write checkpoint {final.name} in {root} ({free / 2**20:.0f} MiB free "
            f"there): {detail}; the older checkpoints are intact, resume from them"
        ) from None


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    verify: bool = True,
) -> CheckpointState:
    """Load a checkpoint folder's weights into `model` (and state into the others, if given).

    Weights missing from the checkpoint (frozen ones, unless it was saved with save_frozen)
    keep the values they have in `model`; a checkpoint weight the model lacks, or has in
    another shape, is a ValueError. With `verify` (the default) every file is first checked
    against the manifest (`verify_checkpoint`); a damaged or unreadable file is a one-line
    CheckpointError, never a parser's traceback.

    A sharded checkpoint loads into a model sharded by FSDP2 (every process calls it, each
    reads the shards it holds) or, in one process, into an unsharded model and optimizer.
    """
    path = Path(path)
    layout = _layout(path)
    required = _REQUIRED_SHARDED if layout == SHARDED else _REQUIRED
    missing = [name for name in required if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint: {', '.join(missing)} missing"
        )
    if verify:
        verify_checkpoint(path)
    if layout == SHARDED:
        _load_sharded(path, model, optimizer)
        if scheduler is not None:
            scheduler.load_state_dict(_read(path / "scheduler.pt", _load_pt))
        return read_checkpoint_state(path)
    tensors = _read(path / MODEL_FILE, load_file)
    _check_fits(path / MODEL_FILE, tensors, model)
    model.load_state_dict(tensors, strict=False)
    if optimizer is not None:
        optimizer.load_state_dict(_read(path / "optimizer.pt", _load_pt))
    if scheduler is not None:
        scheduler.load_state_dict(_read(path / "scheduler.pt", _load_pt))
    return read_checkpoint_state(path)


def read_checkpoint_state(path: str | Path) -> CheckpointState:
    """The numbers, config and provenance a checkpoint folder records (no tensors loaded).

    An unreadable state.json or config.json is a one-line CheckpointError naming it.
    """
    path = Path(path)
    state = _read(path / "state.json", _load_json)
    config = _read(path / "config.json", _load_json)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / 'state.json'} is not a checkpoint state")
    state.pop("checkpoint_format", None)
    try:
        return CheckpointState(**state, config=config)
    except TypeError as e:
        raise CheckpointError(f"{path / 'state.json'} is not a checkpoint state: {e}") from None


def restore_rng(path: str | Path, rank: int) -> None:
    """Restore process `rank`'s RNG streams from checkpoint `path`.

    A checkpoint written by fewer processes has no streams for the extra ranks: they keep their
    fresh seeds, which changes only random ops (dropout), never the data order.
    """
    file = Path(path) / f"rng-{rank}.pt"
    if not file.is_file():
        warnings.warn(f"{file} not found: process {rank} keeps fresh RNG seeds", stacklevel=2)
        return
    state = _read(file, _load_pt)
    random.setstate(state["python"])
    numpy = state["numpy"]
    key = numpy["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state({**numpy, "state": {**numpy["state"], "key": key}})
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def _rng_state() -> dict[str, Any]:
    numpy = np.random.get_state(legacy=False)
    # The MT19937 key as a tensor, because weights_only loading refuses numpy arrays.
    key = torch.from_numpy(numpy["state"]["key"].astype(np.int64))
    return {
        "python": random.getstate(),
        "numpy": {**numpy, "state": {**numpy["state"], "key": key}},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _model_tensors(model: nn.Module, save_frozen: bool) -> dict[str, Tensor]:
    # named_parameters lists a tied weight once, which safetensors requires; state_dict's keys
    # tell persistent buffers (part of the model's state) from scratch ones.
    persistent = model.state_dict().keys()
    tensors = {n: p for n, p in model.named_parameters() if p.requires_grad or save_frozen}
    tensors |= {n: b for n, b in model.named_buffers() if n in persistent}
    return {n: t.detach().cpu().contiguous() for n, t in tensors.items()}


def _saved_names(model: nn.Module, save_frozen: bool) -> set[str]:
    """The names `_model_tensors` saves: trainable (or all) parameters, each tied weight once,
    and persistent buffers."""
    persistent = model.state_dict().keys()
    names = {n for n, p in model.named_parameters() if p.requires_grad or save_frozen}
    return names | {n for n, _ in model.named_buffers() if n in persistent}


# --------------------------------------------------------------------------- sharded layout
def _layout(path: Path) -> str:
    """The layout a checkpoint's manifest names; without a readable manifest, SHARDED if DCP's
    index is there (verification then says what is wrong)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        return str(manifest.get("layout", FULL)) if isinstance(manifest, dict) else FULL
    except (OSError, ValueError):
        return SHARDED if (path / DCP_METADATA).is_file() else FULL


def _tensor_leaves(tree: Any, prefix: str = "") -> None:
    """ValueError unless every leaf of a nested dict is a tensor (module docstring: DCP would
    pickle anything else, and ropekit loads only tensors)."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _tensor_leaves(value, f"{name}.")
        elif not isinstance(value, Tensor):
            raise ValueError(
                f"a sharded checkpoint holds tensors only; {name} is a {type(value).__name__}"
            )


def _save_sharded(
    folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, save_frozen: bool
) -> list[dict[str, Any]]:
    """Every process writes its shards of the weights and the optimizer state into `folder`
    (a collective); returns the optimizer's param_groups, for the main process to write."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(model, optimizer)
    kept = _saved_names(model, save_frozen)
    tensors = {
        "model": {n: t for n, t in weights.items() if n in kept},
        "optimizer": optim["state"],
    }
    _tensor_leaves(tensors)
    try:
        save(tensors, storage_writer=FileSystemWriter(folder, sync_files=True))
    except BaseException as e:
        raise _dcp_failure(e) from None  # e.g. the OSError of a full disk, as one line
    return optim["param_groups"]


def _dcp_failure(error: BaseException) -> BaseException:
    """The first process's own exception inside DCP's CheckpointException (a BaseException
    whose text is every process's traceback), or `error` itself."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            return first[0]
    return error


def _load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load a sharded checkpoint's weights (and optimizer state) into `model` (FSDP2-sharded on
    every process, or whole on one)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    stored = _read(path / DCP_METADATA, _load_metadata).state_dict_metadata
    if optimizer is None:
        weights, optim = get_model_state_dict(model), None
    else:
        weights, optim = get_state_dict(model, optimizer)
    saved = {k.removeprefix("model."): v for k, v in stored.items() if k.startswith("model.")}
    _check_shapes(
        path / DCP_METADATA,
        {name: tuple(meta.size) for name, meta in saved.items()},
        {name: tuple(w.shape) for name, w in weights.items()},
    )
    tensors: dict[str, Any] = {"model": {name: weights[name] for name in saved}}
    if optim is not None:
        tensors["optimizer"] = optim["state"]
        groups = _read(path / OPTIMIZER_GROUPS, _load_pt)
    try:
        # One process without a process group (a whole model, e.g. for inspection) reads alone;
        # DCP warns that it assumes so even when told.
        alone = not torch.distributed.is_initialized()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            load(tensors, storage_reader=_checked_reader(path), no_dist=alone)
    except BaseException as e:  # DCP gathers every process's error into one long report
        failure = _dcp_failure(e)
        if isinstance(failure, CheckpointError | OSError | KeyboardInterrupt | SystemExit):
            raise failure from None
        detail = (str(failure).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"{path} cannot be read, the checkpoint is damaged ({type(failure).__name__}: {detail})"
        ) from None
    loose = StateDictOptions(strict=False)  # frozen weights are not in it, as in MODEL_FILE
    set_model_state_dict(model, tensors["model"], options=loose)
    if optim is not None:
        state = {"state": tensors["optimizer"], "param_groups": groups}
        set_optimizer_state_dict(model, optimizer, state)


# Globals DCP's metadata pickle may name: its own metadata classes (any class of
# torch.distributed.checkpoint.metadata), the file index entry, sizes, dtypes, layouts, paths.
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` and nothing else: a pickle naming any other global (a
    function to call, a class to build) is refused before anything runs."""

    def find_class(self, module: str, name: str) -> Any:
        import torch.distributed.checkpoint.metadata as dcp_metadata

        value = getattr(torch, name, None) if module == "torch" else None
        allowed = (module, name) in _METADATA_GLOBALS or isinstance(value, torch.dtype)
        if module == dcp_metadata.__name__:
            allowed = isinstance(getattr(dcp_metadata, name, None), type)
        if not allowed:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which is not DCP metadata")
        return super().find_class(module, name)


def _load_metadata(path: Path) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    with path.open("rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise ValueError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    for name, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"{name} is not a tensor (ropekit stores tensors only)")
    return metadata


@functools.cache
def _checked_reader_class() -> type:
    """DCP's file reader with `.metadata` read by `_load_metadata` (built on first use: importing
    torch.distributed.checkpoint takes over a second)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = _read(Path(self.path) / DCP_METADATA, _load_metadata)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader


def _checked_reader(path: Path) -> Any:
    return _checked_reader_class()(path)


def _load_pt(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _load_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _read(path: Path, loader: Any) -> Any:
    """`loader(path)`, with any failure to parse the file as one line naming it."""
    try:
        return loader(path)
    except OSError:
        raise
    except Exception as e:  # safetensors, pickle, zipfile and json all have their own
        detail = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"{path} cannot be read, the checkpoint is damaged ({type(e).__name__}: {detail})"
        ) from None


def _check_fits(file: Path, tensors: dict[str, Tensor], model: nn.Module) -> None:
    own = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    _check_shapes(file, {name: tuple(t.shape) for name, t in tensors.items()}, own)


def _check_shapes(file: Path, saved: dict[str, tuple], own: dict[str, tuple]) -> None:
    """ValueError unless every weight ``file`` holds is one of the model's, of its shape."""
    unexpected = [name for name in saved if name not in own]
    if unexpected:
        raise ValueError(
            f"{file} holds {len(unexpected)} weights the model does not have, "
            f"e.g. {unexpected[:3]}: was it saved from a different model?"
        )
    shapes = [
        f"{name} {shape} vs {own[name]}" for name, shape in saved.items() if shape != own[name]
    ]
    if shapes:
        raise ValueError(
            f"{file} holds {len(shapes)} weights of other shapes than the model's "
            f"(checkpoint vs model: {'; '.join(shapes[:3])}): was it saved from a different model?"
        )


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_manifest(folder: Path, layout: str = FULL) -> None:
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.iterdir())
        if p.name != MANIFEST
    }
    manifest: dict[str, Any] = {"format": MANIFEST_FORMAT, "files": files}
    if layout != FULL:  # a whole-file checkpoint's manifest stays as it always was
        manifest["layout"] = layout
    path = folder / MANIFEST
    with path.open("w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _problems(path: Path) -> tuple[list[str], bool]:
    """What is wrong with checkpoint `path` (empty if intact), and whether it predates
    manifests (then only its required files are checked for presence)."""
    if not path.is_dir():
        return ["it is not a folder"], False
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return _without_manifest(path)
    except (OSError, ValueError) as e:
        return [f"{MANIFEST} unreadable ({type(e).__name__})"], False
    listed = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(listed, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return [f"{MANIFEST} is not a format-{MANIFEST_FORMAT} manifest"], False
    if any(Path(name).name != name or name in ("", ".", "..") for name in listed):
        return [f"{MANIFEST} lists names that are not files of the checkpoint"], False
    layout = manifest.get("layout", FULL)
    if layout not in (FULL, SHARDED):
        return [f"{MANIFEST} has layout={layout!r}; allowed: {FULL!r}, {SHARDED!r}"], False
    required = _REQUIRED_SHARDED if layout == SHARDED else _REQUIRED
    problems = [f"{MANIFEST} does not list {name}" for name in required if name not in listed]
    present = {p.name for p in path.iterdir()}
    problems += [f"{name} is not in {MANIFEST}" for name in sorted(present - {MANIFEST, *listed})]
    for name, entry in listed.items():
        file = path / name
        if name not in present or not file.is_file():
            problems.append(f"{name} missing")
            continue
        try:
            size, digest = file.stat().st_size, _sha256(file)
            expected_size, expected_digest = int(entry["bytes"]), str(entry["sha256"])
        except OSError as e:
            problems.append(f"{name} unreadable ({e.strerror})")
            continue
        except (KeyError, TypeError, ValueError):
            problems.append(f"{MANIFEST} entry of {name} is malformed")
            continue
        if size != expected_size:
            problems.append(f"{name} is {size} bytes, {MANIFEST} says {expected_size}")
        elif digest != expected_digest:
            problems.append(f"{name} does not match its sha256 in {MANIFEST}")
    return problems or _unreadable(path), False


def _unreadable(path: Path) -> list[str]:
    """What cannot be parsed in a checkpoint whose files are all there (and match a manifest
    that may itself have been rewritten): every ``.pt`` file loads with ``weights_only``
    (memory-mapped, so nothing large is read), the weights' safetensors header parses. A
    checkpoint failing this is damaged like one failing its checksums: skipped on resume."""
    problems = []
    for file in sorted(path.iterdir()):
        try:
            if file.suffix == ".pt":
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            elif file.suffix == ".safetensors":
                with safe_open(file, framework="pt"):
                    pass
        except Exception as e:  # pickle, zipfile, safetensors: each has its own errors
            problems.append(f"{file.name} cannot be read ({type(e).__name__})")
    return problems


def _without_manifest(path: Path) -> tuple[list[str], bool]:
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [f"{MANIFEST} missing", "state.json missing"], False
    except (OSError, ValueError):
        return [f"{MANIFEST} missing", "state.json unreadable"], False
    if not isinstance(state, dict) or "checkpoint_format" in state:
        return [f"{MANIFEST} missing"], False
    missing = [f"{name} missing" for name in _REQUIRED if not (path / name).is_file()]
    problems = missing or _unreadable(path)
    return problems, not problems


def _warn_legacy(path: Path) -> None:
    warnings.warn(
        f"checkpoint {path} has no {MANIFEST} (written by a ropekit without checkpoint "
        "checksums): its files cannot be verified",
        CheckpointWarning,
        stacklevel=3,
    )


def _newest_intact(root: Path) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """The newest checkpoint in `root` that verifies, and the newer ones that do not (with
    their problems). Raises CheckpointError if there are checkpoints and none verifies."""
    steps = _step_dirs(root)
    damaged = []
    for step in sorted(steps, reverse=True):
        problems, legacy = _problems(steps[step])
        if not problems:
            if legacy:
                _warn_legacy(steps[step])
            return steps[step], damaged
        damaged.append((steps[step], problems))
    if damaged:
        raise CheckpointError(f"no intact checkpoint in {root}: {_damaged_list(damaged)}")
    return None, []


def _damaged_list(damaged: list[tuple[Path, list[str]]]) -> str:
    return "; ".join(f"{path.name} is damaged ({', '.join(p)})" for path, p in damaged)


def _set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the `step-*` names; returns its new path."""
    target = path.with_name(f"damaged-{path.name}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"damaged-{path.name}-{n}")
    os.replace(path, target)
    return target


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_dirs(root: Path) -> dict[int, Path]:
    if not root.is_dir():
        return {}
    return {int(m[1]): p for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))}


def _prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints."""
    steps = _step_dirs(root)
    for step in sorted(steps)[:-keep_last]:
        old = steps[step]
        # Renamed first, so a crash while deleting never leaves a half-deleted step-*.
        trash = root / f".trash-{old.name}"
        os.replace(old, trash)
        shutil.rmtree(trash)


def _remove_leftovers(root: Path) -> None:
    """Delete temp and trash folders a crashed save left behind."""
    if root.is_dir():
        for path in [*root.glob(".tmp-*"), *root.glob(".trash-*")]:
            shutil.rmtree(path)
