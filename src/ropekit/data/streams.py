"""Token streams: documents tokenized and concatenated, with the bytes each token covers.

Holds `TokenStream`, `encode_documents(documents, tokenizer)` and `TOKEN_CACHE_VERSION`.

A stream is `doc_0 SEP doc_1 SEP ... doc_last` (the tokenizer's separator between documents,
none after the last). It keeps cumulative byte offsets, so any window of tokens knows how many
UTF-8 bytes of text it covers: the denominator of bits per byte.

The token cache: a subword tokenizer takes a while over a long corpus, every time a
comparison starts or plans (the State of the Union messages took 11 s with both cores busy,
0.1 s from the cache), so the documents' tokens are kept in
``$ROPEKIT_CACHE/tokens/<key>.npz``. The key is a digest of everything the tokens depend on:
the cache layout's version, the tokenizer's identity (a digest of its whole specification,
`tokenizer_identity`), the ``tokenizers`` library's version and every document's text. Any
change reads as a miss and tokenizes afresh; an unreadable or inconsistent file is
tokenized afresh and replaced. Only what a document's text alone decides is cached (its ids and
the bytes of each token): names and separators are joined on reading.
"""

import hashlib
import importlib.metadata
import io
import itertools
import json
import warnings
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ropekit.data.documents import Document, EmptyCorpusError
from ropekit.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, tokenizer_identity
from ropekit.utils import atomic_write_bytes, cache_dir

TOKEN_CACHE_VERSION = 1  # of the cached layout and of what encode_with_bytes returns

# N tokens · D documents


@dataclass(frozen=True, eq=False)
class TokenStream:
    """Tokens of whole documents, end to end."""

    ids: torch.Tensor  # (N,) int64
    # (N+1,) int64: tokens [i, j) cover byte_offsets[j] - byte_offsets[i] bytes of text
    byte_offsets: torch.Tensor
    # (D+1,) int64: document d and the separator after it are ids[doc_starts[d]:doc_starts[d+1]]
    doc_starts: torch.Tensor
    names: tuple[str, ...]  # (D,) document names
    tokenizer: str  # name of the tokenizer that produced the ids

    def __len__(self) -> int:
        return self.ids.numel()

    def digest(self) -> str:
        """sha256 of the token ids: two streams with equal digests hold the same tokens."""
        return hashlib.sha256(self.ids.numpy().tobytes()).hexdigest()

    def n_bytes(self, start: int = 0, stop: int | None = None) -> int:
        """UTF-8 bytes of text covered by tokens [start, stop)."""
        stop = len(self) if stop is None else stop
        if not 0 <= start <= stop <= len(self):
            raise ValueError(
                f"start={start}, stop={stop} is not allowed; allowed: 0 <= start <= stop <= "
                f"{len(self)}"
            )
        return int(self.byte_offsets[stop] - self.byte_offsets[start])

    @property
    def bytes_per_token(self) -> float:
        return self.n_bytes() / max(len(self), 1)

    def head(self, n_tokens: int) -> "TokenStream":
        """The first `n_tokens` tokens; documents cut at the end keep their names."""
        if not 0 < n_tokens <= len(self):
            raise ValueError(f"n_tokens={n_tokens} is not allowed; allowed: 1..{len(self)}")
        n_docs = int(torch.searchsorted(self.doc_starts, n_tokens, side="left"))
        starts = torch.cat([self.doc_starts[:n_docs], torch.tensor([n_tokens])])
        return TokenStream(
            ids=self.ids[:n_tokens],
            byte_offsets=self.byte_offsets[: n_tokens + 1],
            doc_starts=starts,
            names=self.names[:n_docs],
            tokenizer=self.tokenizer,
        )


def _separator(tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(tokenizer.separator, str):
        return tokenizer.encode_with_bytes(tokenizer.separator)
    # A special token (EOS) stands for no text: it covers zero bytes.
    return np.array([tokenizer.separator], dtype=np.int64), np.zeros(1, dtype=np.int64)


def encode_documents(
    documents: Sequence[Document],
    tokenizer: Tokenizer,
    progress: bool | None = None,
    cache: bool | None = None,
) -> TokenStream:
    """Tokenize `documents` into one stream, separator between documents.

    `progress` shows a bar over characters and `cache` keeps the tokens in the token cache
    (module docstring); by default both only for subword tokenizers on more than a million
    characters (byte tokenization is instant).
    """
    if not documents:
        raise EmptyCorpusError("no documents to encode")
    total = sum(len(d.text) for d in documents)
    slow = not isinstance(tokenizer, ByteTokenizer) and total > 1_000_000
    progress = slow if progress is None else progress
    cache = slow if cache is None else cache
    separator = _separator(tokenizer)
    path = _cache_path(documents, tokenizer) if cache else None
    encoded = _cached(path, len(documents)) if path is not None else None
    if encoded is None:
        encoded = []
        with tqdm(
            total=total, unit="char", unit_scale=True, desc="tokenizing", disable=not progress
        ) as bar:
            for doc in documents:
                encoded.append(tokenizer.encode_with_bytes(doc.text))
                bar.update(len(doc.text))
        if path is not None:
            _keep(path, encoded)
    pieces = [piece for doc in encoded for piece in (doc, separator)][:-1]  # none after the last
    ids = np.concatenate([p[0] for p in pieces])
    byte_offsets = np.concatenate([[0], np.cumsum(np.concatenate([p[1] for p in pieces]))])
    doc_lengths = [len(d[0]) + len(separator[0]) for d in encoded]
    doc_lengths[-1] -= len(separator[0])
    return TokenStream(
        ids=torch.from_numpy(ids.astype(np.int64)),
        byte_offsets=torch.from_numpy(byte_offsets.astype(np.int64)),
        doc_starts=torch.from_numpy(np.cumsum([0, *doc_lengths]).astype(np.int64)),
        names=tuple(d.name for d in documents),
        tokenizer=tokenizer.name,
    )


def _cache_path(documents: Sequence[Document], tokenizer: Tokenizer) -> Path | None:
    """Where the tokens of `documents` by `tokenizer` are cached; None for a tokenizer of
    another kind, whose identity is only its name (nothing safe to key on)."""
    if not isinstance(tokenizer, ByteTokenizer | HFTokenizer):
        return None
    identity = tokenizer_identity(tokenizer)
    key = hashlib.sha256()
    header = {
        "version": TOKEN_CACHE_VERSION,
        "tokenizer": identity,
        "tokenizers": importlib.metadata.version("tokenizers"),
    }
    key.update(json.dumps(header, sort_keys=True).encode("utf-8"))
    for doc in documents:  # each text with its length: no two corpora join to one key
        text = doc.text.encode("utf-8")
        key.update(len(text).to_bytes(8, "little"))
        key.update(text)
    return cache_dir() / "tokens" / f"{key.hexdigest()}.npz"


def _cached(path: Path, n_documents: int) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """The documents' (ids, bytes per token) as cached at `path`; None when it is missing,
    unreadable or not of `n_documents` documents (then it is tokenized afresh)."""
    try:
        with np.load(path) as stored:
            ids, nbytes, counts = stored["ids"], stored["bytes"], stored["counts"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    if counts.shape != (n_documents,) or int(counts.sum()) != len(ids) or ids.shape != nbytes.shape:
        return None
    bounds = np.cumsum([0, *counts.tolist()])
    return [
        (ids[a:b].astype(np.int64), nbytes[a:b].astype(np.int64))
        for a, b in itertools.pairwise(bounds)
    ]


def _keep(path: Path, encoded: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """Cache the documents' tokens at `path` (written whole, by a rename; int32 halves the
    file: ids and bytes per token are far below 2^31). A cache that cannot be written (a
    read-only or full disk) is warned about and the tokens are used all the same."""
    buffer = io.BytesIO()
    np.savez(
        buffer,
        ids=np.concatenate([ids for ids, _ in encoded]).astype(np.int32),
        bytes=np.concatenate([nbytes for _, nbytes in encoded]).astype(np.int32),
        counts=np.array([len(ids) for ids, _ in encoded], dtype=np.int64),
    )
    try:
        atomic_write_bytes(path, buffer.getvalue())
    except (OSError, ValueError) as e:  # OutputError is a ValueError
        warnings.warn(
            f"the token cache was not written ({e}); tokenizing again next time", stacklevel=3
        )
