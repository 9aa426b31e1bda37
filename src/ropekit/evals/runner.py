"""The task runner: generate samples, predict greedily, score, summarize, plot; resumable.

Holds:
- `EvalConfig`: lengths, samples, depths, seed, batching, answer budget, chat, thresholds.
- `run_tasks(model, tasks, config, out_dir)`: the pipeline; `run_needle`, `run_passkey`,
  `run_ruler` name its task sets (`ropekit eval needle|passkey|ruler`). It returns the run's
  summary, a `TasksResult` (the ``tasks`` kind at `VERSION`: a `TaskEntry` per task with its
  `TaskScore`s, `TaskSkip`s and needle `DepthCell`s, the `AverageScore`s and the
  `EffectiveLength`s).

Output layout (stages talk through files, as in RULER):

    out_dir/
      summary.json                 every task and length, effective lengths, spec, seed, versions
      accuracy_vs_length.png       one line per task, the average in bold
      <task>/heatmap.png           needle tasks: accuracy over length x depth
      <task>/<length>/data.jsonl   the samples (`Sample` records)
      <task>/<length>/pred.jsonl   one prediction per sample, rewritten after every batch
      <task>/<length>/summary.json score of the stage, by depth for needle tasks

Resuming and provenance: a stage's provenance is what its samples depend on (generator
version, task arguments, length, seed, sample plan, tokenizer, prompt format, answer budget)
and the model that predicts them (`Backbone.identity`: weights digest, encoding spec and
parameters, LoRA, tokenizer). Its `summary.json` records it whole from the start; every record
of `data.jsonl` and `pred.jsonl` carries its digest. A rerun reuses matching samples and
predictions and computes only what is missing: a finished run does no model call at all. A
stage made with other settings or another model is refused, naming the field that differs,
unless `overwrite=True`, which redoes it. The folder's `summary.json` is never replaced by one
of another kind of run or another model.

Several processes (`accelerate launch`, `torchrun`): the main process reads or makes the
stage files and hands the samples to the others; the processes take the prediction batches
in turns (the same batches one process would run, so the same greedy answers), every process
gets every prediction, and only the main process writes files. The summary is the one a
single process writes.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from tqdm.auto import tqdm

from ropekit.data.tokenizers import Tokenizer
from ropekit.distributed import Processes
from ropekit.distributed import processes as current_processes
from ropekit.evals.adapters import LanguageModel, as_language_model, newline_ids, place_on
from ropekit.evals.plots import plot_accuracy_vs_length, plot_heatmap
from ropekit.evals.prompts import PromptFormat
from ropekit.evals.scoring import (
    RELATIVE_THRESHOLD,
    SCORERS,
    THRESHOLD,
    clean_prediction,
    effective_length,
)
from ropekit.evals.stages import Stage
from ropekit.evals.tasks import (
    GENERATOR_VERSION,
    RULER_TASKS,
    Sample,
    TaskDoesNotFit,
    TaskRecord,
    TaskSpec,
    generate_sample,
    get_task,
)
from ropekit.results import (
    check_replaceable,
    read_records,
    register,
    run_metadata,
    to_json,
    write_records,
    write_result,
)


@dataclass(frozen=True)
class EvalConfig:
    """Settings of one task evaluation. Lengths count the model's tokens, answer included."""

    lengths: tuple[int, ...]  # prompt lengths to evaluate (tokens, answer included)
    samples: int = 10  # per length; for needle tasks with `depths`, per length and depth
    # Needle depths (0 = start of the haystack, 1 = end). None: each needle task spreads its
    # samples evenly over [0, 1] (RULER-style, one depth per sample).
    depths: tuple[float, ...] | None = None
    seed: int = 0  # draws the samples (haystack spans, needles, keys): equal seeds, equal samples
    batch_size: int = 4  # prompts per generation batch
    max_new_tokens: int | None = None  # answer budget (tokens); None: each answer's length + slack
    chat: bool = False  # wrap prompts in the tokenizer's chat template (instruction models)
    threshold: float = THRESHOLD  # effective length: absolute score bar
    relative_threshold: float = RELATIVE_THRESHOLD  # ... and share of the shortest-length score

    def __post_init__(self) -> None:
        lengths = tuple(self.lengths)
        if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
            raise ValueError(
                f"lengths={self.lengths!r} is not allowed; allowed: one or more integers >= 1"
            )
        object.__setattr__(self, "lengths", tuple(sorted(set(lengths))))
        if self.depths is not None:
            depths = tuple(float(d) for d in self.depths)
            if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
                raise ValueError(
                    f"depths={self.depths!r} is not allowed; allowed: None or values in [0, 1]"
                )
            object.__setattr__(self, "depths", tuple(sorted(set(depths))))
        for name in ("samples", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed; allowed: >= 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens!r} is not allowed; allowed: None or >= 1"
            )
        for name in ("threshold", "relative_threshold"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not allowed; allowed: 0 < value <= 1"
                )

    def plan(self, spec: TaskSpec) -> list[tuple[int, float | None, int]]:
        """(index, depth, draw) of each sample of `spec` at one length. A draw number fixes
        the needles, so every depth and length of a heatmap row uses the same needle."""
        if not spec.needle:
            return [(k, None, k) for k in range(self.samples)]
        if self.depths is None:
            spread = self.samples - 1
            return [(k, k / spread if spread else 0.5, k) for k in range(self.samples)]
        return [
            (i * self.samples + k, depth, k)
            for i, depth in enumerate(self.depths)
            for k in range(self.samples)
        ]


@dataclass
class _Stage(Stage):
    kind: ClassVar[str] = "task-stage"
    records_file: ClassVar[str] = "data.jsonl"
    settings: ClassVar[str] = (
        "task arguments, seed, samples, depths, tokenizer, prompt format, answer budget"
    )
    spec: TaskSpec = field(kw_only=True)
    samples: list[Sample] | None = None
    skipped: str | None = None
    predictions: dict[int, dict[str, Any]] | None = None


def _provenance(
    spec: TaskSpec, length: int, config: EvalConfig, fmt: PromptFormat, model: dict[str, Any]
) -> dict[str, Any]:
    """What a stage's samples and predictions depend on (module docstring)."""
    samples = {
        "generator": GENERATOR_VERSION,
        "task": spec.to_json(),
        "length": length,
        "seed": config.seed,
        "plan": config.plan(spec),
        "tokenizer": fmt.tokenizer.name,
        "format": fmt.name,
        "max_new_tokens": config.max_new_tokens,
    }
    return {"samples": samples, "model": model}


def _does_not_fit(stage: _Stage, config: EvalConfig, fmt: PromptFormat) -> str | None:
    """Why the stage's task does not fit its length (its first planned sample, built in
    memory), or None when it fits."""
    index, depth, draw = next(iter(config.plan(stage.spec)))
    try:
        generate_sample(
            stage.spec, fmt, stage.length, index, config.seed, depth, config.max_new_tokens, draw
        )
    except TaskDoesNotFit as e:
        return str(e)
    return None


def _prepare(stage: _Stage, config: EvalConfig, fmt: PromptFormat, overwrite: bool) -> None:
    """Load the stage's samples and predictions, or generate the samples."""
    stage.claim(overwrite, task=stage.spec.name)
    data_path = stage.directory / "data.jsonl"
    records = read_records(data_path)
    if records:
        stage.samples = [Sample.from_json(r) for r in records]
    else:
        try:
            stage.samples = [
                generate_sample(
                    stage.spec,
                    fmt,
                    stage.length,
                    index,
                    config.seed,
                    depth,
                    config.max_new_tokens,
                    draw,
                )
                for index, depth, draw in config.plan(stage.spec)
            ]
        except TaskDoesNotFit as e:
            stage.skipped = str(e)
            return
        records = [{**s.to_json(), "stage": stage.fingerprint} for s in stage.samples]
        write_records(data_path, records)
    stage.predictions = {
        r["index"]: r
        for r in read_records(stage.directory / "pred.jsonl")
        if r.get("stage") == stage.fingerprint
    }


def _predict(
    stage: _Stage,
    lm: LanguageModel,
    fmt: PromptFormat,
    config: EvalConfig,
    stop: frozenset[int],
    bar: tqdm,
    procs: Processes,
) -> None:
    assert stage.samples is not None and stage.predictions is not None
    pending = [s for s in stage.samples if s.index not in stage.predictions]
    # Longest first: a batch holds similar lengths (less padding, more equal-length groups).
    pending.sort(key=lambda s: (-s.n_tokens, s.index))
    batches = [
        pending[b : b + config.batch_size] for b in range(0, len(pending), config.batch_size)
    ]
    bar.set_postfix_str(f"{stage.spec.name} @ {stage.length}")
    # Several processes take the batches in turns, one each per round: the batches are the
    # ones a single process would run (so are the greedy outputs), and after every round the
    # main process rewrites pred.jsonl with everything predicted so far, as one process does
    # after every batch.
    for first in range(0, len(batches), procs.world):
        mine = batches[first + procs.rank] if first + procs.rank < len(batches) else []
        for records in procs.each(functools.partial(_predict_batch, stage, lm, fmt, stop, mine)):
            stage.predictions.update(records)
        if procs.is_main:
            write_records(
                stage.directory / "pred.jsonl",
                [stage.predictions[i] for i in sorted(stage.predictions)],
            )
        bar.update(sum(len(batch) for batch in batches[first : first + procs.world]))


def _predict_batch(
    stage: _Stage,
    lm: LanguageModel,
    fmt: PromptFormat,
    stop: frozenset[int],
    batch: list[Sample],
) -> dict[int, dict[str, Any]]:
    """Greedy answers to one batch of samples, as pred.jsonl records by sample index."""
    if not batch:
        return {}
    prompts = [fmt.encode(s.input) for s in batch]
    for s, ids in zip(batch, prompts, strict=True):
        if len(ids) != s.n_tokens:
            raise ValueError(
                f"{stage.directory}: sample {s.index} encodes to {len(ids)} tokens, not the "
                f"{s.n_tokens} it was made with; the tokenizer changed: use another out_dir"
            )
    outputs = lm.greedy(prompts, max(s.max_new_tokens for s in batch), stop)
    records = {}
    for s, out in zip(batch, outputs, strict=True):
        out = out[: s.max_new_tokens]
        text = lm.tokenizer.decode(out)
        records[s.index] = {
            "index": s.index,
            "stage": stage.fingerprint,
            "pred": clean_prediction(text),
            "generated": text,
            "n_generated": len(out),
        }
    return records


def _score(stage: _Stage, write: bool = True) -> dict[str, Any]:
    """The stage's score (by depth for needle tasks), written to its summary.json if `write`."""
    base = {"task": stage.spec.name, "length": stage.length, "stage": stage.fingerprint}
    if stage.skipped is not None:
        summary = {**base, "skipped": stage.skipped}
        if write:
            _write_stage(stage, summary)
        return summary
    assert stage.samples is not None and stage.predictions is not None
    scorer = SCORERS[stage.spec.metric]
    rows = [
        {
            "index": s.index,
            "depth": s.depth,
            "score": scorer(stage.predictions[s.index]["pred"], s.outputs),
            "n_tokens": s.n_tokens,
            "needle_depth": s.needle_depth,
        }
        for s in stage.samples
        if s.index in stage.predictions
    ]
    summary: dict[str, Any] = {
        **base,
        "metric": stage.spec.metric,
        "n": len(rows),
        "complete": len(rows) == len(stage.samples),
        "score": sum(r["score"] for r in rows) / len(rows) if rows else None,
        "mean_prompt_tokens": sum(s.n_tokens for s in stage.samples) / len(stage.samples),
    }
    if stage.spec.needle and rows:
        by_depth: dict[float, list[float]] = {}
        for r in rows:
            by_depth.setdefault(r["depth"], []).append(r["score"])
        summary["by_depth"] = [
            {"depth": d, "score": sum(v) / len(v), "n": len(v)} for d, v in sorted(by_depth.items())
        ]
    if write:
        _write_stage(stage, summary)
    return summary


def _write_stage(stage: _Stage, summary: dict[str, Any]) -> None:
    meta = run_metadata(seed=stage.provenance["samples"]["seed"])
    write_result(
        stage.directory / "summary.json", "task-stage", summary, meta=meta,
        provenance=stage.provenance,
    )  # fmt: skip


def run_tasks(
    model: Any,
    tasks: list[str | TaskSpec] | tuple[str | TaskSpec, ...],
    config: EvalConfig,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    kind: str = "tasks",
    spec: str | None = None,
    command: str = "",
    progress: bool = True,
    overwrite: bool = False,
    processes: Processes | None = None,
) -> TasksResult:
    """Run every task at every length of `config` into `out_dir` (see the module docstring);
    return the overall summary (also written to `out_dir/summary.json`). `model` is a
    Backbone, a Decoder, a Hugging Face causal LM or a `LanguageModel` (with `tokenizer` when
    it has none); `kind` labels the run (tasks, needle, passkey, ruler).

    Launched as several processes (`accelerate launch`, `torchrun`), they share the
    predictions and all return the summary; only the main process writes files. `processes`
    defaults to the current run's (`ropekit.distributed.processes()`)."""
    lm = as_language_model(model, tokenizer)
    specs = [get_task(t) for t in tasks]
    if not specs:
        raise ValueError("tasks=[] is not allowed; allowed: one or more task names")
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"tasks={[s.name for s in specs]} is not allowed: a task appears twice")
    procs = processes if processes is not None else current_processes()
    place_on(lm, procs.device)
    progress = progress and procs.is_main
    out = Path(out_dir)
    model = lm.identity()
    provenance = {"model": model}
    if procs.is_main:  # another command's or another model's summary is never replaced
        check_replaceable(out / "summary.json", "tasks", provenance, overwrite=overwrite)
    fmt = PromptFormat(lm.tokenizer, chat=config.chat)
    stages = [
        _Stage(n, out / s.name / str(n), _provenance(s, n, config, fmt, model), spec=s)
        for s in specs
        for n in config.lengths
    ]
    _run_stages(stages, lm, fmt, config, overwrite, progress, procs)
    stage_summaries = [_score(stage, write=procs.is_main) for stage in stages]
    summary = replace(
        _summary(specs, stage_summaries, config, out, kind, spec, fmt, lm, procs),
        meta=run_metadata(command, spec=spec, seed=config.seed),
        provenance=json.loads(to_json(provenance)),  # as the file holds it
    )
    if procs.is_main:
        write_result(out / "summary.json", "tasks", summary)
    procs.barrier()  # the files are complete when any process returns
    return summary


def _run_stages(
    stages: list[_Stage],
    lm: LanguageModel,
    fmt: PromptFormat,
    config: EvalConfig,
    overwrite: bool,
    progress: bool,
    procs: Processes,
) -> None:
    """Prepare every stage (main process), then predict what is missing (all processes)."""
    stop = newline_ids(lm.tokenizer) | lm.eos_ids

    def prepare() -> list[tuple[Any, ...]]:
        # A run where no task fits any length would measure nothing: refused before any
        # stage folder is touched, with the first reason (exit 2 on the command line).
        reasons = [_does_not_fit(stage, config, fmt) for stage in stages]
        if all(reasons):
            raise TaskDoesNotFit(f"no task fits any of the lengths asked: {reasons[0]}")
        for stage in tqdm(stages, desc="samples", unit="stage", disable=not progress):
            _prepare(stage, config, fmt, overwrite)
        return [(s.samples, s.skipped, s.predictions) for s in stages]

    # The main process reads, checks or makes the stage files; the others take its samples
    # and saved predictions, so every process agrees on what is still to predict.
    for stage, (samples, skipped, predictions) in zip(stages, procs.on_main(prepare), strict=True):
        stage.samples, stage.skipped, stage.predictions = samples, skipped, predictions
    pending = sum(
        len(s.samples) - len(s.predictions)
        for s in stages
        if s.samples is not None and s.predictions is not None
    )
    with tqdm(total=pending, desc="predictions", unit="sample", disable=not progress) as bar:
        for stage in stages:
            if stage.skipped is None:
                _predict(stage, lm, fmt, config, stop, bar, procs)


# ----------------------------------------------------------------------------- the record
@dataclass(frozen=True)
class TaskScore:
    length: int
    score: float  # mean over the samples (0..1)
    n: int  # samples scored


@dataclass(frozen=True)
class TaskSkip:
    length: int
    reason: str  # why the task does not fit the length


@dataclass(frozen=True)
class DepthCell:
    """A needle task's score at one length and needle depth (the heatmap's cell)."""

    length: int
    depth: float
    score: float
    n: int


@dataclass(frozen=True)
class TaskEntry:
    """One task of a run."""

    spec: TaskRecord
    scores: tuple[TaskScore, ...]  # the lengths it was scored at
    skipped: tuple[TaskSkip, ...]  # the lengths it does not fit
    effective_length: int | None  # absolute bar (``effective_length``); None: none scored
    effective_length_relative: int | None  # relative bar
    cells: tuple[DepthCell, ...] | None  # needle tasks; None for the others

    def by_length(self) -> dict[int, float]:
        """length -> score."""
        return {s.length: s.score for s in self.scores}


@dataclass(frozen=True)
class AverageScore:
    length: int
    score: float  # mean over the tasks (only where every task was scored)


@dataclass(frozen=True)
class EffectiveLength:
    rule: str  # in words
    threshold: float
    relative_threshold: float
    average: int | None  # of the task average; None: no length has every task
    average_relative: int | None


VERSION = 3  # 3: typed, every field written (2: the untyped layout)


def _from_v2(data: dict[str, Any]) -> dict[str, Any]:
    """The untyped layout wrote ``cells`` only for needle tasks."""
    tasks = {name: {"cells": None, **entry} for name, entry in data["tasks"].items()}
    return {**data, "tasks": tasks}


@register("tasks", VERSION, {2: _from_v2})
@dataclass(frozen=True)
class TasksResult:
    """summary.json of ``run_tasks`` (also what it returns)."""

    meta: dict[str, Any]  # run_metadata
    provenance: dict[str, Any]  # the model: what a rerun in the folder must match
    run: str  # tasks, needle, passkey or ruler
    spec: str | None  # the encoding spec the model carried, as the caller named it
    seed: int
    format: str  # the prompt format (PromptFormat.name)
    config: EvalConfig
    tasks: dict[str, TaskEntry]  # by name, in the order asked
    average: tuple[AverageScore, ...]
    effective_length: EffectiveLength
    model: dict[str, Any]  # LanguageModel.describe()
    paths: dict[str, str]  # summary, accuracy_vs_length, heatmap_<task>


def _task_entry(
    task: TaskSpec, mine: list[dict[str, Any]], config: EvalConfig
) -> tuple[TaskEntry, dict[int, float]]:
    """One task's part of the summary (from its stages' summaries) and its scores by length."""
    done = [s for s in mine if "skipped" not in s and s["score"] is not None]
    by_length = {s["length"]: s["score"] for s in done}
    entry = TaskEntry(
        spec=TaskRecord(**task.to_json()),
        scores=tuple(TaskScore(s["length"], s["score"], s["n"]) for s in done),
        skipped=tuple(TaskSkip(s["length"], s["skipped"]) for s in mine if "skipped" in s),
        effective_length=effective_length(by_length, config.threshold) if by_length else None,
        effective_length_relative=effective_length(
            by_length, config.relative_threshold, relative=True
        )
        if by_length
        else None,
        cells=tuple(
            DepthCell(s["length"], c["depth"], c["score"], c["n"])
            for s in done
            for c in s["by_depth"]  # a needle task's scored stage has one
        )
        if task.needle
        else None,
    )
    return entry, by_length


def _summary(
    specs: list[TaskSpec],
    stage_summaries: list[dict[str, Any]],
    config: EvalConfig,
    out: Path,
    kind: str,
    spec: str | None,
    fmt: PromptFormat,
    lm: LanguageModel,
    procs: Processes,
) -> TasksResult:
    """The run's summary without metadata or provenance (and, on the main process, its
    figures)."""
    tasks_out: dict[str, TaskEntry] = {}
    scores: dict[str, dict[int, float]] = {}
    paths: dict[str, str] = {}
    for task in specs:
        entry, scores[task.name] = _task_entry(
            task, [s for s in stage_summaries if s["task"] == task.name], config
        )
        if entry.cells:
            heatmap = out / task.name / "heatmap.png"
            if procs.is_main:
                title = " ".join(filter(None, [task.name, spec]))
                plot_heatmap([asdict(c) for c in entry.cells], heatmap, title=title)
            paths[f"heatmap_{task.name}"] = str(heatmap)
        tasks_out[task.name] = entry
    # The task average exists only where every task was scored, so skipped tasks never make
    # a length look better or worse than its neighbours.
    average = {
        n: sum(scores[t.name][n] for t in specs) / len(specs)
        for n in config.lengths
        if all(n in scores[t.name] for t in specs)
    }
    curve = out / "accuracy_vs_length.png"
    if procs.is_main:
        plot_accuracy_vs_length(
            scores, curve, config.threshold, average if len(specs) > 1 else None,
            title=f"{kind}: {spec or lm.tokenizer.name}",
        )  # fmt: skip
    paths["accuracy_vs_length"] = str(curve)
    paths["summary"] = str(out / "summary.json")
    rule = (
        "longest evaluated length L such that every length <= L scores >= the bar; absolute "
        "bar = threshold, relative bar = relative_threshold x the score at the shortest length"
    )
    return TasksResult(
        meta={}, provenance={}, run=kind, spec=spec, seed=config.seed, format=fmt.name,
        config=config, tasks=tasks_out,
        average=tuple(AverageScore(n, s) for n, s in average.items()),
        effective_length=EffectiveLength(
            rule=rule, threshold=config.threshold,
            relative_threshold=config.relative_threshold,
            average=effective_length(average, config.threshold) if average else None,
            average_relative=effective_length(average, config.relative_threshold, relative=True)
            if average else None,
        ),
        model=lm.describe(), paths=paths,
    )  # fmt: skip


def run_needle(
    model: Any,
    config: EvalConfig,
    out_dir: str | os.PathLike[str] = "runs/needle",
    *,
    task: str = "niah_single_2",
    **options: Any,
) -> TasksResult:
    """Needle in a haystack over length x depth (default: a number in Paul Graham essays).
    `options` are `run_tasks`'s keyword arguments."""
    return run_tasks(model, [task], config, out_dir, kind="needle", **options)


def run_passkey(
    model: Any,
    config: EvalConfig,
    out_dir: str | os.PathLike[str] = "runs/passkey",
    *,
    task: str = "passkey",
    **options: Any,
) -> TasksResult:
    """Pass-key retrieval over length x depth, in the retrieval mixture's format.
    `options` are `run_tasks`'s keyword arguments."""
    return run_tasks(model, [task], config, out_dir, kind="passkey", **options)


def run_ruler(
    model: Any,
    config: EvalConfig,
    out_dir: str | os.PathLike[str] = "runs/ruler",
    *,
    tasks: list[str] | tuple[str, ...] = RULER_TASKS,
    **options: Any,
) -> TasksResult:
    """RULER's synthetic tasks (all of them by default), needle depths spread per sample.
    `options` are `run_tasks`'s keyword arguments."""
    return run_tasks(model, list(tasks), config, out_dir, kind="ruler", **options)
