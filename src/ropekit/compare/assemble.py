"""The finished jobs of a comparison assembled into compare.json and its report.

A process holds only the jobs it ran or loaded itself; what other processes of the same
comparison (``--join``) finished and wrote in compare.json before is kept (``_merged``), so
every interim report is whole (experiment E's 19:40 report, written by the joined process,
lacked STRING's perplexity and the unmodified model's probes before this rule).

Holds: COMPARE_JSON, Finished, Setting, write, length_entries, engine_answers, but.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ropekit.backbone import Backbone
from ropekit.data.streams import TokenStream
from ropekit.encodings import PositionEncoding
from ropekit.evals import PerplexityResult
from ropekit.evals.perplexity import LengthScore
from ropekit.evals.probe_summary import NeedleAccuracy, PairedProbes, ProbesResult, paired_probes
from ropekit.results import ResultError, read_record, read_records, run_metadata, write_result
from ropekit.serve.serving import served_by

from .config import CompareConfig
from .ledger import Ledger
from .plan import eval_folder
from .record import (
    CompareResult,
    EngineAnswer,
    JobTime,
    LrSearch,
    Method,
    MethodRetrieval,
    ProbeSettings,
    Race,
    SeedBin,
    Skipped,
    Stat,
    Stretch,
    SummaryEntry,
    TableEntry,
)
from .report import write_report
from .verdict import (
    mean_std,
    method_retrieval,
    out_of_race,
    per_engine,
    pooled_bin,
    recommend,
    retrieval_note,
)

COMPARE_JSON = "compare.json"
# table[label][domain][length]: the per-seed ppl results' rows gathered into one cell
Rows = dict[str, dict[str, dict[int, TableEntry]]]
Scores = dict[str, PerplexityResult]  # domain -> one model's ppl.json there


class Setting(NamedTuple):
    """What a comparison is, beside its finished jobs."""

    config: CompareConfig  # canonical (CompareConfig.canonical)
    out: Path
    command: str
    trained_at: int  # L0
    methods: tuple[Method, ...]
    baseline: str  # the unmodified model's label
    skipped: tuple[Skipped, ...]  # the lengths a domain's documents cannot hold
    streams: Mapping[str, TokenStream]  # the held-out tokens per domain


@dataclasses.dataclass
class Finished:
    """What this process holds of the comparison's finished jobs: a method's perplexity and
    its rate search enter with every seed, its probes with every probed seed."""

    scores: dict[str, dict[int, Scores]] = dataclasses.field(default_factory=dict)
    searches: dict[str, LrSearch] = dataclasses.field(default_factory=dict)
    probes: dict[str, dict[int, ProbesResult]] = dataclasses.field(default_factory=dict)
    served: dict[str, dict[str, EngineAnswer]] = dataclasses.field(default_factory=dict)
    race: Race | None = None  # a raced comparison's rounds so far (None: not raced)


class _Written(NamedTuple):
    """What a compare.json holds per method: the table, the rate searches, the retrieval,
    the engines' answers, the held-out text per domain, and the jobs timed."""

    table: Rows
    lr_search: dict[str, LrSearch]
    retrieval: dict[str, MethodRetrieval]
    served: dict[str, dict[str, EngineAnswer]]
    held_out: dict[str, tuple[Stretch, ...]]
    jobs: set[str]


def write(setting: Setting, finished: Finished, ledger: Ledger, stage: str) -> CompareResult:
    """Write compare.json and the report from ``finished``, with what other processes of this
    comparison wrote in it before (`_merged`), one process at a time."""
    c, s = setting.config, setting
    with ledger.waiting("write"):
        mine = _Written(
            _table(c, finished.scores), dict(finished.searches),
            _retrieval(finished.probes, s.trained_at),
            dict(finished.served), _held_out(s, finished.scores), set(ledger.jobs),
        )  # fmt: skip
        written = _merged(_previous(s), mine, s.methods)
        ledger.sync()  # the jobs the others finished, with their times
        times = (JobTime(**r) for r in ledger.records.values() if r["job"] in written.jobs)
        lengths = c.retrieval_lengths(s.trained_at)
        settings = ProbeSettings(
            tuple(lengths), c.probe_needles, c.probe_haystacks, c.probe_task,
            c.probe_needles * c.probe_haystacks,
        ) if lengths else None  # fmt: skip
        record = CompareResult(
            meta=run_metadata(s.command, seed=c.seed), provenance={"config": c.to_dict()},
            stage=stage, trained_at=s.trained_at, target_length=c.target_length,
            lengths=tuple(c.eval_lengths(s.trained_at)), domains=tuple(c.eval_data),
            single_documents=c.single_documents, skipped=s.skipped,
            held_out=written.held_out, methods=s.methods, baseline=s.baseline,
            table=written.table, summary=_summary(written.table), lr_search=written.lr_search,
            verdict=_verdict(s, written, finished.race), retrieval=written.retrieval,
            length_retrieval={}, probes=settings, served=written.served, times=tuple(times),
            config=c.to_dict(), race=finished.race,
        )  # fmt: skip
        write_result(s.out / COMPARE_JSON, "compare", record)
        write_report(record, s.out)
    return record


def _verdict(s: Setting, written: _Written, race: Race | None) -> Any:
    """The rule's verdict on what is written (None until the baseline is scored), with the
    retrieval and the engines' choices beside it, never part of it; a method out of the race
    is not a candidate (its windows stop at its last round)."""
    c, table = s.config, written.table
    if s.baseline not in table:
        return None
    out = race.stops if race is not None else {}
    verdict = recommend(
        table, [m.label for m in s.methods if m.label in table and m.label not in out],
        s.baseline, s.trained_at,
        c.target_length, c.margin, min_difference=c.min_difference,
        trained=[m.label for m in s.methods if m.trained],
    )  # fmt: skip
    return dataclasses.replace(
        out_of_race(verdict, out),
        retrieval=retrieval_note(written.retrieval, verdict, _paired_past(s, written, verdict)),
        serving=per_engine(verdict, written.served),
    )


def _paired_past(s: Setting, written: _Written, verdict: Any) -> PairedProbes | None:
    """The recommended method's and the runner-up's answers past the trained length, joined
    probe by probe, where each was probed at one seed (compare's default: a trained method's
    first seed, an untrained method's one run) on the same probes (a comparison probes every
    run alike); None otherwise, and the note then compares their pooled accuracies as two
    independent samples."""
    pair = [verdict.winner, verdict.runner_up]
    found = [written.retrieval.get(m) for m in pair if m is not None]
    if len(found) != 2 or any(r is None or r.past is None or r.past_from is None for r in found):
        return None
    answers = []
    for label, retrieval in zip(pair, found, strict=True):
        seeds = {e.seed for b in retrieval.by_distance for e in b.per_seed}
        if len(seeds) != 1:
            return None
        folder = eval_folder(s.out, label, seeds.pop(), "probes")
        answers.append([
            {**r, "length": n}
            for n in s.config.retrieval_lengths(s.trained_at)
            for r in read_records(folder / str(n) / "probes.jsonl")
        ])  # fmt: skip
    first = found[0]
    try:
        return paired_probes(*answers, first.past_from, first.past.confidence)
    except ValueError:  # answers missing or of other probes: not pairs
        return None


def _previous(s: Setting) -> CompareResult | None:
    """compare.json as a process of this comparison last wrote it: None when there is none,
    or it is unreadable, or of other settings (methods aside: a comparison may have gained
    methods since)."""
    try:
        data = read_record(s.out / COMPARE_JSON, CompareResult)
    except (OSError, ResultError):
        return None
    methods = ("methods", "names")  # added methods keep the others; added domains do not
    return data if but(data.config, methods) == but(s.config.to_dict(), methods) else None


def but(config: dict[str, Any], fields: Collection[str]) -> dict[str, Any]:
    """A comparison's config (``to_dict``) without ``fields``: what must stay the same when
    those may change."""
    return {k: v for k, v in config.items() if k not in fields}


def _merged(previous: CompareResult | None, mine: _Written, methods: Sequence[Method]) -> _Written:
    """``mine`` with what ``previous`` holds of the methods it lacks, where ``previous`` is
    of the same comparison and scored that method as the same spec (a method this process
    holds is its own: its results were read from the files just now). In the methods'
    order."""
    if previous is None:
        return mine
    specs = {(m.label, m.spec, m.trained) for m in methods}
    same = {m.label for m in previous.methods if (m.label, m.spec, m.trained) in specs}

    def merge(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> dict[str, Any]:
        both = {**{k: v for k, v in theirs.items() if k in same}, **ours}
        return {m.label: both[m.label] for m in methods if m.label in both}

    held_out = {**previous.held_out, **mine.held_out}
    return _Written(
        merge(previous.table, mine.table),
        merge(previous.lr_search, mine.lr_search),
        merge(previous.retrieval, mine.retrieval),
        merge(previous.served or {}, mine.served),
        {d: held_out[d] for d in previous.domains if d in held_out},
        mine.jobs | {t.job for t in previous.times},
    )


def _table(config: CompareConfig, scores: dict[str, dict[int, Scores]]) -> Rows:
    """table[label][domain][length]: per-seed ppl, NLL, last-quarter windows and their
    blocks, and binned NLL-vs-position curve."""
    table: Rows = {}
    for label, by_seed in scores.items():
        table[label] = {}
        for domain in (d for d in config.eval_data if d in by_seed[min(by_seed)]):
            table[label][domain] = length_entries([by_seed[s][domain] for s in sorted(by_seed)])
    return table


def _held_out(s: Setting, scores: dict[str, dict[int, Scores]]) -> dict[str, tuple]:
    """domain -> the held-out text its windows were cut from: the single-document spans, or
    the stretch of the documents joined end to end (every method scores the same windows,
    so the first scored result says it)."""
    out: dict[str, tuple[Stretch, ...]] = {}
    for domain in s.config.eval_data:
        scored = (r for by_seed in scores.values() for r in by_seed.values())
        result = next((r[domain] for r in scored if domain in r), None)
        if result is None:
            continue
        if result.spans is not None:  # a single-document run names its spans
            out[domain] = tuple(Stretch(x.document, x.offset, x.tokens) for x in result.spans)
        elif result.start is not None:
            out[domain] = _stretch(s.streams[domain], result.start, result.config.n_tokens)
    return out


def engine_answers(
    backbone: Backbone, target: int, encoding: PositionEncoding | None = None
) -> dict[str, EngineAnswer]:
    """compare.json's record of ``served_by``: {engine: answer} for the method ``backbone``
    carries (or ``encoding``, not attached) at ``target`` tokens."""
    served = served_by(backbone, target, encoding=encoding)
    return {name: EngineAnswer(s.exact, s.why) for name, s in served.items()}


def length_entries(per_seed: Sequence[PerplexityResult]) -> dict[int, TableEntry]:
    """One method's table cells on one domain, {length: entry}, from each seed's ppl.json there
    (seeds in order)."""
    rows: dict[int, list[LengthScore]] = {}
    for result in per_seed:
        for row in result.results:
            rows.setdefault(row.length, []).append(row)
    return {n: _entry(seeds) for n, seeds in rows.items()}


def _entry(seeds: Sequence[LengthScore]) -> TableEntry:
    """One cell of the table from each seed's ppl.json row at that length (seeds in order)."""
    windows = [row.last_quarter_nll_windows for row in seeds]
    if any(w is None for w in windows):  # compare scores whole windows, never with a stride
        raise ValueError("a perplexity row without last-quarter windows cannot be compared")
    return TableEntry(
        ppl=tuple(row.perplexity for row in seeds),
        nll=tuple(row.nll for row in seeds),
        last_quarter_windows=tuple(w for w in windows if w is not None),
        # ppl.json written before the blocks existed has none: the verdict then takes its
        # error from windows alone
        last_quarter_blocks=tuple(row.last_quarter_nll_blocks for row in seeds),
        position_nll=tuple(row.position_nll for row in seeds),  # binned curve
    )


def _quarter_ppl(entry: TableEntry) -> list[float]:
    """Each seed's last-quarter perplexity: exp of its mean last-quarter NLL over windows."""
    return [math.exp(sum(w) / len(w)) for w in entry.last_quarter_windows]


def _summary(table: Rows) -> dict[str, dict[str, dict[int, SummaryEntry]]]:
    """label -> domain -> length -> mean ± std over seeds of ppl and last-quarter ppl."""
    return {
        label: {
            domain: {
                n: SummaryEntry(Stat(**mean_std(e.ppl)), Stat(**mean_std(_quarter_ppl(e))))
                for n, e in rows.items()
            }
            for domain, rows in domains.items()
        }
        for label, domains in table.items()
    }


def _stretch(stream: TokenStream, start: int, n_tokens: int) -> tuple[Stretch, ...]:
    """The documents that tokens [start, start + n_tokens] of ``stream`` (its documents joined
    end to end) lie in, in order."""
    stop = min(len(stream), start + n_tokens + 1)  # + the first input token
    bounds = stream.doc_starts.tolist()
    out = []
    for d, name in enumerate(stream.names):
        lo, hi = max(start, bounds[d]), min(stop, bounds[d + 1])
        if lo < hi:
            out.append(Stretch(name, lo - bounds[d], hi - lo))
    return tuple(out)


def _needle_accuracy(entry: NeedleAccuracy) -> dict[str, Any]:
    """The fields ``entry`` shares with every needle accuracy (a probes summary's by_distance
    entry carries its bin's own fields beside them)."""
    return {f.name: getattr(entry, f.name) for f in dataclasses.fields(NeedleAccuracy)}


def _retrieval(
    probes: dict[str, dict[int, ProbesResult]], trained_at: int
) -> dict[str, MethodRetrieval]:
    """label -> its probes by needle distance: each bin pooled over the seeds' probes (correct
    and n summed, one Wilson interval) with each seed's own entry beside it, the reach of the
    pooled bins, and the probes past the trained length pooled (`method_retrieval`)."""
    out = {}
    for label, by_seed in probes.items():
        bins: dict[tuple[int, int], list[SeedBin]] = {}
        for seed in sorted(by_seed):
            for e in by_seed[seed].by_distance:
                bins.setdefault((e.low_distance, e.high_distance), []).append(
                    SeedBin(**_needle_accuracy(e), seed=seed, mean_distance=e.mean_distance)
                )
        pooled = [pooled_bin(es, low, high) for (low, high), es in sorted(bins.items())]
        config = by_seed[min(by_seed)].config  # every run of a comparison probes alike
        out[label] = method_retrieval(pooled, config.bin_edges, config.reach_accuracy, trained_at)
    return out
