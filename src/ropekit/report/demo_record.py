"""demo.json as a typed record: what ``ropekit demo`` (``ropekit.demo``, floor 7) writes and the
report's demo section reads.

Why here, below the pipeline that writes it: a record class sits at or below the lowest room that
reads it, so every reader imports it by a plain import the layer test sees (issue 55; results.py
imports no owner by name). The report (floor 6) reads demo.json; the demo imports it from here.

Holds: `VERSION`, `DemoConfig` (every setting of a run, the base recipe in ``base``), and
`DemoResult` (registered as the ``demo`` kind at `VERSION`; ``_from_v2`` migrates the untyped
layout): the config, and once the run is done its `Outcome` (the `BaseModel` with its
`BaseStage`s, one `MethodRow` with `MethodFiles` per method, figures, notes, timings).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ropekit.encodings import Spec
from ropekit.results import register
from ropekit.train.recipe import BaseRecipe

VERSION = 3  # of demo.json. 3: typed, a finished run's numbers under outcome (2: untyped)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Settings of one demo run. Lengths are in bytes (the byte tokenizer's tokens)."""

    # The base model, its data and seed (these, and only these, key the model cache).
    base: BaseRecipe = dataclasses.field(default_factory=BaseRecipe)
    factor: int = 8  # extend to factor * L
    extend_samples: int = 100  # samples of factor * L (the paper's protocol: 100)
    extend_lr: float = 1e-2  # positional parameters' learning rate
    length_multiples: tuple[int, ...] = (1, 2, 4, 8)  # evaluation lengths, in units of L
    eval_windows: int = 16  # held-out windows of the longest length scored at every length
    # kv1_shakespeare is the mixture's kv record with one fact (ropekit.evals.tasks).
    tasks: tuple[str, ...] = ("passkey_shakespeare", "kv1_shakespeare")
    task_samples: int = 20  # samples per task and length, needle depths spread over 0..1
    analysis_windows: int = 4  # held-out windows for the head analysis
    influence_windows: int = 2  # of those, used for head influence (one pass per head)
    preset: str = "custom"  # which preset the settings came from (for the report)

    def __post_init__(self) -> None:
        object.__setattr__(self, "length_multiples", tuple(self.length_multiples))
        object.__setattr__(self, "tasks", tuple(self.tasks))
        for name in (
            "factor", "extend_samples", "eval_windows", "task_samples", "analysis_windows",
            "influence_windows",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 1")
        if self.factor < 2:
            raise ValueError(f"factor={self.factor} is not allowed; extension needs >= 2")
        if not self.length_multiples or any(m < 1 for m in self.length_multiples):
            raise ValueError(
                f"length_multiples={self.length_multiples!r} is not allowed; give integers >= 1"
            )
        if self.influence_windows > self.analysis_windows:
            raise ValueError(
                f"influence_windows={self.influence_windows} must be <= "
                f"analysis_windows={self.analysis_windows}"
            )

    @property
    def context(self) -> int:
        return self.base.context

    @property
    def data(self) -> str:
        return self.base.data

    @property
    def seed(self) -> int:
        return self.base.seed

    @property
    def target_length(self) -> int:
        return self.factor * self.context

    @property
    def lengths(self) -> list[int]:
        return sorted({m * self.context for m in self.length_multiples} | {self.context})

    def method_spec(self, method: str) -> Spec:
        """The extension spec of a method; the model supplies original_length and base."""
        if method == "rope":
            return Spec("rope")
        spec = Spec("adarope", (("init", "yarn"),)) if method == "adarope" else Spec(method)
        return spec.with_options(factor=self.factor)


@dataclasses.dataclass(frozen=True)
class BaseStage:
    """One training stage of the base model (``ropekit.train.recipe``)."""

    name: str  # "recall" or "mixture"
    context: int  # bytes per sample
    steps: int
    batch_size: int
    retrieval_ratio: float  # share of samples carrying a retrieval record


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """The base model the methods extend: where it is cached and how it was trained (from
    its pretrain.json)."""

    key: str  # its cache key (``BaseRecipe.key``)
    path: str  # its folder in the cache
    reused: bool  # found in the cache: this run trained nothing
    encoding: str
    parameters: int
    steps: int
    stages: tuple[BaseStage, ...]
    final_loss: float  # nats per byte
    elapsed_s: float
    tokens_per_s: float
    settings: dict[str, Any]  # ``BaseRecipe.settings()``: what keys the cache


@dataclasses.dataclass(frozen=True)
class MethodFiles:
    """A method's result files, relative to the demo folder."""

    ppl: str
    tasks: str
    extend: str | None  # None: `rope` is not extended


@dataclasses.dataclass(frozen=True)
class MethodRow:
    """One method's numbers, copied from the files its stages wrote (``files``)."""

    name: str  # one of METHODS
    spec: str  # the encoding evaluated
    trainable: int  # parameters the extension trained
    extend_s: float | None  # None: not extended
    final_loss: float | None  # of the extension; None: nothing trained
    bpb: dict[int, float]  # length -> bits per byte on held-out text
    tasks: dict[str, dict[int, float]]  # task -> length -> accuracy (lengths it fits only)
    files: MethodFiles

    def score(self, task: str, length: int) -> float | None:
        """Accuracy on ``task`` at ``length``; None where the task does not fit in ``length``
        bytes (its scores skip that length). Every method ran every task: an unknown one is a
        KeyError, not a blank."""
        return self.tasks[task].get(length)  # a typed map: a missing length is the answer


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a finished demo measured (the rest of demo.json is the config)."""

    base: BaseModel
    methods: tuple[MethodRow, ...]  # in METHODS order
    analysis: str  # the AdaRoPE analysis.json, relative to the demo folder
    figures: dict[str, str]  # file -> caption
    notes: tuple[str, ...]  # plain-language readings (``_notes``)
    timings: dict[str, float]  # stage -> wall seconds


def _from_v2(data: dict[str, Any]) -> dict[str, Any]:
    """The untyped layout: a finished run's numbers at the top level beside copies of the
    config's context, target length, lengths, data, sample counts and tasks (dropped: the
    config holds them); a running one had only its status and config."""
    data = dict(data)
    copies = ("context", "target_length", "lengths", "data", "extend_samples", "task_samples")
    outcome = ("base", "methods", "analysis", "figures", "notes", "timings")
    if data["status"] != "done":
        return {**data, "outcome": None}
    for key in (*copies, "tasks"):
        del data[key]
    data["outcome"] = {key: data.pop(key) for key in outcome}
    return data


@register("demo", VERSION, {2: _from_v2})
@dataclasses.dataclass(frozen=True)
class DemoResult:
    """demo.json. Written when the run starts (``outcome`` None: the folder is a demo's from
    then on) and again when it is done."""

    meta: dict[str, Any]  # run_metadata
    provenance: dict[str, Any]  # {}: the base model's cache key is in outcome.base
    status: str  # "running" or "done"
    config: DemoConfig
    outcome: Outcome | None  # None until the run is done

    def finished(self) -> Outcome:
        """The outcome; ValueError naming the status when the run has not finished."""
        if self.outcome is None:
            raise ValueError(f"the demo has not finished (status {self.status!r})")
        return self.outcome
