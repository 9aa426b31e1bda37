"""Resumable evaluation stages: one folder per (task, length), shared by the task runner and
the retrieval probes.

A stage's folder holds its ``summary.json`` (written at the start with the stage's provenance
and ``complete: false``, replaced by the scored summary at the end) and a records file whose
every line carries the stage's fingerprint (a digest of the provenance). ``Stage.claim``
checks a folder before any work: the same settings and model resume it; other settings or
another model are refused naming the field that differs (``results.check_replaceable``), or
with ``overwrite`` the folder is cleared and redone.

Holds: Stage.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ropekit.results import (
    ProvenanceMismatch,
    ResultError,
    check_replaceable,
    digest,
    read_records,
    run_metadata,
    write_result,
)


@dataclass
class Stage:
    """One length of one task: its folder and what its records depend on. A kind of stage
    names its summary's result kind, its records file and, for the refusal, what its
    settings are."""

    length: int
    directory: Path
    provenance: dict[str, Any]

    kind: ClassVar[str]  # summary.json's result kind
    records_file: ClassVar[str]  # the file whose records carry the fingerprint
    settings: ClassVar[str]  # what the provenance covers, in words (for the refusal)

    @property
    def fingerprint(self) -> str:
        """The digest every record of the stage carries."""
        return digest(self.provenance, size=8)

    def claim(self, overwrite: bool, **payload: Any) -> None:
        """Refuse (or, with ``overwrite``, clear) a folder made with other settings or another
        model; then leave this stage's provenance in its summary.json, with ``payload``."""
        summary = self.directory / "summary.json"
        records = self.directory / self.records_file
        try:
            if summary.exists():
                check_replaceable(summary, self.kind, self.provenance)
            elif any(r.get("stage") != self.fingerprint for r in read_records(records)):
                raise ProvenanceMismatch(
                    f"{records} was made with other settings ({self.settings} or model); use "
                    "another output folder, or --overwrite to recompute it"
                )
        except ResultError:
            if not overwrite:
                raise
            shutil.rmtree(self.directory)
        if not summary.exists():
            body = {**payload, "length": self.length, "stage": self.fingerprint}
            write_result(
                summary, self.kind, {**body, "complete": False},
                meta=run_metadata(), provenance=self.provenance,
            )  # fmt: skip
