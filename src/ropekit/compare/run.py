"""``ropekit compare``: the plan's jobs run through the ledger, then assembled into a verdict.

The runner is one loop: ``for job in plan: ledger.run(job, RUNNERS[job.kind])`` (`plan.jobs`
is the one list of jobs, cheapest stage first; `ledger.Ledger` claims, times and reuses them),
and the verdict is rewritten from what is finished each time a method's perplexity or probes
are complete (`assemble.write`), so an interrupted comparison leaves honest partial results:

1. every method that trains nothing (fixed schedules, attention-level remaps, searched
   factors) is attached as an extension run (``ropekit extend``: its adapter, exportable) and
   scored on every held-out domain;
2. every trained method: one run per learning rate at the first seed, the rate chosen by the
   mean NLL on ``selection_samples`` unseen samples of the training split (never the held-out
   text the results are measured on), then the other seeds at that rate; each scored;
3. retrieval probes of every method (every seed of a trained one, or its first
   ``probe_seeds``): K needles per haystack asked from the cached prefix (``ropekit eval
   probes``), pooled over seeds into one accuracy per needle distance bin with its Wilson
   interval, and each method's reach, reported beside the rule.

Every job is a library run with its own provenance (extend, eval ppl, the probes), so a rerun
of the same comparison recomputes nothing, and a change of model, adapter, spec or data in
the same folder is refused rather than served from a cache. A method is recorded by its
canonical spec (``CompareConfig.canonical``), so spelling it another way is the same
comparison. The one change a folder takes is methods or held-out domains added (every earlier
label kept with its spec, every earlier domain kept, every other field the same): the rerun
scores what was added and reuses every finished job, the learning-rate selections too (each
keyed by what it depends on: ``plan.selection_key``).

Several processes may run one comparison into one folder (``ropekit compare --join``): a job
another process holds is left (`ledger.Held`), with the jobs that need it, for a later pass;
when only such jobs are left, the process waits for them (`ledger.WAIT_SECONDS`) and takes
over any whose process died. Alone in its folder a comparison ends in one pass.

Layout of ``out_dir``:

    compare.json, report.md, report.html, *.png      the verdict, the tables, the figures
    times.jsonl                                       each job's wall time (`ledger`)
    methods/<label>/s<seed>/                          extension runs (adapter/, extend.json)
    methods/<label>/lr-<lr>/s<seed>/                  learning-rate candidates (trained)
    eval/<label>/s<seed>/<domain>/ppl.json            perplexity on one held-out domain (its
                                                      windows inside single documents unless
                                                      single_documents=False)
    eval/<label>/s<seed>/probes/                      retrieval probes (summary.json, one
                                                      folder per length)
    .jobs/                                            the claims of the jobs running now

The plan (``plan_compare``, every run's first line) costs each job (`plan.CostModel`), and for
a resumed folder also at the pace its finished jobs kept: their recorded wall time over the
same estimate, the median per kind of job, since one forward's rate moves with the load.

Holds: run_compare, plan_compare, Comparison, RUNNERS, JobCost, paces.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ropekit.backbone import COMPUTE_DTYPES, Backbone, open_backbone
from ropekit.backbone.cost import TIMED_ATTENTION, TIMED_TOKENS, forward_seconds
from ropekit.data import heldout_stream, make_train_dataset
from ropekit.data.streams import TokenStream
from ropekit.evals import (
    DocumentsTooShort,
    PerplexityResult,
    PromptFormat,
    as_language_model,
    check_single_documents,
    run_perplexity,
    run_probes,
)
from ropekit.evals.adapters import shared_chunks
from ropekit.evals.probes import ProbesResult, build_haystack, check_probe_sizes, probe_task
from ropekit.results import ResultError, check_replaceable, digest, read_record
from ropekit.train.extend import extend

from . import ledger as ledger_module
from .assemble import COMPARE_JSON, Finished, Scores, Setting, but, engine_answers, write
from .config import CompareConfig
from .ledger import Held, Ledger
from .plan import (
    BASELINE,
    KINDS,
    RESULT_FILE,
    CostModel,
    Job,
    ResolvedMethod,
    chosen_rates,
    jobs,
    ppl_config,
    resolve_methods,
    selection_key,
)
from .record import CompareResult, LrSearch, Method, Skipped
from .rounds import Rounds


class JobCost(NamedTuple):
    """One job of the plan as it is costed (`Comparison.job_costs`)."""

    kind: str  # training, selection, perplexity or probes
    job: str  # its name in times.jsonl
    seconds: float  # estimated (plan.CostModel)
    finished: bool  # its result is in the folder


class Comparison:
    """One comparison in its folder: its methods resolved once, its jobs, its ledger, and
    what this process has finished."""

    def __init__(
        self, config: CompareConfig, out: Path, command: str, log: Callable, progress: bool
    ) -> None:
        self.out, self.command, self.log = Path(out), command, log
        self.progress = progress  # each evaluation's own progress bar (windows, probes)
        probe = open_backbone(config.model)
        self.trained_at = probe.training_length
        self.methods = resolve_methods(config, probe)
        self.config = config.canonical(self.trained_at)  # what every file records
        self.baseline = next(m.label for m in self.methods if m.spec == BASELINE)
        self.tokenizer = probe.require_tokenizer()
        self.streams: dict[str, TokenStream] = {}  # held-out tokens, made once per domain
        self.skipped: list[Skipped] = []  # the lengths left out, with the reason
        # probe length -> filler a later haystack keeps, and the needle distance of every probe
        # a run asks (the plan counts them); probes that do not fit stop it here
        self.kept, self.distances = _probes_fit(self.config, probe, self.trained_at)
        probe.cast(COMPUTE_DTYPES[config.dtype])
        self.forward_seconds = forward_seconds(probe)  # for the plan's estimate
        # an unknown, empty or unreadable domain stops it here
        self.domains = {d: self.domain_lengths(d) for d in config.eval_data}
        self.ledger = Ledger(self.out)
        self.rounds = (
            Rounds.of(self.config, self.methods, self.domains, self.trained_at)
            if self.config.race == "on"
            else None
        )
        self.finished = Finished(race=self.rounds and self.rounds.record())
        self.nll: dict[str, float] = {}  # selection job -> its score
        self.chosen = chosen_rates(self.config, self.methods, self._recorded_nll)
        self.done: set[str] = set()  # the jobs this process ran or loaded
        self.attached: tuple[str, Backbone, float] | None = None  # the last run, its time
        self.scored: dict[str, dict[int, Scores]] = {}  # label -> seed -> domain -> ppl.json
        self.runs: dict[str, Job] = {}  # training jobs seen, by name

    # ------------------------------------------------------------------ the plan
    def jobs(self, planned: bool = False) -> Iterator[Job]:
        """The plan's jobs (`plan.jobs`), generated as they are read: a trained method's later
        seeds at the rate ``chosen`` holds when they are reached, a raced round's for the
        methods the race holds when it is reached (``planned``: every round not decided yet
        for every method not stopped, the most it can run)."""
        probed = bool(self.config.retrieval_lengths(self.trained_at))
        args = self.config, self.out, self.methods, self.domains, self.chosen, probed
        if self.rounds is None:
            return jobs(*args)
        race = self.rounds
        return jobs(*args, race.planned if planned else race.entrants, race.rule.rounds)

    def _recorded_nll(self, job: str) -> float | None:
        record = self.ledger.records.get(job)
        return None if record is None else record.get("nll")

    def cost_model(self) -> CostModel:
        c, seconds = self.config, self.forward_seconds
        return CostModel(c, self.trained_at, seconds, self.domains, self.kept)

    def job_costs(self) -> list[JobCost]:
        """Every job of the plan, costed, and whether its result is in the folder (a
        selection: its record in times.jsonl)."""
        cost = self.cost_model()
        return [
            JobCost(job.kind, job.name, cost(job), self.is_finished(job))
            for job in self.jobs(planned=True)
        ]

    def is_finished(self, job: Job) -> bool:
        """Its result is in the folder (a selection's: its record in times.jsonl)."""
        return job.name in self.ledger.records if job.result is None else job.result.is_file()

    def estimated_seconds(self, left: bool = False, paced: bool = False) -> dict[str, float]:
        """Seconds per kind of job: of every job, or with ``left`` of those whose result is
        not in the folder yet; with ``paced`` each kind scaled by its pace (`paces`)."""
        costs = self.job_costs()
        kept = paces(self.ledger, costs) if paced else {}
        out = dict.fromkeys(KINDS, 0.0)
        for job in costs:
            if not (left and job.finished):
                out[job.kind] += job.seconds * kept.get(job.kind, (1.0, 0))[0]
        return out

    # ------------------------------------------------------------------ what it reads
    def domain_lengths(self, domain: str) -> tuple[int, ...]:
        """The perplexity lengths ``domain`` is scored at: all of them, or with single
        documents those its documents can hold (the longest dropped first, since a span is
        lcm(lengths) tokens), each dropped length recorded for the report. The same for
        every method (one tokenizer), so every method is scored on the same windows."""
        split = self.config.heldout_split(domain)
        self.streams[domain] = heldout_stream(domain, self.tokenizer, split=split)
        lengths = self.config.eval_lengths(self.trained_at)
        while self.config.single_documents and lengths:
            try:
                ppl = ppl_config(self.config, lengths)
                check_single_documents(self.streams[domain], self.tokenizer, ppl)
                break
            except DocumentsTooShort as e:
                self.skipped.append(Skipped(domain, lengths[-1], e.span, e.capacity, e.count))
                lengths = lengths[:-1]
        return lengths

    # ------------------------------------------------------------------ the runners
    def attach(self, run: Job) -> Backbone:
        """The model with ``run``'s method attached (trained at its seed and rate, or its
        finished run loaded), in the comparison's dtype; the last one is kept."""
        if self.attached is not None and self.attached[0] == run.name:
            return self.attached[1]
        self.attached = None  # one model in memory at a time
        c = self.config
        backbone = open_backbone(c.model)
        config = c.extension_config(run.method.spec, run.seed, run.lr)
        result = extend(backbone, config, run.folder, resume=True, command=self.command,
                        log=self.log)  # fmt: skip
        backbone.cast(COMPUTE_DTYPES[c.dtype])  # trained in float32, scored in the config's
        self.attached = (run.name, backbone, result.elapsed_s)
        return backbone

    def train(self, job: Job) -> float:
        """A training job: the run trained (or loaded); returns the run's own time."""
        self.log(f"{job.method.label}: {'training' if job.method.trained else 'attaching'} "
                 f"at lr {job.lr:g}, seed {job.seed}")  # fmt: skip
        self.attach(job)
        assert self.attached is not None
        return self.attached[2]

    def select(self, job: Job) -> float:
        """A selection job: its score, found by its key (the method's canonical spec: another
        spelling finds it) or computed."""
        key = selection_key(self.config, job.method, job.lr)
        earlier = digest({"job": job.name, "config": self.config.to_dict()})  # before the key
        record = self.ledger.find(lambda r: r.get("key") in (key, earlier))
        if record is not None:
            return record["nll"]
        return self.selection_nll(self.attach(self.runs[job.after[0]]), job.seed)

    def selection_nll(self, backbone: Backbone, seed: int) -> float:
        """Mean NLL on the training-split samples right after the ones trained on (unseen)."""
        c = self.config
        packed = make_train_dataset(
            c.train_data if isinstance(c.train_data, str) else list(c.train_data),
            backbone.require_tokenizer(), c.target_length, seed=seed,
        )  # fmt: skip
        total = 0.0
        for k in range(c.samples, c.samples + c.selection_samples):
            ids = torch.as_tensor(packed.sample(k)[0])[None]  # (1, N+1)
            total += float(backbone.token_nll(ids, 2048).double().mean())
        return total / c.selection_samples

    def score(self, job: Job) -> PerplexityResult:
        assert job.domain is not None and job.folder is not None
        backbone = self.attach(self.runs[job.after[0]])
        if job.method.label not in self.finished.served:  # the first run scored says it
            served = engine_answers(backbone, self.config.target_length)
            self.finished.served[job.method.label] = served
        config = ppl_config(self.config, self.domains[job.domain], job.round)
        return run_perplexity(
            backbone, config, job.folder, data=job.domain, stream=self.streams[job.domain],
            spec=str(job.method.spec), command=self.command, progress=self.progress,
        ).result  # fmt: skip

    def probe(self, job: Job) -> ProbesResult:
        assert job.folder is not None
        self.log(f"{job.method.label}: retrieval probes, seed {job.seed}")
        return run_probes(
            self.attach(self.runs[job.after[0]]), self.config.probe_config(self.trained_at),
            job.folder, spec=str(job.method.spec), command=self.command,
            progress=self.progress,
        )  # fmt: skip

    # ------------------------------------------------------------------ the loop
    def sweep(self) -> list[str]:
        """One pass over the plan: every job not done yet whose jobs before it are done, run
        (or loaded) through the ledger; returns the jobs other processes held."""
        held: list[str] = []
        for job in self.jobs():  # the later seeds at the rate chosen as the selections finish
            if job.kind == "training":
                self.runs[job.name] = job
            if job.name in self.done or any(a not in self.done for a in job.after):
                continue  # done, or waits for a job another process holds
            if isinstance(self.run_job(job), Held):
                held.append(job.name)
        return held

    def run_job(self, job: Job) -> Any:
        """``job`` run (or loaded) through the ledger and taken in; a `Held` when another
        process holds it."""
        fn = functools.partial(RUNNERS[job.kind], self, job)
        value = self.ledger.run(job.name, fn, job.folder, RESULT_FILE.get(job.kind, ""))
        if not isinstance(value, Held):
            self.done.add(job.name)
            self.finish(job, value)
        return value

    def finish(self, job: Job, value: Any) -> None:
        """Take in a finished job's value; a method whose perplexity (or probes) is complete
        enters the verdict, which is written then."""
        label, finished = job.method.label, self.finished
        if job.kind == "training":
            record = self.ledger.records.get(job.name, {})
            # A run trained ahead into its folder (experiment E's prefetch) is loaded: its
            # time is the run's own (extend.json's); a run trained here records at least it.
            if value > record.get("seconds", 0.0):
                self.ledger.set(job.name, {"job": job.name, "seconds": value})
        elif job.kind == "selection":
            self.nll[job.name] = value
            record = self.ledger.records[job.name]
            key = selection_key(self.config, job.method, job.lr)
            if record.get("key") != key:
                self.ledger.set(job.name, {**record, "key": key, "nll": value})
            self.chosen.update(chosen_rates(self.config, self.methods, self.nll.get))
        elif job.kind == "perplexity" and self.rounds is not None:
            assert job.round is not None and job.domain is not None
            if self.rounds.add(label, job.round, job.seed, job.domain, value):
                for m in (m for m in self.methods if m.label in self.rounds.results):
                    finished.scores[m.label] = self.rounds.scores(m.label)
                    self._searched(m)
                finished.race = self.rounds.record()
                self.write(f"round {self.rounds.decided}")
        elif job.kind == "perplexity":
            assert job.domain is not None
            self.scored.setdefault(label, {}).setdefault(job.seed, {})[job.domain] = value
            seeds = self.config.seeds if job.method.trained else (0,)
            domains = [d for d, lengths in self.domains.items() if lengths]
            by_seed = self.scored[label]
            if all(len(by_seed.get(s, {})) == len(domains) for s in seeds):
                finished.scores[label] = {s: by_seed[s] for s in seeds}
                self._searched(job.method)
                self.write(f"{label} scored")
        else:
            finished.probes.setdefault(label, {})[job.seed] = value
            if len(finished.probes[label]) == len(self.config.probed_seeds(job.method.trained)):
                self.write(f"{label} probed")

    def _searched(self, m: ResolvedMethod) -> None:
        """A trained method's rate search enters the result with its scores."""
        if m.trained:
            lrs = self.config.lrs
            names = {lr: f"select {m.label} lr {lr:g}" for lr in lrs} if len(lrs) > 1 else {}
            nll = {lr: self.nll[name] for lr, name in names.items()}
            self.finished.searches[m.label] = LrSearch(lrs, nll, self.chosen[m.label])

    def write(self, stage: str) -> CompareResult:
        methods = tuple(Method(m.label, str(m.spec), m.trained, m.given) for m in self.methods)
        setting = Setting(
            self.config, self.out, self.command, self.trained_at, methods, self.baseline,
            tuple(self.skipped), self.streams,
        )  # fmt: skip
        return write(setting, self.finished, self.ledger, stage)


RUNNERS: dict[str, Callable[[Comparison, Job], Any]] = {
    "training": Comparison.train,
    "selection": Comparison.select,
    "perplexity": Comparison.score,
    "probes": Comparison.probe,
}


def paces(ledger: Ledger, costs: list[JobCost]) -> dict[str, tuple[float, int]]:
    """kind -> (median over the finished jobs of that kind that times.jsonl holds of
    their recorded wall seconds over their estimate, how many). The estimate rests on one
    timed forward and so moves with the machine's load at that moment; the median, so
    that a few records that are off (a job that waited out a pause) move it little."""
    ratios: dict[str, list[float]] = {}
    for job in costs:
        record = ledger.records.get(job.job)
        if job.finished and record is not None and job.seconds > 0:
            ratios.setdefault(job.kind, []).append(record["seconds"] / job.seconds)
    return {kind: (statistics.median(r), len(r)) for kind, r in ratios.items()}


def _probes_fit(
    config: CompareConfig, probe: Backbone, trained_at: int
) -> tuple[dict[int, int], list[int]]:
    """Check the probe sizes and build every haystack now: K needles that do not fit a length
    stop the comparison here (TaskDoesNotFit, a ValueError), not after every method trained.
    Returns, per length, the tokens a later haystack keeps of the one before it (the whole
    chunks of their shared filler), for the plan's estimate, and the needle distance of every
    probe a run asks, for its plan line."""
    if not config.retrieval_lengths(trained_at):
        return {}, []
    probes, lm = config.probe_config(trained_at), as_language_model(probe)
    check_probe_sizes(probes, lm)
    task, fmt = probe_task(probes.task), PromptFormat(probe.require_tokenizer(), chat=probes.chat)
    kept, distances = {}, []
    for length in probes.lengths:
        hays = [build_haystack(task, fmt, probes, length, h) for h in range(probes.haystacks)]
        if probes.haystacks > 1:
            kept[length] = shared_chunks(hays[0].prefix, hays[1].prefix, lm.prefill_chunk)
        distances += [p.distance for hay in hays for p in hay.probes]
    return kept, distances


def _plan_line(run: Comparison) -> str:
    """What the comparison will run, said before it starts (finished jobs are reused)."""
    c, planned = run.config, list(run.jobs(planned=True))
    trained = [m for m in run.methods if m.trained]
    runs = sum(j.kind == "training" and j.method.trained for j in planned)
    scored = len({(j.method.label, j.seed) for j in planned if j.kind == "perplexity"})
    windows = run.domains
    per_length = ppl_config(c, (c.target_length,)).n_tokens
    tokens = sum(len(n) for n in windows.values()) * per_length
    lengths = c.retrieval_lengths(run.trained_at)
    prefills = sum(j.kind == "probes" for j in planned) * c.probe_haystacks * len(lengths)
    at_target = sum(c.spans for n in windows.values() if c.target_length in n)
    warning = (
        f"; warning: {at_target} window{'s' * (at_target != 1)} at {c.target_length}: "
        "a lead is resolved only within their own text (the error then comes from blocks of "
        "positions inside them; 3 paired windows say whether it holds across documents): "
        "raise spans, or add a domain whose documents hold the target length"
        if at_target < 3
        else ""
    )
    elsewhere = run.ledger.running_elsewhere()
    return (
        f"plan: {len(run.methods)} methods; {runs} training runs "
        f"({len(trained)} trained methods x ({len(c.lrs)} rates + {len(c.seeds) - 1} more "
        f"seeds)); {scored} scored models x {tokens:,} tokens of held-out windows each "
        f"(longest {max(max(v) for v in windows.values() if v):,}); {prefills} probe "
        f"prefills"
        + (f" of up to {max(lengths):,} tokens" if lengths else "")
        + (
            f" asking {len(run.distances)} probes per run, "
            f"{sum(d > run.trained_at for d in run.distances)} of them at needle "
            f"distances past {run.trained_at:,} (up to {max(run.distances):,})"
            if run.distances
            else ""
        )
        + "; finished jobs in the folder are reused"
        + (
            f"; raced in {run.rounds.rule.rounds} rounds (at most the above: a method out of "
            "reach stops receiving perplexity and probes; --race off scores every window)"
            if run.rounds is not None
            else ""
        )
        + _estimate(run)
        + (f"; running now in other processes: {', '.join(elsewhere)}" if elsewhere else "")
        + warning
    )


def _estimate(run: Comparison) -> str:
    """The plan's compute estimate in words: for every job, and for the jobs not finished
    yet when the folder holds finished ones (a resumed comparison), then at the pace the
    folder's finished jobs kept (`paces`)."""
    measured_paces = paces(run.ledger, run.job_costs())

    def hours(left: bool, paced: bool = False) -> str:
        parts = run.estimated_seconds(left, paced).items()
        return ", ".join(f"{what} {_duration(t)}" for what, t in parts if t)

    every, left = hours(False), hours(True)
    measured = ", ".join(f"{kind} x{r:.2f} of {n}" for kind, (r, n) in measured_paces.items())
    return (
        f"; estimated compute for every job: {every}"
        + (f"; left (a job in progress counted whole): {left or 'none'}" if left != every else "")
        + f" (rough: FLOPs at the rates of one timed forward of {TIMED_TOKENS} tokens and "
        f"one attention call of {TIMED_ATTENTION})"
        + (
            f"; left at the pace of this folder's finished jobs: {hours(True, True)} "
            f"(their recorded wall time over the estimate, median per kind: {measured}; "
            "a kind with none finished as estimated)"
            if measured_paces and left not in ("", every)
            else ""
        )
    )


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def _folder_config(out: Path, config: CompareConfig, log: Callable[[str], None]) -> dict:
    """The config ``out``'s comparison must have been made with: ``config``'s own, or the
    earlier one when ``config`` only adds to it, methods (every earlier label kept with its
    spec) or held-out domains (every earlier one kept), every other field the same; the rerun
    then scores what was added beside what is finished. Both canonical."""
    current = config.to_dict()
    try:
        recorded = read_record(out / COMPARE_JSON, CompareResult).provenance["config"]
        earlier = CompareConfig.from_dict(recorded)
    except (OSError, ResultError, KeyError, TypeError, ValueError):
        return current  # no comparison there, or not one this can grow: the check says which
    grown = ("methods", "names", "eval_data")
    same = but(recorded, grown) == but(current, grown)
    specs = dict(zip(config.labels, config.methods, strict=True))
    kept = all(specs.get(lb) == m for lb, m in zip(earlier.labels, earlier.methods, strict=True))
    kept = kept and set(earlier.eval_data) <= set(config.eval_data)
    added = [lb for lb in config.labels if lb not in earlier.labels]
    added += [f"domain {d}" for d in config.eval_data if d not in earlier.eval_data]
    if not (same and kept and added):
        return current
    log(f"{out}: {', '.join(added)} added to the comparison there; finished jobs are reused")
    return recorded


def _open(
    config: CompareConfig, out: Path, command: str, log: Callable, progress: bool
) -> Comparison:
    run = Comparison(config, out, command, log, progress)
    # A folder holds one comparison: another config is refused before anything runs (naming
    # the field), so its compare.json and report are never replaced by another's.
    provenance = {"config": _folder_config(out, run.config, log)}
    check_replaceable(out / COMPARE_JSON, "compare", provenance)
    return run


def plan_compare(
    config: CompareConfig, out_dir: str | Path, *, log: Callable[[str], None] = print
) -> str:
    """The plan a run of ``config`` into ``out_dir`` starts with: what it runs, the compute
    estimate for every job and, where the folder holds finished jobs, for what is left. Runs
    and writes nothing, so it may be asked beside a running comparison
    (``ropekit compare --plan-only``); a folder holding another comparison is refused as the
    run would refuse it."""
    return _plan_line(_open(config, Path(out_dir), "", log, False))


def run_compare(
    config: CompareConfig,
    out_dir: str | Path,
    *,
    command: str = "",
    log: Callable[[str], None] = print,
    progress: bool = False,
) -> CompareResult:
    """Run the comparison into ``out_dir`` (module docstring); returns compare.json's record.
    A rerun continues where an earlier run stopped. ``progress``: show each evaluation's
    progress bar (the command line does)."""
    run = _open(config, Path(out_dir), command, log, progress)
    log(_plan_line(run))
    run.write("planned")  # the first pass writes in any case
    said: list[str] = []
    while held := run.sweep():
        # What is left is held by other processes of this comparison (--join): wait for it,
        # or take it over from one that stopped (its lock is then free). Said once per set
        # of held jobs, not at every look (the last job may run for hours).
        if held != said:
            log(
                f"{len(held)} job{'s' * (len(held) != 1)} left, held by other processes of "
                f"this comparison ({held[0]}{', ...' * (len(held) > 1)}): looking again every "
                f"{ledger_module.WAIT_SECONDS:g} s"
            )
            said = held
        time.sleep(ledger_module.WAIT_SECONDS)
    return run.write("done")
