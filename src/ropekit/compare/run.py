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
over any whose process died. Alone in its folder a comparison ends in one pass. With
``executor="ray"`` the same jobs run as Ray tasks on a cluster (`remote`), the folder on
storage every node reads.

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

Holds: run_compare, plan_compare (and, from ``comparison``, Comparison, RUNNERS, JobCost, paces).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from ropekit.backbone.cost import TIMED_ATTENTION, TIMED_TOKENS
from ropekit.results import ResultError, check_replaceable, read_record

from . import ledger as ledger_module
from . import remote
from .assemble import COMPARE_JSON, but
from .comparison import RUNNERS, Comparison, JobCost, paces
from .config import CompareConfig
from .plan import ppl_config
from .record import CompareResult
from .remote import EXECUTORS, RayOptions

__all__ = ["COMPARE_JSON", "RUNNERS", "Comparison", "JobCost", "paces", "plan_compare",
           "run_compare"]  # fmt: skip


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
    executor: str = "local",
    ray: RayOptions | None = None,
) -> CompareResult:
    """Run the comparison into ``out_dir`` (module docstring); returns compare.json's record.
    A rerun continues where an earlier run stopped. ``progress``: show each evaluation's
    progress bar (the command line does). ``executor``: run the jobs in this process
    (``local``) or as Ray tasks (``ray``, with ``ray``'s options: `remote`)."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor={executor!r} is not allowed; allowed: {', '.join(EXECUTORS)}")
    with remote.cluster() if executor == "ray" else contextlib.nullcontext() as cluster:
        run = _open(config, Path(out_dir), command, log, progress)
        log(_plan_line(run))
        run.write("planned")  # the first pass writes in any case
        if cluster is not None:
            remote.run_on_ray(cluster, run, config, ray or RayOptions(), log)
        else:
            _run_here(run, log)
        return run.write("done")


def _run_here(run: Comparison, log: Callable[[str], None]) -> None:
    """Every job of the plan in this process, then the jobs other processes held."""
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
