"""The document-level train/validation split: properties that must hold for any documents."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ropekit.data import Document, split_documents

texts = st.lists(st.text(min_size=1, max_size=20), min_size=2, max_size=60)


def _docs(texts: list[str]) -> list[Document]:
    return [Document(f"doc{i}", t) for i, t in enumerate(texts)]


@given(texts)
def test_split_partitions_and_keeps_order(texts: list[str]):
    docs = _docs(texts)
    train, validation = split_documents(docs, "train"), split_documents(docs, "validation")
    assert validation, "at least one document is held out"
    assert sorted(d.name for d in train + validation) == sorted(d.name for d in docs)
    assert [d for d in docs if d in train] == train
    # Documents with equal text always land on the same side.
    assert not {d.text for d in train} & {d.text for d in validation}


@given(texts)
def test_split_depends_on_text_not_on_order_or_names(texts: list[str]):
    docs = _docs(texts)
    shuffled = [Document(f"renamed{i}", d.text) for i, d in enumerate(docs)]
    random.Random(0).shuffle(shuffled)
    held_out = {d.text for d in split_documents(docs, "validation")}
    assert {d.text for d in split_documents(shuffled, "validation")} == held_out


def test_split_holds_out_the_documented_fraction():
    docs = _docs([f"text {i}" for i in range(200)])
    assert len(split_documents(docs, "validation")) == 20
    assert len(split_documents(docs, "validation", fraction=0.25)) == 50


def test_one_document_goes_to_train():
    docs = _docs(["the only one"])
    assert split_documents(docs, "train") == docs
    assert split_documents(docs, "validation") == []


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
def test_bad_fraction_is_rejected(fraction: float):
    with pytest.raises(ValueError, match="fraction="):
        split_documents(_docs(["a", "b"]), "train", fraction=fraction)
