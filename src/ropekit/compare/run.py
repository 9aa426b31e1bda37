"""``ropekit compare``: the methods of a ``CompareConfig`` trained, scored and judged.

Stages, cheapest first, so an interrupted comparison leaves honest partial results (the
verdict is rewritten after every stage from what is done):

1. every method that trains nothing (fixed schedules, attention-level remaps, searched
   factors) is attached as an extension run (``ropekit extend``: its adapter, exportable) and
   scored on every held-out domain;
2. every trained method: one run per learning rate at the first seed, the rate chosen by the
   mean NLL on ``selection_samples`` unseen samples of the training split (never the held-out
   text the results are measured on), then the other seeds at that rate; each scored;
3. retrieval probes of every method (every seed of a trained one, or its first
   ``probe_seeds``), the longest stage: K
   needles per haystack asked from the cached prefix (``ropekit eval probes``), pooled over
   seeds into one accuracy per length with its Wilson interval, reported beside the rule.

Every piece is a library run with its own provenance (extend, eval ppl, the probes), so a
rerun of the same comparison recomputes nothing, and a change of model, adapter, spec or data
in the same folder is refused rather than served from a cache. The one change a folder takes
is methods or held-out domains added (every earlier label kept with its spec, every earlier
domain kept, every other field the same): the rerun scores what was added and reuses every
finished job, the learning-rate selections too (each keyed by what it depends on: the
method's spec, the training and the rate).

Several processes may run one comparison into one folder (``ropekit compare --join``): each
claims a job before it runs or loads it (`_Comparison.claim`: a ``flock`` per job under
``.jobs/``, dropped by the kernel when its process dies, kill -9 included), leaves a job
another process holds for a later pass (`JobHeld`), and, when only such jobs are left, waits
for them (`WAIT_SECONDS`) and takes over any whose process died. times.jsonl is rewritten
under a lock with every other process's records kept, and the verdict is written by one
process at a time, keeping what the others wrote of the methods it has not read itself
(`_merged`), so every interim report is whole. Alone in its folder a comparison ends in one
pass.

Layout of ``out_dir``:

    compare.json, report.md, report.html, *.png      the verdict, the tables, the figures
    times.jsonl                                       each finished job's wall time, over
                                                      all its attempts; a job begun and not
                                                      finished: when its attempt began; a
                                                      job found finished (copied in): none,
                                                      or a run's own (extend.json's)
    methods/<label>/s<seed>/                          extension runs (adapter/, extend.json)
    methods/<label>/lr-<lr>/s<seed>/                  learning-rate candidates (trained)
    eval/<label>/s<seed>/<domain>/ppl.json            perplexity on one held-out domain (its
                                                      windows inside single documents unless
                                                      single_documents=False)
    eval/<label>/s<seed>/probes/                      retrieval probes (summary.json, one
                                                      folder per length)
    .jobs/                                            the claims of the jobs running now

The plan (``plan_compare``, every run's first line) costs each job from one timed forward,
and for a resumed folder also at the pace its finished jobs kept: their recorded wall time
over the same estimate, the median per kind of job, since one forward's rate moves with the
machine's load.

Holds: run_compare, plan_compare, run_folder, engine_answers, length_entries, JobCost,
JobHeld.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ropekit.backbone import COMPUTE_DTYPES, Backbone, open_backbone
from ropekit.data import heldout_stream, make_train_dataset
from ropekit.data.streams import TokenStream
from ropekit.encodings import PositionEncoding
from ropekit.evals import (
    DocumentsTooShort,
    PerplexityConfig,
    PerplexityResult,
    PromptFormat,
    as_language_model,
    check_single_documents,
    run_perplexity,
    run_probes,
)
from ropekit.evals.adapters import shared_chunks
from ropekit.evals.perplexity import LengthScore, windows_read
from ropekit.evals.probes import (
    NeedleAccuracy,
    ProbesResult,
    build_haystack,
    check_probe_sizes,
    probe_task,
)
from ropekit.outdir import LockHolder, OutDirLocked, hold_lock, holder_of
from ropekit.results import (
    ResultError,
    check_replaceable,
    digest,
    read_record,
    read_records,
    run_metadata,
    write_records,
    write_result,
)
from ropekit.serve.serving import served_by
from ropekit.train.extend import EXTEND_JSON, ExtendResult, extend, resolve_method

from .config import CompareConfig
from .record import (
    CompareResult,
    EngineAnswer,
    JobTime,
    LrSearch,
    Method,
    ProbeSettings,
    Retrieval,
    SeedAccuracy,
    Skipped,
    Stat,
    Stretch,
    SummaryEntry,
    TableEntry,
)
from .report import write_report
from .verdict import mean_std, per_engine, pooled_retrieval, recommend, retrieval_note

COMPARE_JSON = "compare.json"
BASELINE = "rope"  # the unmodified model: what a method's cost at L0 is measured against
# table[label][domain][length]: the per-seed ppl results' rows gathered into one cell
Rows = dict[str, dict[str, dict[int, TableEntry]]]
Scores = dict[str, PerplexityResult]  # domain -> one model's ppl.json there


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip("-") or "method"


def run_folder(out: Path, label: str, trained: bool, seed: int, lr: float) -> Path:
    """Where the comparison in ``out`` keeps the extension run of method ``label`` at ``seed``
    (and ``lr``, if it trains): another process may run it there first (``ropekit extend
    --resume`` with ``CompareConfig.extension_config``), and the comparison then reuses it."""
    base = Path(out) / "methods" / _slug(label)
    return base / f"lr-{lr:g}" / f"s{seed}" if trained else base / f"s{seed}"


class _Comparison:
    """The state of one comparison run: the config, its folder, the jobs' records."""

    def __init__(
        self, config: CompareConfig, out: Path, command: str, log: Callable, progress: bool
    ) -> None:
        self.config, self.out, self.command, self.log = config, out, command, log
        self.progress = progress  # each evaluation's own progress bar (windows, probes)
        probe = open_backbone(config.model)
        self.trained_at = probe.training_length
        methods = list(zip(config.labels, config.methods, strict=True))
        if BASELINE not in config.methods:
            methods.insert(0, ("rope (unmodified)", BASELINE))
        # Each spec as the extension run resolves it (a factor it omits is N / L0: extend's
        # one rule), so a spec that cannot be built stops the comparison here, before any job.
        encodings = {label: self.resolved(probe, spec) for label, spec in methods}
        self.methods = [
            Method(label, spec, bool(encodings[label].positional_parameters()))
            for label, spec in methods
        ]
        # Methods whose perplexity windows are each read alone, none in a longer one's reading
        # (a length-following encoding; Backbone.prefix_nll): for the plan's estimate.
        self.reads_alone = {label for label, e in encodings.items() if e.dynamic}
        self.baseline = next(m.label for m in self.methods if m.spec == BASELINE)
        self.tokenizer = probe.require_tokenizer()
        self.streams: dict[str, TokenStream] = {}  # held-out tokens, made once per domain
        self.fitting: dict[str, tuple[int, ...]] = {}  # lengths each domain's documents hold
        self.skipped: list[Skipped] = []  # the lengths left out, with the reason
        self.times = out / "times.jsonl"  # wall time of each job, kept when a job is reused
        self.records: dict[str, dict[str, Any]] = {}  # finished jobs: {"job", "seconds", ...}
        self.attempts: dict[str, dict[str, Any]] = {}  # jobs begun, not finished (_timed)
        self.changed: set[str] = set()  # jobs whose entry this process changed, not yet written
        for record in read_records(self.times):
            self._place(record)
        # The jobs of this comparison, run or reused: the time table lists only these (the
        # folder may keep records of a stopped run with other methods or domains).
        self.jobs: set[str] = set()
        # Which engines serve each method exactly ({label: {engine: answer}}), from the
        # encoding it was scored with (a trained method's at its first seed).
        self.served: dict[str, dict[str, EngineAnswer]] = {}
        # Tokens a later haystack of each probe length keeps of the one before it (the whole
        # chunks of their shared filler): for the plan's estimate.
        self.kept: dict[int, int] = {}
        self.distances: list[int] = []  # of every probe a run asks (the plan counts them)
        self.check_probes_fit(probe)
        probe.cast(COMPUTE_DTYPES[config.dtype])
        self.forward_seconds = forward_seconds(probe)  # for the plan's estimate
        for domain in config.eval_data:  # an unknown, empty or unreadable domain stops it here
            self.domain_lengths(domain)

    def resolved(self, probe: Backbone, spec: str) -> PositionEncoding:
        c = self.config
        return resolve_method(probe, c.extension_config(spec, c.seeds[0], c.lrs[0]))[0]

    def check_probes_fit(self, probe: Backbone) -> None:
        """Check the probe sizes and build one haystack per probe length now: K needles that
        do not fit a length stop the comparison here (TaskDoesNotFit, a ValueError), not after
        every method trained."""
        if not self.config.retrieval_lengths(self.trained_at):
            return
        config = self.config.probe_config(self.trained_at)
        lm = as_language_model(probe)
        check_probe_sizes(config, lm)
        task, fmt = probe_task(config.task), PromptFormat(self.tokenizer, chat=config.chat)
        for length in config.lengths:
            hays = [build_haystack(task, fmt, config, length, h) for h in range(config.haystacks)]
            if config.haystacks > 1:
                self.kept[length] = shared_chunks(hays[0].prefix, hays[1].prefix, lm.prefill_chunk)
            self.distances += [p.distance for hay in hays for p in hay.probes]

    def plan(self) -> str:
        """What the comparison will run, said before it starts (finished jobs are reused)."""
        c = self.config
        trained = [m for m in self.methods if m.trained]
        runs = len(trained) * (len(c.lrs) + len(c.seeds) - 1)
        scored = len(self.methods) - len(trained) + len(trained) * len(c.seeds)
        windows = {d: self.domain_lengths(d) for d in c.eval_data}
        # every length of a domain scores the same spans x N targets (ppl_config)
        per_length = self.ppl_config((c.target_length,)).n_tokens
        tokens = sum(len(n) for n in windows.values()) * per_length
        lengths = c.retrieval_lengths(self.trained_at)
        probed = len(self.methods) - len(trained) + len(trained) * len(c.probed_seeds(True))
        prefills = probed * c.probe_haystacks * len(lengths)
        at_target = sum(c.spans for n in windows.values() if c.target_length in n)
        warning = (
            f"; warning: {at_target} window{'s' * (at_target != 1)} at {c.target_length}: "
            "a lead is resolved only within their own text (the error then comes from blocks of "
            "positions inside them; 3 paired windows say whether it holds across documents): "
            "raise spans, or add a domain whose documents hold the target length"
            if at_target < 3
            else ""
        )
        return (
            f"plan: {len(self.methods)} methods; {runs} training runs "
            f"({len(trained)} trained methods x ({len(c.lrs)} rates + {len(c.seeds) - 1} more "
            f"seeds)); {scored} scored models x {tokens:,} tokens of held-out windows each "
            f"(longest {max(max(v) for v in windows.values() if v):,}); {prefills} probe "
            f"prefills"
            + (f" of up to {max(lengths):,} tokens" if lengths else "")
            + (
                f" asking {len(self.distances)} probes per run, "
                f"{sum(d > self.trained_at for d in self.distances)} of them at needle "
                f"distances past {self.trained_at:,} (up to {max(self.distances):,})"
                if self.distances
                else ""
            )
            + "; finished jobs in the folder are reused"
            + self.estimate()
            + self.running_elsewhere()
            + warning
        )

    def running_elsewhere(self) -> str:
        """The jobs other live processes of this comparison hold now (``--join``), from their
        claims' records, read without taking them (so the plan stays read-only)."""
        claims = sorted((self.out / CLAIMS).glob("*.lock")) if (self.out / CLAIMS).is_dir() else []
        holders = [h for h in map(holder_of, claims) if h is not None and h.command]
        jobs = [h.command for h in holders if h.pid != os.getpid() and h.alive() is not False]
        return f"; running now in other processes: {', '.join(jobs)}" if jobs else ""

    def estimate(self) -> str:
        """The plan's compute estimate (`job_costs`), in words: for every job, and for the jobs
        not finished yet when the folder holds finished ones (a resumed comparison), then at
        the pace the folder's finished jobs kept (`paces`)."""
        jobs = self.job_costs()
        paces = self.paces(jobs)

        def hours(left: bool, paced: bool = False) -> str:
            parts = _totals(jobs, left, paces if paced else None).items()
            return ", ".join(f"{what} {_duration(t)}" for what, t in parts if t)

        every, left = hours(False), hours(True)
        measured = ", ".join(f"{kind} x{r:.2f} of {n}" for kind, (r, n) in paces.items())
        return (
            f"; estimated compute for every job: {every}"
            + (
                f"; left (a job in progress counted whole): {left or 'none'}"
                if left != every
                else ""
            )
            + f" (rough: FLOPs at the rates of one timed forward of {TIMED_TOKENS} tokens and "
            f"one attention call of {TIMED_ATTENTION})"
            + (
                f"; left at the pace of this folder's finished jobs: {hours(True, True)} "
                f"(their recorded wall time over the estimate, median per kind: {measured}; "
                "a kind with none finished as estimated)"
                if paces and left not in ("", every)
                else ""
            )
        )

    def estimated_seconds(self, left: bool = False, paced: bool = False) -> dict[str, float]:
        """Seconds of training, rate selection, perplexity and probes (`job_costs`): of every
        job, or with ``left`` of those whose result is not in the folder yet; with ``paced``
        each kind scaled by its measured pace (`paces`), where the folder has one."""
        jobs = self.job_costs()
        return _totals(jobs, left, self.paces(jobs) if paced else None)

    def paces(self, jobs: list[JobCost]) -> dict[str, tuple[float, int]]:
        """kind -> (median over the finished jobs of that kind that times.jsonl holds of
        their recorded wall seconds over their estimate, how many). The estimate rests on one
        timed forward and so moves with the machine's load at that moment; a finished job's
        record is what the work took here, pauses and a busy machine included. The median,
        so that a few records that are off (a job recorded before resumed jobs counted their
        earlier attempts, a job that waited out a pause) move it little."""
        ratios: dict[str, list[float]] = {}
        for job in jobs:
            record = self.records.get(job.job)
            if job.finished and record is not None and job.seconds > 0:
                ratios.setdefault(job.kind, []).append(record["seconds"] / job.seconds)
        return {kind: (statistics.median(r), len(r)) for kind, r in ratios.items()}

    def job_costs(self) -> list[JobCost]:
        """Every job of the comparison (`JobCost`), each costed
        at ``forward_seconds``: a training run (a step's forward and backward as three
        forwards per sample), a rate's selection forwards, a model's perplexity on one domain
        and its probes. Windows read in a longer one's reading (`windows_read`) and the filler
        a later haystack keeps (``kept``) cost nothing (the last partial chunk each reads
        apart is left out). Finished: the job's result is in the folder (extend.json, the
        selection's record in times.jsonl, ppl.json, the probes' summary.json); a trained
        method's later seeds count as finished at whichever rate holds them, and are named
        at the first rate until one does."""
        c, seconds = self.config, self.forward_seconds
        window = (c.pose_window or self.trained_at) if c.pose else c.target_length
        run_seconds = c.samples * 3 * seconds(window)
        ppl = {  # domain -> (seconds with shared readings, seconds with every window alone)
            d: tuple(
                sum(k * seconds(n) for n, k in windows_read(self.ppl_config(lengths), s).items())
                for s in (True, False)
            )
            for d in c.eval_data
            if (lengths := self.domain_lengths(d))
        }
        probe_seconds = sum(
            seconds(n) + (c.probe_haystacks - 1) * (seconds(n) - seconds(self.kept.get(n, 0)))
            for n in c.retrieval_lengths(self.trained_at)
        )
        jobs = []

        def job(kind: str, seconds: float, folder: Path) -> None:
            finished = (folder / RESULT_FILE[kind]).is_file()
            jobs.append(JobCost(kind, self.job_name(kind, folder), seconds, finished))

        for m in self.methods:
            seeds = c.seeds if m.trained else (0,)  # `free` scores at seed 0
            if m.trained:
                for lr in c.lrs:  # every rate at the first seed, then the chosen rate
                    job("training", run_seconds, self.run_folder(m, c.seeds[0], lr))
                    if len(c.lrs) > 1:
                        name = f"select {m.label} lr {lr:g}"
                        seconds_ = c.selection_samples * seconds(c.target_length)
                        jobs.append(JobCost("selection", name, seconds_, name in self.records))
                for seed in seeds[1:]:
                    folders = [self.run_folder(m, seed, lr) for lr in c.lrs]
                    done = [f for f in folders if (f / RESULT_FILE["training"]).is_file()]
                    job("training", run_seconds, (done or folders)[0])
            for seed in seeds:
                for domain, both in ppl.items():
                    job(
                        "perplexity",
                        both[m.label in self.reads_alone],
                        self.eval_folder(m, seed, domain),
                    )
            for seed in c.probed_seeds(m.trained) if probe_seconds else ():
                job("probes", probe_seconds, self.eval_folder(m, seed, "probes"))
        return jobs

    # ------------------------------------------------------------------ jobs
    def _timed(
        self, job: str, fn: Callable[[], Any], folder: Path | None = None, result: str = ""
    ) -> Any:
        """Run ``fn`` as ``job`` and record its wall time in times.jsonl once it finishes. A
        job stopped part way (a kill, a session's end: a 32k evaluation spans several) is
        recorded as begun (``started``, wall clock), and when it is resumed its earlier
        attempts count up to the last file each wrote in ``folder`` (its window caches,
        probe answers or checkpoints): the work after that is lost, done again and counted
        then. Without this a resumed job recorded only its last attempt. A stop that Python
        sees (SIGTERM, Ctrl-C) settles the attempt's time there and then (``started`` None),
        so a later copy of the folder that does not keep the files' times cannot lengthen it;
        a kill -9 leaves it to the files' times.

        A job whose ``result`` file is in ``folder`` with no record of it here, finished or
        begun, was computed elsewhere (copied in, or run ahead into the folder): it is
        loaded and gets no record, since the second the loading takes is not its time."""
        with self.claim(job):
            finished = job in self.records
            unknown = not finished and job not in self.attempts
            if unknown and folder is not None and result and (folder / result).is_file():
                value = fn()  # computed elsewhere: loaded
                self.jobs.add(job)
                return value
            if not finished:
                earlier = self._earlier_seconds(job, folder)
                self._set(job, {"job": job, "started": time.time(), "earlier": earlier})
            start = time.perf_counter()
            try:
                value = fn()
            except BaseException:
                if not finished:
                    settled = self._earlier_seconds(job, folder)
                    self._set(job, {"job": job, "started": None, "earlier": settled})
                raise
            self.jobs.add(job)
            if not finished:
                self._set(job, {"job": job, "seconds": earlier + time.perf_counter() - start})
            return value

    def _earlier_seconds(self, job: str, folder: Path | None) -> float:
        """Wall seconds of ``job``'s earlier attempts, each up to the last file it wrote in
        ``folder`` (0 for a job never begun, or begun with no file written since); an attempt
        settled when it stopped counts as settled."""
        attempt = self.attempts.get(job)
        if attempt is None:
            return 0.0
        if attempt["started"] is None:  # settled when it stopped
            return attempt["earlier"]
        files = folder.rglob("*") if folder is not None and folder.is_dir() else ()
        last = max((f.stat().st_mtime for f in files if f.is_file()), default=0.0)
        return attempt["earlier"] + max(0.0, last - attempt["started"])

    @contextlib.contextmanager
    def claim(self, job: str) -> Iterator[None]:
        """Hold ``job`` for this process while it runs or loads it: several processes may run
        one comparison in one folder (``ropekit compare --join``), and each takes only the
        jobs no other holds. A job another live process holds raises `JobHeld`; a job held
        by a process that died is free (the kernel drops its lock; `ropekit.outdir`). Inside,
        the records are the folder's as of the claim (`_sync_times`), so a job another
        process finished meanwhile is found finished. A process may claim a job it holds."""
        try:
            lock = hold_lock(self._claims(f"{_slug(job)}.lock"), command=job)
        except OutDirLocked as e:
            raise JobHeld((job,), e.holder) from None
        with lock:
            self._sync_times()
            yield

    @contextlib.contextmanager
    def _waiting(self, name: str) -> Iterator[None]:
        """The folder-wide lock ``name`` (a few milliseconds of writing), waited for."""
        while True:
            try:
                lock = hold_lock(self._claims(name))
                break
            except OutDirLocked:
                time.sleep(0.05)
        with lock:
            yield

    def _set(self, job: str, entry: dict[str, Any]) -> None:
        """Record ``job`` as finished ({"job", "seconds", ...}) or begun ("started") and write
        times.jsonl; the entry is this process's until then (`_sync_times`)."""
        self._place(entry)
        self.changed.add(job)
        self._write_times()

    def _place(self, entry: dict[str, Any]) -> None:
        """``entry`` as its job's one record: begun ("started") or finished."""
        begun = "started" in entry
        (self.records if begun else self.attempts).pop(entry["job"], None)
        (self.attempts if begun else self.records)[entry["job"]] = entry

    def _claims(self, name: str) -> Path:
        """The lock file ``name`` in the folder's claims (`claim`), its folder made."""
        (self.out / CLAIMS).mkdir(parents=True, exist_ok=True)
        return self.out / CLAIMS / name

    def _sync_times(self, write: bool = False) -> None:
        """Take into this process's records what times.jsonl now says of every job it has
        not changed since it last wrote (the other processes' jobs); with ``write``, then
        write them all back, this process's changes with the others', under the folder's
        lock, so no process's record is lost to another's write. The records keep the file's
        order (a job finished since, at its attempt's place: after every finished one), so
        processes writing in turn list the jobs in the order they finished."""
        with self._waiting("times.lock"):
            on_file = read_records(self.times)
            for record in on_file:
                if record["job"] not in self.changed:
                    self._place(record)
            place = {r["job"]: i for i, r in enumerate(on_file)}

            def in_file_order(records: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
                return dict(sorted(records.items(), key=lambda jr: place.get(jr[0], len(place))))

            self.records, self.attempts = map(in_file_order, (self.records, self.attempts))
            if write:
                write_records(self.times, [*self.records.values(), *self.attempts.values()])
                self.changed.clear()

    def _write_times(self) -> None:
        self._sync_times(write=True)

    def job_name(self, kind: str, folder: Path) -> str:
        """A training run's, a perplexity's or a probes' job name in times.jsonl: the kind's
        prefix and its folder."""
        return f"{JOB_PREFIX[kind]} {folder.relative_to(self.out)}"

    def eval_folder(self, method: Method, seed: int, job: str) -> Path:
        """Where ``method``'s run at ``seed`` is scored: ``job`` a held-out domain, or
        "probes"."""
        return self.out / "eval" / _slug(method.label) / f"s{seed}" / _slug(job)

    def run_folder(self, method: Method, seed: int, lr: float) -> Path:
        """Where ``method``'s extension run at ``seed`` (and ``lr``, if it trains) lives."""
        return run_folder(self.out, method.label, method.trained, seed, lr)

    def extension(self, method: Method, seed: int, lr: float, folder: Path) -> Backbone:
        """The model with ``method`` attached (trained at ``seed`` and ``lr`` if it trains)."""
        c = self.config
        backbone = open_backbone(c.model)
        config = c.extension_config(method.spec, seed, lr)

        def run() -> ExtendResult:
            return extend(backbone, config, folder, resume=True, command=self.command, log=self.log)

        job = self.job_name("training", folder)
        with self.claim(job):
            result = self._timed(job, run, folder, RESULT_FILE["training"])
            # A run that finished before the comparison reached it (trained ahead into its
            # folder, as experiment E's prefetch does) is loaded, not trained: its time is the
            # run's own (extend.json's). A run the comparison trained records at least the
            # run's own time (the whole call, every attempt), so the larger of the two is the
            # run's either way; a load recorded as the run's time before this rule is mended
            # when it is next reached.
            if result.elapsed_s > self.records.get(job, {}).get("seconds", 0.0):
                self._set(job, {"job": job, "seconds": result.elapsed_s})
        backbone.cast(COMPUTE_DTYPES[c.dtype])  # trained in float32, scored in the config's dtype
        return backbone

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

    def ppl_config(self, lengths: tuple[int, ...]) -> PerplexityConfig:
        c = self.config
        return PerplexityConfig(
            lengths, n_tokens=c.spans * c.target_length, seed=c.seed,
            single_documents=c.single_documents,
        )  # fmt: skip

    def domain_lengths(self, domain: str) -> tuple[int, ...]:
        """The perplexity lengths ``domain`` is scored at: all of them, or with single
        documents those its documents can hold (the longest dropped first, since a span is
        lcm(lengths) tokens), each dropped length recorded for the report. The same for
        every method (one tokenizer), so every method is scored on the same windows."""
        if domain not in self.fitting:
            if domain not in self.streams:
                split = self.config.heldout_split(domain)
                self.streams[domain] = heldout_stream(domain, self.tokenizer, split=split)
            lengths = self.config.eval_lengths(self.trained_at)
            while self.config.single_documents and lengths:
                try:
                    check_single_documents(
                        self.streams[domain], self.tokenizer, self.ppl_config(lengths)
                    )
                    break
                except DocumentsTooShort as e:
                    self.skipped.append(Skipped(domain, lengths[-1], e.span, e.capacity, e.count))
                    lengths = lengths[:-1]
            self.fitting[domain] = lengths
        return self.fitting[domain]

    def evaluate(self, method: Method, seed: int, backbone: Backbone) -> Scores:
        """Perplexity of the model on every held-out domain that holds a length:
        {domain: ppl.json's record}."""
        out, held = {}, []
        for domain in self.config.eval_data:
            lengths = self.domain_lengths(domain)
            if not lengths:
                continue
            folder = self.eval_folder(method, seed, domain)
            config = self.ppl_config(lengths)

            def score(
                folder: Path = folder, domain: str = domain, config: PerplexityConfig = config
            ) -> PerplexityResult:
                return run_perplexity(
                    backbone, config, folder, data=domain,
                    stream=self.streams[domain], spec=method.spec, command=self.command,
                    progress=self.progress,
                ).result  # fmt: skip

            job = self.job_name("perplexity", folder)
            with _unless_held(held):
                out[domain] = self._timed(job, score, folder, RESULT_FILE["perplexity"])
        _raise_held(held)  # every domain another process does not hold is scored first
        return out

    # ------------------------------------------------------------------ stages
    def sweep(self, results: dict, searches: dict[str, LrSearch], probes: dict) -> list[str]:
        """One pass over the stages (module docstring), filling in what ``results``,
        ``searches`` and ``probes`` lack and writing the verdict after each stage that added
        to them; returns the jobs other processes held (`JobHeld`), left for a later pass.
        Alone in its folder a comparison ends in one pass."""
        held: list[str] = []
        before = len(results) if results else -1  # the first pass writes in any case
        for method in (m for m in self.methods if not m.trained and m.label not in results):
            with _unless_held(held):
                results[method.label] = {0: self.untrained(method)}
        if len(results) > before:
            self.write(results, searches, probes, "untrained methods scored")
        for method in (m for m in self.methods if m.trained and m.label not in results):
            with _unless_held(held):
                results[method.label], searches[method.label] = self.trained(method)
                self.write(results, searches, probes, f"{method.label} trained and scored")
        if self.config.retrieval_lengths(self.trained_at):
            for method in (m for m in self.methods if m.label not in probes):
                if method.trained and method.label not in searches:
                    continue  # its rate is not chosen yet: held above
                lr = searches[method.label].chosen if method.trained else self.config.lrs[0]
                with _unless_held(held):
                    self.log(f"{method.label}: retrieval probes")
                    probes[method.label] = self.retrieval(method, lr)
                    self.write(results, searches, probes, f"{method.label} probed")
        return held

    def untrained(self, method: Method) -> dict[str, PerplexityResult]:
        lr = self.config.lrs[0]
        self.log(f"{method.label}: attached as {method.spec}, scoring")
        backbone = self.extension(method, 0, lr, self.run_folder(method, 0, lr))
        self.served[method.label] = engine_answers(backbone, self.config.target_length)
        return self.evaluate(method, 0, backbone)

    def trained(self, method: Method) -> tuple[dict[int, Scores], LrSearch]:
        c = self.config
        first = c.seeds[0]
        candidates, held = {}, []
        for lr in c.lrs:
            with _unless_held(held):
                self.log(f"{method.label}: training at lr {lr:g}, seed {first}")
                backbone = self.extension(method, first, lr, self.run_folder(method, first, lr))
                if len(c.lrs) > 1:
                    job = f"select {method.label} lr {lr:g}"
                    candidates[lr] = self._selected(
                        job, method, lambda b=backbone: self.selection_nll(b, first)
                    )
        _raise_held(held)  # the rate is chosen from every candidate
        lr = min(candidates, key=candidates.get) if candidates else c.lrs[0]
        search = LrSearch(tuple(c.lrs), candidates, lr)
        results = {}
        for seed in c.seeds:
            with _unless_held(held):
                self.log(f"{method.label}: seed {seed} at lr {lr:g}, scoring")
                backbone = self.extension(method, seed, lr, self.run_folder(method, seed, lr))
                if seed == first:
                    self.served[method.label] = engine_answers(backbone, c.target_length)
                results[seed] = self.evaluate(method, seed, backbone)
        _raise_held(held)  # a method enters the table with every seed, or not yet
        return results, search

    def retrieval(self, method: Method, lr: float) -> dict[int, ProbesResult]:
        """Probe summaries of ``method`` at every seed it was scored at: {seed: summary}.
        Each run probes into its own folder with the probes module's provenance, so a rerun
        reuses its answers and other probe settings or another model there are refused."""
        c = self.config
        config = c.probe_config(self.trained_at)
        out, held = {}, []
        for seed in c.probed_seeds(method.trained):
            folder = self.eval_folder(method, seed, "probes")
            with _unless_held(held):
                backbone = self.extension(method, seed, lr, self.run_folder(method, seed, lr))

                def probe(backbone: Backbone = backbone, folder: Path = folder) -> ProbesResult:
                    return run_probes(
                        backbone, config, folder, spec=method.spec, command=self.command,
                        progress=self.progress,
                    )  # fmt: skip

                job = self.job_name("probes", folder)
                out[seed] = self._timed(job, probe, folder, RESULT_FILE["probes"])
        _raise_held(held)
        return out

    def _selected(self, job: str, method: Method, fn: Callable[[], float]) -> float:
        """A selection score, computed once (its record keeps it with what it depends on:
        the model, the method's spec, the first seed's training and the selection samples;
        the rate is in ``job``). Records made before this key (whose key digested the whole
        config) are still found, and rekeyed."""
        c = self.config
        depends = {
            "model": c.model, "target_length": c.target_length, "spec": method.spec,
            "seed": c.seeds[0], "train_data": c.train_data, "samples": c.samples,
            "pose": c.pose, "pose_window": c.pose_window,
            "grad_checkpointing": c.grad_checkpointing,
            "selection_samples": c.selection_samples, "dtype": c.dtype,
        }  # fmt: skip
        key = digest({"job": job, "selection": depends})
        earlier = digest({"job": job, "config": c.to_dict()})
        with self.claim(job):
            for record in list(self.records.values()):
                if record.get("key") in (key, earlier):
                    self.jobs.add(record["job"])
                    if record["key"] != key:
                        self._set(record["job"], {**record, "key": key})
                    return record["nll"]
            value = self._timed(job, fn)
            self._set(job, {**self.records[job], "key": key, "nll": value})
            return value

    # ------------------------------------------------------------------ the verdict
    def table(self, results: dict[str, dict[int, Scores]]) -> Rows:
        """table[label][domain][length]: per-seed ppl, NLL, last-quarter windows and their
        blocks, and binned NLL-vs-position curve."""
        table: Rows = {}
        for label, by_seed in results.items():
            table[label] = {}
            for domain in (d for d in self.config.eval_data if d in by_seed[min(by_seed)]):
                table[label][domain] = length_entries([by_seed[s][domain] for s in sorted(by_seed)])
        return table

    def held_out(self, results: dict[str, dict[int, Scores]]) -> dict[str, tuple]:
        """domain -> the held-out text its windows were cut from: the single-document spans,
        or the stretch of the documents joined end to end (every method scores the same
        windows, so the first scored result says it)."""
        out: dict[str, tuple[Stretch, ...]] = {}
        for domain in self.config.eval_data:
            scored = (r for by_seed in results.values() for r in by_seed.values())
            result = next((r[domain] for r in scored if domain in r), None)
            if result is None:
                continue
            if result.spans is not None:  # a single-document run names its spans
                out[domain] = tuple(Stretch(s.document, s.offset, s.tokens) for s in result.spans)
            elif result.start is not None:
                out[domain] = _stretch(self.streams[domain], result.start, result.config.n_tokens)
        return out

    def write(
        self, results: dict, searches: dict[str, LrSearch], probes: dict, stage: str
    ) -> CompareResult:
        """Write compare.json and the report from what this process holds, with what other
        processes of this comparison (``--join``) finished and wrote in it before (`_merged`):
        each process reads only the jobs it ran or loaded itself, so without this a process's
        interim report drops the others' methods (experiment E's 19:40 report lacked STRING's
        perplexity and the unmodified model's probes)."""
        c = self.config
        with self._waiting("write.lock"):  # one process at a time reads and writes the verdict
            mine = _Written(
                self.table(results), dict(searches), _retrieval(probes), dict(self.served),
                self.held_out(results), set(self.jobs),
            )  # fmt: skip
            written = _merged(self._previous(), mine, self.methods)
            table = written.table
            verdict = (
                recommend(
                    table,
                    [m.label for m in self.methods if m.label in table],
                    self.baseline,
                    self.trained_at,
                    c.target_length,
                    c.margin,
                    min_difference=c.min_difference,
                    trained=[m.label for m in self.methods if m.trained],
                )
                if self.baseline in table
                else None
            )
            if verdict is not None:  # supporting numbers beside the rule, never part of it
                verdict = dataclasses.replace(
                    verdict,
                    retrieval=retrieval_note(written.retrieval, verdict),
                    serving=per_engine(verdict, written.served),
                )
            lengths = c.retrieval_lengths(self.trained_at)
            settings = ProbeSettings(
                tuple(lengths), c.probe_needles, c.probe_haystacks, c.probe_task,
                c.probe_needles * c.probe_haystacks,
            ) if lengths else None  # fmt: skip
            self._sync_times()  # the jobs the others finished, with their times
            times = (JobTime(**r) for r in self.records.values() if r["job"] in written.jobs)
            record = CompareResult(
                meta=run_metadata(self.command, seed=c.seed), provenance={"config": c.to_dict()},
                stage=stage, trained_at=self.trained_at, target_length=c.target_length,
                lengths=tuple(c.eval_lengths(self.trained_at)), domains=tuple(c.eval_data),
                single_documents=c.single_documents, skipped=tuple(self.skipped),
                held_out=written.held_out, methods=tuple(self.methods),
                baseline=self.baseline, table=table, summary=_summary(table),
                lr_search=written.lr_search, verdict=verdict, retrieval=written.retrieval,
                probes=settings, served=written.served, times=tuple(times), config=c.to_dict(),
            )  # fmt: skip
            write_result(self.out / COMPARE_JSON, "compare", record)
            write_report(record, self.out)
        return record

    def _previous(self) -> CompareResult | None:
        """compare.json as a process of this comparison last wrote it: None when there is
        none, or it is unreadable, or of other settings (methods aside: a comparison may have
        gained methods since)."""
        try:
            data = read_record(self.out / COMPARE_JSON, CompareResult)
        except (OSError, ResultError):
            return None
        methods = ("methods", "names")  # added methods keep the others; added domains do not
        return data if _but(data.config, methods) == _but(self.config.to_dict(), methods) else None


def _but(config: dict[str, Any], fields: Collection[str]) -> dict[str, Any]:
    """A comparison's config (``to_dict``) without ``fields``: what must stay the same when
    those may change."""
    return {k: v for k, v in config.items() if k not in fields}


class _Written(NamedTuple):
    """What a compare.json holds per method: the table, the rate searches, the retrieval,
    the engines' answers, the held-out text per domain, and the jobs timed."""

    table: Rows
    lr_search: dict[str, LrSearch]
    retrieval: dict[str, dict[int, Retrieval]]
    served: dict[str, dict[str, EngineAnswer]]
    held_out: dict[str, tuple[Stretch, ...]]
    jobs: set[str]


def _merged(previous: CompareResult | None, mine: _Written, methods: Sequence[Method]) -> _Written:
    """``mine`` with what ``previous`` holds of the methods it lacks, where ``previous`` is
    of the same comparison and scored that method as the same spec (a method this process
    holds is its own: its results were read from the files just now). In the methods'
    order."""
    if previous is None:
        return mine
    same = {m.label for m in previous.methods if m in methods}

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


class JobCost(NamedTuple):
    """One job of a comparison as the plan costs it (`_Comparison.job_costs`)."""

    kind: str  # training, selection, perplexity or probes
    job: str  # its name in times.jsonl
    seconds: float  # estimated (forward_seconds)
    finished: bool  # its result is in the folder


class JobHeld(Exception):
    """Jobs another live process of the same comparison holds (``ropekit compare --join``):
    this process leaves them, takes the next jobs, and waits for these at the end."""

    def __init__(self, jobs: tuple[str, ...], holder: LockHolder | None = None) -> None:
        super().__init__(", ".join(jobs))
        self.jobs, self.holder = jobs, holder


@contextlib.contextmanager
def _unless_held(held: list[str]) -> Iterator[None]:
    """Run the block; a `JobHeld` raised in it adds its jobs to ``held`` instead, so the
    jobs after the block still run."""
    try:
        yield
    except JobHeld as e:
        held.extend(e.jobs)


def _raise_held(held: list[str]) -> None:
    if held:
        raise JobHeld(tuple(held))


# Where the processes of one comparison claim its jobs (`_Comparison.claim`); how long one
# that has nothing left but jobs another holds waits before it looks again.
CLAIMS, WAIT_SECONDS = ".jobs", 60.0
# The prefix of each kind's job names in times.jsonl (`_Comparison.job_name`; a selection's
# name is "select {label} lr {lr}"), and the file in its folder that holds its result once
# it is finished.
JOB_PREFIX = {"training": "train", "perplexity": "eval", "probes": "probes"}
RESULT_FILE = {"training": EXTEND_JSON, "perplexity": "ppl.json", "probes": "summary.json"}


# The forward a comparison times before it starts, to estimate what it will take (plan), and
# the length of the attention call timed beside it (long enough that its T^2 term dominates).
TIMED_TOKENS, TIMED_ATTENTION = 1024, 4096


def forward_seconds(backbone: Backbone) -> Callable[[int], float]:
    """A rough cost model of one forward over T tokens on this machine: 2 FLOPs per weight per
    token at the rate of one timed forward of ``TIMED_TOKENS`` tokens (at most L0), plus
    causal attention's 2 x heads x head_dim x T^2 per layer at the rate of one timed causal
    attention call of ``TIMED_ATTENTION`` tokens (attention runs slower per FLOP here)."""
    shape = backbone.fingerprint()
    weights = sum(p.numel() for p in backbone.backbone_parameters().values())
    heads, dim = shape.get("n_heads", 1), shape.get("head_dim", 1)
    attention = shape.get("n_layers", 0) * 2 * heads * dim  # x T^2

    def timed(fn: Callable[[], Any]) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            fn()
            return max(time.perf_counter() - start, 1e-9)

    g = torch.Generator().manual_seed(0)
    dtype = next(iter(backbone.backbone_parameters().values())).dtype
    q, k = (torch.randn(1, h, TIMED_ATTENTION, dim, generator=g).to(dtype) for h in (heads, 1))
    attention_rate = (
        2
        * heads
        * dim
        * TIMED_ATTENTION**2
        / timed(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
    )
    n = min(TIMED_TOKENS, backbone.training_length)
    ids = torch.randint(0, backbone.vocab_size, (1, n), generator=g)
    timed(lambda: backbone.forward_logits(ids[:, :16]))  # compiled kernels warm up untimed
    whole = timed(lambda: backbone.forward_logits(ids))
    rest = max(whole - attention * n**2 / attention_rate, whole / 10)  # the weights' share
    weight_rate = 2.0 * weights * n / rest
    return lambda tokens: (
        2.0 * weights * tokens / weight_rate + attention * tokens**2 / attention_rate
    )


def _totals(
    jobs: list[JobCost], left: bool, paces: dict[str, tuple[float, int]] | None = None
) -> dict[str, float]:
    """Seconds per kind of job (`_Comparison.job_costs`), of every job or of those left, each
    kind scaled by its pace (`_Comparison.paces`) where ``paces`` has one."""
    out = dict.fromkeys(("training", "selection", "perplexity", "probes"), 0.0)
    for job in jobs:
        if not (left and job.finished):
            out[job.kind] += job.seconds * (paces or {}).get(job.kind, (1.0, 0))[0]
    return out


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


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
    """The fields ``entry`` shares with every needle accuracy (a probes summary's by_length
    entry carries its stage's own fields beside them)."""
    return {f.name: getattr(entry, f.name) for f in dataclasses.fields(NeedleAccuracy)}


def _retrieval(probes: dict[str, dict[int, ProbesResult]]) -> dict[str, dict[int, Retrieval]]:
    """label -> length -> accuracy pooled over the seeds' probes (correct and n summed, one
    Wilson interval), with each seed's own entry beside it."""
    out = {}
    for label, by_seed in probes.items():
        by_length: dict[int, list[SeedAccuracy]] = {}
        for seed in sorted(by_seed):
            for e in by_seed[seed].by_length:
                by_length.setdefault(e.length, []).append(
                    SeedAccuracy(**_needle_accuracy(e), length=e.length, seed=seed)
                )
        out[label] = {n: pooled_retrieval(es) for n, es in sorted(by_length.items())}
    return out


def _folder_config(out: Path, config: CompareConfig, log: Callable[[str], None]) -> dict:
    """The config ``out``'s comparison must have been made with: ``config``'s own, or the
    earlier one when ``config`` only adds to it, methods (every earlier label kept with its
    spec) or held-out domains (every earlier one kept), every other field the same; the rerun
    then scores what was added beside what is finished."""
    current = config.to_dict()
    try:
        recorded = read_record(out / COMPARE_JSON, CompareResult).provenance["config"]
        earlier = CompareConfig(**recorded)
    except (OSError, ResultError, KeyError, TypeError, ValueError):
        return current  # no comparison there, or not one this can grow: the check says which
    grown = ("methods", "names", "eval_data")
    same = _but(recorded, grown) == _but(current, grown)
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
) -> _Comparison:
    # A folder holds one comparison: another config is refused before anything runs (naming
    # the field), so its compare.json and report are never replaced by another's.
    check_replaceable(out / COMPARE_JSON, "compare", {"config": _folder_config(out, config, log)})
    return _Comparison(config, out, command, log, progress)


def plan_compare(
    config: CompareConfig, out_dir: str | Path, *, log: Callable[[str], None] = print
) -> str:
    """The plan a run of ``config`` into ``out_dir`` starts with: what it runs, the compute
    estimate for every job and, where the folder holds finished jobs, for what is left. Runs
    and writes nothing, so it may be asked beside a running comparison
    (``ropekit compare --plan-only``); a folder holding another comparison is refused as the
    run would refuse it."""
    return _open(config, Path(out_dir), "", log, False).plan()


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
    log(run.plan())
    results: dict[str, dict[int, Scores]] = {}
    searches: dict[str, LrSearch] = {}
    probes: dict[str, Any] = {}
    said: list[str] = []
    while held := run.sweep(results, searches, probes):
        # What is left is held by other processes of this comparison (--join): wait for it,
        # or take it over from one that stopped (its lock is then free). Said once per set
        # of held jobs, not at every look (the last job may run for hours).
        if held != said:
            log(
                f"{len(held)} job{'s' * (len(held) != 1)} left, held by other processes of "
                f"this comparison ({held[0]}{', ...' * (len(held) > 1)}): looking again every "
                f"{WAIT_SECONDS:g} s"
            )
            said = held
        time.sleep(WAIT_SECONDS)
    return run.write(results, searches, probes, "done")
