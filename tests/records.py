"""What every typed result's tests assert of a bad file: it is refused in one line that names
the file and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ropekit.results import ResultError, read_record


def assert_refused(path: Path, data: dict[str, Any], cls: type, message: str) -> None:
    """``data`` written at ``path`` is refused by ``read_record(path, cls)``: one line that
    names the file and holds ``message``."""
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError) as error:
        read_record(path, cls)
    text = str(error.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text
