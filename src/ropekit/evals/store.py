"""Files of the evaluation stages: JSON and JSONL, written atomically.

Holds: write_json, write_jsonl, read_jsonl, to_json.

Every write goes to a temporary file beside the target and is renamed over it, so an
interrupted run leaves the previous complete file or none, never half of one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ropekit.utils import atomic_write_text


def _plain(obj: Any) -> Any:
    """JSON has no NaN or infinity: write them as null rather than as invalid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


def to_json(obj: Any, indent: int | None = 2) -> str:
    return json.dumps(_plain(obj), indent=indent, default=str)


def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    atomic_write_text(path, to_json(obj) + "\n")
    return path


def write_jsonl(path: str | Path, records: Iterable[Any]) -> Path:
    path = Path(path)
    atomic_write_text(path, "".join(to_json(r, indent=None) + "\n" for r in records))
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL file; [] when it does not exist."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
