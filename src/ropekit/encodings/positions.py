"""The key a table cache compares positions by (``PositionsKey``), and the one-entry memo the
band kernels keep their layout in (``LastCall``), in a module of their own so that both the
encodings and the band kernels use them without importing each other.

Holds: PositionsKey, LastCall.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

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


class LastCall:
    """What the last call of a band kernel made from its bands and key positions (its
    layout), kept for the next call that has the very same bands objects (kept alive here, so
    their identities cannot be reused) and key positions (``PositionsKey``) and the same
    ``key`` (the rest of what the layout depends on). Every layer of a forward gets the same
    bands objects (a remap computes them once per forward) and key positions, so the layout
    is made once per forward, not once per layer."""

    def __init__(self) -> None:
        self._entry: tuple[tuple, tuple[Any, ...], PositionsKey, Any] | None = None

    def get(self, key: tuple, bands: Sequence[Any], positions: Tensor) -> Any | None:
        """The layout kept for this very call, or None."""
        if self._entry is None:
            return None
        old_key, old_bands, old_positions, layout = self._entry
        if old_key != key or len(old_bands) != len(bands):
            return None
        same = all(a is b for a, b in zip(old_bands, bands, strict=True))
        return layout if same and old_positions.matches(positions) else None

    def put(self, key: tuple, bands: Sequence[Any], positions: Tensor, layout: Any) -> Any:
        """Keep ``layout`` as this call's (replacing the last one's) and return it."""
        self._entry = (key, tuple(bands), PositionsKey(positions), layout)
        return layout
