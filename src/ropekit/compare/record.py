"""compare.json as typed records: what ``ropekit compare`` writes and everything reads.

``CompareResult`` is one comparison: its methods, the per-seed numbers behind every cell
(``table``), their means (``summary``), the learning-rate selections, retrieval pooled over
seeds, which engines serve each method, the job times, and the ``Verdict`` (the rule's
numbers, the paired ``Difference`` and, per serving engine, an ``EngineChoice``). Lengths
and learning rates are int and float keys here; ``ropekit.results`` converts them at the
JSON boundary. Registered as the ``compare`` kind at ``VERSION``; ``_from_v2`` migrates the
untyped layout (format_version 2), whose older files omit fields later writers added,
``_from_v3`` a verdict whose error did not yet have the seeds' spread, ``_from_v4`` retrieval
before the substring rule, ``_from_v5`` methods recorded as the user wrote them (now the
canonical spec, the user's text kept as ``given``), ``_from_v7`` retrieval per haystack
length (now per needle distance, the old table kept as ``length_retrieval``); a file before 7
was not raced.

Holds: VERSION, Method, Skipped, Stretch, TableEntry, Stat, SummaryEntry, LrSearch,
SeedAccuracy, Retrieval, SeedBin, DistanceRetrieval, MethodRetrieval, ProbeSettings,
EngineAnswer, JobTime, Difference, BeyondMargin, EngineChoice, Verdict, Stop, Race, CompareResult.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ropekit.encodings import Spec
from ropekit.evals.perplexity import PositionCurve
from ropekit.evals.probe_summary import Accuracy, NeedleAccuracy, Reach
from ropekit.results import register
from ropekit.train.extend import method_spec

from .config import CompareConfig, spec_label

# 8: retrieval per needle distance bin, with each method's reach (was per haystack length);
# 7: the race (None: every window scored); 6: methods by their canonical spec, the user's
# text as `given`; 5: retrieval by RULER's substring rule beside exact match; 4: the
# verdict's error has the seeds' spread; 3: typed, every field written, none left out; 2: the
# untyped layout
VERSION = 8


@dataclasses.dataclass(frozen=True)
class Method:
    label: str  # as the report names it (--names), unique
    spec: str  # canonical: the spec it was attached and scored with (CompareConfig.canonical)
    trained: bool  # its encoding has parameters to train
    given: str  # the spec as the user wrote it


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A length a domain's held-out documents cannot hold (single-document windows)."""

    domain: str
    length: int  # the window left out
    span: int  # tokens one single-document span needs (lcm of the lengths)
    capacity: int  # spans the documents hold
    count: int  # spans needed


@dataclasses.dataclass(frozen=True)
class Stretch:
    """Where a domain's windows were cut from: ``tokens`` tokens of one document."""

    document: str
    offset: int  # first token, in the document
    tokens: int


@dataclasses.dataclass(frozen=True)
class TableEntry:
    """One method on one domain at one length: a value per seed (seeds in order)."""

    ppl: tuple[float, ...]  # whole-window perplexity
    nll: tuple[float, ...]  # whole-window NLL (nats per token)
    last_quarter_windows: tuple[tuple[float, ...], ...]  # per seed: per window, last-quarter NLL
    # per seed: per window, block means of the last quarter; None for a ppl.json written
    # before the blocks were kept (the verdict then takes its error from windows alone)
    last_quarter_blocks: tuple[tuple[tuple[float, ...], ...] | None, ...]
    position_nll: tuple[PositionCurve | None, ...]  # per seed (evals' curve); None: not binned


@dataclasses.dataclass(frozen=True)
class Stat:
    """Mean, sample standard deviation (0 for one value) and count over seeds."""

    mean: float | None  # None when n = 0
    std: float | None
    n: int


@dataclasses.dataclass(frozen=True)
class SummaryEntry:
    ppl: Stat  # whole windows
    last_quarter_ppl: Stat  # exp of each seed's mean last-quarter NLL


@dataclasses.dataclass(frozen=True)
class LrSearch:
    """A trained method's learning rate, chosen by the selection NLL at the first seed."""

    lrs: tuple[float, ...]
    selection_nll: dict[float, float]  # rate -> mean NLL on unseen training samples ({}: one rate)
    chosen: float


@dataclasses.dataclass(frozen=True)
class SeedAccuracy(NeedleAccuracy):
    """One seed's probes at one length (a probes summary's by_length entry), in a comparison
    written before distances (``length_retrieval``)."""

    length: int
    seed: int


@dataclasses.dataclass(frozen=True)
class Retrieval(NeedleAccuracy):
    """Accuracy at one haystack length pooled over seeds, in a comparison written before
    distances (``length_retrieval``): correct and n summed, one Wilson interval; the wrong
    answers naming another needle and the substring rule's accuracy pooled too, None when a
    seed did not count them."""

    runs: int  # seeds pooled
    per_seed: tuple[SeedAccuracy, ...]


@dataclasses.dataclass(frozen=True)
class SeedBin(NeedleAccuracy):
    """One seed's probes in one distance bin (a probes summary's by_distance entry)."""

    seed: int
    mean_distance: float  # of its probes (tokens)


@dataclasses.dataclass(frozen=True)
class DistanceRetrieval(NeedleAccuracy):
    """Accuracy in one needle distance bin, the probes whose question starts in (low, high]
    tokens after their needle, pooled over seeds as `Retrieval` is (each probe counted once
    per seed: every probe has its own needle, key and value)."""

    low_distance: int
    high_distance: int
    mean_distance: float  # of its probes over the seeds (tokens)
    runs: int  # seeds pooled
    per_seed: tuple[SeedBin, ...]


@dataclasses.dataclass(frozen=True)
class MethodRetrieval:
    """One method's retrieval by needle distance (``compare.assemble``): its bins pooled over
    seeds, its reach on them, and the probes past the trained length pooled, which the
    verdict's retrieval note compares (Newcombe's interval over independent probes)."""

    by_distance: tuple[DistanceRetrieval, ...]  # bins with probes, nearest first
    reach: Reach | None  # evals.probe_summary.reach of the pooled bins; None: no bins (probes of a
    # summary written before distances)
    past_from: int | None  # the first bin edge at or past L0; None: the bins end before L0
    past: Accuracy | None  # the probes of the bins from past_from on, pooled; None: none


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    lengths: tuple[int, ...]
    needles: int  # K per haystack
    haystacks: int  # H per length and run
    task: str
    probes_per_run: int  # K x H


@dataclasses.dataclass(frozen=True)
class EngineAnswer:
    """Whether an engine serves a method exactly (``ropekit inspect``'s rules), and why not."""

    exact: bool
    why: str


@dataclasses.dataclass(frozen=True)
class JobTime:
    """A job's wall time (times.jsonl); a learning-rate selection keeps its key and NLL."""

    job: str
    seconds: float
    key: str | None = None
    nll: float | None = None


@dataclasses.dataclass(frozen=True)
class Difference:
    """The paired last-quarter NLL difference, recommended minus runner-up, at N."""

    mean: float | None
    std: float | None
    n: int  # paired windows
    # the error the rule uses: the larger of the two below, se_seeds added in quadrature
    se: float | None
    se_windows: float | None  # over windows (at least 2)
    se_blocks: float | None  # from blocks within the windows
    block_tokens: int | None
    blocks: int | None
    se_seeds: float | None  # over the seeds' paired differences (at least 2 seeds)
    seeds: int | None  # seeds paired; None: written before the seeds' spread was kept


@dataclasses.dataclass(frozen=True)
class BeyondMargin:
    """The best method an engine serves over the cost margin, where it scores better."""

    method: str
    score: float  # last-quarter NLL at N, mean over domains
    cost: float  # relative perplexity change at L0


@dataclasses.dataclass(frozen=True)
class EngineChoice:
    """What one serving engine should run: the best eligible method it serves exactly."""

    method: str | None  # None: it serves no eligible method exactly
    score: float | None
    cost: float | None
    behind: float | None  # its score minus the recommended method's (nats)
    why_not_best: str | None  # why it does not serve the recommended method
    beyond_margin: BeyondMargin | None
    sentence: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The recommendation (``verdict.recommend``): the rule, its numbers and one sentence;
    retrieval and serving are supporting numbers added beside it."""

    rule: str
    margin: float  # the cost at L0 a method may have
    min_difference: float  # nats a resolved lead needs
    short_length: int  # L0
    target_length: int  # N
    baseline: str
    costs: dict[str, float | None]  # method -> cost at L0 (None: not scored there)
    scores: dict[str, float | None]  # method -> last-quarter NLL at N
    eligible: tuple[str, ...]  # by score, best first
    winner: str | None
    runner_up: str | None
    difference: Difference | None
    resolved: bool
    collapsed: tuple[str, ...]
    sentence: str
    retrieval: str | None = None  # verdict.retrieval_note
    serving: dict[str, EngineChoice] | None = None  # engine -> choice (verdict.per_engine)


@dataclasses.dataclass(frozen=True)
class Stop:
    """Where a method left the race (``compare.race``)."""

    round: int  # the last round it was scored in
    score: float  # its score then (last-quarter NLL at N over its windows so far)
    reason: str  # collapsed, over the margin at L0, behind <leader>


@dataclasses.dataclass(frozen=True)
class Race:
    """A comparison scored in rounds: the rounds planned and done, the level of each look,
    and each method that left the race."""

    rounds: int  # K: planned (spans per domain)
    decided: int  # rounds scored and decided so far
    alpha: float  # one-sided, per method over all its looks
    z: float  # the bound at each look (alpha / K)
    stops: dict[str, Stop]  # label -> where it stopped


@register(
    "compare",
    VERSION,
    {2: lambda d: _from_v2(d), 3: lambda d: _from_v3(d), 4: lambda d: _from_v4(d),
     5: lambda d: _from_v5(d), 6: lambda d: _from_v6(d), 7: lambda d: _from_v7(d)},
)  # fmt: skip
@dataclasses.dataclass(frozen=True)
class CompareResult:
    """compare.json (``ropekit.compare.run`` writes it after every stage)."""

    meta: dict[str, Any]  # run_metadata, plus "amended" when ``ropekit report`` added to it
    provenance: dict[str, Any]  # {"config": the config's dict}
    stage: str  # what is done ("done" at the end)
    trained_at: int  # L0
    target_length: int  # N
    lengths: tuple[int, ...]
    domains: tuple[str, ...]
    single_documents: bool  # windows inside single documents (else joined text)
    skipped: tuple[Skipped, ...]
    held_out: dict[str, tuple[Stretch, ...]]  # domain -> the text its windows were cut from
    methods: tuple[Method, ...]
    baseline: str  # the unmodified model's label
    table: dict[str, dict[str, dict[int, TableEntry]]]  # label -> domain -> length
    summary: dict[str, dict[str, dict[int, SummaryEntry]]]  # label -> domain -> length
    lr_search: dict[str, LrSearch]  # trained label -> its selection
    verdict: Verdict | None  # None until the baseline is scored
    retrieval: dict[str, MethodRetrieval]  # label -> its probes by needle distance
    # label -> haystack length: a comparison written before distances (compare.json < 8), as
    # it was written; {} since (a needle at depth d of n tokens asked from the end was
    # (1 - d) n tokens back: depth 0.5, about n / 2, so "@n" there is not a distance of n)
    length_retrieval: dict[str, dict[int, Retrieval]]
    probes: ProbeSettings | None  # None: not probed
    served: dict[str, dict[str, EngineAnswer]] | None  # label -> engine; None: never asked
    times: tuple[JobTime, ...]
    config: dict[str, Any]  # CompareConfig.to_dict()
    race: Race | None  # None: every window of every method scored (race off)

    @property
    def compare_config(self) -> CompareConfig:
        return CompareConfig.from_dict(self.config)

    def entry(self, label: str, domain: str, length: int) -> TableEntry | None:
        """The table's cell; None where the method or the domain was not scored there."""
        domains = self.table.get(label, {})
        rows = domains.get(domain, {})
        return rows.get(length)


def _from_v2(data: dict[str, Any]) -> dict[str, Any]:
    """The untyped layout: every field later writers added is given the value its readers
    took for it when absent (a comparison written before it)."""
    data = {"held_out": {}, "skipped": [], "single_documents": False, "probes": None, **data}
    data.setdefault("served", None)  # refresh_comparison asks the engines
    for domains in data["table"].values():
        for rows in domains.values():
            for entry in rows.values():
                entry.setdefault("last_quarter_blocks", [None] * len(entry["ppl"]))
                entry.setdefault("position_nll", [None] * len(entry["ppl"]))
    for by_length in data.get("retrieval", {}).values():
        for entry in by_length.values():
            for seed in entry["per_seed"]:
                for key in ("other_needle", "nearest_needle"):
                    seed.setdefault(key, None)
            for key in ("other_needle", "nearest_needle"):
                entry.setdefault(key, None)
    verdict = data.get("verdict")
    if verdict is not None:
        data["verdict"] = verdict = {"collapsed": [], "retrieval": None, "serving": None,
                                     **verdict}  # fmt: skip
        if verdict["difference"] is not None:
            blocks = ("se_windows", "se_blocks", "block_tokens", "blocks")
            verdict["difference"] = {**dict.fromkeys(blocks), **verdict["difference"]}
        for entry in (verdict["serving"] or {}).values():
            entry.setdefault("beyond_margin", None)
    return data


def _from_v3(data: dict[str, Any]) -> dict[str, Any]:
    """Before the seeds' spread entered the verdict's error: its difference has none (the
    error stays as written, over windows and blocks only)."""
    verdict = data.get("verdict")
    if verdict is not None and verdict["difference"] is not None:
        verdict["difference"] = {**verdict["difference"], "se_seeds": None, "seeds": None}
    return data


def _from_v4(data: dict[str, Any]) -> dict[str, Any]:
    """Before retrieval was summed by the substring rule too: unknown here (None); the
    comparison's next pass reads it from the probes' answers."""
    for by_length in data.get("retrieval", {}).values():  # a v2 file may have none
        for entry in by_length.values():
            entry["substring"] = None
            for seed in entry["per_seed"]:
                seed["substring"] = None
    return data


def _from_v5(data: dict[str, Any]) -> dict[str, Any]:
    """Before methods were recorded by their canonical spec: each method's text is kept as
    ``given`` and its spec, and the config's (provenance and ``config``), made canonical by
    extend's rule (``method_spec``: a factor it omits is N / L0), so a rerun that spells a
    method either way is the same comparison."""
    target, trained_at = data["target_length"], data["trained_at"]

    def canonical(text: str) -> str:
        return str(method_spec(Spec.parse(text), target, trained_at))

    data["methods"] = [
        {**m, "spec": canonical(m["spec"]), "given": m["spec"]} for m in data["methods"]
    ]
    for config in (data["config"], data["provenance"].get("config")):
        if config is None:
            continue
        given = list(config["methods"])
        config["methods"] = [canonical(m) for m in given]
        if config["methods"] != given and config.get("names") is None:
            config["names"] = [spec_label(Spec.parse(m)) for m in given]  # as they were
    return data


def _from_v6(data: dict[str, Any]) -> dict[str, Any]:
    """Before racing: every window of every method was scored (no race)."""
    return {**data, "race": None}


def _from_v7(data: dict[str, Any]) -> dict[str, Any]:
    """Before retrieval by distance: the per-length table stays as written, in
    ``length_retrieval``, and ``retrieval`` by distance is empty (where its probes' summaries
    hold distance bins, probes version 5, a rerun of the comparison in its folder reads them
    without a model call and writes them)."""
    return {**data, "retrieval": {}, "length_retrieval": data.get("retrieval", {})}
