"""User files: .txt / .jsonl / parquet round trips and the errors that explain what is wrong."""

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ropekit.data import (
    DataFileError,
    EmptyCorpusError,
    load_documents,
    load_files,
    validation_documents,
)

TEXTS = ["Première ligne.\nSecond line — ünïcödé 😀", "plain ascii", "三行目"]


def _write_txt(folder: Path, texts: list[str]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{i:02d}.txt" for i in range(len(texts))]
    for path, text in zip(paths, texts, strict=True):
        path.write_text(text, encoding="utf-8")
    return paths


def test_txt_files_round_trip(tmp_path: Path):
    paths = _write_txt(tmp_path, TEXTS)
    docs = load_files(paths)
    assert [d.text for d in docs] == TEXTS
    assert [d.name for d in docs] == [str(p) for p in paths]


def test_glob_and_folder_find_the_same_files_once(tmp_path: Path):
    paths = _write_txt(tmp_path / "corpus", TEXTS)
    (tmp_path / "corpus" / "README.md").write_text("not a document")
    by_glob = load_files(str(tmp_path / "corpus" / "*.txt"))
    by_folder = load_files(tmp_path / "corpus")
    assert [d.text for d in by_glob] == [d.text for d in by_folder] == TEXTS
    # A file named by the glob and again by path is read once.
    assert len(load_files([str(tmp_path / "corpus" / "*.txt"), paths[0]])) == len(TEXTS)


@pytest.mark.parametrize("field", ["text", "body"])
def test_jsonl_round_trip(tmp_path: Path, field: str):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({field: t, "id": i}, ensure_ascii=False) for i, t in enumerate(TEXTS)]
    path.write_text("\n".join(lines[:2]) + "\n\n" + lines[2] + "\n", encoding="utf-8")
    docs = load_files(path, text_field=field)
    assert [d.text for d in docs] == TEXTS
    assert [d.name for d in docs] == [f"{path}:1", f"{path}:2", f"{path}:4"]


@pytest.mark.parametrize("field", ["text", "content"])
def test_parquet_round_trip(tmp_path: Path, field: str):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({field: TEXTS, "n": [1, 2, 3]}), path)
    docs = load_files(path, text_field=field)
    assert [d.text for d in docs] == TEXTS
    assert docs[0].name == f"{path}:0"


def test_user_files_split_by_document(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _write_txt(tmp_path / "books", [f"book {i} " * 50 for i in range(20)])
    train = load_documents(str(tmp_path / "books"), "train")
    validation = validation_documents(str(tmp_path / "books"))
    assert len(validation) == 2 and len(train) == 18
    assert not {d.text for d in train} & {d.text for d in validation}
    # The split follows the text, so a relative path gives the same split.
    monkeypatch.chdir(tmp_path)
    assert [d.text for d in validation_documents("books")] == [d.text for d in validation]


def test_non_utf8_names_file_and_byte_offset(tmp_path: Path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(DataFileError) as e:
        load_files(path)
    assert str(path) in str(e.value)
    assert "byte offset 3" in str(e.value) and "UTF-8" in str(e.value)


def test_empty_corpus_is_an_error(tmp_path: Path):
    _write_txt(tmp_path, ["", "  \n\n"])
    with pytest.raises(EmptyCorpusError, match="empty"):
        load_files(tmp_path)


def test_single_document_has_no_validation_split(tmp_path: Path):
    (path,) = _write_txt(tmp_path, ["one long document " * 100])
    assert load_documents(path, "train")[0].name == str(path)
    with pytest.raises(EmptyCorpusError, match=r"validation split.*one document cannot be split"):
        validation_documents(path)


def test_missing_file_and_empty_glob(tmp_path: Path):
    with pytest.raises(DataFileError, match="no such file"):
        load_files(tmp_path / "absent.txt")
    with pytest.raises(DataFileError, match="matches no file"):
        load_files(str(tmp_path / "*.jsonl"))
    with pytest.raises(DataFileError, match=r"holds no \.txt, \.jsonl, \.parquet file"):
        load_files(tmp_path)


def test_unsupported_file_kind_lists_the_allowed_ones(tmp_path: Path):
    path = tmp_path / "table.csv"
    path.write_text("a,b\n")
    with pytest.raises(DataFileError, match=r"'\.csv'.*allowed: \.txt, \.jsonl, \.parquet"):
        load_files(path)


def test_jsonl_errors_name_the_line_and_the_fix(tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(
        DataFileError, match=r"bad.jsonl:2: no field 'text'.*\['body'\].*text_field"
    ):
        load_files(path)
    path.write_text('{"text": "fine"}\n{not json}\n')
    with pytest.raises(DataFileError, match=r"bad.jsonl:2: not valid JSON"):
        load_files(path)
    path.write_text('{"text": 3}\n')
    with pytest.raises(DataFileError, match="is a int, expected a string"):
        load_files(path)


def test_parquet_errors_name_the_columns(tmp_path: Path):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"body": TEXTS, "n": [1, 2, 3]}), path)
    with pytest.raises(DataFileError, match=r"no column 'text'.*\['body', 'n'\].*text_field"):
        load_files(path)
    with pytest.raises(DataFileError, match="column 'n' is int64, expected a string"):
        load_files(path, text_field="n")


@pytest.mark.parametrize("damage", ["not parquet", "cut short"])
def test_a_damaged_parquet_file_is_named(tmp_path: Path, damage: str):
    """pyarrow's own message ("Parquet magic bytes not found in footer") names no file."""
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": TEXTS}), path)
    data = path.read_bytes()
    path.write_bytes(b"not a parquet file\n" if damage == "not parquet" else data[: len(data) // 2])
    with pytest.raises(DataFileError, match=r"data\.parquet: not a readable parquet file \("):
        load_files(path)


def test_a_fifo_is_not_called_missing(tmp_path: Path):
    """A named pipe exists: "no such file" would send the user looking for the wrong fault,
    and reading it would wait for a writer forever."""
    fifo = tmp_path / "text.txt"
    os.mkfifo(fifo)
    with pytest.raises(DataFileError, match=r"text\.txt' is not a regular file \(a pipe"):
        load_files(fifo)
