"""Adapters: what an extension trained, saved apart from the backbone, for any model kind.

A positional adapter is a folder with two files, both written atomically (temp file, fsync,
rename):

- ``adapter.safetensors``: every parameter of the encoding (AdaRoPE's frequency offsets and
  temperatures, tuned-yarn's knobs; empty for fixed schedules), named as in
  ``encoding.named_parameters()``.
- ``adapter.json``: the spec that rebuilds the encoding, the fingerprint of the model it was
  trained on (architecture, layers, heads, kv heads, head dim, base, original length), a
  sample of that model's weights (``weights_sample``: 64 values, compared to bfloat16's
  precision, so another model of the same shape is refused and the same model in another
  dtype is not; ``ROPEKIT_ADAPTER_OTHER_WEIGHTS=1`` loads it anyway, e.g. onto a fine-tuned
  copy of the model; files written before it have none), each
  parameter's shape and dtype, the sha256 of the weights file, the sha256 of all of these
  (``meta_sha256``: an edited spec or fingerprint is refused; files written before it have
  none and load as they did), the layers the encoding covers (index and type: a spec whose
  layers differ on load is refused) and the versions that wrote it.

LoRA weights (an extension run's ``lora.safetensors``) carry the same check in ``lora.json``:
rank, alpha, target modules, the model's fingerprint, every tensor's shape and the sha256 of
the weights, so a file from another run, rank or model is refused instead of loaded.

The weights are written first and the JSON last, so a crash between the two leaves a JSON whose
checksum no longer matches and loading says so instead of using stale numbers.

Holds: AdapterError, save_adapter, write_adapter, read_adapter, load_adapter (an adapter folder
or an extension run folder), check_weights, check_layers, OTHER_WEIGHTS_ENV, add_lora,
save_lora, load_lora, ADAPTER_WEIGHTS, ADAPTER_CONFIG, LORA_WEIGHTS, LORA_CONFIG.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from ropekit import __version__
from ropekit.encodings import PositionEncoding
from ropekit.utils import atomic_write_bytes, atomic_write_text

from .base import Backbone

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter.json"
FORMAT = "ropekit-adapter"
FORMAT_VERSION = 1
LORA_WEIGHTS = "lora.safetensors"
LORA_CONFIG = "lora.json"
LORA_FORMAT = "ropekit-lora"
# What an adapter's model must match (Backbone.fingerprint).
FINGERPRINT_FIELDS = (
    "architecture",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "base",
    "original_length",
)


class AdapterError(ValueError):
    """An adapter that cannot be loaded: missing, corrupted, or made for another model."""


def _versions() -> dict[str, str]:
    import transformers

    return {
        "ropekit": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _write_checked(
    directory: Path, weights: str, config: str, tensors: dict[str, torch.Tensor], meta: dict
) -> None:
    """Weights first, then the JSON with their sha256: a crash between leaves a mismatch."""
    data = safetensors.torch.save(tensors, metadata={"format": "pt"})
    meta = {
        **meta,
        "parameters": {
            name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for name, t in tensors.items()
        },
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    meta["meta_sha256"] = _meta_digest(meta)
    meta |= {"versions": _versions(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_bytes(directory / weights, data)
    atomic_write_text(directory / config, json.dumps(meta, indent=2) + "\n")


# Entries of a checked JSON that its own checksum does not cover: the record of who wrote it
# and when (the checksum itself, the versions, the time).
_UNCHECKED = ("meta_sha256", "versions", "created")


def _meta_digest(meta: dict[str, Any]) -> str:
    """sha256 of every entry that says what the weights are (the spec, LoRA's rank and
    targets, the model's fingerprint, the parameters, the weights' own sha256)."""
    checked = {k: v for k, v in meta.items() if k not in _UNCHECKED}
    return hashlib.sha256(json.dumps(checked, sort_keys=True).encode()).hexdigest()


def _read_checked(
    directory: Path, weights: str, config: str, fmt: str, keys: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config_path, weights_path = directory / config, directory / weights
    for path in (config_path, weights_path):
        if not path.is_file():
            raise AdapterError(f"{path} is missing; the folder holds {config} and {weights}")
    try:
        meta = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{config_path} is corrupted: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        raise AdapterError(f"{config_path} is not a {fmt} file (format != {fmt!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise AdapterError(
            f"{config_path} has format_version={meta.get('format_version')!r}; this ropekit "
            f"reads version {FORMAT_VERSION}"
        )
    for key in ("fingerprint", "parameters", "sha256", *keys):
        if key not in meta:
            raise AdapterError(f"{config_path} is corrupted: the {key!r} entry is missing")
    # Written since the checksum covers the metadata too; files written before have none.
    if "meta_sha256" in meta and meta["meta_sha256"] != _meta_digest(meta):
        described = ", ".join(k for k in (*keys, "fingerprint") if k in meta)
        raise AdapterError(
            f"{config_path} was edited after it was written: its entries ({described}, "
            "parameters) no longer match the checksum it was written with; re-create the "
            "adapter (ropekit extend) rather than editing it"
        )
    data = weights_path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != meta["sha256"]:
        raise AdapterError(
            f"{weights_path} is corrupted or does not belong to {config_path}: its sha256 is "
            f"{digest[:16]}..., {config} records {str(meta['sha256'])[:16]}..."
        )
    try:
        tensors = safetensors.torch.load(data)
    except SafetensorError as e:
        raise AdapterError(f"{weights_path} is corrupted: not a safetensors file ({e})") from None
    return meta, tensors


def _same(expected: Any, got: Any) -> bool:
    # JSON turns 10000.0 into 10000: numbers compare as floats, everything else as is.
    def number(x: Any) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool)

    if number(got) and number(expected):
        return float(expected) == float(got)
    return expected == got


def check_fingerprint(saved: dict[str, Any], model: dict[str, Any], where: Path) -> None:
    """AdapterError naming every field in which the adapter's model and this one differ."""
    problems = []
    for field in FINGERPRINT_FIELDS:
        expected, got = saved.get(field), model.get(field)
        if not _same(expected, got):
            problems.append(f"{field}: expected {expected!r}, got {got!r}")
    if problems:
        raise AdapterError(
            f"adapter {where} was saved for a different model (expected = the adapter's model, "
            f"got = this model): {'; '.join(problems)}"
        )


# The override for an adapter of another model's weights (module docstring).
OTHER_WEIGHTS_ENV = "ROPEKIT_ADAPTER_OTHER_WEIGHTS"
# A cast to bfloat16 moves a weight by at most half its last place (2^-9 relative); the
# tolerance is four times that, plus an absolute floor for float16's subnormals.
_SAMPLE_RTOL, _SAMPLE_ATOL = 2.0**-7, 1e-7


def check_weights(saved: list[float] | None, backbone: Backbone, where: Path) -> None:
    """AdapterError when the weights the adapter was made on are not this model's: its
    ``weights_sample`` differs beyond a dtype cast (none recorded: files written before it,
    which load as they did; ``OTHER_WEIGHTS_ENV`` set: load anyway)."""
    if saved is None or os.environ.get(OTHER_WEIGHTS_ENV) == "1":
        return
    got = backbone.weights_sample(len(saved))
    differ = [
        (a, b)
        for a, b in zip(saved, got, strict=True)
        if abs(a - b) > _SAMPLE_RTOL * abs(a) + _SAMPLE_ATOL
    ]
    if differ:
        raise AdapterError(
            f"adapter {where} was made for another model: its weights_sample differs from this "
            f"model's weights at {len(differ)} of {len(saved)} positions (e.g. {differ[0][0]:.6g} "
            f"vs {differ[0][1]:.6g}), beyond a dtype cast; load it onto the model it was trained "
            f"on, or set {OTHER_WEIGHTS_ENV}=1 to load it anyway (e.g. a fine-tuned copy)"
        )


# ----------------------------------------------------------------------------- positional
def write_adapter(
    encoding: PositionEncoding,
    model_fingerprint: dict[str, Any],
    directory: str | Path,
    *,
    weights_sample: list[float],
    layers: dict[int, str] | None = None,
) -> Path:
    """Write an adapter: the encoding's parameters (every one, frozen or not: a model frozen
    for evaluation must still save what it learned), its spec, the model's fingerprint, its
    ``Backbone.weights_sample`` and the layers the encoding covers
    (``Backbone.encoded_layers``: index and type)."""
    directory = Path(directory)
    tensors = {n: p.detach().to("cpu").contiguous() for n, p in encoding.named_parameters()}
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "spec": encoding.spec,
        "fingerprint": model_fingerprint,
        "weights_sample": weights_sample,
    }
    if layers is not None:
        meta["layers"] = [[index, kind] for index, kind in layers.items()]
    _write_checked(directory, ADAPTER_WEIGHTS, ADAPTER_CONFIG, tensors, meta)
    return directory


def save_adapter(model: Backbone | nn.Module, directory: str | Path) -> Path:
    """Save the positional parameters of a model's ropekit encoding; returns the folder."""
    from .kinds import as_backbone

    backbone = as_backbone(model)
    encoding = backbone.encoding
    if encoding is None:
        raise AdapterError(
            "the model is not patched with a ropekit encoding; attach one "
            "(ropekit.hf.patch(model, spec), or Backbone.set_encoding) before saving"
        )
    return write_adapter(
        encoding, backbone.fingerprint(), directory, weights_sample=backbone.weights_sample(),
        layers=backbone.encoded_layers(),
    )  # fmt: skip


def read_adapter(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(metadata, tensors) of an adapter folder, checked for completeness and corruption."""
    return _read_checked(Path(directory), ADAPTER_WEIGHTS, ADAPTER_CONFIG, FORMAT, ("spec",))


def check_layers(recorded: list | None, backbone: Backbone, directory: Path) -> None:
    """AdapterError unless the spec, rebuilt on this model, covers the layers the adapter
    was trained on (a family's default layer types could differ between versions); files
    written before layers were recorded have none and load as they did."""
    if recorded is None:
        return
    here = [[index, kind] for index, kind in backbone.encoded_layers().items()]
    if [list(pair) for pair in recorded] != here:

        def words(pairs: list) -> str:
            return ", ".join(f"L{i} {kind}" for i, kind in pairs) or "none"

        raise AdapterError(
            f"{directory / ADAPTER_CONFIG} was trained on layers {words(recorded)}; its spec "
            f"covers {words(here)} of this model: load it with a spec naming layers= as "
            "trained, or retrain"
        )


def _apply_positional(backbone: Backbone, directory: Path) -> PositionEncoding:
    meta, tensors = read_adapter(directory)
    check_fingerprint(meta["fingerprint"], backbone.fingerprint(), directory)
    check_weights(meta.get("weights_sample"), backbone, directory)
    spec = meta["spec"]
    encoding = backbone.encoding
    if encoding is None or encoding.spec != spec:
        try:
            # The saved spec names every non-default option, so it rebuilds without the
            # model's context (which the fingerprint check has just shown to agree anyway).
            encoding = backbone.set_encoding(spec)
        except ValueError as e:
            raise AdapterError(f"{directory / ADAPTER_CONFIG}: {e}") from None
    check_layers(meta.get("layers"), backbone, directory)
    params = dict(encoding.named_parameters())
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


# ----------------------------------------------------------------------------- LoRA
def add_lora(
    backbone: Backbone, rank: int, alpha: int, targets: tuple[str, ...] | None = None
) -> tuple[str, ...]:
    """Inject PEFT LoRA adapters into ``targets`` (default: the backbone's attention
    projections); returns the targets used."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = tuple(targets or backbone.lora_targets)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets))
    inject_adapter_in_model(config, backbone.model)
    return targets


def save_lora(
    backbone: Backbone, directory: str | Path, rank: int, alpha: int, targets: tuple[str, ...]
) -> Path | None:
    """Write the backbone's LoRA weights and their lora.json; None when it has none."""
    tensors = {n: p.detach().cpu().contiguous() for n, p in backbone.lora_parameters().items()}
    if not tensors:
        return None
    directory = Path(directory)
    meta = {
        "format": LORA_FORMAT,
        "format_version": FORMAT_VERSION,
        "rank": rank,
        "alpha": alpha,
        "targets": list(targets),
        "fingerprint": backbone.fingerprint(),
        "weights_sample": backbone.weights_sample(),
    }
    _write_checked(directory, LORA_WEIGHTS, LORA_CONFIG, tensors, meta)
    return directory / LORA_WEIGHTS


def load_lora(backbone: Backbone, directory: str | Path) -> None:
    """Add LoRA as ``lora.json`` describes it and load its checked weights."""
    directory = Path(directory)
    meta, tensors = _read_checked(
        directory, LORA_WEIGHTS, LORA_CONFIG, LORA_FORMAT, ("rank", "alpha", "targets")
    )
    check_fingerprint(meta["fingerprint"], backbone.fingerprint(), directory)
    check_weights(meta.get("weights_sample"), backbone, directory)
    if not backbone.lora_parameters():
        add_lora(backbone, int(meta["rank"]), int(meta["alpha"]), tuple(meta["targets"]))
    params = backbone.lora_parameters()
    if set(params) != set(tensors):
        raise AdapterError(
            f"{directory / LORA_WEIGHTS} does not fit this model's LoRA layers: missing "
            f"{sorted(set(params) - set(tensors))[:3]}, unexpected "
            f"{sorted(set(tensors) - set(params))[:3]}"
        )
    for name, p in params.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise AdapterError(
                f"{directory / LORA_WEIGHTS}: {name} has shape {tuple(tensors[name].shape)}; "
                f"this model's LoRA layer has {tuple(p.shape)} (rank {meta['rank']})"
            )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])
            p.requires_grad_(False)


# ----------------------------------------------------------------------------- both
def load_adapter(model: Backbone | nn.Module, directory: str | Path) -> PositionEncoding:
    """Load an adapter into a model of any kind, attaching its encoding; returns it.

    ``directory`` is an adapter folder or an extension run folder (``ropekit extend --out``):
    then its ``adapter/`` loads, and its LoRA weights too when the run trained LoRA. The
    backbone remembers the adapter's sha256 (its results' provenance names it).
    """
    from .kinds import as_backbone

    backbone = as_backbone(model)
    directory = Path(directory)
    if not directory.is_dir():
        raise AdapterError(
            f"{directory} is not a folder; an adapter is a folder ({ADAPTER_CONFIG})"
        )
    run = directory if not (directory / ADAPTER_CONFIG).exists() else None
    adapter_dir = directory / "adapter" if run is not None else directory
    encoding = _apply_positional(backbone, adapter_dir)
    digests = [read_adapter(adapter_dir)[0]["sha256"]]
    if run is not None:
        _warn_if_record_damaged(run / RUN_RECORD)
    if run is not None and ((run / LORA_WEIGHTS).exists() or (run / LORA_CONFIG).exists()):
        load_lora(backbone, run)
        digests.append(json.loads((run / LORA_CONFIG).read_text())["sha256"])
    backbone.adapter_sha256 = digests[0] if len(digests) == 1 else "+".join(digests)
    return encoding


RUN_RECORD = "extend.json"  # the extension run's record (ropekit.train.extend writes it)


def _warn_if_record_damaged(path: Path) -> None:
    """The weights check themselves and load without the run's record; a record that is
    there but unreadable still means the folder was damaged, so it is said, not ignored."""
    if not path.exists():
        return
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problem = " ".join(str(e).split())
    else:
        if isinstance(record, dict) and record.get("kind") == "extend":
            return
        problem = "not an extension record"
    warnings.warn(
        f"{path} is damaged ({problem}); the adapter and LoRA weights beside it passed their "
        "own checks and are loaded without it",
        stacklevel=3,
    )
