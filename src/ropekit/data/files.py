"""User text files, given by path, glob or folder.

Holds `TEXT_SUFFIXES`, `expand_paths` (a path, glob or folder -> files) and `load_files`
(files -> documents), with one reader per kind:
- `.txt`: one document per file, named by its path;
- `.jsonl`: one document per line, text in a field (default "text"), named `path:line` (1-based);
- `.parquet`: one document per row, text in a string column (default "text"), named `path:row`
  (0-based).

Text must be UTF-8; anything else is a `DataFileError` naming the file and the byte offset.
Empty texts are skipped; a source with no text at all is an `EmptyCorpusError`.
"""

import glob
import json
import os
from collections.abc import Sequence
from pathlib import Path

from ropekit.data.documents import DataFileError, Document, EmptyCorpusError

TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".jsonl", ".parquet")
_GLOB_CHARS = frozenset("*?[")

PathSpec = str | os.PathLike[str]


def _check_suffix(path: Path) -> Path:
    if path.suffix not in TEXT_SUFFIXES:
        raise DataFileError(
            f"{path}: unsupported file kind {path.suffix or '(no suffix)'!r}; "
            f"allowed: {', '.join(TEXT_SUFFIXES)}"
        )
    return path


def expand_paths(source: PathSpec) -> list[Path]:
    """Files named by `source`: a file, a glob (`**` recurses) or a folder (searched
    recursively for supported files). Raises `DataFileError` when nothing matches."""
    text = os.fspath(source)
    if _GLOB_CHARS & set(text):
        files = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        if not files:
            raise DataFileError(f"the glob {text!r} matches no file")
        return [_check_suffix(p) for p in files]
    path = Path(text)
    if path.is_dir():
        # A folder may hold other files (README, images): take only the supported kinds.
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise DataFileError(f"the folder {text!r} holds no {', '.join(TEXT_SUFFIXES)} file")
        return files
    if path.is_file():
        return [_check_suffix(path)]
    if path.exists():  # a FIFO, socket or device: reading it could block forever
        raise DataFileError(
            f"{text!r} is not a regular file (a pipe, socket or device); allowed: a text file, "
            "a glob or a folder of them"
        )
    raise DataFileError(f"no such file or folder: {text!r}")


def read_utf8(path: Path) -> str:
    """The file's text; a `DataFileError` with the byte offset if it is not UTF-8."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataFileError(
            f"{path}: not valid UTF-8 at byte offset {e.start} (byte 0x{data[e.start]:02x}); "
            "text files must be UTF-8 — convert it first, e.g. `iconv -f latin1 -t utf-8`"
        ) from None
    return text.removeprefix("\ufeff")  # a byte-order mark is not text


def _read_txt(path: Path, text_field: str) -> list[Document]:
    return [Document(str(path), read_utf8(path))]


def _read_jsonl(path: Path, text_field: str) -> list[Document]:
    docs = []
    # Split on "\n" only: str.splitlines would also break at U+2028 inside JSON strings.
    for number, line in enumerate(read_utf8(path).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFileError(
                f"{where}: not valid JSON ({e.msg}); each line of a .jsonl file must be "
                "one JSON object"
            ) from None
        if not isinstance(record, dict):
            raise DataFileError(f"{where}: a {type(record).__name__}, expected a JSON object")
        if text_field not in record:
            raise DataFileError(
                f"{where}: no field {text_field!r}; the record has {sorted(record)}; "
                "choose the text field with text_field="
            )
        text = record[text_field]
        if not isinstance(text, str):
            raise DataFileError(
                f"{where}: field {text_field!r} is a {type(text).__name__}, expected a string"
            )
        docs.append(Document(where, text))
    return docs


def _read_parquet(path: Path, text_field: str) -> list[Document]:
    import pyarrow as pa  # imported here: pyarrow is only needed for parquet files
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:  # not parquet, truncated, unreadable
        reason = " ".join(str(e).split()) or type(e).__name__
        raise DataFileError(f"{path}: not a readable parquet file ({reason})") from None
    if text_field not in schema.names:
        raise DataFileError(
            f"{path}: no column {text_field!r}; the file has {schema.names}; "
            "choose the text column with text_field="
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataFileError(f"{path}: column {text_field!r} is {kind}, expected a string column")
    try:
        column = pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
    except (pa.ArrowException, OSError) as e:  # a footer that parses over damaged pages
        reason = " ".join(str(e).split()) or type(e).__name__
        raise DataFileError(f"{path}: not a readable parquet file ({reason})") from None
    return [Document(f"{path}:{row}", text) for row, text in enumerate(column) if text is not None]


_READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}


def load_files(sources: PathSpec | Sequence[PathSpec], text_field: str = "text") -> list[Document]:
    """Documents from files, globs and folders, in the order given (a glob's matches sorted).

    A file named twice (say by a glob and by name) is read once. Blank documents are skipped.
    """
    if isinstance(sources, str | os.PathLike):
        sources = [sources]
    files: dict[Path, Path] = {}  # resolved path -> path as the user wrote it
    for source in sources:
        for path in expand_paths(source):
            files.setdefault(path.resolve(), path)
    docs = [
        doc
        for path in files.values()
        for doc in _READERS[path.suffix](path, text_field)
        if doc.text.strip()
    ]
    if not docs:
        shown = ", ".join(os.fspath(s) for s in sources)
        raise EmptyCorpusError(f"no text in {shown}: every file and record is empty")
    return docs
