"""One writer and one reader for every result, summary and stage file ropekit writes.

A result file is one JSON object whose first keys the writer always adds:

    {"kind": "perplexity",            # what wrote it: one of KINDS
     "format_version": 2,             # of this layout; readers refuse what they do not know
     "meta": {"command", "spec", "seed", "versions", "machine"},
     "provenance": {...},             # what produced it (model, adapter, data, ...); may be {}
     ...the payload of that kind...}

Why one writer: a number is only worth what is known about what made it, so every file says
which command, model, encoding, data and seed it belongs to, in one place, the same way; the
report dispatches on ``kind`` instead of guessing from file names; and no command replaces a
file another command (or another model's run) wrote (``check_replaceable``). Metadata holds no
timestamp: rerunning on the same inputs writes the same bytes.

Provenance is a flat mapping of named fields (``model``, ``adapter``, ``spec``, ``tokenizer``,
``data``, ``task``, ``lengths``, ``seed``, ``ropekit``, ...), each a JSON value. A cache or a
result is reused only when its recorded provenance equals the current one; otherwise
``ProvenanceMismatch`` names the first field that differs (``check_provenance``).

Stage files are JSONL (``write_records`` / ``read_records``): one record per line, written
whole by an atomic rename; a torn last line (a kill mid-write of an appended log) is dropped.

Holds: KINDS, FORMAT_VERSION, ResultError, ProvenanceMismatch, run_metadata, digest, plain,
to_json, write_result, make_record, read_result, result_kind, check_replaceable,
check_provenance, write_records, read_records.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ropekit.utils import atomic_write_text

FORMAT_VERSION = 2
# kind -> what writes it. The report and every reader dispatch on these names.
KINDS: dict[str, str] = {
    "pretrain": "ropekit pretrain: the trained decoder's summary (pretrain.json)",
    "train": "the training loop: one run's summary (summary.json beside checkpoints/)",
    "extend": "ropekit extend: one extension stage (extend.json)",
    "search": "ropekit search: LongRoPE-style searched factors (search.json)",
    "perplexity": "ropekit eval ppl (ppl.json)",
    "tasks": "ropekit eval needle|passkey|ruler: every task and length (summary.json)",
    "task-stage": "one task at one length of a task run (<task>/<length>/summary.json)",
    "probes": "ropekit eval probes: many retrieval probes per long prefill (summary.json)",
    "probe-stage": "one length of a probes run (<length>/summary.json)",
    "analysis": "ropekit analyze (analysis.json)",
    "schedules": "ropekit schedules (schedules.json)",
    "demo": "ropekit demo (demo.json)",
    "experiment": "an experiment script's committed results (results.json)",
    "compare": "ropekit compare: methods x domains x lengths and the verdict (compare.json)",
    "inspect": "ropekit inspect --json: what each serving engine does with a folder's rope config",
}


_HEADER = ("kind", "format_version", "meta", "provenance")


class ResultError(ValueError):
    """A result file that cannot be read or must not be replaced."""


class ProvenanceMismatch(ResultError):
    """A cache or result made by something else than what asks for it."""


def run_metadata(command: str = "", *, spec: str | None = None, seed: int | None = None) -> dict:
    """The command, encoding spec, seed and versions a result records (no timestamp: see the
    module docstring)."""
    import torch

    from ropekit import __version__

    versions = {"ropekit": __version__, "torch": torch.__version__}
    versions["python"] = platform.python_version()
    for package in ("transformers", "accelerate", "peft", "safetensors", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return {
        "command": command or " ".join(sys.argv),
        "spec": spec,
        "seed": seed,
        "versions": versions,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }


def plain(obj: Any) -> Any:
    """JSON has no NaN or infinity: write them as null rather than as invalid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return obj


def to_json(obj: Any, indent: int | None = 2) -> str:
    return json.dumps(plain(obj), indent=indent, default=str)


def digest(obj: Any, size: int = 16) -> str:
    """A short stable hash of a JSON-able value (keys sorted): the name of an identity."""
    text = json.dumps(plain(obj), sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def result_kind(path: str | Path) -> str | None:
    """The ``kind`` a file records, or None when it is not a readable ropekit result."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    kind = data.get("kind") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) else None


def _first_difference(recorded: Any, current: Any, where: str) -> str | None:
    if isinstance(recorded, Mapping) and isinstance(current, Mapping):
        for key in sorted(set(recorded) | set(current), key=str):
            found = _first_difference(recorded.get(key), current.get(key), f"{where}.{key}")
            if found is not None:
                return found
        return None
    return None if plain(recorded) == plain(current) else where


def check_provenance(recorded: Mapping[str, Any], current: Mapping[str, Any], what: str) -> None:
    """Raise ProvenanceMismatch naming the first field in which ``what`` (a file or folder) was
    made by something else than ``current`` describes."""
    field = _first_difference(dict(recorded), dict(current), "")
    if field is None:
        return
    path = field.lstrip(".")

    def value(tree: Any) -> Any:
        for part in path.split("."):
            tree = tree.get(part) if isinstance(tree, Mapping) else None
        return tree

    def short(v: Any) -> str:
        text = json.dumps(plain(v), sort_keys=True, default=str)
        return text if len(text) <= 60 else text[:57] + "..."

    raise ProvenanceMismatch(
        f"{what} was made with other settings: {path} is {short(value(recorded))} there, "
        f"{short(value(current))} now; use another output folder, or --overwrite to recompute it"
    )


def check_replaceable(
    path: str | Path,
    kind: str,
    provenance: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
) -> bool:
    """May a ``kind`` result with ``provenance`` be written at ``path``? Returns True when a
    result of the same kind and provenance is already there (reusable), False when the path
    is free or ``overwrite`` is set; raises ResultError for a file of another command, another
    format or another provenance."""
    path = Path(path)
    if overwrite or not (path.exists() or path.is_symlink()):
        return False
    if path.is_symlink() or not path.is_file():
        raise ResultError(f"{path} exists and is not a regular file; use another output folder")
    existing = result_kind(path)
    if existing != kind:
        owner = f"a {existing!r} result" if existing else "a file ropekit did not write"
        raise ResultError(
            f"{path} holds {owner}, not a {kind!r} result; use another output folder, or "
            "--overwrite to replace it"
        )
    data = read_result(path, kind)
    if provenance is not None:
        check_provenance(data.get("provenance") or {}, provenance, str(path))
    return True


def write_result(
    path: str | Path,
    kind: str,
    payload: Mapping[str, Any],
    *,
    meta: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
    overwrite: bool = True,
    indent: int | None = 2,
) -> Path:
    """Write a ``kind`` result atomically; returns the path.

    ``meta`` is ``run_metadata(...)``; ``provenance`` what produced the numbers. With
    ``overwrite=False`` a file of another kind or provenance is never replaced
    (``check_replaceable``); the default replaces only after the command checked its folder
    at start, which every command does.
    """
    path = Path(path)
    record = make_record(kind, payload, meta=meta, provenance=provenance)
    if not overwrite:
        check_replaceable(path, kind, provenance)
    atomic_write_text(path, to_json(record, indent) + "\n")
    return path


def make_record(
    kind: str,
    payload: Mapping[str, Any],
    *,
    meta: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The content ``write_result`` writes (what a command returns, so its caller holds what
    the file holds): the header keys first, then the payload's own."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not allowed; use one of {', '.join(KINDS)}")
    body = {k: v for k, v in payload.items() if k not in _HEADER}
    return {
        "kind": kind,
        "format_version": FORMAT_VERSION,
        "meta": dict(meta) if meta is not None else run_metadata(),
        "provenance": dict(provenance or {}),
        **body,
    }


def read_result(path: str | Path, kind: str | None = None) -> dict[str, Any]:
    """A result file's content, checked: valid JSON, a known kind (``kind`` when given) and
    this format version. Raises ResultError naming the file and what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResultError(f"{path} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultError(f"{path} is not valid JSON (corrupted?): {e}") from None
    if not isinstance(data, dict) or data.get("kind") not in KINDS:
        raise ResultError(f"{path} is not a ropekit result (no known 'kind')")
    if kind is not None and data["kind"] != kind:
        raise ResultError(f"{path} is a {data['kind']!r} result, not a {kind!r} one")
    if data.get("format_version") != FORMAT_VERSION:
        raise ResultError(
            f"{path} has format_version={data.get('format_version')!r}; this ropekit reads "
            f"{FORMAT_VERSION}: recompute it (--overwrite)"
        )
    return data


def write_records(path: str | Path, records: Iterable[Mapping[str, Any]]) -> Path:
    """Write a JSONL stage file atomically (all records, one per line)."""
    path = Path(path)
    atomic_write_text(path, "".join(to_json(r, indent=None) + "\n" for r in records))
    return path


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL file; [] when it does not exist. A torn last line (a kill while it
    was appended) is dropped; a damaged line elsewhere is an error naming it."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ResultError(f"{path}, line {number}, is not valid JSON (corrupted?)") from None
    return records
