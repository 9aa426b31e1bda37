"""What a comparison runs: ``CompareConfig``, built from the command line or a JSON file.

A comparison answers one question for one model: which extension method to use at a target
length N, and what it costs at the original length L0. Every method is a spec; a method whose
encoding has parameters (AdaRoPE, tuned-yarn) trains them with the backbone frozen, on the
same training samples at every seed (paired), at a learning rate chosen on held-out samples of
the *training* domain; every other method (fixed schedules, attention-level remaps, searched
factors) is applied as it is. Every method is then scored on the same held-out windows of
several domains.

Holds: CompareConfig, from_file, spec_label, RACE.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from ropekit.backbone import COMPUTE_DTYPES
from ropekit.data import CORPORA
from ropekit.encodings import Spec
from ropekit.evals.probe_haystacks import ProbeConfig, probe_task
from ropekit.train.extend import ExtendConfig, method_spec


def spec_label(spec: Spec) -> str:
    """A method's label where the config names none: its spec in words."""
    return str(spec).replace(":", " ").replace("=", "").replace(",", " ")


@dataclasses.dataclass(frozen=True)
class CompareConfig:
    """One comparison. Lengths are in the model's tokens."""

    model: str  # a ropekit run or model folder, a Hugging Face folder, or an installed model name
    target_length: int  # N, the context the methods must serve (tokens)
    methods: tuple[Spec, ...]  # encoding specs, comma-separated; rope = the model unmodified
    names: tuple[str, ...] | None = None  # one label per method (default: derived from its spec)
    seeds: tuple[int, ...] = (0, 1, 2)  # trained methods: one extension per seed, paired samples
    train_data: str | tuple[str, ...] = "shakespeare"  # text the trained methods learn from
    samples: int = 16  # training samples of N tokens per seed (the paper's protocol: 100)
    pose: bool = False  # train on PoSE windows whose positions cover N (Zhu et al. 2023)
    pose_window: int | None = None  # tokens per PoSE window; None: the model's training length
    grad_checkpointing: bool = False  # recompute layers in the backward (memory for time)
    lrs: tuple[float, ...] = (1e-2, 3e-2)  # learning rates tried at the first seed
    selection_samples: int = 2  # unseen training-split samples that choose the learning rate
    eval_data: tuple[str, ...] = ("shakespeare", "kjv")  # held-out domains, corpora or files
    lengths: tuple[int, ...] | None = None  # perplexity lengths; None: L0/4, L0 and N
    spans: int = 1  # held-out spans of N tokens per domain, scored at every length
    # score windows inside one held-out document each: a long-context number must come from
    # long documents, never from unrelated texts joined end to end; a length no
    # document of a domain holds is left out there, and the report says so
    single_documents: bool = True
    # a bundled corpus that no method trains on (not in train_data) is held-out text whole:
    # score all its documents, not only its validation split (KJV's split holds no book of
    # 32k tokens; all of it holds several)
    whole_untrained_corpora: bool = False
    # retrieval probe haystack lengths (tokens); None: N, whose cut points ask distances up
    # to N; empty ('' on the command line): none
    probe_lengths: tuple[int, ...] | None = None
    # K: needles near the start of each haystack, each asked once from its own cut point of
    # the cached prefill; 12 x 5 haystacks at N = 4 L0 ask about 45 probes past L0 per run
    # for 5 prefills of N (experiment E's 5 probes per length read 5 of N/2 and 5 of N: 64-79
    # minutes a method, a whole 32k haystack 542-871 s)
    probe_needles: int = 12
    probe_haystacks: int = 5  # H: haystacks per length and run; K x H probes per length and run
    probe_task: str = "niah_single_2"  # the probes' format: a niah task asking one key's value
    # trained methods: probe the runs of their first k seeds only (None: every seed); one
    # probe is one long prefill, the costliest job of a long comparison
    probe_seeds: int | None = None
    margin: float = 0.01  # largest cost at L0 a recommended method may have (0.01 = +1% ppl)
    # smallest lead in last-quarter NLL at N (nats/token) called resolved: 0.005 = 0.5% ppl
    min_difference: float = 0.005
    seed: int = 0  # picks the evaluation spans and the retrieval haystacks and needles
    dtype: str = "float32"  # the compute dtype every method is scored in (training: float32)
    # on: score the windows in rounds (one window at N of one domain a round) and stop spending
    # perplexity and probes on a method once it is resolvably out of the verdict's reach
    # (collapsed, over the margin at L0, or behind the leader: ropekit.compare.race); off:
    # score every window of every method (a comparison that needs every contrast)
    race: str = "on"

    def __post_init__(self) -> None:
        # parsed once, here: an unknown name or a malformed spec stops here, model unread
        object.__setattr__(self, "methods", tuple(map(Spec.parse, self.methods)))
        for name in ("seeds", "eval_data", "lrs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("names", "lengths", "probe_lengths"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if not isinstance(self.train_data, str):
            object.__setattr__(self, "train_data", tuple(self.train_data))
        self._check()

    def _check(self) -> None:
        def integer(name: str, value: Any, minimum: int) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(
                    f"{name}={value!r} is not allowed; it must be an integer >= {minimum}"
                )

        integer("target_length", self.target_length, 2)
        for name in ("samples", "selection_samples", "spans", "probe_needles", "probe_haystacks"):
            integer(name, getattr(self, name), 1)
        integer("seed", self.seed, 0)
        if self.probe_seeds is not None:
            integer("probe_seeds", self.probe_seeds, 1)
            if self.probe_seeds > len(self.seeds):
                raise ValueError(
                    f"probe_seeds={self.probe_seeds} is not allowed; there are "
                    f"{len(self.seeds)} seeds (give at most that many, or none for every seed)"
                )
        if not self.methods:
            raise ValueError("methods=() is not allowed; name at least one encoding spec")
        if self.names is not None and len(self.names) != len(self.methods):
            raise ValueError(
                f"names has {len(self.names)} labels for {len(self.methods)} methods; give one "
                "per method or none"
            )
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"method labels {self.labels} repeat; give each method its name")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds={self.seeds!r} is not allowed; give distinct seeds")
        for s in self.seeds:
            integer("seeds", s, 0)
        if not self.lrs or any(not (math.isfinite(lr) and 0 < lr <= 10) for lr in self.lrs):
            raise ValueError(f"lrs={self.lrs!r} is not allowed; give learning rates in (0, 10]")
        if not self.eval_data:
            raise ValueError("eval_data=() is not allowed; name at least one held-out domain")
        for name in ("lengths", "probe_lengths"):
            for n in getattr(self, name) or ():
                integer(name, n, 2)
                if n > self.target_length:
                    raise ValueError(
                        f"{name} holds {n}, above target_length={self.target_length}; the "
                        "comparison is about lengths up to the target"
                    )
        probe_task(self.probe_task)  # an unsuitable task stops here, not after the training
        if not (math.isfinite(self.margin) and 0 <= self.margin < 1):
            raise ValueError(f"margin={self.margin!r} is not allowed; it must lie in [0, 1)")
        if not (math.isfinite(self.min_difference) and self.min_difference >= 0):
            raise ValueError(
                f"min_difference={self.min_difference!r} is not allowed; it must be a finite "
                "number >= 0 (nats per token)"
            )
        if self.pose_window is not None and not self.pose:
            raise ValueError("pose_window applies only with pose=True (--pose)")
        if self.race not in RACE:
            raise ValueError(f"race={self.race!r} is not allowed; allowed: {', '.join(RACE)}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"dtype={self.dtype!r} is not allowed; allowed: {', '.join(COMPUTE_DTYPES)}"
            )

    @property
    def labels(self) -> tuple[str, ...]:
        return self.names if self.names is not None else tuple(map(spec_label, self.methods))

    def eval_lengths(self, trained_at: int) -> tuple[int, ...]:
        default = (max(2, trained_at // 4), trained_at, self.target_length)
        return tuple(sorted(set(self.lengths or default)))

    def retrieval_lengths(self, trained_at: int) -> tuple[int, ...]:
        """The probe lengths; () when probes are off (an empty ``probe_lengths``)."""
        if self.probe_lengths is None:
            return (self.target_length,)
        return tuple(sorted(set(self.probe_lengths)))

    def heldout_split(self, domain: str) -> str:
        """The split of ``domain`` that is scored: a bundled corpus's validation split, or
        all of it when no method trains on it and ``whole_untrained_corpora``; a user's own
        files whole (a split of one file would be empty, of a folder a tenth of it)."""
        if domain not in CORPORA:
            return "all"
        trained_on = {self.train_data} if isinstance(self.train_data, str) else set(self.train_data)
        return "all" if self.whole_untrained_corpora and domain not in trained_on else "validation"

    def canonical(self, trained_at: int) -> CompareConfig:
        """This comparison with every method as extend builds it for a model trained at
        ``trained_at`` tokens (``method_spec``: a factor it omits is N / L0), the spec every
        file of the comparison records, so two spellings of one method are one method. A
        label derived from a spec stays the one derived from the text given."""
        methods = tuple(method_spec(m, self.target_length, trained_at) for m in self.methods)
        names = self.names if self.names is not None or methods == self.methods else self.labels
        return dataclasses.replace(self, methods=methods, names=names)

    def extension_config(self, spec: Spec, seed: int, lr: float) -> ExtendConfig:
        """The extension run of method ``spec`` at ``seed`` and ``lr``: the same training for
        every method (samples, data, PoSE), so that differences are the methods'."""
        return ExtendConfig(
            method=spec, target_length=self.target_length, samples=self.samples, lr=lr,
            data=self.train_data, seed=seed, pose=self.pose, pose_window=self.pose_window,
            grad_checkpointing=self.grad_checkpointing,
        )  # fmt: skip

    def probed_seeds(self, trained: bool) -> tuple[int, ...]:
        """The seeds whose runs a method's probes ask: a method that trains nothing runs once."""
        return self.seeds[: self.probe_seeds] if trained else (0,)

    def probe_config(self, trained_at: int) -> ProbeConfig:
        """The probes every run answers (the same haystacks and needles for every method)."""
        return ProbeConfig(
            self.retrieval_lengths(trained_at), needles=self.probe_needles,
            haystacks=self.probe_haystacks, task=self.probe_task, seed=self.seed,
        )  # fmt: skip

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> CompareConfig:
        """The config ``to_dict`` wrote: a field it left out is at the value the comparisons
        made before it existed ran at (``_ADDED``), which need not be today's default."""
        return cls(**{**_ADDED, **fields})

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values, for files and provenance. A field added after
        comparisons were run is left out at the value they ran at (``_ADDED``; ``from_dict``
        reads it so): their folders stay resumable and their results keep matching."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["methods"] = tuple(map(str, self.methods))
        return {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in fields.items()
            if k not in _ADDED or v != _ADDED[k]
        }


# Fields added after committed comparisons were made, with the default those comparisons ran at.
# (Racing came after them: they scored every window, race off.)
_ADDED: dict[str, Any] = {
    "dtype": "float32", "probe_seeds": None, "whole_untrained_corpora": False, "race": "off",
}  # fmt: skip
RACE = ("on", "off")


def from_file(path: str | Path, **overrides: Any) -> CompareConfig:
    """A CompareConfig from a JSON file holding its fields (``methods`` may also be a mapping
    of label -> spec); ``overrides`` win. Unknown fields are refused, naming them. A field it
    leaves out is at its default (a file without ``race`` races; a compare.json's config is
    read with ``CompareConfig.from_dict``, its left-out fields at the values it ran at)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object of CompareConfig fields")
    data.pop("description", None)  # for the reader of the file
    methods = data.get("methods")
    if isinstance(methods, dict):
        data["names"], data["methods"] = list(methods), list(methods.values())
    data.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in dataclasses.fields(CompareConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown fields {unknown}; allowed: {', '.join(sorted(known))}")
    missing = [k for k in ("model", "target_length", "methods") if k not in data]
    if missing:
        raise ValueError(f"{path}: the required fields {missing} are missing")
    try:
        return CompareConfig(**data)
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None
