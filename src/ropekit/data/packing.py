"""Fixed-length training samples cut from a token stream, optionally carrying retrieval records.

Holds `PackedDataset` (a map-style torch Dataset) and `IGNORE_INDEX`.

Packing: the stream (documents joined by the tokenizer's separator) is cut into chunks of
T + 1 tokens with stride T, so every token but the first is a target exactly once per epoch.
Sample = `input_ids` chunk[:-1], `labels` chunk[1:] (-100 where there is no loss), and
`loss_weight` (1.0 on ordinary targets, 0.0 where the label is -100, the configured weight on
retrieval answers).

Data position: one integer `k`, the number of samples the run has consumed. `dataset[k]` is
valid for every k >= 0: epoch `k // len(dataset)` visits each chunk once, in the order of a
permutation seeded by (seed, epoch). Whether sample k carries retrieval records, and which,
is seeded by (seed, k), so a chunk seen again in a later epoch gets fresh records. Resuming
at k is `DataLoader(dataset, batch_size=B, sampler=range(k, k + n_samples))`.
"""

import dataclasses
import hashlib
import operator
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ropekit.data.documents import EmptyCorpusError
from ropekit.data.retrieval import (
    RetrievalConfig,
    RetrievalSample,
    Role,
    draw_records,
    records_length,
    weave,
)
from ropekit.data.tokenizers import Tokenizer, tokenizer_identity

# T context (tokens per sample) · N stream length

IGNORE_INDEX = -100  # the label PyTorch's cross_entropy skips by default

# Independent random streams drawn from one seed.
_ORDER_STREAM, _RETRIEVAL_STREAM = 0, 1


class PackedDataset(torch.utils.data.Dataset):
    """Samples of `context` tokens from a token stream; see the module docstring."""

    def __init__(
        self,
        ids: torch.Tensor | np.ndarray,
        context: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        retrieval: RetrievalConfig | None = None,
        tokenizer: Tokenizer | None = None,
    ):
        if not isinstance(context, int) or context < 1:
            raise ValueError(f"context={context!r} is not allowed; allowed: an int >= 1")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} is not allowed; allowed: an int >= 0")
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"ids has shape {ids.shape} and dtype {ids.dtype}; allowed: integer ids (N,)"
            )
        if len(ids) < context + 1:
            raise EmptyCorpusError(
                f"context={context} needs at least {context + 1} tokens; the data has "
                f"{len(ids)}; allowed: more data or a shorter context"
            )
        retrieval = retrieval or RetrievalConfig()
        if retrieval.ratio > 0 and tokenizer is None:
            raise ValueError("retrieval.ratio > 0 needs the tokenizer that encodes the records")
        if ids.min() < 0:
            raise ValueError(f"ids hold {ids.min()}; allowed: token ids >= 0")
        # Smallest integer type that holds the ids: a byte stream stays one byte per token.
        self._ids = ids.astype(np.uint8 if ids.max() < 256 else np.int32)
        self.context = context
        self.seed = seed
        self.shuffle = shuffle
        self.retrieval = retrieval
        self.tokenizer = tokenizer
        self._n_chunks = (len(ids) - 1) // context
        self._order_cache: tuple[int, np.ndarray] | None = None
        if retrieval.ratio > 0:
            self._check_records_fit()

    def identity(self) -> dict[str, Any]:
        """What a training run's provenance records about its data: a digest of every token
        (so other files of the same size differ), the context, seed, order and retrieval mix."""
        return {
            "tokens": hashlib.sha256(self._ids.tobytes()).hexdigest(),
            "n_tokens": len(self._ids),
            "context": self.context,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "retrieval": dataclasses.asdict(self.retrieval),
            "tokenizer": tokenizer_identity(self.tokenizer),
        }

    def _check_records_fit(self) -> None:
        # Fail at construction rather than mid-run: measure a few drawn records.
        rng = np.random.default_rng([self.seed, _RETRIEVAL_STREAM, 2**32])
        longest = max(
            records_length(draw_records(rng, self.retrieval), self.tokenizer) for _ in range(8)
        )
        if longest >= self.context:
            raise ValueError(
                f"context={self.context} is too short for retrieval records of about {longest} "
                f"tokens; allowed: context > {longest}, or fewer facts (n_facts, n_queries)"
            )

    def __len__(self) -> int:
        """Samples per epoch."""
        return self._n_chunks

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # Without this, `for x in dataset` would run forever: every k >= 0 is a valid index.
        return (self[k] for k in range(len(self)))

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, _ORDER_STREAM, epoch])
            self._order_cache = (epoch, rng.permutation(self._n_chunks))
        return self._order_cache[1]

    def sample(self, k: int) -> tuple[np.ndarray, np.ndarray, RetrievalSample | None]:
        """Tokens (T+1,), roles (T+1,) and retrieval positions (or None) of sample `k`."""
        k = operator.index(k)
        if k < 0:
            raise IndexError(f"sample index {k} is negative; allowed: k >= 0")
        epoch, i = divmod(k, self._n_chunks)
        chunk = int(self._order(epoch)[i]) if self.shuffle else i
        start = chunk * self.context
        tokens = self._ids[start : start + self.context + 1].astype(np.int64)
        rng = np.random.default_rng([self.seed, _RETRIEVAL_STREAM, k])
        if self.retrieval.ratio == 0 or rng.random() >= self.retrieval.ratio:
            return tokens, np.full_like(tokens, Role.TEXT), None
        records = draw_records(rng, self.retrieval)
        return weave(tokens, records, self.tokenizer, rng)

    def retrieval_info(self, k: int) -> RetrievalSample | None:
        """Where the records and answers of sample `k` are, or None for plain text."""
        return self.sample(k)[2]

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        tokens, roles, _ = self.sample(k)
        target_roles = roles[1:]  # the role of the token each position predicts
        labels = np.where(target_roles == Role.RANDOM, IGNORE_INDEX, tokens[1:])
        weight = np.select(
            [target_roles == Role.RANDOM, target_roles == Role.ANSWER],
            [0.0, self.retrieval.answer_weight],
            default=1.0,
        )
        return {
            "input_ids": torch.from_numpy(tokens[:-1]),  # (T,)
            "labels": torch.from_numpy(labels),  # (T,)
            "loss_weight": torch.from_numpy(weight.astype(np.float32)),  # (T,)
        }
