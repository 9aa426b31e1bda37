"""The key a table cache compares positions by (``PositionsKey``), in a module of its own so
that both the encodings and the band kernels use it without importing each other.

Holds: PositionsKey.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor


class PositionsKey:
    """What a table cache compares positions by: the very tensor and its version counter.

    Identity alone is wrong: a decoding loop that advances positions in place (``pos += 1``)
    keeps the tensor and changes its values. Every in-place write through torch (``+=``,
    ``copy_``, index assignment, on the tensor or on a view of it) bumps ``_version``, so
    (identity, version) means "the same values" without reading them (no device sync).
    Inference tensors (``torch.inference_mode``) have no version counter: their values are kept
    and compared instead. So are a few positions (at most ``BY_VALUE``, a decoding step's), of
    any tensor: each layer and each band of a step slices them anew, and equal values are what
    makes the tables equal. Writes torch cannot see (through ``.numpy()`` or ``.data``) are not
    detected; pass a fresh tensor after those.
    """

    BY_VALUE: ClassVar[int] = 64

    def __init__(self, positions: Tensor) -> None:
        self.tensor = positions
        inference = positions.is_inference()
        self.by_value = positions.numel() <= self.BY_VALUE
        self.values = positions.clone() if inference or self.by_value else None
        self.version = None if inference else positions._version

    def matches(self, positions: Tensor) -> bool:
        if self.by_value:
            v = self.values
            return (
                positions.shape == v.shape and positions.dtype == v.dtype
                and positions.device == v.device and torch.equal(v, positions)
            )  # fmt: skip
        if positions is not self.tensor:
            return False
        if self.values is not None:
            return torch.equal(self.values, positions)
        return positions._version == self.version
