"""Entry points for training loops and evaluations: data spec in, documents or tokens out.

Holds:
- `load_documents(data, split)`: documents of corpora and user files;
- `validation_documents(data)`: the held-out documents, for evaluation;
- `make_train_dataset(data, tokenizer, context, ...)`: a `PackedDataset` for training;
- `heldout_stream(data, tokenizer, n_tokens)`: held-out documents as one long token stream.

`data` is a bundled corpus name ("shakespeare", "wikipedia", "kjv", "essays", "sotu"), a path, glob
or folder of `.txt`/`.jsonl`/`.parquet` files, or a list mixing them. Each bundled corpus is
split by its own rule (Shakespeare by a fixed list of plays, the others by text hash); all
user documents of one call are pooled and split by text hash (`VALIDATION_FRACTION`).
"""

import os
from collections.abc import Sequence

from ropekit.data.corpora import CORPORA, load_corpus, unknown_corpus
from ropekit.data.documents import (
    Document,
    EmptyCorpusError,
    Split,
    check_split,
    split_documents,
)
from ropekit.data.files import TEXT_SUFFIXES, PathSpec, load_files
from ropekit.data.packing import PackedDataset
from ropekit.data.retrieval import RetrievalConfig
from ropekit.data.streams import TokenStream, encode_documents
from ropekit.data.tokenizers import Tokenizer, load_tokenizer

DataSpec = PathSpec | Sequence[PathSpec]


def _is_path(item: PathSpec) -> bool:
    if not isinstance(item, str):
        return True  # an os.PathLike
    return bool(set(item) & set("*?[/\\")) or item.endswith(TEXT_SUFFIXES) or os.path.exists(item)


def _items(data: DataSpec) -> list[PathSpec]:
    items = [data] if isinstance(data, str | os.PathLike) else list(data)
    if not items:
        raise EmptyCorpusError(
            f"data=[] names nothing; allowed: a corpus ({', '.join(sorted(CORPORA))}), a path, "
            "glob or folder of text files, or a list of these"
        )
    return items


def _describe(data: DataSpec) -> str:
    items = [data] if isinstance(data, str | os.PathLike) else data
    return ", ".join(repr(os.fspath(i)) for i in items)


def load_documents(
    data: DataSpec, split: Split = "all", *, text_field: str = "text"
) -> list[Document]:
    """Documents of `data` in `split` ("train", "validation" or "all"), in a stable order."""
    check_split(split)
    docs: list[Document] = []
    user_files: list[PathSpec] = []
    for item in _items(data):
        if isinstance(item, str) and item in CORPORA:
            docs += load_corpus(item, split)
        elif _is_path(item):
            user_files.append(item)
        else:
            raise unknown_corpus(os.fspath(item))
    if user_files:
        docs += split_documents(load_files(user_files, text_field), split)
    if not docs:
        raise EmptyCorpusError(
            f"the {split} split of {_describe(data)} is empty: a split is made of whole "
            "documents, and one document cannot be split; allowed: more documents (one per "
            ".txt file, JSONL line or parquet row), or split='all' on separate files"
        )
    return docs


def validation_documents(data: DataSpec, *, text_field: str = "text") -> list[Document]:
    """The held-out documents of `data` (never seen by `make_train_dataset(split="train")`)."""
    return load_documents(data, "validation", text_field=text_field)


def _tokenizer(tokenizer: Tokenizer | str | os.PathLike[str]) -> Tokenizer:
    return tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)


def make_train_dataset(
    data: DataSpec,
    tokenizer: Tokenizer | str | os.PathLike[str],
    context: int,
    *,
    split: Split = "train",
    retrieval: RetrievalConfig | None = None,
    seed: int = 0,
    shuffle: bool = True,
    text_field: str = "text",
    progress: bool | None = None,
) -> PackedDataset:
    """Packed samples of `context` tokens from the `split` documents of `data`.

    `dataset[k]` -> {"input_ids" (T,), "labels" (T,), "loss_weight" (T,)}; k is the data
    position (samples consumed so far) and may run past one epoch. See `ropekit.data.packing`.
    """
    tok = _tokenizer(tokenizer)
    stream = encode_documents(load_documents(data, split, text_field=text_field), tok, progress)
    return PackedDataset(
        stream.ids, context, seed=seed, shuffle=shuffle, retrieval=retrieval, tokenizer=tok
    )


def heldout_stream(
    data: DataSpec,
    tokenizer: Tokenizer | str | os.PathLike[str] = "bytes",
    n_tokens: int | None = None,
    *,
    split: Split = "validation",
    text_field: str = "text",
    progress: bool | None = None,
) -> TokenStream:
    """The `split` documents of `data`, whole and in order, as one stream of `n_tokens` tokens
    (all of them when None).

    Long-context evaluation needs streams longer than any one document: documents are joined
    by the tokenizer's separator, so a window may cross from one document into the next,
    which is how packed training data looks too. Raises `EmptyCorpusError` when the held-out
    text is shorter than `n_tokens`.
    """
    tok = _tokenizer(tokenizer)
    stream = encode_documents(load_documents(data, split, text_field=text_field), tok, progress)
    if n_tokens is None:
        return stream
    if n_tokens > len(stream):
        raise EmptyCorpusError(
            f"n_tokens={n_tokens} is more than the {len(stream)} tokens of the {split} split of "
            f"{_describe(data)} ({tok.name} tokens); allowed: n_tokens <= {len(stream)}, or "
            "more data (a list of corpora or files)"
        )
    return stream.head(n_tokens)
