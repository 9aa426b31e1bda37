"""Documents, the errors of the data package, and the split of documents into train/validation.

Holds:
- `Document`: one named text (a play, an essay, a file, a JSONL record).
- The errors: `CorpusNotInstalledError`, `UnknownCorpusError`, `EmptyCorpusError`,
  `DataFileError`.
- `split_documents`: the deterministic, document-level train/validation split used by every
  corpus without a fixed list of held-out documents.

Splits are by document, never inside one, so no validation text is ever seen in training. The
split hashes each document's *text*, not its name or path: the same files give the same split
whether named by a relative or an absolute path, and duplicated texts always land together.
"""

import hashlib
from dataclasses import dataclass
from typing import Literal, get_args

Split = Literal["train", "validation", "all"]
SPLITS: tuple[str, ...] = get_args(Split)

# Share of documents held out where a corpus has no fixed list (Shakespeare has one).
VALIDATION_FRACTION = 0.1


class CorpusNotInstalledError(RuntimeError):
    """A bundled corpus whose package is not installed (the message names the pip command)."""


class UnknownCorpusError(ValueError):
    """A data source that is neither a known corpus name nor a path to text files."""


class EmptyCorpusError(ValueError):
    """A source, split or file set that holds no text."""


class DataFileError(ValueError):
    """A user file that is missing, of an unsupported kind, or not readable as UTF-8 text."""


@dataclass(frozen=True)
class Document:
    """One unit of text that is never split between train and validation."""

    name: str  # unique within its source: "shakespeare/hamlet", "notes/a.txt", "x.jsonl:12"
    text: str

    @property
    def n_bytes(self) -> int:
        """Length of the text in UTF-8 bytes (the unit of bits-per-byte)."""
        return len(self.text.encode("utf-8"))


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not allowed; allowed: {', '.join(SPLITS)}")


def _text_hash(text: str) -> int:
    # hashlib, not hash(): Python salts str hashes per process, the split must not change.
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def split_documents(
    documents: list[Document], split: Split, fraction: float = VALIDATION_FRACTION
) -> list[Document]:
    """Return the documents of `split`, keeping their order.

    Validation holds the `max(1, round(fraction * n))` documents with the smallest text hash
    (plus any duplicate of the last one), train holds the rest. A single document cannot be
    split by document: it goes to train and validation is empty.
    """
    check_split(split)
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction={fraction!r} is not allowed; allowed: 0 < fraction < 1")
    if split == "all":
        return list(documents)
    if len(documents) < 2:
        held_out: set[int] = set()
    else:
        hashes = [_text_hash(d.text) for d in documents]
        n_validation = max(1, round(fraction * len(documents)))
        threshold = sorted(hashes)[n_validation - 1]
        held_out = {i for i, h in enumerate(hashes) if h <= threshold}
    want_validation = split == "validation"
    return [d for i, d in enumerate(documents) if (i in held_out) == want_validation]
