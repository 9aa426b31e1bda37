"""One writer and one reader for every result, summary and stage file ropekit writes.

A result file is one JSON object whose first keys the writer always adds:

    {"kind": "perplexity",            # what wrote it: one of KINDS
     "format_version": 2,             # of this layout; readers refuse what they do not know
     "meta": {"command", "spec", "seed", "versions", "machine", "cpu"},
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

Typed records: a kind whose writer owns a frozen dataclass registers it here (``register``,
with the kind's schema version and a migration from every older version that files were
written in) when its module is imported; results.py imports none of them (they sit above it),
so a reader imports the record class it reads, and the record class sits at or below its lowest
reader. ``read_record`` returns that class; readers read attributes, never nested dicts.
The (de)serialization is generic, driven by the dataclass's type hints (``encode``,
``decode``): JSON object keys are strings, so a ``dict[int, ...]`` (lengths) or
``dict[float, ...]`` (learning rates) field has its keys converted here, at the boundary, and
nowhere else; JSON has no NaN, so a ``float`` written as null reads back as NaN. A file with a
field the class does not have, or without one it needs, is refused by a one-line ResultError
naming the field (a renamed field fails loudly, never reads as a default). A file of an older
version is migrated on reading, in memory (the file is rewritten only by its writer), so
committed results and a comparison stopped mid-run read as the current class.

Stage files are JSONL (``write_records`` / ``read_records``): one record per line, written
whole by an atomic rename; a torn last line (a kill mid-write of an appended log) is dropped.

Holds: KINDS, FORMAT_VERSION, ResultError, ProvenanceMismatch, Schema, register, schema_of,
record_kind, encode, decode, run_metadata, digest, plain, to_json, write_result, make_record,
read_result, read_record, result_kind, check_replaceable, check_provenance, write_records,
read_records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

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
    "benchmarks": "python -m benchmarks (the repository's benchmarks/results.json): ratio rows",
}


_HEADER = ("kind", "format_version", "meta", "provenance")

R = TypeVar("R")
# A migration takes a file's content at version v (header included) to version v + 1.
Migration = Callable[[dict[str, Any]], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Schema:
    """A typed kind: its record class, the version its writer writes, and the migrations
    from each older version (v -> v + 1) that files of the kind were written in."""

    kind: str
    cls: type
    version: int
    migrations: Mapping[int, Migration]


# kind -> its schema, filled by ``register`` when the record's module is imported. results.py
# imports no owner: whoever reads a typed kind imports its record class by name (a plain import
# the layer test sees), and a file of a typed version read before any owner registered it is
# refused (``_migrated``), never read as a dict of another layout.
_SCHEMAS: dict[str, Schema] = {}


def register(
    kind: str, version: int, migrations: Mapping[int, Migration] | None = None
) -> Callable[[type[R]], type[R]]:
    """Class decorator: the frozen dataclass of ``kind`` results, written at ``version``.
    ``migrations[v]`` brings a file of version v to v + 1; every version from FORMAT_VERSION
    (the untyped layout all files had) up to ``version`` needs one."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not allowed; use one of {', '.join(KINDS)}")
    steps = dict(migrations or {})
    missing = [v for v in range(FORMAT_VERSION, version) if v not in steps]
    if missing:
        raise ValueError(f"{kind}: no migration from format_version {missing[0]} to {version}")

    def add(cls: type[R]) -> type[R]:
        params = getattr(cls, "__dataclass_params__", None)
        if params is None or not params.frozen:
            raise TypeError(f"{cls.__name__} must be a frozen dataclass to record {kind!r}")
        _SCHEMAS[kind] = Schema(kind, cls, version, steps)
        return cls

    return add


def schema_of(kind: str) -> Schema | None:
    """The registered schema of ``kind``; None if untyped (or its record's module is not
    imported: ``register`` runs on import)."""
    return _SCHEMAS.get(kind)


def record_kind(cls: type) -> str:
    """The kind whose records ``cls`` holds."""
    for schema in _SCHEMAS.values():
        if schema.cls is cls:
            return schema.kind
    raise ValueError(f"{cls.__name__} is not a registered result record")


def _version(kind: str) -> int:
    schema = schema_of(kind)
    return FORMAT_VERSION if schema is None else schema.version


def encode(value: Any) -> Any:
    """A record (or any value of one) as JSON values: a dataclass as an object in field
    order, mapping keys as strings, tuples as lists (``plain`` then writes NaN as null)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _key(kind: Any, key: str, where: str) -> Any:
    """A JSON object key as the mapping's key type (lengths are ints, rates floats)."""
    if kind in (int, float):
        try:
            return kind(key)
        except ValueError:
            raise ResultError(f"{where}: key {key!r}, expected {kind.__name__}") from None
    return key


def _scalar(kind: type, value: Any, where: str) -> Any:
    if kind is float and value is None:
        return math.nan  # plain() writes a non-finite float as null
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise ResultError(f"{where} is {json.dumps(value)[:40]}, expected {kind.__name__}")


# The Python types ``json.loads`` gives that ``_scalar`` accepts for each kind unchanged
# (a float also from an int, and null as NaN); an exact type check, so a bool is not an int.
_JSON_SCALARS: dict[Any, tuple[type, ...]] = {
    float: (float, int, type(None)),
    int: (int,),
    str: (str,),
    bool: (bool,),
}


def _plain_scalars(kind: Any, values: list) -> list | None:
    """``values`` read as a list of ``kind`` when every item is a JSON scalar ``_scalar`` takes
    as it is, else None (then each item is decoded on its own, and the first it refuses is
    named). Results hold long lists of numbers (every window's NLL, every probe's distance):
    this reads them without building a path and inspecting the hint for each item."""
    accepted = _JSON_SCALARS.get(kind)
    if accepted is None or not all(type(v) in accepted for v in values):
        return None
    if kind is float:
        return [math.nan if v is None else float(v) for v in values]
    return list(values)


def decode(kind: Any, value: Any, where: str) -> Any:
    """``value`` (JSON) as a value of type ``kind``: a dataclass from an object whose keys are
    exactly its fields (those with defaults may be absent), containers element by element (a
    ``tuple[int, float]`` place by place, a ``tuple[int, ...]`` of any length).
    Raises ResultError naming the field (``where``, dotted) that is missing, unknown or of
    another type."""
    if kind is Any:
        return value
    if dataclasses.is_dataclass(kind):
        return _decode_class(kind, value, where)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options[:-1]:  # the first that reads it (e.g. str | list[str])
            with contextlib.suppress(ResultError):
                return decode(option, value, where)
        return decode(options[-1], value, where)
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise ResultError(f"{where} is {json.dumps(value)[:40]}, not a list")
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed: one hint a place
            if len(value) != len(args):
                raise ResultError(f"{where} has {len(value)} items, expected {len(args)}")
            places = enumerate(zip(args, value, strict=True))
            return tuple(decode(a, v, f"{where}[{i}]") for i, (a, v) in places)
        item = args[0] if args else Any
        items = _plain_scalars(item, value)
        if items is None:
            items = [decode(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping) or kind is dict:
        if not isinstance(value, dict):
            raise ResultError(f"{where} is {json.dumps(value)[:40]}, not an object")
        keys, values = args if args else (str, Any)
        return {_key(keys, k, where): decode(values, v, f"{where}.{k}") for k, v in value.items()}
    return _scalar(kind, value, where)


def _decode_class(cls: type, value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise ResultError(f"{where} is {json.dumps(value)[:40]}, not a {cls.__name__} object")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = {f.name for f in fields}
    unknown = [k for k in value if k not in names]
    if unknown:
        raise ResultError(
            f"{where}.{unknown[0]} is not a field of {cls.__name__} (renamed? it has "
            f"{', '.join(sorted(names))})"
        )
    hints, kwargs = _hints(cls), {}
    for f in fields:
        if f.name in value:
            kwargs[f.name] = decode(hints[f.name], value[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ResultError(f"{where}.{f.name} is missing ({cls.__name__} needs it)")
    try:
        return cls(**kwargs)
    except ResultError:
        raise
    except (ValueError, TypeError) as e:  # the record's own checks (__post_init__) refuse it
        raise ResultError(f"{where} is not a valid {cls.__name__}: {e}") from None


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
        "cpu": _cpu(),
    }


def _cpu() -> str:
    """The processor's name and the instruction set torch's CPU kernels dispatch to. Float
    results move with the host, not only with the versions: the same package versions, model
    and window gave SmolLM2-135M's NLL 1e-5 nats per token apart on two hosts of this project
    (an AVX512 one and an AVX2 one; experiment E's README), so a result says where it ran."""
    import torch

    name = platform.processor() or "unknown processor"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        name = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            name,
        )
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}"


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


def _first_difference(recorded: Any, current: Any) -> tuple[Any, ...] | None:
    """The keys down to the first field (keys in sorted order, depth first) whose values
    differ as JSON; None when none does."""
    if isinstance(recorded, Mapping) and isinstance(current, Mapping):
        for key in sorted(set(recorded) | set(current), key=str):
            found = _first_difference(recorded.get(key), current.get(key))
            if found is not None:
                return (key, *found)
        return None
    return None if plain(recorded) == plain(current) else ()


def check_provenance(recorded: Mapping[str, Any], current: Mapping[str, Any], what: str) -> None:
    """Raise ProvenanceMismatch naming the first field in which ``what`` (a file or folder) was
    made by something else than ``current`` describes (nested fields dotted: ``data.tokens``)."""
    keys = _first_difference(dict(recorded), dict(current))
    if keys is None:
        return

    def value(tree: Any) -> Any:
        for key in keys:  # every key but the last was found in a mapping on both sides
            tree = tree.get(key)
        return tree

    def short(v: Any) -> str:
        text = json.dumps(plain(v), sort_keys=True, default=str)
        return text if len(text) <= 60 else text[:57] + "..."

    raise ProvenanceMismatch(
        f"{what} was made with other settings: {'.'.join(map(str, keys))} is "
        f"{short(value(recorded))} there, {short(value(current))} now; use another output "
        "folder, or --overwrite to recompute it"
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
    format or another provenance, or one its kind's record class cannot read."""
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
    schema = schema_of(kind)
    if schema is not None:  # a file its own record class cannot read is not reused either
        read_record(path, schema.cls)
    if provenance is not None:
        check_provenance(data.get("provenance") or {}, provenance, str(path))
    return True


def write_result(
    path: str | Path,
    kind: str,
    payload: Mapping[str, Any] | Any,
    *,
    meta: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
    overwrite: bool = True,
    indent: int | None = 2,
) -> Path:
    """Write a ``kind`` result atomically; returns the path.

    ``payload`` is a dict, or a typed kind's record. ``meta`` is ``run_metadata(...)``;
    ``provenance`` what produced the numbers. With
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
    the file holds): the header keys first, then the payload's own. A typed kind's payload
    is its record (``encode``d here), whose ``meta`` and ``provenance`` fields are the
    header's unless given."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not allowed; use one of {', '.join(KINDS)}")
    if dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        if type(payload) is not getattr(schema_of(kind), "cls", None):
            raise ValueError(f"a {type(payload).__name__} is not a {kind!r} record")
        payload = encode(payload)
        meta = payload["meta"] if meta is None else meta
        provenance = payload["provenance"] if provenance is None else provenance
    body = {k: v for k, v in payload.items() if k not in _HEADER}
    return {
        "kind": kind,
        "format_version": _version(kind),
        "meta": dict(meta) if meta is not None else run_metadata(),
        "provenance": dict(provenance or {}),
        **body,
    }


def read_result(path: str | Path, kind: str | None = None) -> dict[str, Any]:
    """A result file's content, checked: valid JSON, a known kind (``kind`` when given) and
    this format version (a typed kind's older version migrated to it, in memory). Raises
    ResultError naming the file and what is wrong."""
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
    return _migrated(data, path)


def _migrated(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """``data`` at its kind's current version: migrated step by step from an older one."""
    schema, version = schema_of(data["kind"]), data.get("format_version")
    current = _version(data["kind"])
    while schema is not None and version in schema.migrations and version != current:
        try:
            data = {**schema.migrations[version](data), "format_version": version + 1}
        except (KeyError, TypeError, AttributeError) as e:  # not the layout its version says
            raise ResultError(
                f"{path} does not read as format_version {version} ({type(e).__name__}: {e}); "
                "recompute it (--overwrite)"
            ) from None
        version = data["format_version"]
    if schema is None and isinstance(version, int) and version > FORMAT_VERSION:
        raise ResultError(
            f"{path} is a typed {data['kind']!r} result (format_version {version}) read before "
            "its record class was imported; read it with read_record(path, <its class>)"
        )
    if version != current:
        raise ResultError(
            f"{path} has format_version={version!r}; this ropekit reads {current}: recompute "
            "it (--overwrite)"
        )
    return data


def read_record(path: str | Path, cls: type[R]) -> R:
    """A result file of the kind ``cls`` records, as ``cls`` (migrated from an older version;
    ``read_result``'s checks, then ``decode``'s: a missing, unknown or mistyped field raises
    ResultError naming the file and the field)."""
    kind = record_kind(cls)
    data = read_result(path, kind)
    body = {k: v for k, v in data.items() if k not in ("kind", "format_version")}
    try:
        return decode(cls, body, kind)
    except ResultError as e:
        raise ResultError(f"{path}: {e}") from None


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
