"""One comparison in its folder, as the runner holds it: its methods resolved once, its jobs
(`plan.jobs`), its ledger, the runners of each kind of job, and what is finished.

``run`` drives it (in this process, or its jobs as Ray tasks: ``remote``); each worker of a Ray
cluster opens one of its own. Its costs (`JobCost`, `paces`) feed the plan line.

Holds: Comparison, RUNNERS, JobCost, paces.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ropekit.backbone import COMPUTE_DTYPES, Backbone, open_backbone
from ropekit.backbone.cost import forward_seconds
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
from ropekit.evals.probe_haystacks import build_haystack, probe_task
from ropekit.evals.probe_summary import ProbesResult
from ropekit.evals.probes import check_probe_sizes
from ropekit.results import digest
from ropekit.train.extend import extend

from .assemble import Finished, Scores, Setting, engine_answers, write
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
        # probe length -> the tokens each haystack's prefill reads, and the needle distance of
        # every probe a run asks (the plan counts them); probes that do not fit stop it here
        self.reads, self.distances = _probes_fit(self.config, probe, self.trained_at)
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
        return jobs(*args, race.planned if planned else race.entrants, race.cells)

    def _recorded_nll(self, job: str) -> float | None:
        record = self.ledger.records.get(job)
        return None if record is None else record.get("nll")

    def cost_model(self) -> CostModel:
        c, seconds = self.config, self.forward_seconds
        return CostModel(c, self.trained_at, seconds, self.domains, self.reads)

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
        config = ppl_config(self.config, self.domains[job.domain], job.part)
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
) -> tuple[dict[int, tuple[tuple[int, int], ...]], list[int]]:
    """Check the probe sizes and build every haystack now: K needles that do not fit a length
    stop the comparison here (TaskDoesNotFit, a ValueError), not after every method trained.
    Returns, per length, the tokens each haystack's prefill reads, (from, to): from the whole
    chunks of filler it keeps of the haystack before it (0 for the first) to its longest cut
    (a one-needle haystack is read to its one cut, about half the length on average), for
    the plan's estimate; and the needle distance of every probe a run asks, for its plan line."""
    if not config.retrieval_lengths(trained_at):
        return {}, []
    probes, lm = config.probe_config(trained_at), as_language_model(probe)
    check_probe_sizes(probes, lm)
    task, fmt = probe_task(probes.task), PromptFormat(probe.require_tokenizer(), chat=probes.chat)
    reads, distances = {}, []
    for length in probes.lengths:
        hays = [build_haystack(task, fmt, probes, length, h) for h in range(probes.haystacks)]
        kept = shared_chunks(hays[0].prefix, hays[1].prefix, lm.prefill_chunk) if hays[1:] else 0
        reads[length] = tuple(
            (kept if h else 0, max(p.cut for p in hay.probes)) for h, hay in enumerate(hays)
        )
        distances += [p.distance for hay in hays for p in hay.probes]
    return reads, distances
