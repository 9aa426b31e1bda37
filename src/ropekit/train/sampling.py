"""Which dataset items each optimizer step uses, on each process.

Holds:
    global_batch   the dataset indices of one optimizer step, the same on every process.
    local_batches  one process's share of a global batch, cut into micro-batches.
    collate        stack dataset items (dicts of equal-shape tensors) into a batch.

The order is a pure function of (seed, dataset length, step): epoch e is a permutation drawn
from the seed sequence [seed, e], and step s takes positions [s * B, (s + 1) * B) of the
endless concatenation of epochs. Resuming therefore needs only the step, and the global batch
does not depend on how many processes share it.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import Tensor


@lru_cache(maxsize=2)  # the current epoch and, across a boundary, the next
def _epoch_order(dataset_len: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(dataset_len)


def global_batch(step: int, batch_size: int, dataset_len: int, seed: int) -> list[int]:
    """Dataset indices of optimizer step `step` (0-based): `batch_size` of them.

    Every item appears once per epoch; a batch may straddle two epochs.
    """
    positions = range(step * batch_size, (step + 1) * batch_size)
    return [
        int(_epoch_order(dataset_len, seed, pos // dataset_len)[pos % dataset_len])
        for pos in positions
    ]


def local_batches(
    indices: list[int], rank: int, num_processes: int, grad_accum: int
) -> list[list[int]]:
    """Process `rank`'s contiguous share of a global batch, as `grad_accum` micro-batches.

    Concatenating the micro-batches of ranks 0..N-1 in order gives back `indices`, so 1
    process with grad_accum = N * A sees exactly the micro-batches that N processes with
    grad_accum = A see together.
    """
    if len(indices) % (num_processes * grad_accum):
        raise ValueError(
            f"a global batch of {len(indices)} does not split into {num_processes} processes "
            f"x {grad_accum} micro-batches; choose batch_size a multiple of their product"
        )
    micro = len(indices) // (num_processes * grad_accum)
    start = rank * grad_accum * micro
    return [indices[start + i * micro : start + (i + 1) * micro] for i in range(grad_accum)]


def collate(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack each key of the items into one (B, ...) tensor; every item must have every key."""
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}
