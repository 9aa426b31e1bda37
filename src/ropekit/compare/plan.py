"""What a comparison runs: its methods resolved once, its one list of jobs, and their cost.

``--plan-only``, the run, ``--join``, the plan's cost line and experiment E's prefetch all read
the jobs from here (``jobs``), so what is planned, costed, run and recorded in times.jsonl is
one list of names:

- ``training``  ``train methods/<label>[/lr-<lr>]/s<seed>``: an extension run (a method that
  trains nothing is attached once, at seed 0, and its adapter kept: ``ropekit extend``);
- ``selection`` ``select <label> lr <lr>``: a trained method's candidate rate scored on unseen
  training-split samples at the first seed (only where there are several rates);
- ``perplexity`` ``eval eval/<label>/s<seed>/<domain>``: one run on one held-out domain;
  raced (``CompareConfig.race``), ``eval eval/<label>/s<seed>/<domain>/round-<r>``: round r's
  window (`race_cells`: one span of one domain), planned only for the methods still in the
  race after round r - 1 (`rounds.Rounds`);
- ``probes``    ``probes eval/<label>/s<seed>/probes``: one run's retrieval probes.

A trained method's later seeds run at the rate its selections choose; until they have chosen,
they are planned (and named) at the first rate, after the selections.

The cost model (``CostModel``) prices each job from one timed forward on this machine
(``backbone.cost.forward_seconds``): a training step as three forwards per sample, a
selection's forwards, a perplexity's windows (those read in a longer window's reading cost
nothing, except for an encoding that follows the length) and the probes' prefills (each
haystack read to its longest cut, less the filler it keeps of the one before).

Holds: BASELINE, KINDS, ResolvedMethod, resolve_methods, Job, jobs, race_cells, selection_key,
chosen_rates, ppl_config, CostModel, run_folder, eval_folder, slug.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Generator, Iterator, Mapping, Sequence
from pathlib import Path

from ropekit.backbone import Backbone
from ropekit.encodings import Spec
from ropekit.evals import PerplexityConfig
from ropekit.evals.perplexity import windows_read
from ropekit.results import digest
from ropekit.train.extend import EXTEND_JSON, resolve_method

from .config import CompareConfig

BASELINE = Spec("rope")  # the unmodified model: what a method's cost at L0 is measured against
BASELINE_LABEL = "rope (unmodified)"  # its label where the config does not name it
KINDS = ("training", "selection", "perplexity", "probes")
# The prefix of each kind's job names in times.jsonl, and the file in its folder that holds
# its result once it is finished (a selection's result is its record in times.jsonl).
JOB_PREFIX = {"training": "train", "perplexity": "eval", "probes": "probes"}
RESULT_FILE = {"training": EXTEND_JSON, "perplexity": "ppl.json", "probes": "summary.json"}


@dataclasses.dataclass(frozen=True)
class ResolvedMethod:
    """A method of a comparison, resolved once for its model."""

    label: str
    spec: Spec  # canonical: as extend builds it (CompareConfig.canonical)
    given: str  # the spec as the user wrote it
    trained: bool  # its encoding has parameters to train
    dynamic: bool  # it follows the length: each perplexity window is read alone


def resolve_methods(config: CompareConfig, probe: Backbone) -> tuple[ResolvedMethod, ...]:
    """``config``'s methods as given, each made canonical (``CompareConfig.canonical``) and
    built once for ``probe``'s model, the unmodified model first when the config does not
    name it: a spec that cannot be built stops the comparison here, before any job."""
    canonical = config.canonical(probe.training_length)
    pairs = list(zip(config.labels, canonical.methods, config.methods, strict=True))
    if BASELINE not in canonical.methods:
        pairs.insert(0, (BASELINE_LABEL, BASELINE, BASELINE))
    out = []
    for label, spec, given in pairs:
        extension = config.extension_config(spec, config.seeds[0], config.lrs[0])
        encoding = resolve_method(probe, extension)[0]
        trained = bool(encoding.positional_parameters())
        out.append(ResolvedMethod(label, spec, str(given), trained, encoding.dynamic))
    return tuple(out)


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip("-") or "method"


def run_folder(out: Path, label: str, trained: bool, seed: int, lr: float) -> Path:
    """Where the comparison in ``out`` keeps the extension run of method ``label`` at ``seed``
    (and ``lr``, if it trains): another process may run it there first (``ropekit extend
    --resume`` with ``CompareConfig.extension_config``), and the comparison then reuses it."""
    base = Path(out) / "methods" / slug(label)
    return base / f"lr-{lr:g}" / f"s{seed}" if trained else base / f"s{seed}"


def eval_folder(out: Path, label: str, seed: int, job: str) -> Path:
    """Where method ``label``'s run at ``seed`` is scored: ``job`` a held-out domain, or
    "probes"."""
    return Path(out) / "eval" / slug(label) / f"s{seed}" / slug(job)


@dataclasses.dataclass(frozen=True)
class Job:
    """One job of a comparison: what it is, where its result goes, what it needs first."""

    kind: str  # one of KINDS
    name: str  # its name in times.jsonl
    method: ResolvedMethod
    seed: int
    lr: float  # the rate its run trains at (a method that trains nothing: the first rate)
    folder: Path | None  # where its result is written (None: a selection)
    domain: str | None = None  # perplexity: the held-out domain
    after: tuple[str, ...] = ()  # the jobs whose results it needs
    round: int | None = None  # a raced perplexity: its round
    part: int | None = None  # a raced perplexity: the span of the domain it scores (0-based)

    @property
    def result(self) -> Path | None:
        """The file that holds its result once it is finished (None: a selection)."""
        return None if self.folder is None else self.folder / RESULT_FILE[self.kind]


def _named(kind: str, out: Path, folder: Path) -> str:
    return f"{JOB_PREFIX[kind]} {folder.relative_to(out)}"


def jobs(
    config: CompareConfig,
    out: Path,
    methods: Sequence[ResolvedMethod],
    domains: Mapping[str, tuple[int, ...]],
    chosen: Mapping[str, float],
    probed: bool,
    entrants: Callable[[int], Collection[str] | None] | None = None,
    cells: Sequence[tuple[int, str]] = (),
) -> Iterator[Job]:
    """Every job of the comparison, cheapest stage first (the module docstring): the methods
    that train nothing, attached and scored; the trained ones, their rate chosen, each seed
    trained and scored; then every run's probes (where ``probed``). ``domains``: the lengths
    each held-out domain is scored at (none: not scored there); ``chosen``: each trained
    method's chosen rate, read as the jobs are generated, so a runner that fills it in as
    selections finish gets the later seeds at that rate. A raced comparison (``entrants``:
    the methods in round r, None while undecided) scores its rounds (``cells``: round r + 1
    scores span ``cells[r][0]`` of domain ``cells[r][1]``) after every run (`_raced`), and
    probes only the methods that finished the race."""
    out = Path(out)

    def training(m: ResolvedMethod, seed: int, lr: float, after: tuple[str, ...] = ()) -> Job:
        folder = run_folder(out, m.label, m.trained, seed, lr)
        return Job("training", _named("training", out, folder), m, seed, lr, folder, after=after)

    def scored(m: ResolvedMethod, run: Job) -> Iterator[Job]:
        for domain, lengths in domains.items() if entrants is None else ():
            if lengths:
                folder = eval_folder(out, m.label, run.seed, domain)
                name = _named("perplexity", out, folder)
                after = (run.name, *run.after)
                yield Job("perplexity", name, m, run.seed, run.lr, folder, domain, after)

    runs: dict[str, list[Job]] = {}  # label -> its runs, in seed order
    for m in (m for m in methods if not m.trained):
        run = training(m, 0, config.lrs[0])
        runs[m.label] = [run]
        yield run
        yield from scored(m, run)
    first = config.seeds[0]
    for m in (m for m in methods if m.trained):
        candidates = [training(m, first, lr) for lr in config.lrs]
        selections = []
        for run in candidates:
            yield run
            if len(config.lrs) > 1:
                name = f"select {m.label} lr {run.lr:g}"
                selections.append(Job("selection", name, m, first, run.lr, None, None, (run.name,)))
                yield selections[-1]
        lr = chosen.get(m.label, config.lrs[0])  # read now: the selections have run
        after = tuple(s.name for s in selections)
        runs[m.label] = []
        for seed in config.seeds:
            run = training(m, seed, lr, after)
            if seed != first:
                yield run
            runs[m.label].append(run)
            yield from scored(m, run)
    left: Collection[str] | None = [m.label for m in methods]
    if entrants is not None:
        left = yield from _raced(out, methods, runs, entrants, cells)
    if probed and left is not None:
        for m in (m for m in methods if m.label in left):
            for run in runs[m.label][: len(config.probed_seeds(m.trained))]:
                folder = eval_folder(out, m.label, run.seed, "probes")
                name = _named("probes", out, folder)
                after = (run.name, *run.after)
                yield Job("probes", name, m, run.seed, run.lr, folder, after=after)


def race_cells(spans: int, domains: Sequence[str]) -> tuple[tuple[int, str], ...]:
    """The rounds of a raced comparison: round r + 1 scores ``cells[r]`` = (span, domain), one
    window at N of one domain, span by span and each span over every domain in order. A round
    per window rather than per span: a method that is out is seen so after its first window
    (collapsed, or behind by more than its blocks' error allows), and it stops having cost one
    window of one domain, not one of each (experiment E: 28% of its compute against 50%,
    experiments/smollm2_32k/race.md)."""
    return tuple((span, domain) for span in range(spans) for domain in domains)


def _raced(
    out: Path,
    methods: Sequence[ResolvedMethod],
    runs: Mapping[str, Sequence[Job]],
    entrants: Callable[[int], Collection[str] | None],
    cells: Sequence[tuple[int, str]],
) -> Generator[Job, None, Collection[str] | None]:
    """The perplexity jobs of a raced comparison, round by round: round r's window
    (``cells[r - 1]``) at every run of each method in round r, each after every job of the
    round before (the race decides on all of them); returns the methods that finished the
    race (None: a round is not decided yet, and nothing after it is planned)."""
    before: tuple[str, ...] = ()
    for r, (span, domain) in enumerate(cells, 1):
        scored = entrants(r)
        if scored is None:
            return None
        names = []
        for m in (m for m in methods if m.label in scored):
            for run in runs[m.label]:
                folder = eval_folder(out, m.label, run.seed, domain) / f"round-{r}"
                name, after = _named("perplexity", out, folder), (run.name, *run.after)
                names.append(name)
                yield Job("perplexity", name, m, run.seed, run.lr, folder, domain,
                          (*after, *before), r, span)  # fmt: skip
        before = tuple(names)
    return entrants(len(cells) + 1)


def selection_key(config: CompareConfig, method: ResolvedMethod, lr: float) -> str:
    """What a selection score depends on, digested: the model, the method's canonical spec,
    the first seed's training and the selection samples (the rate is in the job's name), so
    the same method spelled another way finds the same score."""
    c = config
    depends = {
        "model": c.model, "target_length": c.target_length, "spec": str(method.spec),
        "seed": c.seeds[0], "train_data": c.train_data, "samples": c.samples,
        "pose": c.pose, "pose_window": c.pose_window,
        "grad_checkpointing": c.grad_checkpointing,
        "selection_samples": c.selection_samples, "dtype": c.dtype,
    }  # fmt: skip
    return digest({"job": f"select {method.label} lr {lr:g}", "selection": depends})


def chosen_rates(
    config: CompareConfig, methods: Sequence[ResolvedMethod], nll: Callable[[str], float | None]
) -> dict[str, float]:
    """label -> the rate each trained method's selections chose (the lowest selection NLL),
    for the methods whose every candidate has a score (``nll(job name)``, None: not yet)."""
    out = {}
    for m in (m for m in methods if m.trained):
        if len(config.lrs) == 1:
            out[m.label] = config.lrs[0]
            continue
        scores = {lr: nll(f"select {m.label} lr {lr:g}") for lr in config.lrs}
        if all(v is not None for v in scores.values()):
            out[m.label] = min(scores, key=lambda lr: scores[lr])
    return out


def ppl_config(
    config: CompareConfig, lengths: tuple[int, ...], part: int | None = None
) -> PerplexityConfig:
    """The perplexity every model is scored with on a domain held at ``lengths``: the same
    spans x N targets at every length, the same windows for every method; a raced round's
    ``part``, that span of them."""
    return PerplexityConfig(
        lengths, n_tokens=config.spans * config.target_length, seed=config.seed,
        single_documents=config.single_documents, part=part,
    )  # fmt: skip


class CostModel:
    """Seconds each job takes on this machine, from ``forward_seconds(tokens)``."""

    def __init__(
        self,
        config: CompareConfig,
        trained_at: int,
        forward: Callable[[int], float],
        domains: Mapping[str, tuple[int, ...]],
        reads: Mapping[int, Sequence[tuple[int, int]]],
    ) -> None:
        self.config, self.trained_at, self.forward = config, trained_at, forward
        # reads: probe length -> (from, to) tokens of each haystack's prefill
        self.domains, self.reads = domains, reads

    def __call__(self, job: Job) -> float:
        c, seconds = self.config, self.forward
        if job.kind == "training":
            if not job.method.trained:
                return 0.0  # attached: nothing trained
            window = (c.pose_window or self.trained_at) if c.pose else c.target_length
            return c.samples * 3 * seconds(window)
        if job.kind == "selection":
            return c.selection_samples * seconds(c.target_length)
        if job.kind == "perplexity":
            assert job.domain is not None
            ppl = ppl_config(c, self.domains[job.domain], job.part)
            read = windows_read(ppl, not job.method.dynamic)
            return sum(k * seconds(n) for n, k in read.items())
        return sum(  # probes: each haystack read to its longest cut, less what it keeps
            seconds(to) - seconds(start)
            for n in c.retrieval_lengths(self.trained_at)
            for start, to in self.reads[n]
        )
