"""Token streams: documents tokenized and concatenated, with the bytes each token covers.

Holds `TokenStream` and `encode_documents(documents, tokenizer)`.

A stream is `doc_0 SEP doc_1 SEP ... doc_last` (the tokenizer's separator between documents,
none after the last). It keeps cumulative byte offsets, so any window of tokens knows how many
UTF-8 bytes of text it covers: the denominator of bits per byte.
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from ropekit.data.documents import Document, EmptyCorpusError
from ropekit.data.tokenizers import ByteTokenizer, Tokenizer

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
    documents: Sequence[Document], tokenizer: Tokenizer, progress: bool | None = None
) -> TokenStream:
    """Tokenize `documents` into one stream, separator between documents.

    `progress` shows a bar over characters; by default only for subword tokenizers on more
    than a million characters (byte tokenization is instant).
    """
    if not documents:
        raise EmptyCorpusError("no documents to encode")
    total = sum(len(d.text) for d in documents)
    if progress is None:
        progress = not isinstance(tokenizer, ByteTokenizer) and total > 1_000_000
    separator = _separator(tokenizer)
    encoded = []
    with tqdm(
        total=total, unit="char", unit_scale=True, desc="tokenizing", disable=not progress
    ) as bar:
        for doc in documents:
            encoded.append(tokenizer.encode_with_bytes(doc.text))
            bar.update(len(doc.text))
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
