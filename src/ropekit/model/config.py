"""The decoder's configuration.

Holds: DecoderConfig (frozen, validated in ``__post_init__``; ``to_dict()`` is its JSON form
and ``DecoderConfig(**that_dict)`` rebuilds it), default_ffn_hidden.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ropekit.encodings import Spec


def default_ffn_hidden(d_model: int) -> int:
    """SwiGLU hidden width: 8/3 d_model rounded up to a multiple of 32.

    8/3 keeps a three-matrix SwiGLU at the parameter count of a 4x two-matrix MLP (Shazeer
    2020, "GLU Variants Improve Transformer"); 32 keeps the matmuls' inner sizes aligned.
    """
    return 32 * math.ceil(8 * d_model / 3 / 32)


def _require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"DecoderConfig.{name}={value!r} is not allowed; it must be {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shape and options of the reference decoder.

    The defaults are the 1.8M-parameter byte-level model of DESIGN.md's measurements
    (4 layers, d_model 192, 6 heads of 32 channels, context 256).
    """

    vocab_size: int = 256  # token ids in [0, vocab_size); 256 = one UTF-8 byte per token
    d_model: int = 192  # residual stream width (channels)
    n_layers: int = 4  # transformer blocks
    n_heads: int = 6  # query heads; head_dim = d_model / n_heads
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); None = n_heads
    ffn_hidden: int | None = None  # SwiGLU hidden width; None = 8/3 d_model rounded up to 32
    norm_eps: float = 1e-5  # RMSNorm epsilon (Llama uses 1e-5 or 1e-6)
    encoding: str = "rope"  # position encoding spec, e.g. "alibi", "adarope:l_ref=256"
    tie_embeddings: bool = True  # LM head shares the token embedding matrix (GPT-2, Press & Wolf)
    init_std: float = 0.02  # std of normal init for embeddings and projections (GPT-2)
    # Training context (tokens). Recorded with the model, and handed to the encoding as its
    # `original_length` so specs such as "yarn:factor=8" need not restate it.
    context_length: int = 256

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "context_length"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, name, value, "an integer >= 1")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _require(
            _is_int(self.n_kv_heads)
            and self.n_kv_heads >= 1
            and self.n_heads % self.n_kv_heads == 0,
            "n_kv_heads",
            self.n_kv_heads,
            f"an integer >= 1 that divides n_heads={self.n_heads}",
        )
        _require(
            self.d_model % self.n_heads == 0,
            "d_model",
            self.d_model,
            f"a multiple of n_heads={self.n_heads}",
        )
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", default_ffn_hidden(self.d_model))
        _require(
            _is_int(self.ffn_hidden) and self.ffn_hidden >= 1,
            "ffn_hidden",
            self.ffn_hidden,
            "an integer >= 1",
        )
        for name in ("norm_eps", "init_std"):
            value = getattr(self, name)
            _require(
                isinstance(value, int | float) and math.isfinite(value) and value > 0,
                name,
                value,
                "a finite number > 0",
            )
        _require(
            isinstance(self.tie_embeddings, bool), "tie_embeddings", self.tie_embeddings, "a bool"
        )
        # Parse the spec now so a typo fails here, not at the first forward; shape-dependent
        # checks (an odd head_dim for RoPE) happen when the decoder builds the encoding.
        _require(isinstance(self.encoding, str), "encoding", self.encoding, "a spec string")
        try:
            Spec.parse(self.encoding).config(**self.encoding_context())
        except ValueError as e:
            raise ValueError(f"DecoderConfig.encoding: {e}") from None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def encoding_context(self) -> dict[str, Any]:
        """What the model tells the encoding when its spec leaves it out."""
        return {"original_length": self.context_length}

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (derived fields resolved, so the dict rebuilds this exact config)."""
        return dataclasses.asdict(self)
