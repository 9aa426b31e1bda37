"""Positional adapters: the few parameters a patched model's encoding learned, saved apart from
the backbone.

An adapter is a folder with two files, both written atomically (temp file, fsync, rename):

- ``adapter.safetensors``: every parameter of the encoding (AdaRoPE's frequency offsets and
  temperatures, tuned-yarn's knobs; empty for fixed schedules), named as in
  ``encoding.named_parameters()``.
- ``adapter.json``: the spec that rebuilds the encoding, the fingerprint of the model it was
  trained on (architecture, layers, heads, kv heads, head dim, base, original length), each
  parameter's shape and dtype, the sha256 of the weights file and the versions that wrote it.

The weights are written first and the JSON last, so a crash between the two leaves a JSON whose
checksum no longer matches and ``load_adapter`` says so instead of loading stale numbers.

Holds: save_adapter, load_adapter, write_adapter and apply_adapter (any model kind),
read_adapter, AdapterError, ADAPTER_WEIGHTS, ADAPTER_CONFIG.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from ropekit import __version__
from ropekit.encodings import PositionEncoding, build
from ropekit.utils import atomic_write_bytes, atomic_write_text

from .archs import FINGERPRINT_FIELDS, fingerprint, model_dims, unwrap
from .patching import encoding_of, patch

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter.json"
FORMAT = "ropekit-adapter"
FORMAT_VERSION = 1


class AdapterError(ValueError):
    """An adapter that cannot be loaded: missing, corrupted, or made for another model."""


def _parameters(encoding: PositionEncoding) -> dict[str, nn.Parameter]:
    # Every parameter, not only those with requires_grad: a model frozen for evaluation
    # (model.requires_grad_(False)) must still save what it learned.
    return dict(encoding.named_parameters())


def save_adapter(model: nn.Module, directory: str | Path) -> Path:
    """Save the positional parameters of a patched model; returns the adapter folder."""
    encoding = encoding_of(model)
    if encoding is None:
        raise AdapterError(
            "the model is not patched; call ropekit.hf.patch(model, spec) before saving"
        )
    return write_adapter(encoding, fingerprint(unwrap(model).config), directory)


def write_adapter(
    encoding: PositionEncoding, model_fingerprint: dict[str, Any], directory: str | Path
) -> Path:
    """Write an adapter for any model kind (patched HF model or ropekit Decoder): the
    encoding's parameters, its spec and the fingerprint of the model it belongs to."""
    directory = Path(directory)
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in _parameters(encoding).items()}
    data = safetensors.torch.save(tensors, metadata={"format": "pt", "spec": encoding.spec})
    import transformers

    meta: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "spec": encoding.spec,
        "fingerprint": model_fingerprint,
        "parameters": {
            name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for name, t in tensors.items()
        },
        "sha256": hashlib.sha256(data).hexdigest(),
        "versions": {
            "ropekit": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic_write_bytes(directory / ADAPTER_WEIGHTS, data)
    atomic_write_text(directory / ADAPTER_CONFIG, json.dumps(meta, indent=2) + "\n")
    return directory


def read_adapter(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(metadata, tensors) of an adapter folder, checked for completeness and corruption."""
    directory = Path(directory)
    config_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise AdapterError(
                f"{path} is missing; an adapter folder holds {ADAPTER_CONFIG} "
                f"and {ADAPTER_WEIGHTS} (written by save_adapter)"
            )
    try:
        meta = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{config_path} is corrupted: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise AdapterError(f"{config_path} is not a ropekit adapter (format != {FORMAT!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise AdapterError(
            f"{config_path} has format_version={meta.get('format_version')!r}; this ropekit "
            f"reads version {FORMAT_VERSION}"
        )
    for key in ("spec", "fingerprint", "parameters", "sha256"):
        if key not in meta:
            raise AdapterError(f"{config_path} is corrupted: the {key!r} entry is missing")
    data = weights_path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != meta["sha256"]:
        raise AdapterError(
            f"{weights_path} is corrupted or does not belong to {config_path}: its sha256 is "
            f"{digest[:16]}..., the adapter records {str(meta['sha256'])[:16]}..."
        )
    try:
        tensors = safetensors.torch.load(data)
    except SafetensorError as e:
        raise AdapterError(f"{weights_path} is corrupted: not a safetensors file ({e})") from None
    return meta, tensors


def _same(expected: Any, got: Any) -> bool:
    # JSON turns 10000.0 into 10000: numbers compare as floats, everything else as is.
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if number(got) and number(expected):
        return float(expected) == float(got)
    return expected == got


def _check_fingerprint(saved: dict[str, Any], model: dict[str, Any], where: Path) -> None:
    problems = []
    for field in FINGERPRINT_FIELDS:
        expected, got = saved.get(field), model[field]
        if not _same(expected, got):
            problems.append(f"{field}: expected {expected!r}, got {got!r}")
    if problems:
        raise AdapterError(
            f"adapter {where} was saved for a different model (expected = the adapter's model, "
            f"got = this model): {'; '.join(problems)}"
        )


def load_adapter(model: nn.Module, directory: str | Path) -> PositionEncoding:
    """Load an adapter into ``model``: check the fingerprint, patch with the adapter's spec if
    the model is not already patched with it, copy the parameters in; returns the encoding."""
    model = unwrap(model)

    def attach(spec: str) -> PositionEncoding:
        # The saved spec names every non-default option, so it rebuilds without the model's
        # context (which the fingerprint check has just shown to agree anyway).
        encoding = build(spec, **model_dims(model.config).as_kwargs())
        patch(model, encoding)
        return encoding

    return apply_adapter(directory, fingerprint(model.config), attach, encoding_of(model))


def apply_adapter(
    directory: str | Path,
    model_fingerprint: dict[str, Any],
    attach: Callable[[str], PositionEncoding],
    current: PositionEncoding | None,
) -> PositionEncoding:
    """Load an adapter for any model kind: check ``model_fingerprint``, ``attach(spec)`` a new
    encoding unless ``current`` already has the adapter's spec, copy the parameters in."""
    directory = Path(directory)
    meta, tensors = read_adapter(directory)
    _check_fingerprint(meta["fingerprint"], model_fingerprint, directory)
    spec = meta["spec"]
    encoding = current
    if encoding is None or encoding.spec != spec:
        try:
            encoding = attach(spec)
        except ValueError as e:
            raise AdapterError(f"{directory / ADAPTER_CONFIG}: {e}") from None
    params = _parameters(encoding)
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise AdapterError(
            f"{directory / ADAPTER_WEIGHTS} does not match {spec!r}: missing {missing}, "
            f"unexpected {unexpected}"
        )
    for name, p in params.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise AdapterError(
                f"{directory / ADAPTER_WEIGHTS}: {name} has shape {tuple(tensors[name].shape)}; "
                f"{spec!r} on this model expects {tuple(p.shape)}"
            )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])
    return encoding
