"""ALiBi: a head-specific linear penalty on query-key distance (Press et al. 2022).

Shape legend: B batch · H query heads · T query length · S key length.

score(i, j) = q_i . k_j / sqrt(d) - m_h |i - j|, with slopes m_h a geometric sequence.

Holds: alibi_slopes, ALiBiConfig, ALiBi.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from torch import Tensor

from .base import EncodingConfig, PositionEncoding


def alibi_slopes(n_heads: int) -> Tensor:
    """The ALiBi paper's slopes: 2^(-8h/n) for h = 1..n when n is a power of two.

    Otherwise (paper, sec. 3 footnote, and its reference code): the slopes of the closest
    power of two m below n, followed by every other slope of 2m until there are n.
    """
    if n_heads < 1:
        raise ValueError(f"n_heads={n_heads} is not allowed; it must be >= 1")

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    m = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(m) + geometric(2 * m)[0::2][: n_heads - m]
    return torch.tensor(slopes, dtype=torch.float64)


@dataclasses.dataclass(frozen=True)
class ALiBiConfig(EncodingConfig):
    """ALiBi has no options: the slopes follow from the number of heads."""

    name: ClassVar[str] = "alibi"


class ALiBi(PositionEncoding):
    has_score_bias: ClassVar[bool] = True
    # The bias is the same in every layer: a model may build it once per forward and share it.
    layer_independent_bias: ClassVar[bool] = True

    def __init__(self, config: ALiBiConfig, **dims: int) -> None:
        super().__init__(config, **dims)
        self.register_buffer("slopes", alibi_slopes(self.n_heads).float(), persistent=False)

    def score_bias(self, q_pos: Tensor, k_pos: Tensor, layer: int = 0) -> Tensor:
        """-m_h |i - j|: (B|1, H, T, S), Toeplitz in (i, j) and decreasing with distance.

        One (B|1, 1, T, S) float32 temporary besides the result (not int64 ones): positions
        are shifted to start at 0 and made float32 as vectors first, which keeps every distance
        an exact integer while they span less than 2^24 (otherwise the outer difference is
        taken in int64). The distance is then cast to the slopes' dtype, as before. Callers
        wanting less memory ask for a block of query rows (q_pos[:, a:b]) at a time.
        """
        origin = torch.minimum(q_pos.min(), k_pos.min())
        span = int(torch.maximum(q_pos.max(), k_pos.max()) - origin)
        if span < 2**24:
            q_f = (q_pos - origin).float()  # (B|1, T) exact integers
            k_f = (k_pos - origin).float()  # (B|1, S)
            distance = (q_f[:, None, :, None] - k_f[:, None, None, :]).abs_()  # (B, 1, T, S)
        else:
            distance = (q_pos[:, None, :, None] - k_pos[:, None, None, :]).abs()
        distance = distance.to(self.slopes.dtype)
        return distance * -self.slopes[None, :, None, None]  # (B|1, H, T, S)
