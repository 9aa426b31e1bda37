"""Entry points: corpora, files and lists of both, end to end."""

from pathlib import Path

import pytest
import torch

from ropekit.data import (
    DataFileError,
    EmptyCorpusError,
    HFTokenizer,
    UnknownCorpusError,
    heldout_stream,
    load_corpus,
    load_documents,
    make_train_dataset,
    validation_documents,
)


def test_a_list_mixes_corpora_and_files(tmp_path: Path):
    for i in range(10):
        (tmp_path / f"{i}.txt").write_text(f"my document {i} " * 40)
    data = ["essays", "kjv", tmp_path]
    docs = load_documents(data, "train")
    names = {d.name for d in docs}
    assert {d.name for d in load_corpus("essays", "train")} <= names
    assert {d.name for d in load_corpus("kjv", "train")} <= names
    assert sum(d.name.startswith(str(tmp_path)) for d in docs) == 9
    held_out = {d.name for d in validation_documents(data)}
    assert held_out.isdisjoint(names)
    assert sum(n.startswith(str(tmp_path)) for n in held_out) == 1


def test_train_dataset_never_sees_held_out_text():
    ds = make_train_dataset("shakespeare", "bytes", context=4096, shuffle=False)
    train_text = bytes(torch.cat([ds[k]["input_ids"] for k in range(len(ds))]).tolist())
    assert b"Now is the winter of our discontent" not in train_text  # Richard III, held out
    assert b"O Romeo, Romeo! wherefore art thou Romeo?" in train_text
    for play in validation_documents("shakespeare"):
        text = play.text.encode()
        for start in range(0, len(text) - 200, 20_000):
            assert text[start : start + 200] not in train_text


def test_subword_tokenizer_end_to_end(hf_tokenizer: HFTokenizer):
    ds = make_train_dataset("essays", hf_tokenizer, context=128)
    sample = ds[0]
    assert sample["input_ids"].shape == (128,)
    assert int(sample["input_ids"].max()) < hf_tokenizer.vocab_size
    stream = heldout_stream("essays", hf_tokenizer)
    assert stream.n_bytes() == sum(d.n_bytes for d in validation_documents("essays"))
    assert 2 < stream.bytes_per_token < 6


def test_a_tokenizer_given_by_path(hf_tokenizer_dir: Path):
    ds = make_train_dataset("essays", hf_tokenizer_dir, context=64)
    assert ds.tokenizer.name == str(hf_tokenizer_dir)


def test_names_that_are_neither_corpus_nor_file():
    with pytest.raises(UnknownCorpusError, match="known corpora: essays, kjv, shakespeare"):
        load_documents(["essays", "poems"])
    with pytest.raises(DataFileError, match="no such file"):
        load_documents("poems.txt")
    with pytest.raises(EmptyCorpusError, match="data=\\[\\] names nothing"):
        load_documents([])
