"""Encodings that remap the relative distance per query-key pair: rerope (and Leaky ReRoPE),
self-extend, dca, string. Each describes its attention as bands (``bands.py``) over a base
rotary schedule (plain RoPE by default; any fixed schedule with ``init=``).

Shape legend: B batch · T query length · S key length · i, j query and key positions,
d = i - j their distance (>= 0 under causal attention).

Every method maps the distance d to the distance the model sees, d', by rotating queries and
keys at other positions in a few bands:

- ReRoPE (Su 2023, "Rectified Rotary Position Embeddings", kexue.fm/archives/9708 and
  bojone/rerope): d' = d for d < w, else w (clipped); Leaky ReRoPE: w + (d - w) / k.
  Near band at true positions; far band with queries at w and keys at 0 (clipped), or queries
  at (i + w (k - 1)) / k and keys at j / k (leaky, fractional positions). Su's patch also
  scales queries by max(1, ln(i + 1) / ln L0) (log-n scaling); ``logn=true`` does that.
  Defaults from the patch: w = 512, k = 16 for the leaky variant.
- Self-Extend (Jin et al. 2024, ICML, "LLM Maybe LongLM", datamllab/LongLM): neighbours with
  d < W keep their positions; beyond, queries at floor(i / G) + W - floor(W / G) and keys at
  floor(j / G), so d' = floor(i / G) - floor(j / G) + W - floor(W / G). Defaults from the
  authors' code: G = 8, W = 1024. ``mode=llama.cpp`` reproduces llama.cpp's group attention
  (``--grp-attn-n G --grp-attn-w W``), which groups the KV cache in whole blocks of W tokens
  as it grows: keys of completed blocks sit at floor(j / G), the query and the keys of its own
  block continue from floor(i / W) * W / G (docs/decisions.md has the check).
- DCA, dual chunk attention (An et al. 2024, "Training-Free Long-Context Scaling of Large
  Language Models", HKUNLP/ChunkLlama): chunks of c = chunk_size - local_size tokens;
  keys at j mod c; queries at i mod c for keys of their own chunk (intra), at
  min(i mod c + c, chunk_size) for the previous chunk (successive: exact distances for the
  first local_size rows of a chunk), at min(2c - 1, chunk_size) for older chunks (inter).
  Every distance stays <= chunk_size. Defaults as ChunkLlama runs it now
  (chunkllama_attn_replace.py, replace_with_chunkllama): chunk_size = 3 L0 / 4, local_size =
  L0 / 8 (its first release: L0 / 16), and the cos and sin of q and k times
  0.05 ln(L / L0) + 1 beyond L0 (get_mscale), L the keys attended, so logits times its square
  (``scale=chunkllama``); ``scale=vllm`` is vLLM's dual-chunk backend
  (vllm/attention/backends/dual_chunk_flash_attn.py: keys and the softmax scale times
  max(0.1 ln(L / L0) + 1, 1) in a prefill of L tokens), ``scale=none`` the positions alone.
  Qwen2.5-1M's ``dual_chunk_attention_config`` names chunk_size and local_size the same way.
- STRING (An et al. 2025, ICLR, "Why Does the Effective Context Length of LLMs Fall Short?",
  HKUNLP/STRING): d' = d for d < S, else d - S + W: the well-trained small distances are
  shifted over the rarely trained large ones, W restoring locality at the seam. Far band with
  queries at i - S + W. Defaults as the authors run it: S = int(0.33 L) with L the length
  attended (niah/test_niah_llama.py, ruler/test_ruler_llama.py: 0.33 of the test length;
  ``shift_of=original``: 0.33 L0, ropekit's first STRING), W = 128, and the cos and sin of q
  and k times 0.1 ln 2 + 1 (string_for_llama.py, replace_with_string: attention_factor), so
  logits times 1.143 (``scale=authors``; ``scale=none`` without). With the authors' shift
  the longest distance maps to about 0.67 L + W: inside L0 only up to about 1.5 L0
  (`StringConfig`).

DCA's scale and STRING's default shift follow the length attended, L = the last key position
+ 1 of the call (the rule of length-following schedules): such an encoding is ``dynamic``, so
a cached step is exact per layer and scoring takes one forward per window. Their specs always
name the variant (``scale=``, ``shift_of=``); a DCA or STRING spec without them was written
before the authors' variants existed and meant the positions alone (local_size L0 / 16,
S = int(0.33 L0)).

Where the remap is the identity (sequences shorter than w, W, the chunk length or S; G = 1;
k = 1; W = S) each equals its base schedule to round-off (DCA and STRING with ``scale=none``).

``rotate_q`` / ``rotate_k`` rotate at the true positions (the identity band): attention that
does not read ``bands`` would compute the base schedule, so integrations check
``remaps_distance`` (ropekit's decoder and patched Hugging Face models do).

Holds: RemapConfig, ReRopeConfig, SelfExtendConfig, DCAConfig, StringConfig, RemapEncoding,
ReRope, SelfExtend, DCA, String.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from .adarope import check_init, init_schedule
from .bands import Band
from .base import (
    EncodingConfig,
    Extension,
    PositionEncoding,
    check_choice,
    check_positive,
)
from .positions import PositionsKey
from .rope import RopeConfig, RotaryEncoding
from .rotary import rotate


@dataclasses.dataclass(frozen=True)
class RemapConfig(EncodingConfig):
    """Options shared by the distance remaps: the base schedule (``init`` and its options, as
    for AdaRoPE) and the original length L0 some defaults derive from. An ``original_length``
    option is the base schedule's too when that schedule has one (yarn, llama3)."""

    init: str = "rope"  # base rotary schedule: rope, linear, ntk, yarn, llama3
    original_length: int | None = None  # L0 (tokens): the model's training length
    schedule: RopeConfig = dataclasses.field(default_factory=RopeConfig)  # parsed init options

    CONTEXT_FIELDS: ClassVar[tuple[str, ...]] = RopeConfig.CONTEXT_FIELDS

    def __post_init__(self) -> None:
        check_init(self.init, self.schedule)
        inner = self.schedule.extension().original_length
        if self.original_length is None and inner is not None:
            object.__setattr__(self, "original_length", inner)
        if inner is not None and self.original_length != inner:
            raise ValueError(
                f"original_length={self.original_length} differs from the {self.init} "
                f"schedule's original_length={inner}"
            )
        if self.original_length is not None:
            check_positive("original_length", self.original_length, minimum=1, strict=False)
        self._resolve()

    def _resolve(self) -> None:
        """Fill defaults derived from L0 and validate the method's own options."""

    def _defaults(self) -> dict[str, Any]:
        """The values the derived options take by default (omitted from the spec)."""
        return {}

    def _require_length(self, what: str) -> int:
        if self.original_length is None:
            raise ValueError(
                f"{what} is required for {self.name}, or original_length (the model's "
                "training length, which a model supplies when patched) to derive it"
            )
        return self.original_length

    @classmethod
    def own_fields(cls) -> dict[str, Any]:
        return {k: v for k, v in cls.field_types().items() if k != "schedule"}

    @classmethod
    def option_types(cls, options: dict[str, str]) -> dict[str, Any]:
        schedule = init_schedule(options.get("init", "rope"))
        return {**cls.own_fields(), **schedule.option_types(options)}

    @classmethod
    def from_options(cls, options: dict[str, str], context: dict[str, Any] | None = None):
        own_types = cls.own_fields()
        init = options.get("init", "rope")
        schedule_cls = init_schedule(init)
        schedule_types = schedule_cls.field_types()
        shared = {"original_length"} & set(schedule_types)
        own = {k: v for k, v in options.items() if k in own_types}
        rest = {k: v for k, v in options.items() if k not in own_types or k in shared}
        try:
            schedule = schedule_cls.from_options(rest, context)
        except ValueError as e:
            allowed = ", ".join(dict.fromkeys([*own_types, *schedule_types]))
            raise ValueError(f"{e} ({cls.name} with init={init} allows: {allowed})") from None
        kwargs = {k: cls.parse_value(k, v, own_types[k]) for k, v in own.items()}
        length = (context or {}).get("original_length")
        if "original_length" not in kwargs and "original_length" not in shared and length:
            kwargs["original_length"] = int(length)
        return cls(schedule=schedule, **kwargs)

    def options(self) -> dict[str, Any]:
        own = {k: v for k, v in super().options().items() if k != "schedule"}
        if self.schedule.extension().original_length is not None:
            own.pop("original_length", None)  # the schedule's options spell it
        for key, default in self._defaults().items():
            if own.get(key) == default:
                own.pop(key)
        return {**own, **self.schedule.options()}

    @property
    def base_schedule(self) -> RopeConfig:
        return self.schedule

    @property
    def length_following(self) -> bool:
        """Whether the bands depend on the length of the sequence attended (not only on each
        pair's positions)."""
        return False

    def extension(self) -> Extension:
        inner = self.schedule.extension()
        return Extension(inner.base, inner.factor, self.original_length)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 1")


@dataclasses.dataclass(frozen=True)
class ReRopeConfig(RemapConfig):
    """ReRoPE / Leaky ReRoPE (Su 2023): distances past ``window`` clipped, or slowed by 1/leaky."""

    name: ClassVar[str] = "rerope"
    window: int = 512  # w (tokens): distances below it keep their positions (Su's patch: 512)
    leaky: float | None = None  # k: beyond w, distance w + (d - w)/k; None = clip (Su: k = 16)
    logn: bool = False  # scale queries by max(1, ln(i+1)/ln L0), as Su's patches do

    def _resolve(self) -> None:
        _positive_int("window", self.window)
        if self.leaky is not None:
            check_positive("leaky", self.leaky, minimum=1.0, strict=False)
        if self.logn and (self.original_length is None or self.original_length < 2):
            raise ValueError(
                f"original_length is required for rerope with logn=true (log-n scaling divides "
                f"by ln L0; it must be >= 2, got {self.original_length!r})"
            )


@dataclasses.dataclass(frozen=True)
class SelfExtendConfig(RemapConfig):
    """Self-Extend (Jin et al. 2024): neighbour window W, group size G beyond it."""

    name: ClassVar[str] = "self-extend"
    group: int = 8  # G: positions beyond the window are floor(p / G) (authors' default 8)
    window: int = 1024  # W (tokens): neighbour window with normal positions (authors' 1024)
    mode: str = "paper"  # "paper" (sliding neighbour window) or "llama.cpp" (grouped blocks)

    MODES: ClassVar[tuple[str, ...]] = ("paper", "llama.cpp")

    def _resolve(self) -> None:
        _positive_int("group", self.group)
        _positive_int("window", self.window)
        check_choice("mode", self.mode, self.MODES)
        if self.mode == "llama.cpp" and self.window % self.group:
            raise ValueError(
                f"window={self.window} is not allowed with mode=llama.cpp; llama.cpp requires "
                f"--grp-attn-w to be a multiple of --grp-attn-n (group={self.group})"
            )


# DCA's logit scale beyond L0 as a function of L / L0 (L: the keys a call attends over, its last
# key position + 1); q and k each carry the factor, so logits carry its square.
#   chunkllama: HKUNLP/ChunkLlama chunkllama_attn_replace.py, get_mscale (cos and sin of q and k
#               times 0.05 ln(L / L0) + 1, none at L <= L0);
#   vllm: vLLM's dual-chunk backend (vllm/attention/backends/dual_chunk_flash_attn.py: keys and
#         the softmax scale times max(0.1 ln(L / L0) + 1, 1) in a prefill of L tokens);
#   none: ropekit's first DCA (the paper's positions alone).
DCA_SCALES = ("chunkllama", "vllm", "none")


def dca_logit_scale(rule: str, length: int, original_length: int) -> float:
    """The factor on every logit of a DCA call over ``length`` keys (``DCA_SCALES``)."""
    ratio = length / original_length
    if rule == "chunkllama":
        m = 1.0 if ratio <= 1 else 0.05 * math.log(ratio) + 1.0
    elif rule == "vllm":
        m = max(0.1 * math.log(ratio) + 1.0, 1.0) if length else 1.0  # no keys: 1 (ln 0 = -inf)
    else:
        m = 1.0
    return m * m


@dataclasses.dataclass(frozen=True)
class DCAConfig(RemapConfig):
    """Dual chunk attention (An et al. 2024), as ChunkLlama runs it by default: chunk_size
    3 L0 / 4, local_size L0 / 8, q and k scaled by 0.05 ln(L / L0) + 1 beyond L0 (``scale``;
    the module docstring cites each). Qwen2.5-1M's ``dual_chunk_attention_config`` uses the
    same names for chunk_size and local_size. The spec always names ``scale``: a DCA spec
    written before the scale existed (no ``scale=``) was the first release's positions with
    local_size L0 / 16 and no scale."""

    name: ClassVar[str] = "dca"
    chunk_size: int | None = None  # tokens; the largest distance seen; default 3 L0 / 4
    # tokens; chunk length = chunk_size - local_size; default L0 / 8 (ChunkLlama's current
    # replace_with_chunkllama; its first release: L0 / 16)
    local_size: int | None = None
    scale: str = "chunkllama"  # logit scale beyond L0: chunkllama, vllm or none (DCA_SCALES)

    def _defaults(self) -> dict[str, Any]:
        if self.original_length is None:
            return {}
        return {
            "chunk_size": self.original_length * 3 // 4,
            "local_size": self.original_length // 8,
        }

    def _resolve(self) -> None:
        check_choice("scale", self.scale, DCA_SCALES)
        if self.scale != "none" and self.original_length is None:
            raise ValueError(
                f"original_length is required for dca with scale={self.scale} (it scales logits "
                "by ln(L / L0)); give it (a model supplies it when patched), or scale=none"
            )
        for name in ("chunk_size", "local_size"):
            if getattr(self, name) is None:
                self._require_length(name)
                object.__setattr__(self, name, self._defaults()[name])
        _positive_int("chunk_size", self.chunk_size)
        if isinstance(self.local_size, bool) or not isinstance(self.local_size, int):
            raise ValueError(f"local_size={self.local_size!r} is not an integer")
        if not 0 <= self.local_size < self.chunk_size:
            raise ValueError(
                f"local_size={self.local_size} is not allowed; it must lie in "
                f"[0, chunk_size={self.chunk_size})"
            )

    def options(self) -> dict[str, Any]:
        return {**super().options(), "scale": self.scale}  # the variant, always said

    @property
    def length_following(self) -> bool:
        return self.scale != "none"

    @property
    def chunk_len(self) -> int:
        """c: the tokens in one chunk."""
        return self.chunk_size - self.local_size


# STRING's shift S when no ``shift`` is given: int(shift_ratio x L) with L the length of the
# sequence attended (the authors' scripts: S = int(0.33 x test length), HKUNLP/STRING
# niah/test_niah_llama.py and ruler/test_ruler_llama.py) or L0 (ropekit's first STRING).
# Bands kept per encoding: two, so that a layer that asks for its keys' bands (vLLM's rotary
# holding keys rotated: ``serve.paged_attention.rotate_for_cache``) and then for its
# attention's finds both again in the next layer (one entry made every layer recompute both).
BANDS_KEPT = 2
STRING_SHIFTS = ("length", "original")
# STRING's scale: the authors' Llama and Qwen2 code multiplies cos and sin by 0.1 ln 2 + 1
# (HKUNLP/STRING string_for_llama.py, replace_with_string: attention_factor), so every logit
# by its square, 1.143; none: ropekit's first STRING.
STRING_SCALES = {"authors": 0.1 * math.log(2) + 1.0, "none": 1.0}


@dataclasses.dataclass(frozen=True)
class StringConfig(RemapConfig):
    """STRING (An et al. 2025): distances >= S are shifted down by S - W, as the authors run
    it by default: S = int(0.33 x the length attended), cos and sin x (0.1 ln 2 + 1)
    (``shift_of``, ``scale``; the module docstring cites each). The spec always names both: a
    STRING spec written before they existed was S = int(0.33 L0) with no scale.

    Its reach: the longest distance, L - 1, becomes L - 1 - S + W, about 0.67 L + W with the
    authors' shift, which stays inside a model's trained L0 only while L <= (L0 - W) / 0.67,
    about 1.5 L0. STRING replaces undertrained far positions inside L0; it does not extend a
    model 4x (experiment E: 785-1236 last-quarter perplexity at 32k from SmolLM2-135M's 8k,
    where the other remaps read 11-33)."""

    name: ClassVar[str] = "string"
    shift: int | None = None  # S (tokens): distances >= S become d - S + W; None: shift_of's rule
    shift_ratio: float = 0.33  # S / L when shift is not given (the authors' 0.33)
    shift_of: str = "length"  # L: the sequence attended (the authors'), or original (L0)
    window: int = 128  # W (tokens): the local window kept at the seam (authors' 128)
    scale: str = "authors"  # logits x (0.1 ln 2 + 1)^2 (authors), or none (STRING_SCALES)

    def _defaults(self) -> dict[str, Any]:
        if self.original_length is None or self.shift_of != "original":
            return {}
        return {"shift": int(self.shift_ratio * self.original_length)}

    def _resolve(self) -> None:
        check_choice("shift_of", self.shift_of, STRING_SHIFTS)
        check_choice("scale", self.scale, tuple(STRING_SCALES))
        if not (isinstance(self.shift_ratio, float | int) and 0 < self.shift_ratio <= 1):
            raise ValueError(
                f"shift_ratio={self.shift_ratio!r} is not allowed; it must lie in (0, 1]"
            )
        _positive_int("window", self.window)
        if self.shift is None and self.shift_of == "original":
            self._require_length("shift")
            object.__setattr__(self, "shift", self._defaults()["shift"])
        if self.shift is not None:
            _positive_int("shift", self.shift)
            if self.window > self.shift:
                raise ValueError(
                    f"window={self.window} is not allowed; it must not exceed shift={self.shift} "
                    "(window = shift is the identity)"
                )

    def options(self) -> dict[str, Any]:
        own = super().options()
        if self.shift is None:
            own["shift_of"] = self.shift_of  # the variant, always said
        return {**own, "scale": self.scale}

    @property
    def length_following(self) -> bool:
        return self.shift is None

    def shift_at(self, length: int) -> int:
        """S for a sequence of ``length`` keys: the given or L0-derived one, or
        int(shift_ratio x length), at least W (a shift below the window would stretch
        distances; W = S is the identity)."""
        if self.shift is not None:
            return self.shift
        return max(self.window, int(self.shift_ratio * length))


class RemapEncoding(PositionEncoding):
    """A distance remap over a base rotary schedule (module docstring)."""

    config: RemapConfig
    remaps_distance: ClassVar[bool] = True

    def __init__(self, config: RemapConfig, **dims: int) -> None:
        super().__init__(config, **dims)
        self.inner = RotaryEncoding(config.schedule, **dims)
        self._band_cache: list[tuple[PositionsKey, PositionsKey, list[Band]]] = []
        # The bands follow the length of the sequence attended (STRING's shift, DCA's scale):
        # cached decoding is then exact per layer, as for dynamic schedules (model.cache).
        self.dynamic = config.length_following
        self.rotary_dim, self.n_pairs, self.pairing = (
            self.inner.rotary_dim,
            self.inner.n_pairs,
            self.inner.pairing,
        )

    # The identity band: what attention that ignores bands would compute.
    def rotate_q(self, q: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        return self.inner.rotate_q(q, positions, layer)

    def rotate_k(self, k: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        return self.inner.rotate_k(k, positions, layer)

    def inv_freq(self, layer: int = 0, length: int | None = None) -> tuple[Tensor, float]:
        return self.inner.inv_freq(layer, length)

    def rotate_band(self, x: Tensor, positions: Tensor, query: bool, layer: int = 0) -> Tensor:
        """x (B, H|K, N, D) rotated at any positions (B|1, N), integer or fractional; queries
        and keys alike (the base schedules have no query-only factor)."""
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = self.band_tables(positions, query, layer, dtype)
        return rotate(x, cos, sin, self.pairing)

    def band_tables(
        self, positions: Tensor, query: bool, layer: int = 0, dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor, Tensor]:
        """The base schedule's tables (B|1, 1, N, F): float64 angles from any real position,
        cached per positions tensor, so every layer of a step finds them made."""
        return self.inner.tables(positions, dtype)

    def bands(self, q_pos: Tensor, k_pos: Tensor, layer: int = 0) -> list[Band]:
        """The bands (``bands.Band``) for queries at q_pos (B|1, T) over keys at k_pos (B|1, S).

        The same for every layer, so one forward computes them once: the last calls' bands
        (``BANDS_KEPT``) are returned again for the same positions tensors at the same versions
        (as the tables cache matches them, ``PositionsKey``), and with them their positions
        tensors, whose rotation tables every layer then finds in the base schedule's cache."""
        for q_key, k_key, bands in self._band_cache:
            if q_key.matches(q_pos) and k_key.matches(k_pos):
                return bands
        bands = self._bands(q_pos, k_pos)
        entry = (PositionsKey(q_pos), PositionsKey(k_pos), bands)
        self._band_cache = [entry, *self._band_cache[: BANDS_KEPT - 1]]
        return bands

    def _bands(self, q_pos: Tensor, k_pos: Tensor) -> list[Band]:
        raise NotImplementedError


class ReRope(RemapEncoding):
    config: ReRopeConfig

    def _bands(self, q_pos: Tensor, k_pos: Tensor) -> list[Band]:
        w, k = self.config.window, self.config.leaky
        seam = q_pos - w + 1  # keys at positions >= seam are within the window (d < w)
        scale = None
        if self.config.logn:
            L0 = self.config.original_length
            logn = (torch.log((q_pos + 1).double()) / math.log(L0)).clamp(min=1)  # (B|1, T)
            scale = logn[:, None, :, None]  # (B|1, 1, T, 1)
        if k is None:  # clipped: every far pair sees exactly w
            far_q = torch.full_like(q_pos, w)
            far_k = torch.zeros_like(k_pos)
        else:  # leaky: (i + w (k - 1)) / k - j / k = w + (d - w) / k
            far_q = (q_pos.double() + w * (k - 1)) / k
            far_k = k_pos.double() / k
        return [
            Band(q_pos, k_pos, lo=seam, q_scale=scale),
            Band(far_q, far_k, hi=seam, q_scale=scale),
        ]


class SelfExtend(RemapEncoding):
    config: SelfExtendConfig

    def _bands(self, q_pos: Tensor, k_pos: Tensor) -> list[Band]:
        G, W = self.config.group, self.config.window
        if self.config.mode == "paper":
            seam = q_pos - W + 1  # neighbours: d < W
            group_q = torch.div(q_pos, G, rounding_mode="floor") + W - W // G
        else:
            # llama.cpp: the query's own block of W tokens keeps relative positions; the keys
            # of completed blocks were divided by G, and the query's block continues from
            # the grouped ones: floor(i / W) * W / G + (i mod W).
            block = torch.div(q_pos, W, rounding_mode="floor")
            seam = block * W
            group_q = block * (W // G) + (q_pos - seam)
        group_k = torch.div(k_pos, G, rounding_mode="floor")
        return [Band(q_pos, k_pos, lo=seam), Band(group_q, group_k, hi=seam)]


class DCA(RemapEncoding):
    config: DCAConfig

    def _bands(self, q_pos: Tensor, k_pos: Tensor) -> list[Band]:
        c, top = self.config.chunk_len, self.config.chunk_size
        chunk_start = torch.div(q_pos, c, rounding_mode="floor") * c  # (B|1, T)
        q_in = q_pos - chunk_start  # i mod c
        k_in = torch.remainder(k_pos, c)  # j mod c
        succ_q = (q_in + c).clamp(max=top)
        inter_q = torch.full_like(q_pos, min(2 * c - 1, top))
        scale = None
        if self.config.scale != "none":
            factor = dca_logit_scale(self.config.scale, _length(k_pos), self.config.original_length)
            scale = None if factor == 1 else _logit_scale(factor, q_pos)
        return [
            Band(q_in, k_in, lo=chunk_start, q_scale=scale),  # intra: the query's own chunk
            Band(succ_q, k_in, lo=chunk_start - c, hi=chunk_start, q_scale=scale),  # successive
            Band(inter_q, k_in, hi=chunk_start - c, q_scale=scale),  # inter: older chunks
        ]


class String(RemapEncoding):
    config: StringConfig

    def _bands(self, q_pos: Tensor, k_pos: Tensor) -> list[Band]:
        S, W = self.config.shift_at(_length(k_pos)), self.config.window
        factor = STRING_SCALES[self.config.scale] ** 2
        scale = None if factor == 1 else _logit_scale(factor, q_pos)
        seam = q_pos - S + 1  # d < S keeps its position
        return [
            Band(q_pos, k_pos, lo=seam, q_scale=scale),
            Band(q_pos - S + W, k_pos, hi=seam, q_scale=scale),
        ]


def _logit_scale(factor: float, q_pos: Tensor) -> Tensor:
    """A band's ``q_scale`` (1, 1, T, 1) multiplying every logit by ``factor`` (float64: the
    kernels cast it to the queries' dtype)."""
    return torch.full((1, 1, q_pos.shape[-1], 1), factor, dtype=torch.float64, device=q_pos.device)


def _length(k_pos: Tensor) -> int:
    """L: the keys a call attends over, its last key position + 1 (the rule length-following
    schedules use; one sync)."""
    return int(k_pos.max()) + 1 if k_pos.numel() else 0
