"""analysis.json as typed records: what ``ropekit analyze`` writes and the report, the CLI and
the figures read.

``AnalysisResult`` is one analysis: its four sections (``EffectiveLength``, ``Utilization``
with its ``DistanceProfile``, ``Schedule`` with its ``EffectiveBase`` and ``Learned``
parameters, ``Influence`` per ``InfluenceKind``), which were skipped and why, and what was
analysed (``ModelShape``, each ``AnalysedLayer``, ``Windows``, the config). ``Sections`` is the
part ``analyze_windows`` measures (no files, no provenance); figures draw from either. Tensors
are nested tuples in the shapes the comments give (``run``'s shape legend); a non-finite number
is NaN in memory and null in the file (``ropekit.results``); an axis L runs over the analysed
layers, in ``layers``' order. Registered as the ``analysis`` kind at ``VERSION``; ``_from_v2``
migrates the untyped layout (format_version 2), ``_from_v3`` a file from before layer types.

Holds: VERSION, AnalysedLayer, Row, Grid, Grid3, Grid4, EffectiveLength, ProfileHead,
DistanceProfile, Utilization, EffectiveBase, Learned, Schedule, InfluenceUnit, InfluenceKind,
Influence, ModelShape, Windows, Sections, AnalysisResult, nested.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ropekit.results import register

# 4: the analysed layers and their types (3: every layer; 2: untyped, the class as "class")
VERSION = 4

Row = tuple[float, ...]
Grid = tuple[Row, ...]
Grid3 = tuple[Grid, ...]
Grid4 = tuple[Grid3, ...]


def nested(values: Any) -> Any:
    """Nested lists (``Tensor.tolist()``) as nested tuples, the records' immutable arrays."""
    return tuple(nested(v) for v in values) if isinstance(values, list | tuple) else values


@dataclasses.dataclass(frozen=True)
class AnalysedLayer:
    """One layer whose attention rotates with the analysed encoding (``Backbone.
    encoded_layers``): a spec may cover only some layer types (Gemma 3's global layers), the
    others keep the model's own RoPE or rotate nothing (NoPE) and are not analysed."""

    index: int  # in the model's layers
    kind: str  # the layer type, as the model's config names it ("full_attention", ...)

    @property
    def label(self) -> str:
        """How tables and figures name the layer, e.g. "L3 full_attention"."""
        return f"L{self.index} {self.kind}"


@dataclasses.dataclass(frozen=True)
class EffectiveLength:
    """Section 1: E_beta per layer and head against context length."""

    betas: tuple[float | str, ...]  # orders of E_beta; an infinite one is "inf" (not JSON)
    primary_beta_index: int  # the beta figures and summaries show: 2 if present
    lengths: tuple[int, ...]  # n_L context lengths, ascending
    dynamic_schedule: bool  # the schedule follows the length: one forward per length
    window_mean: Grid4  # (n_b, n_L, L, H) mean over a window's queries
    last_quarter: Grid4  # (n_b, n_L, L, H) over the queries of its last quarter


@dataclasses.dataclass(frozen=True)
class ProfileHead:
    """One head's contribution by distance (paper, Figure 1)."""

    layer: int  # index in the model's layers
    head: int  # query head
    why: str  # why it was picked (max CoV, min CoV, top AdaFreq influence)
    contribution: Grid  # (F, R) mean logit contribution q_f.k_f / sqrt(D)


@dataclasses.dataclass(frozen=True)
class DistanceProfile:
    distances: tuple[int, ...]  # R relative distances
    heads: tuple[ProfileHead, ...]


@dataclasses.dataclass(frozen=True)
class Utilization:
    """Section 2 (rotary encodings): per-pair utilization at max(lengths)."""

    length: int
    pairing: str  # "half" or "interleaved"
    n_pairs: int  # F
    qk_pairs_per_window: int
    mean_abs: Grid3  # (L, H, F) mean |pair contribution|, logit units
    cov: Grid  # (L, H) coefficient of variation across pairs
    max_cov: float  # the CoV of one pair only: sqrt(F - 1)
    weighted_frequency: Grid  # (L, H)
    weighted_log_frequency: Grid  # (L, H)
    mean_log_frequency: Grid  # (L, H)
    log_frequency_correlation: float | None  # None: no variance to correlate
    distance_profile: DistanceProfile


@dataclasses.dataclass(frozen=True)
class EffectiveBase:
    """The fit ln theta_f = -(2f/d) ln Theta + c (``schedules.effective_bases``)."""

    per_head: Grid  # (L, K)
    per_layer: Row  # (L,) geometric mean over the layer's kv heads
    intercept: Grid  # (L, K)
    fit_rms: Grid  # (L, K) residual, ln theta units
    rotary_dim: int


@dataclasses.dataclass(frozen=True)
class Learned:
    """What training moved (``PositionEncoding.learned_state``): AdaRoPE's dxi, gamma and tau,
    or tuned-yarn's knobs and the dxi they make. A field the encoding does not have is None."""

    kind: str  # "adarope" or "tuned-yarn"
    xi_init: Row  # (F,) initial ln theta
    dxi: Grid3 | None  # (L|1, K|1, F) learned minus initial ln theta
    gamma: Grid | None  # (L|1, H|1) AdaScale
    tau: Grid | None  # (L|1, H|1) AdaScale, exp(log_tau)
    share_layers: bool | None  # AdaRoPE
    share_heads: bool | None  # AdaRoPE
    l_ref: int | None  # AdaRoPE
    knobs: dict[str, float] | None  # tuned-yarn: the trained knobs
    init_knobs: dict[str, float] | None  # tuned-yarn: as configured

    @classmethod
    def of(cls, state: dict[str, Any]) -> Learned:
        """From an encoding's ``learned_state`` (which holds only its own fields)."""
        absent = dict.fromkeys(f.name for f in dataclasses.fields(cls))
        return cls(**{k: nested(v) for k, v in {**absent, **state}.items()})


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Section 3: effective base; what AdaRoPE / tuned-yarn learned."""

    effective_base: EffectiveBase
    initial_base: float | None  # the base of the initial schedule; None: nothing learned
    learned: Learned | None


@dataclasses.dataclass(frozen=True)
class InfluenceUnit:
    """One head (``influence.Unit``) and the NLL rise when its parameters are reverted."""

    layer: int | None  # None: a row shared by every layer
    head: int | None  # kv head (freq) or query head (scale); None: shared
    label: str
    delta_nll: float  # nats per token
    computed: bool  # False: at init already, so delta is exactly 0 without a forward


@dataclasses.dataclass(frozen=True)
class InfluenceKind:
    units: tuple[InfluenceUnit, ...]  # in parameter-row order
    top: tuple[InfluenceUnit, ...]  # the top_k by delta_nll, descending


@dataclasses.dataclass(frozen=True)
class Influence:
    """Section 4 (AdaRoPE): head influence at the target length."""

    target_length: int
    windows: int
    baseline_nll: float
    freq: InfluenceKind | None  # AdaFreq; None: the encoding has no such rows
    scale: InfluenceKind | None  # AdaScale

    def kinds(self) -> dict[str, InfluenceKind]:
        """kind ("freq", "scale") -> its influence, for the kinds measured."""
        both = {"freq": self.freq, "scale": self.scale}
        return {kind: section for kind, section in both.items() if section is not None}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    class_name: str  # the module's class (2: "class")
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    # an unpatched Hugging Face model is analysed with its own RoPE, patched meanwhile
    patched_for_analysis: bool


@dataclasses.dataclass(frozen=True)
class Windows:
    """Where the N held-out windows came from (``run.held_out_windows``)."""

    window_length: int
    n_windows: int
    source: str | tuple[str, ...]  # "tensor", "token stream", a corpus name or files
    starts: tuple[int, ...] | None  # first token of each window in the stream; None: given rows
    tokenizer: str | None  # None: ids were given
    split: str | None  # "validation" for a data spec; None otherwise
    tokens: str  # sha256 of the windows' ids


@dataclasses.dataclass(frozen=True)
class Sections:
    """What ``analyze_windows`` measures; a section is None when skipped (``skipped`` says
    why)."""

    spec: str  # the encoding analysed
    layers: tuple[AnalysedLayer, ...]  # the L layers every section's layer axis runs over
    effective_length: EffectiveLength
    utilization: Utilization | None
    schedule: Schedule | None
    influence: Influence | None
    capture: str  # the q/k capture path used: probe or encoding
    skipped: dict[str, str]  # section -> why it was not measured


def _from_v2(data: dict[str, Any]) -> dict[str, Any]:
    """The untyped layout: the model's class under "class"; windows without a tokenizer or a
    split when they had none; learned parameters only with the encoding's own fields."""
    data = dict(data)
    model = dict(data["model"])
    model["class_name"] = model.pop("class")
    data["model"] = model
    data["data"] = {"tokenizer": None, "split": None, **data["data"]}
    schedule = data["schedule"]
    if schedule is not None and schedule["learned"] is not None:
        absent = {"share_layers": None, "share_heads": None, "l_ref": None}
        absent |= {"knobs": None, "init_knobs": None}
        data["schedule"] = {**schedule, "learned": {**absent, **schedule["learned"]}}
    return data


def _from_v3(data: dict[str, Any]) -> dict[str, Any]:
    """Before layer types every layer was analysed, and every model ropekit patched had layers
    of one type (full attention)."""
    layers = [{"index": i, "kind": "full_attention"} for i in range(data["model"]["n_layers"])]
    return {**data, "layers": layers}


@register("analysis", VERSION, {2: _from_v2, 3: _from_v3})
@dataclasses.dataclass(frozen=True)
class AnalysisResult:
    """analysis.json: ``Sections``' fields, and what was analysed on what."""

    meta: dict[str, Any]  # run_metadata
    provenance: dict[str, Any]  # model, data, config: what a rerun must match to reuse it
    effective_length: EffectiveLength
    utilization: Utilization | None
    schedule: Schedule | None
    influence: Influence | None
    capture: str
    skipped: dict[str, str]
    spec: str
    layers: tuple[AnalysedLayer, ...]
    seed: int
    model: ModelShape
    data: Windows
    config: dict[str, Any]  # AnalysisConfig as JSON (an order inf as "inf"), as in provenance
    figures: dict[str, str]  # figure name -> its file, beside analysis.json
