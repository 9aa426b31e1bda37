"""Experiment D, training-free rows: the attention-level remaps (ReRoPE, Leaky ReRoPE,
Self-Extend, DCA, STRING), the mixed window and LongRoPE-searched factors on SmolLM2-135M
taken from 8,192 to 16,384 tokens, on the held-out span experiment D scores (the same windows:
its rows and these compare), with the wall time and peak memory of every evaluation.

Every method runs through the command line as a user runs it, one process per stage, so the
peak memory of a stage is that process's (its maximum resident set, from ``wait4``):
``ropekit extend`` attaches the spec (nothing trains) and writes its adapter, ``ropekit eval
ppl`` scores experiment D's span (2k, 8k, 16k; whole window and last quarter), ``ropekit eval
probes`` asks each task's needles per haystack at 8k and 16k (one prefill per haystack, every
key asked from its cached prefix). The unmodified model, untuned YaRN and
dynamic NTK are rerun the same way: their
perplexities must equal experiment D's committed ones (the same windows), which checks that the
rows compare.

    python -m experiments.smollm2_16k.remaps    (after the factor search, see README)

Holds: RemapsConfig, run, collect, main.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.common import (
    EXPERIMENTS_DIR,
    check,
    check_ints,
    markdown_table,
    provenance,
    read_config,
    read_record,
    set_field,
    write_record,
    write_results,
)

NAME = "smollm2_16k"
HERE = EXPERIMENTS_DIR / NAME


@dataclasses.dataclass(frozen=True)
class RemapsConfig:
    """The training-free rows of experiment D (remaps.json). Lengths in the model's tokens."""

    model: str  # a model ropekit installs offline
    data: str  # the held-out corpus experiment D scores
    target_length: int  # tokens the methods must serve
    methods: dict[str, str]  # label -> spec, or "adapter:<folder>" for a searched adapter
    eval_lengths: tuple[int, ...]  # experiment D's perplexity window lengths
    eval_spans: int  # held-out spans of max(eval_lengths) tokens (experiment D: 1)
    eval_seed: int  # where the span starts (experiment D: 0)
    probe_lengths: tuple[int, ...]  # retrieval lengths
    # niah-style task (the probes' format) -> {"needles": K per haystack, "haystacks": H per
    # length}: H prefills ask H x K probes. A base model of this size copies the latest needle
    # when a haystack holds several (measured: README), so the passkey takes one per haystack.
    probe_tasks: dict[str, dict[str, int]]
    # experiment D's own retrieval rows, asked the same way (``ropekit eval <task>``): one
    # needle per prompt at depth 0.5, samples_per_depth prompts per length, seed 0
    tasks: tuple[str, ...] = ()
    samples_per_depth: int = 1
    description: str = ""

    def __post_init__(self) -> None:
        check_ints(self, "target_length", minimum=2)
        for name in ("eval_lengths", "probe_lengths"):
            check_ints(self, name, many=True, distinct=True)
        check_ints(self, "eval_spans")
        check_ints(self, "samples_per_depth")
        set_field(self, "tasks", tuple(self.tasks))
        check(set(self.tasks) <= {"passkey", "needle"}, self, "tasks", self.tasks,
              "experiment D's tasks: passkey, needle")  # fmt: skip
        ok = isinstance(self.probe_tasks, dict) and all(
            isinstance(v, dict) and set(v) == {"needles", "haystacks"}
            and all(type(n) is int and n >= 1 for n in v.values())
            for v in self.probe_tasks.values()
        )  # fmt: skip
        allowed = 'task -> {"needles": K, "haystacks": H} with integers >= 1'
        check(ok, self, "probe_tasks", self.probe_tasks, allowed)
        check_ints(self, "eval_seed", minimum=0)
        check(bool(self.methods), self, "methods", self.methods, "name at least one method")
        check(
            max(self.eval_lengths) <= self.target_length,
            self,
            "eval_lengths",
            self.eval_lengths,
            f"lengths up to target_length={self.target_length}",
        )


def _cli(args: Sequence[str], log: Path) -> dict[str, float]:
    """Run ``ropekit ARGS`` in its own process; its wall time and peak memory (maxrss)."""
    command = [sys.executable, "-m", "ropekit.cli", *args]
    env = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    start = time.perf_counter()
    with log.open("a") as out:
        out.write("$ ropekit " + shlex.join(args) + "\n")
        out.flush()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"ropekit {shlex.join(args)} failed; see {log}")
    return {"wall_s": time.perf_counter() - start, "peak_gib": usage.ru_maxrss / 2**20}


def _job(
    cfg: RemapsConfig, runs: Path, label: str, spec: str, *, tasks: Sequence[str]
) -> dict[str, Any]:
    """One method: attach (or take its adapter), score perplexity, probe retrieval. Each stage
    is recorded in stages.json when it ends, so a killed run continues at the stage it was in;
    the numbers are read back from the files the commands wrote (each checks its provenance)."""
    folder = runs / "remaps" / label
    folder.mkdir(parents=True, exist_ok=True)
    model = ["--model", cfg.model]
    adapter: list[str] = []
    if spec.startswith("adapter:"):
        adapter = ["--adapter", spec.removeprefix("adapter:")]
    elif spec != "rope":  # "rope": the model as it is, transformers' own attention
        _stage(folder, "attach", ["extend", *model, "--method", spec, "--target-length",
               str(cfg.target_length), "--out", str(folder / "ext")])  # fmt: skip
        adapter = ["--adapter", str(folder / "ext")]
    _stage(folder, "perplexity", [
        "eval", "ppl", *model, *adapter, "--lengths", ",".join(map(str, cfg.eval_lengths)),
        "--tokens", str(cfg.eval_spans * max(cfg.eval_lengths)), "--seed", str(cfg.eval_seed),
        "--batch-tokens", str(max(cfg.eval_lengths)), "--data", cfg.data,
        "--out", str(folder / "ppl"),
    ])  # fmt: skip
    for task in (t for t in cfg.tasks if t in tasks):
        _stage(folder, task, [
            "eval", task, *model, *adapter, "--lengths", ",".join(map(str, cfg.probe_lengths)),
            "--samples", str(cfg.samples_per_depth), "--depths", "1", "--seed", "0",
            "--batch-size", "1", "--out", str(folder / task),
        ])  # fmt: skip
    for task in (t for t in cfg.probe_tasks if t in tasks):
        needles, haystacks = (str(cfg.probe_tasks[task][k]) for k in ("needles", "haystacks"))
        _stage(folder, f"probes {task}", [
            "eval", "probes", *model, *adapter, "--lengths", ",".join(map(str, cfg.probe_lengths)),
            "--needles", needles, "--haystacks", haystacks, "--task", task,
            "--out", str(folder / f"probes-{task}"),
        ])  # fmt: skip
    stages = read_record(folder / "stages.json")
    return {"label": label, "spec": spec, "stages": stages, **_read(folder, cfg)}


def _retrieval(cfg: RemapsConfig) -> list[str]:
    """Every retrieval task of the config: experiment D's own, then the probe tasks."""
    return [*cfg.tasks, *cfg.probe_tasks]


def _stage_name(cfg: RemapsConfig, task: str) -> str:
    return task if task in cfg.tasks else f"probes {task}"


def _stage(folder: Path, name: str, args: list[str]) -> None:
    """Run one stage unless stages.json says it finished with these arguments; record its time
    and memory. A stage finished with other arguments is refused: its files are another run's."""
    path = folder / "stages.json"
    stages = read_record(path) if path.exists() else {}
    if name in stages and stages[name]["args"] != args:
        raise SystemExit(f"{folder}: stage {name!r} ran with other settings; move the folder away")
    if name not in stages:
        stages[name] = {"args": args, **_cli(args, folder / "log.txt")}
        write_record(path, stages)


def _read(folder: Path, cfg: RemapsConfig) -> dict[str, Any]:
    """The numbers the CLI wrote: perplexity by length, probe accuracy by length and task."""
    from ropekit.evals.intervals import accuracy_entry
    from ropekit.results import read_result

    ppl = read_result(folder / "ppl" / "ppl.json", "perplexity")
    out: dict[str, Any] = {
        "spec_used": ppl["spec"],
        "perplexity": {
            str(r["length"]): {
                "perplexity": r["perplexity"],
                "last_quarter_perplexity": math.exp(r["last_quarter_nll"]),
            }
            for r in ppl["results"]
        },
        "probes": {},
    }
    done = read_record(folder / "stages.json")
    for task in (t for t in cfg.tasks if t in done):
        entry = read_result(folder / task / "summary.json", "tasks")["tasks"][task]
        out["probes"][task] = {
            str(row["length"]): {
                **accuracy_entry(round(row["score"] * row["n"]), row["n"]),
                "needle_depth": 0.5,
            }
            for row in entry["scores"]
        }
    for task in (t for t in cfg.probe_tasks if f"probes {t}" in done):
        probes = read_result(folder / f"probes-{task}" / "summary.json", "probes")
        keys = ("accuracy", "correct", "n", "low", "high", "confidence")
        out["probes"][task] = {
            str(row["length"]): {k: row[k] for k in keys} for row in probes["by_length"]
        }
    return out


def _table(cfg: RemapsConfig, jobs: list[dict[str, Any]], committed: dict[str, Any]) -> str:
    lengths = [str(n) for n in cfg.eval_lengths]
    top = str(max(cfg.eval_lengths))
    header = ["method", *(f"ppl @{n}" for n in lengths), f"last quarter @{top}"]
    header += [f"{t} @{n}" for t in _retrieval(cfg) for n in cfg.probe_lengths]
    header += ["ppl time", "retrieval time", "peak memory"]
    rows = []
    for job in jobs:
        ppl = job["perplexity"]
        row = [f"`{job['label']}`", *(f"{ppl[n]['perplexity']:.2f}" for n in lengths)]
        row.append(f"{ppl[top]['last_quarter_perplexity']:.2f}")
        for task in _retrieval(cfg):
            for n in cfg.probe_lengths:
                p = job["probes"].get(task, {}).get(str(n))
                row.append(
                    f"{p['correct']}/{p['n']} [{p['low']:.2f}, {p['high']:.2f}]" if p else "-"
                )
        stages = job["stages"]
        evals = [s for name, s in stages.items() if name != "attach"]  # measured ones
        retrieval = [
            stages[n]["wall_s"] for t in _retrieval(cfg) if (n := _stage_name(cfg, t)) in stages
        ]
        row.append(f"{stages['perplexity']['wall_s'] / 60:.1f} min")
        row.append(f"{sum(retrieval) / 60:.1f} min" if retrieval else "-")
        row.append(f"{max(s['peak_gib'] for s in evals):.2f} GiB")
        rows.append(row)
    text = markdown_table(header, rows)
    check_rows = [
        [f"`{j['label']}`", *(f"{j['perplexity'][n]['perplexity']:.2f}" for n in lengths),
         *(f"{committed[j['label']][n]:.2f}" for n in lengths)]
        for j in jobs if set(lengths) <= set(committed.get(j["label"], {}))
    ]  # fmt: skip
    if check_rows:
        text += "\n\nReproduction: the same methods rerun here against experiment D's committed "
        text += "perplexities (same windows).\n\n"
        text += markdown_table(
            ["method", *(f"here @{n}" for n in lengths), *(f"D @{n}" for n in lengths)],
            check_rows,
        )
    return text + "\n"


def _committed() -> dict[str, dict[str, float]]:
    """Experiment D's committed perplexities of the untuned methods, by label and length."""
    import json

    data = json.loads((HERE / "results.json").read_text())
    return {
        label: {n: v["perplexity"]["mean"] for n, v in entry["perplexity"].items()}
        for label, entry in data["methods"].items()
        if not entry["trained"]
    }


def run(
    cfg: RemapsConfig,
    runs: Path,
    results: Path,
    command: str,
    *,
    only: Sequence[str] = (),
    tasks: Sequence[str] | None = None,
) -> str:
    """Every method in order (``only``: just those, so two processes can share the work;
    ``tasks``: just these probe tasks, ``()`` perplexity only); the results hold every method
    scored so far."""
    for label, spec in cfg.methods.items():
        if only and label not in only:
            continue
        print(f"{label}: {spec}", flush=True)
        _job(cfg, runs, label, spec, tasks=_retrieval(cfg) if tasks is None else tasks)
        collect(cfg, runs, results, command)
    return collect(cfg, runs, results, command)


def _stages_done(folder: Path) -> set[str]:
    path = folder / "stages.json"
    return set(read_record(path)) if path.exists() else set()


def _earlier(cfg: RemapsConfig, results: Path) -> dict[str, dict[str, Any]]:
    """The methods a results.json of this same config already holds, by label: a method
    scored in an earlier session whose run folder (``runs/``, not committed) is gone stays in
    the results instead of being dropped by the next session's collect. A results.json of
    another config is not read (its numbers are another run's)."""
    from ropekit.results import read_result

    path = results / "results.json"
    if not path.exists():
        return {}
    data = read_result(path, "experiment")
    if data["provenance"] != provenance("remaps", cfg):
        return {}
    return {label: job for label, job in data["methods"].items() if label in cfg.methods}


def collect(cfg: RemapsConfig, runs: Path, results: Path, command: str) -> str:
    """Write results from the methods whose perplexity has finished (nothing runs); methods
    and probes not run yet are named, so a partial run is committed as what it is."""
    jobs, missing, unprobed = [], [], []
    earlier = _earlier(cfg, results)
    for label, spec in cfg.methods.items():
        folder = runs / "remaps" / label
        done = _stages_done(folder)
        if "perplexity" not in done and label in earlier:
            done = set(earlier[label]["stages"])  # scored by an earlier run, folder gone
            jobs.append(earlier[label])
        elif "perplexity" not in done:
            missing.append(label)
            continue
        else:
            stages = read_record(folder / "stages.json")
            jobs.append({"label": label, "spec": spec, "stages": stages, **_read(folder, cfg)})
        if any(_stage_name(cfg, t) not in done for t in _retrieval(cfg)):
            unprobed.append(label)
    markdown = _table(cfg, jobs, _committed()) if jobs else "No method has finished yet.\n"
    if missing:
        markdown += "\nNot run yet (the session's CPU budget ended first): "
        markdown += ", ".join(f"`{m}`" for m in missing) + ".\n"
    if unprobed:
        markdown += "\nRetrieval probes not run yet (`-` above): "
        markdown += ", ".join(f"`{m}`" for m in unprobed) + ".\n"
    payload = {"config": dataclasses.asdict(cfg), "methods": {j["label"]: j for j in jobs}}
    payload.update(not_run=missing, probes_not_run=unprobed)
    write_results(results, payload, markdown, command=command, provenance=provenance("remaps", cfg))
    return markdown


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m experiments.smollm2_16k.remaps")
    parser.add_argument("--config", type=Path, default=HERE / "remaps.json", help="settings")
    parser.add_argument("--runs", type=Path, default=Path("runs/experiments") / NAME,
                        help="the jobs' folders go here (runs/.../remaps/<method>)")  # fmt: skip
    parser.add_argument("--results", type=Path, default=HERE / "remaps",
                        help="results.json and results.md go here")  # fmt: skip
    parser.add_argument(
        "--only", default="", help="run just these methods (labels, comma-separated)"
    )
    parser.add_argument("--no-probes", action="store_true", help="perplexity only (probes later)")
    parser.add_argument(
        "--tasks", default="", help="probe just these tasks of the config (comma-separated)"
    )
    parser.add_argument(
        "--collect", action="store_true", help="run nothing: write the finished methods' results"
    )
    args = parser.parse_args(argv)
    cfg = read_config(RemapsConfig, args.config)
    args.results.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "-m", "experiments.smollm2_16k.remaps", *given])
    only = [m for m in args.only.split(",") if m]
    unknown = [m for m in only if m not in cfg.methods]
    if unknown:
        parser.error(f"--only {unknown} are not methods of {args.config}: {list(cfg.methods)}")
    tasks = [t for t in args.tasks.split(",") if t] or None
    if tasks and set(tasks) - set(_retrieval(cfg)):
        parser.error(f"--tasks {tasks} are not retrieval tasks of {args.config}: {_retrieval(cfg)}")
    if args.no_probes:
        tasks = []
    if args.collect:
        print(collect(cfg, args.runs, args.results, command))
    else:
        print(run(cfg, args.runs, args.results, command, only=only, tasks=tasks))


if __name__ == "__main__":
    main()
