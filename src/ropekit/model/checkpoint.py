"""Saving and loading a decoder: ``model.safetensors`` + ``config.json`` in one folder.

Weights are safetensors only (never pickle, so loading runs no code). A tied LM head is
stored once and re-tied on load. ``config.json`` records the DecoderConfig, the normalised
encoding spec and the SHA-256 of the weights file, so a weights file that was corrupted,
truncated or swapped for another is refused with a message naming it. Each file is written
to a temporary name, fsynced and renamed; a crash between the two writes leaves a checksum
mismatch that ``Decoder.load`` reports, never a silently mixed model.

Dependencies point one way: ``decoder`` imports this module, this module never imports
``decoder`` (it writes and reads the files of any model shaped like a ``Decoder``: a
``config`` DecoderConfig, an ``encoding`` with a spec, a state dict). ``Decoder.load`` (and
``ropekit.model.load_decoder``) reads the folder here, builds the model, and fills it here.

Holds: save_decoder, read_decoder, fill_decoder, WEIGHTS_FILE, CONFIG_FILE.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import safetensors.torch
from safetensors import SafetensorError
from torch import Tensor, nn

from ropekit.utils import atomic_write_bytes, atomic_write_text

from .config import DecoderConfig
from .flops import count_parameters

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FORMAT = "ropekit-decoder"  # what config.json says it describes
FORMAT_VERSION = 1


def _aliases(model: nn.Module) -> tuple[dict[str, Tensor], set[str]]:
    """The state dict with each shared tensor once (first name kept), and the dropped names."""
    unique: dict[str, Tensor] = {}
    seen: set[tuple] = set()
    dropped: set[str] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and key in seen:  # empty tensors may share a null pointer
            dropped.add(name)  # e.g. lm_head.weight, tied to embed.weight
            continue
        seen.add(key)
        unique[name] = tensor.detach().contiguous()
    return unique, dropped


def save_decoder(model: nn.Module, directory: str | Path) -> Path:
    """Write a ``Decoder`` into ``directory`` (created if needed); returns the folder."""
    directory = Path(directory)
    tensors, _ = _aliases(model)
    data = safetensors.torch.save({k: v.cpu() for k, v in tensors.items()})
    atomic_write_bytes(directory / WEIGHTS_FILE, data)
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": model.config.to_dict(),
        "encoding": model.encoding.spec,
        "parameters": count_parameters(model),
        "weights": {"file": WEIGHTS_FILE, "sha256": hashlib.sha256(data).hexdigest()},
    }
    atomic_write_text(directory / CONFIG_FILE, json.dumps(record, indent=2) + "\n")
    return directory


def _read_record(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; a saved decoder is a folder holding {CONFIG_FILE} and "
            f"{WEIGHTS_FILE} (written by Decoder.save)"
        )
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON (corrupted?): {e}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{path} does not describe a ropekit decoder (format {FORMAT!r})")
    if record.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {record.get('format_version')!r}; this ropekit reads "
            f"{FORMAT_VERSION}"
        )
    return record


def read_decoder(directory: str | Path) -> tuple[DecoderConfig, dict[str, Tensor], dict[str, Any]]:
    """The config, the weights (checksum verified) and the record of a saved decoder."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    record = _read_record(config_path)
    try:
        config = DecoderConfig(**record["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{config_path} holds an invalid decoder config: {e}") from None

    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} is missing (the weights of {directory})")
    data = weights_path.read_bytes()
    expected = record.get("weights", {}).get("sha256")
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(
            f"{weights_path} is corrupted or was replaced: its SHA-256 does not match the one "
            f"recorded in {config_path}"
        )
    try:
        tensors = safetensors.torch.load(data)
    except SafetensorError as e:
        raise ValueError(
            f"{weights_path} is not a valid safetensors file (corrupted or truncated): {e}"
        ) from None
    return config, tensors, record


def fill_decoder(
    model: nn.Module, tensors: dict[str, Tensor], record: dict[str, Any], directory: str | Path
) -> None:
    """Load ``read_decoder``'s weights strictly into a model freshly built from its config."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if record.get("encoding") not in (None, model.encoding.spec):
        raise ValueError(
            f"{config_path} records encoding {record['encoding']!r} but its config now builds "
            f"{model.encoding.spec!r}; the encoding's defaults changed since it was saved"
        )
    _, tied = _aliases(model)
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"{weights_path} does not fit the model in {config_path}: {e}") from None
    missing = sorted(set(missing) - tied)
    if missing or unexpected:
        raise ValueError(
            f"{weights_path} does not fit the model in {config_path}: missing {missing}, "
            f"unexpected {sorted(unexpected)}"
        )
