"""Learnable rotary encodings: AdaRoPE (AdaFreq + AdaScale) and tuned-yarn.

Shape legend: B batch · H query heads · K key/value heads · g = H/K query heads per key head ·
T length · D head dim · F rotary pairs · L layers (1 when shared).

AdaRoPE (Wang et al. 2026, "Not All Attention Heads Should Rotate and Scale Equally"):
- AdaFreq, sec. 3.2: theta_f^(l,k) = exp(xi[l, k, f]), initialised from a base schedule (plain
  RoPE for pretraining; YaRN/PI/NTK/Llama-3 for extension). The parameter is the change
  ``dxi = xi - xi_init`` (init 0) on top of the base schedule's log-frequencies, and theta is
  formed as theta_init * exp(dxi) with theta_init the base schedule's float64 frequencies,
  recomputed from the config rather than stored: exp(0) = 1 exactly, so at init AdaRoPE's theta
  *is* its base schedule's, bit for bit, and so are its rotations in any dtype. (Forming
  exp(xi_init + dxi) instead is off by up to ~4 float64 ulps, |ln theta| being up to ~10, which
  already flips float32 rotations at large positions; a float32 xi would be off by ~5e-7
  relative, 3e-3 rad at position 5,000.) Weight decay pulls towards the base schedule, not
  towards theta = 1. Frequencies live per key/value
  head: with grouped-query attention a key is rotated once and read by g query heads, and
  relative-position invariance needs a query and its key rotated alike.
- AdaScale, sec. 3.3: lambda_h(L) = (1/tau_h) * ln(1 + max(L, L_ref)/L_ref)^gamma_h multiplies
  the query of head h, with L = position + 1, the number of keys a causal query sees, so
  training, packing and cached decoding agree. tau = exp(log_tau) with log_tau = 0 and
  gamma = 0 at init, so lambda = 1 and AdaRoPE equals its base schedule exactly.

tuned-yarn: YaRN's global knobs (scale factor, beta_fast, beta_slow, attention factor) made
learnable, stored as logs to stay positive: the "tuned global schedule" control the AdaRoPE
review asks for.

Holds: AdaRoPEConfig, AdaRoPE, TunedYarnConfig, TunedYarn, yarn_inv_freq (differentiable).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from . import schedules
from .base import (
    EncodingConfig,
    Extension,
    HeadRows,
    PositionEncoding,
    check_choice,
    check_positive,
    resolve_positions,
)
from .rope import (
    LinearConfig,
    Llama3Config,
    NTKConfig,
    RopeConfig,
    YarnConfig,
    set_rotary_layout,
)
from .rotary import angles, rotate, rotate_angles, tables

# The largest reference length AdaScale takes: the temperature clamps int64 positions to it.
MAX_L_REF = torch.iinfo(torch.int64).max

# Static schedules AdaFreq can start from (dynamic ones have no single set of frequencies).
INIT_SCHEDULES: dict[str, type[RopeConfig]] = {
    "rope": RopeConfig,
    "linear": LinearConfig,
    "ntk": NTKConfig,
    "yarn": YarnConfig,
    "llama3": Llama3Config,
}


def init_schedule(init: str) -> type[RopeConfig]:
    """The schedule config an ``init`` option names (AdaRoPE and the remaps start from it)."""
    check_choice("init", init, tuple(INIT_SCHEDULES))
    return INIT_SCHEDULES[init]


def check_init(init: str, schedule: RopeConfig) -> None:
    """Refuse a schedule that is not exactly the one ``init`` names: YarnConfig is a
    LinearConfig, and init=linear over a YaRN schedule would write a spec that builds another
    encoding."""
    if type(schedule) is not init_schedule(init):
        raise ValueError(f"schedule {type(schedule).__name__} does not match init={init!r}")


@dataclasses.dataclass(frozen=True)
class AdaRoPEConfig(EncodingConfig):
    """AdaRoPE options; every option it does not own goes to the ``init`` schedule.

    ``l_ref`` defaults to the init schedule's original length, else to an ``l_ref`` the model
    supplies as context (a pretrained model being extended: the paper's extension setting uses
    L_ref = its training length), else to the paper's pretraining value, 64.
    """

    name: ClassVar[str] = "adarope"
    init: str = "rope"  # base schedule theta starts from: rope, linear, ntk, yarn, llama3
    l_ref: int | None = None  # L_ref (tokens): default the init's L0, else the context's, else 64
    share_heads: bool = False  # one schedule/temperature per layer (the review's global control)
    share_layers: bool = False  # one schedule/temperature for all layers
    freq: bool = True  # AdaFreq: learn log-frequencies xi (False: ablation "w/o AdaFreq")
    scale: bool = True  # AdaScale: learn tau, gamma (False: ablation "w/o AdaScale")
    schedule: RopeConfig = dataclasses.field(default_factory=RopeConfig)  # parsed init options

    CONTEXT_FIELDS: ClassVar[tuple[str, ...]] = (*RopeConfig.CONTEXT_FIELDS, "l_ref")
    mixable: ClassVar[bool] = True
    PAPER_PRETRAIN_L_REF: ClassVar[int] = 64

    def __post_init__(self) -> None:
        check_init(self.init, self.schedule)
        if self.l_ref is None:
            object.__setattr__(self, "l_ref", self._default_l_ref())
        check_positive("l_ref", self.l_ref, minimum=1, strict=False)
        if self.l_ref > MAX_L_REF:  # positions are int64: max(L, L_ref) is taken in them
            raise ValueError(
                f"l_ref={self.l_ref!r} is not allowed; it must be a length of at most "
                f"{MAX_L_REF} tokens (2**63 - 1, positions are int64)"
            )

    def _default_l_ref(self) -> int:
        return int(self.schedule.extension().original_length or self.PAPER_PRETRAIN_L_REF)

    @property
    def base_schedule(self) -> RopeConfig:
        return self.schedule

    def extension(self) -> Extension:
        return self.schedule.extension()

    @classmethod
    def option_types(cls, options: dict[str, str]) -> dict[str, Any]:
        schedule = init_schedule(options.get("init", "rope"))
        return {**super().option_types(options), **schedule.option_types(options)}

    @classmethod
    def from_options(cls, options: dict[str, str], context: dict[str, Any] | None = None):
        own_types = {k: v for k, v in cls.field_types().items() if k != "schedule"}
        own = {k: v for k, v in options.items() if k in own_types}
        rest = {k: v for k, v in options.items() if k not in own_types}
        init = own.get("init", "rope")
        schedule_cls = init_schedule(init)
        try:
            schedule = schedule_cls.from_options(rest, context)
        except ValueError as e:
            allowed = ", ".join([*own_types, *schedule_cls.field_types()])
            raise ValueError(f"{e} (adarope with init={init} allows: {allowed})") from None
        kwargs = {k: cls.parse_value(k, v, own_types[k]) for k, v in own.items()}
        context_l_ref = (context or {}).get("l_ref")
        if (
            "l_ref" not in kwargs
            and context_l_ref is not None
            and schedule.extension().original_length is None
        ):
            kwargs["l_ref"] = int(context_l_ref)
        return cls(schedule=schedule, **kwargs)

    def options(self) -> dict[str, Any]:
        own = {k: v for k, v in super().options().items() if k != "schedule"}
        if self.l_ref == self._default_l_ref():
            own.pop("l_ref", None)
        return {**own, **self.schedule.options()}


def _check_layer(layer: int, n_layers: int) -> None:
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer={layer} is out of range; this model has layers 0..{n_layers - 1}")


class _LearnedRotary(PositionEncoding):
    """Shared machinery: per-(layer, key-head) tables and grouped query rotation."""

    learned_frequencies: ClassVar[bool] = True
    pairing: str

    def _setup_dims(self, schedule: RopeConfig) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        set_rotary_layout(self, schedule)

    def inv_freq(self, layer: int = 0, length: int | None = None) -> tuple[Tensor, Tensor | float]:
        """theta (K|1, F) float64 for one layer and the cos/sin attention factor (learned
        schedules do not follow the length)."""
        raise NotImplementedError

    # True: the stored-table path (cos/sin built as autograd ops and kept for backward, for q
    # and again for k in every layer); False: ``rotate_angles`` recomputes them in backward.
    # Both give the same numbers; the stored path stays as the reference and for benchmarks.
    stored_tables: bool = False

    def _check_heads(self, x: Tensor, expected: int, what: str) -> None:
        if x.shape[1] != expected:
            raise ValueError(
                f"{what} has {x.shape[1]} heads (x {tuple(x.shape)}); expected {expected}"
            )

    def _rotate(self, x: Tensor, positions: Tensor, query: bool, layer: int) -> Tensor:
        """Keys (B, K, S, D), or queries (B, H, T, D) rotated per key head, group by group."""
        theta, factor = self.inv_freq(layer)  # (K|1, F) float64
        theta = theta.to(x.device)
        if query:
            x = x.unflatten(1, (theta.shape[0], -1))  # (B, K|1, g, T, D): the heads of one key
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        if self.stored_tables:
            phi = angles(positions[:, None, :], theta[None])  # (B|1, K|1, T, F)
            cos, sin = tables(phi[:, :, None] if query else phi, factor, dtype)
            out = rotate(x, cos, sin, self.pairing)
        else:
            out = rotate_angles(x, positions, theta, factor, self.pairing, dtype)
        return out.flatten(1, 2) if query else out  # (B, H, T, D) or (B, K, S, D)

    def rotate_k(self, k: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        positions = resolve_positions(k, positions, "key")
        self._check_heads(k, self.n_kv_heads, "key")
        return self._rotate(k, positions, False, layer)

    def rotate_q(self, q: Tensor, positions: Tensor | None = None, layer: int = 0) -> Tensor:
        positions = resolve_positions(q, positions, "query")
        self._check_heads(q, self.n_heads, "query")
        return self.scale_q(self._rotate(q, positions, True, layer), positions, layer)

    def scale_q(self, q: Tensor, positions: Tensor, layer: int) -> Tensor:
        return q


class AdaRoPE(_LearnedRotary):
    config: AdaRoPEConfig

    def __init__(self, config: AdaRoPEConfig, **dims: int) -> None:
        super().__init__(config, **dims)
        self._setup_dims(config.schedule)
        inv_freq, attention_factor = config.schedule.frequencies(self.rotary_dim)
        # theta = theta_init exp(dxi): p-RoPE's still pairs (theta_init = 0) stay still.
        self._theta_init = inv_freq  # (F,) float64, derived from the config, never cast
        self._xi_init = inv_freq.log()  # (F,) float64; -inf for p-RoPE's still pairs
        self.attention_factor = float(attention_factor)  # the init schedule's (YaRN mscale)
        n_layers = 1 if config.share_layers else self.n_layers
        n_kv = 1 if config.share_heads else self.n_kv_heads
        n_q = 1 if config.share_heads else self.n_heads
        if config.freq:
            self.dxi = nn.Parameter(torch.zeros(n_layers, n_kv, self.n_pairs))  # (L, K, F)
        if config.scale:
            self.log_tau = nn.Parameter(torch.zeros(n_layers, n_q))  # (L, H)
            self.gamma = nn.Parameter(torch.zeros(n_layers, n_q))  # (L, H)
        self.l_ref = config.l_ref

    def _row(self, layer: int) -> int:
        _check_layer(layer, self.n_layers)
        return 0 if self.config.share_layers else layer

    def xi_init(self, device: torch.device | None = None) -> Tensor:
        """The base schedule's log-frequencies (F,), float64."""
        return self._xi_init.to(device)

    def xi(self, layer: int) -> Tensor:
        """Learned log-frequencies (K|1, F) of one layer, float64."""
        row = self._row(layer)
        if not self.config.freq:
            return self._xi_init[None]
        return self._xi_init.to(self.dxi.device) + self.dxi[row].double()

    def inv_freq(self, layer: int = 0, length: int | None = None) -> tuple[Tensor, float]:
        """theta = theta_init * exp(dxi) (K|1, F): exactly the base schedule at init."""
        row = self._row(layer)
        if not self.config.freq:
            return self._theta_init[None], self.attention_factor
        theta = self._theta_init.to(self.dxi.device) * self.dxi[row].double().exp()
        return theta, self.attention_factor

    def log_frequencies(self, layer: int = 0, length: int | None = None) -> Tensor:
        return self.xi(layer)

    def query_temperature(self, positions: Tensor, layer: int = 0) -> Tensor | None:
        return self.temperature(positions, layer) if self.config.scale else None

    def head_rows(self, kind: str) -> HeadRows | None:
        check_choice("kind", kind, ("freq", "scale"))
        if kind == "freq" and self.config.freq:
            parameters: tuple[nn.Parameter, ...] = (self.dxi,)
        elif kind == "scale" and self.config.scale:
            parameters = (self.log_tau, self.gamma)
        else:
            return None
        return HeadRows(parameters, self.config.share_layers, self.config.share_heads)

    def learned_state(self) -> dict[str, Any]:
        config = self.config
        out: dict[str, Any] = {
            "kind": "adarope",
            "share_layers": config.share_layers,
            "share_heads": config.share_heads,
            "l_ref": self.l_ref,
            "xi_init": self.xi_init().tolist(),  # (F,)
            "dxi": None,
            "gamma": None,
            "tau": None,
        }
        if config.freq:
            out["dxi"] = self.dxi.detach().double().cpu().tolist()  # (L|1, K|1, F)
        if config.scale:
            out["gamma"] = self.gamma.detach().double().cpu().tolist()  # (L|1, H|1)
            out["tau"] = self.log_tau.detach().double().exp().cpu().tolist()  # (L|1, H|1)
        return out

    def temperature(self, positions: Tensor, layer: int) -> Tensor:
        """lambda_h(L) for L = position + 1: (B, H|1, T, 1)."""
        row = self._row(layer)
        log_tau, gamma = self.log_tau[row], self.gamma[row]  # (H|1,)
        length = (positions + 1).clamp(min=self.l_ref).to(gamma.dtype)
        loglog = torch.log(torch.log1p(length / self.l_ref))  # (B, T); ln(1 + x) >= ln 2 > 0
        return torch.exp(gamma[None, :, None] * loglog[:, None, :] - log_tau[None, :, None])[
            ..., None
        ]

    def scale_q(self, q: Tensor, positions: Tensor, layer: int) -> Tensor:
        if not self.config.scale:
            return q
        return q * self.temperature(positions, layer).to(q.dtype)


@dataclasses.dataclass(frozen=True)
class TunedYarnConfig(YarnConfig):
    """YaRN whose global knobs train; starts at ``yarn:...,truncate=false`` with these values."""

    name: ClassVar[str] = "tuned-yarn"
    truncate: bool = False  # must stay False: whole-pair rounding has no gradient

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.truncate:
            raise ValueError(
                "truncate=true is not allowed for tuned-yarn; the ramp ends must stay continuous "
                "to be learned (use yarn:truncate=true for the fixed schedule)"
            )
        if self.proportion < 1:
            raise ValueError(
                f"proportion={self.proportion!r} is not allowed for tuned-yarn, whose learned "
                "ramp spans every pair; use yarn:proportion=... (fixed) or adarope:init=yarn,"
                "proportion=... (learned, still pairs stay still)"
            )


def yarn_inv_freq(
    dim: int,
    base: float,
    original_length: int,
    factor: Tensor,
    beta_fast: Tensor,
    beta_slow: Tensor,
) -> Tensor:
    """YaRN's frequencies (schedules.yarn, truncate=False) as a differentiable function of its
    knobs; float64 (F,)."""

    def correction(rotations: Tensor) -> Tensor:
        return dim * torch.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction(beta_fast).clamp(min=0)
    high = correction(beta_slow).clamp(max=dim - 1)
    pair = torch.arange(schedules.n_pairs(dim), dtype=torch.float64, device=factor.device)
    ramp = ((pair - low) / (high - low)).clamp(0, 1)
    extrapolated = schedules.rope(dim, base)[0].to(factor.device)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp)


class TunedYarn(_LearnedRotary):
    """Learnable knobs, each stored as a log-ratio to its configured value (init 0), so at init
    the schedule equals ``yarn:truncate=false`` exactly in any dtype."""

    config: TunedYarnConfig
    KNOBS: ClassVar[tuple[str, ...]] = ("factor", "beta_fast", "beta_slow", "attention_factor")

    def __init__(self, config: TunedYarnConfig, **dims: int) -> None:
        super().__init__(config, **dims)
        self._setup_dims(config)
        self._init = {
            "factor": config.factor,
            "beta_fast": config.beta_fast,
            "beta_slow": config.beta_slow,
            "attention_factor": schedules.yarn_attention_factor(
                config.factor, config.mscale, config.mscale_all_dim, config.attention_factor
            ),
        }
        for knob in self.KNOBS:
            self.register_parameter(f"log_{knob}_ratio", nn.Parameter(torch.zeros(())))

    def knobs(self) -> dict[str, Tensor]:
        """Current values of the four knobs (float64 scalars)."""
        return {
            k: self._init[k] * getattr(self, f"log_{k}_ratio").double().exp() for k in self.KNOBS
        }

    def _theta(self, knobs: dict[str, Tensor]) -> Tensor:
        return yarn_inv_freq(
            self.rotary_dim,
            self.config.base,
            self.config.original_length,
            knobs["factor"],
            knobs["beta_fast"],
            knobs["beta_slow"],
        )  # (F,)

    def inv_freq(self, layer: int = 0, length: int | None = None) -> tuple[Tensor, Tensor]:
        _check_layer(layer, self.n_layers)
        knobs = self.knobs()
        return self._theta(knobs)[None], knobs["attention_factor"]

    def learned_state(self) -> dict[str, Any]:
        """The four knobs, their configured values, and the change in ln theta (F,) they make
        (as dxi (1, 1, F): one schedule for every layer and head)."""
        knobs = {k: float(v.detach()) for k, v in self.knobs().items()}
        init = {k: float(v) for k, v in self._init.items()}

        def log_theta(values: dict[str, float]) -> Tensor:
            tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}
            return self._theta(tensors).log()  # (F,)

        return {
            "kind": "tuned-yarn",
            "knobs": knobs,
            "init_knobs": init,
            "xi_init": log_theta(init).tolist(),
            "dxi": [[(log_theta(knobs) - log_theta(init)).tolist()]],
            "gamma": None,
            "tau": None,
        }
