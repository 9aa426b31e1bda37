"""Retrieval accuracy as a function of needle distance, run: each haystack
(`evals.probe_haystacks`) prefilled once and every question answered from its own cut point
of the cached prefill, staged and resumable (`ropekit eval probes`); the summary is
`evals.probe_summary`'s.

Holds:
- `answer_probes(lm, haystack, stop)`: prefill the haystack once (up to its longest cut),
  answer every question from the cache cropped to its cut; `answer_haystacks` does so for
  several haystacks in turn; `answer_separately` is the reference, one prompt (the cut
  haystack + question) per probe read from scratch.
- `check_probe_sizes`: work that cannot fit or finish, refused before any haystack.
- `run_probes(model, config, out_dir, ...)`: the staged, resumable evaluation, per-probe
  JSONL, a summary (`ProbesResult`), the figure.

The prefill reads up to the longest cut in chunks that divide every cut
(`adapters.chunk_dividing`), and the questions are asked from the longest cut to the
shortest, the cache cropped (`Backbone.crop_cache`) to each; a chunk's keys and values
depend only on the chunks before it, and each ran at the length it runs at in a fresh read,
so the cropped cache is, bit for bit, the fresh prefill of the cut haystack in those chunks,
for every encoding (dynamic schedules and distance remaps included; tested per family, and
against one forward without a cache, exact where a cache is: ``ropekit.model.cache``).

Output layout:

    out_dir/
      summary.json              kind "probes": accuracy per distance bin, per haystack
                                length and overall, each with its Wilson interval; the reach
      accuracy_vs_distance.png  accuracy with its interval, the trained length marked
      <length>/summary.json     kind "probe-stage": the stage's provenance and score
      <length>/probes.jsonl     one record per answered probe (its needle, cut, distance,
                                prompt sizes, answer, score, the stage digest), rewritten
                                after each haystack

Resuming and provenance, as in `evals/runner.py`: a stage's provenance is what its probes
depend on (generator versions, task, K, H, where the needles sit, the grain, length, seed,
tokenizer, prompt format, answer budget) and the model (`Backbone.identity`); its
`summary.json` records it from the start and every record carries its digest. A rerun
regenerates the haystacks (deterministic, checked against the records) and prefills only
those with unanswered probes: a finished run makes no model call. A stage of other settings
or another model is refused, naming the field, unless `overwrite`. Several processes
(`accelerate launch`, `torchrun`) take the haystacks in turns and the main process writes
the files.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from tqdm.auto import tqdm

from ropekit.data.tokenizers import Tokenizer
from ropekit.distributed import Processes
from ropekit.distributed import processes as current_processes
from ropekit.evals.adapters import (
    LanguageModel,
    PrefixQuestions,
    as_language_model,
    newline_ids,
    place_on,
)
from ropekit.evals.probe_haystacks import (
    PROBES_VERSION,
    ProbeConfig,
    ProbeHaystack,
    build_haystack,
    probe_task,
)
from ropekit.evals.probe_summary import (
    SCORING,
    Accuracy,
    DistanceAccuracy,
    LengthAccuracy,
    ProbesResult,
    Reach,
    exact_match,
    plot_accuracy_vs_distance,
    summarize_records,
    typed_entry,
)
from ropekit.evals.prompts import PromptFormat
from ropekit.evals.scoring import clean_prediction, match_all
from ropekit.evals.stages import Stage
from ropekit.evals.tasks import (
    GENERATOR_VERSION,
    TaskDoesNotFit,
    TaskRecord,
    TaskSpec,
)
from ropekit.results import (
    ProvenanceMismatch,
    check_replaceable,
    read_records,
    run_metadata,
    to_json,
    write_records,
    write_result,
)

# ----------------------------------------------------------------------------- answering
# Sizes checked before anything is built (building a haystack tokenizes its whole text).
NEEDLE_TOKENS = 6  # "The value of key K is V." is 6 words: no tokenizer makes it fewer tokens
MAX_PROMPT_TOKENS = 10**8  # prefill tokens of one probes run: days of CPU for the tiniest model


def check_probe_sizes(config: ProbeConfig, lm: LanguageModel) -> None:
    """Refuse at once, naming the limit, what cannot run: more needles than a length holds,
    more prompt tokens than any machine prefills in reasonable time, or a length whose KV
    cache alone exceeds this machine's memory. A ValueError (TaskDoesNotFit for needles)."""
    for n in config.lengths:
        if config.needles * NEEDLE_TOKENS > n:
            raise TaskDoesNotFit(
                f"needles={config.needles} cannot fit in {n} tokens: each needle takes at "
                f"least {NEEDLE_TOKENS}; allowed: at most {n // NEEDLE_TOKENS} needles at "
                f"length {n}"
            )
    per_token = lm.kv_bytes_per_token
    if per_token is not None:  # a model with a KV cache to size
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        longest = max(config.lengths)
        if longest * per_token > memory:
            raise ValueError(
                f"length {longest} needs a KV cache of {longest * per_token / 2**30:.1f} GiB, "
                f"above this machine's {memory / 2**30:.1f} GiB of memory; allowed: lengths "
                f"up to {memory // per_token:,} tokens"
            )
    total = config.haystacks * sum(config.lengths)
    if total > MAX_PROMPT_TOKENS:
        raise ValueError(
            f"haystacks={config.haystacks} x lengths {list(config.lengths)} is {total:,} "
            f"prompt tokens to prefill; the limit is {MAX_PROMPT_TOKENS:,} (fewer haystacks "
            "or shorter lengths)"
        )


def answer_haystacks(
    lm: LanguageModel, haystacks: Iterable[ProbeHaystack], stop: Collection[int] = ()
) -> Iterator[list[list[int]]]:
    """Greedy answers (token ids, ending before the first stop id) to every probe of each
    haystack in turn, yielded haystack by haystack: one prefill of its prefix (up to its
    longest cut), then each question after the cached prefix cropped to its cut
    (``LanguageModel.greedy_after_prefixes``)."""
    return lm.greedy_after_prefixes(
        (
            PrefixQuestions(
                hay.prefix,
                [p.question for p in hay.probes],
                [p.max_new_tokens for p in hay.probes],
                [p.cut for p in hay.probes],
            )
            for hay in haystacks
        ),
        stop,
    )


def answer_probes(
    lm: LanguageModel, haystack: ProbeHaystack, stop: Collection[int] = ()
) -> list[list[int]]:
    """The answers of one haystack's probes (`answer_haystacks`)."""
    return next(iter(answer_haystacks(lm, [haystack], stop)))


def answer_separately(
    lm: LanguageModel, haystack: ProbeHaystack, stop: Collection[int] = ()
) -> list[list[int]]:
    """The reference: each probe's full prompt (the prefix cut at its cut point, then its
    question) decoded on its own, one prefill per probe (``LanguageModel.greedy``)."""
    return [lm.greedy([haystack.prompt(p)], p.max_new_tokens, stop)[0] for p in haystack.probes]


# ----------------------------------------------------------------------------- stages
@dataclass
class _Stage(Stage):
    kind: ClassVar[str] = "probe-stage"
    records_file: ClassVar[str] = "probes.jsonl"
    settings: ClassVar[str] = (
        "task, needles, haystacks, needles_within, grain, seed, tokenizer, prompt format, "
        "answer budget"
    )
    haystacks: list[ProbeHaystack] | None = None
    records: dict[tuple[int, int], dict[str, Any]] | None = None


def _provenance(
    spec: TaskSpec, length: int, config: ProbeConfig, fmt: PromptFormat, model: dict[str, Any]
) -> dict[str, Any]:
    """What a stage's probes and answers depend on (module docstring)."""
    probes = {
        "generator": [PROBES_VERSION, GENERATOR_VERSION],
        "task": spec.to_json(),
        "needles": config.needles,
        "haystacks": config.haystacks,
        "needles_within": config.needles_within,
        "grain": config.cut_grain,
        "length": length,
        "seed": config.seed,
        "tokenizer": fmt.tokenizer.name,
        "format": fmt.name,
        "max_new_tokens": config.max_new_tokens,
    }
    return {"probes": probes, "model": model}


def _prepare(stage: _Stage, haystacks: list[ProbeHaystack], overwrite: bool) -> None:
    """Give the stage its haystacks and load its answered probes, checked against them."""
    stage.claim(overwrite)
    stage.haystacks = haystacks
    by_id = {(hay.index, p.needle): (hay, p) for hay in stage.haystacks for p in hay.probes}
    stage.records = {}
    for r in read_records(stage.directory / "probes.jsonl"):
        key = (r["haystack"], r["needle"])
        hay, probe = by_id.get(key, (None, None))
        if hay is None or (r["key"], r["value"], r["prefix_tokens"], r["cut"]) != (
            probe.key,
            probe.value,
            len(hay.prefix),
            probe.cut,
        ):
            raise ProvenanceMismatch(
                f"{stage.directory / 'probes.jsonl'}: probe {key} does not match the haystack "
                "these settings build (the tokenizer or the generator changed); use another "
                "output folder, or --overwrite to recompute it"
            )
        stage.records[key] = r


def _answer(
    stage: _Stage,
    lm: LanguageModel,
    haystack: ProbeHaystack | None,
    answers: Iterator[list[list[int]]],
) -> dict[tuple[int, int], dict[str, Any]]:
    """Records of every probe of one haystack, whose answers ``answers`` yields next; {} for
    no haystack."""
    if haystack is None:
        return {}
    start = time.perf_counter()
    answered = next(answers)
    seconds = time.perf_counter() - start
    records = {}
    for probe, ids in zip(haystack.probes, answered, strict=True):
        text = lm.tokenizer.decode(ids)
        pred = clean_prediction(text)
        records[(haystack.index, probe.needle)] = {
            "haystack": haystack.index,
            "needle": probe.needle,
            "stage": stage.fingerprint,
            "depth": probe.depth,
            "key": probe.key,
            "value": probe.value,
            "needle_position": probe.needle_position,
            "needle_depth": probe.needle_depth,
            "cut": probe.cut,
            "distance": probe.distance,
            "prefix_tokens": len(haystack.prefix),
            "prompt_tokens": probe.cut + len(probe.question),
            "pred": pred,
            "generated": text,
            "n_generated": len(ids),
            "correct": exact_match(pred, probe.value),
            "contains": match_all(pred, [probe.value]) == 1.0,
            # the haystack's prefill and all its answers; the chunks it shares with the
            # haystack this process answered before it were read (and timed) for that one
            "haystack_seconds": seconds,
        }
    return records


def _run_stage(
    stage: _Stage,
    lm: LanguageModel,
    stop: frozenset[int],
    bar: tqdm,
    procs: Processes,
) -> None:
    assert stage.haystacks is not None and stage.records is not None
    pending = [
        hay
        for hay in stage.haystacks
        if any((hay.index, p.needle) not in stage.records for p in hay.probes)
    ]
    bar.set_postfix_str(f"@ {stage.length}")
    if not pending:  # a finished stage makes no model call
        return
    # Several processes take the haystacks in turns, one each per round, each answering its
    # own in order (so its haystacks share their chunks); after every round the main process
    # rewrites probes.jsonl with everything answered so far.
    answers = answer_haystacks(lm, pending[procs.rank :: procs.world], stop)
    for first in range(0, len(pending), procs.world):
        mine = pending[first + procs.rank] if first + procs.rank < len(pending) else None
        for records in procs.each(lambda mine=mine: _answer(stage, lm, mine, answers)):
            stage.records.update(records)
        if procs.is_main:
            write_records(
                stage.directory / "probes.jsonl",
                [stage.records[k] for k in sorted(stage.records)],
            )
        bar.update(sum(len(h.probes) for h in pending[first : first + procs.world]))


def answered_haystacks(
    config: ProbeConfig, out_dir: str | os.PathLike[str], overwrite: bool = False
) -> dict[int, int]:
    """Per length of ``config``, how many haystacks a run into ``out_dir`` finds with every
    probe answered (its stage's probes.jsonl), so the cost said before a resumed run is that
    of the haystacks left (``ProbeConfig.expected_reads``); none under ``overwrite``, which
    recomputes them. Read before the haystacks are built, so the answers are not checked
    here: a stage whose answers do not match its settings is refused when the run loads it
    (`_prepare`), before any model call."""
    out = {}
    for n in config.lengths:
        records = [] if overwrite else read_records(Path(out_dir) / str(n) / "probes.jsonl")
        needles: dict[Any, int] = {}
        for r in records:
            needles[r["haystack"]] = needles.get(r["haystack"], 0) + 1
        out[n] = sum(count >= config.needles for count in needles.values())
    return out


def run_probes(
    model: Any,
    config: ProbeConfig,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    spec: str | None = None,
    command: str = "",
    progress: bool = True,
    overwrite: bool = False,
    processes: Processes | None = None,
    trained_length: int | None = None,
) -> ProbesResult:
    """Probe `model` at every length of `config` into `out_dir` (module docstring); return
    the summary (also `out_dir/summary.json`, kind "probes"). `model` is a Backbone, a
    Decoder, a Hugging Face causal LM or a `BackboneLM` (with `tokenizer` when it has none);
    `spec` names its encoding in the result; `trained_length`, the model's training length,
    is marked in the figure and recorded. Under several processes all return the summary
    and the main process writes the files."""
    lm = as_language_model(model, tokenizer)
    task = probe_task(config.task)
    procs = processes if processes is not None else current_processes()
    place_on(lm, procs.device)
    progress = progress and procs.is_main
    out = Path(out_dir)
    identity = lm.identity()
    provenance = {"model": identity}
    check_probe_sizes(config, lm)
    if procs.is_main:  # another command's or another model's summary is never replaced
        check_replaceable(out / "summary.json", "probes", provenance, overwrite=overwrite)
    fmt = PromptFormat(lm.tokenizer, chat=config.chat)
    stages = [
        _Stage(n, out / str(n), _provenance(task, n, config, fmt, identity)) for n in config.lengths
    ]

    _prepare_stages(stages, task, fmt, config, overwrite, procs, progress)
    stop = newline_ids(lm.tokenizer) | lm.eos_ids
    total = config.needles * config.haystacks * len(stages)
    done = sum(len(s.records or {}) for s in stages)
    with tqdm(total=total - done, desc="probes", unit="probe", disable=not progress) as bar:
        for stage in stages:
            _run_stage(stage, lm, stop, bar, procs)

    records = [{**r, "length": s.length} for s in stages for r in (s.records or {}).values()]
    summary = summarize_records(records, config.bin_edges, config.reach_accuracy, config.confidence)
    _complete_stages(stages, summary["by_length"], procs, command, spec, config.seed)
    paths = {
        "summary": str(out / "summary.json"),
        "accuracy_vs_distance": str(out / "accuracy_vs_distance.png"),
    }
    result = ProbesResult(
        meta=run_metadata(command, spec=spec, seed=config.seed),
        provenance=json.loads(to_json(provenance)),  # as the file holds it
        run="probes",
        spec=spec,
        seed=config.seed,
        format=fmt.name,
        task=TaskRecord(**task.to_json()),
        config=config,
        probes_per_length=config.needles * config.haystacks,
        prefills_per_length=config.haystacks,
        scoring=SCORING,
        trained_length=trained_length,
        overall=Accuracy(**summary["overall"]),
        by_length=tuple(LengthAccuracy.from_entry(e) for e in summary["by_length"]),
        by_distance=tuple(typed_entry(DistanceAccuracy, e) for e in summary["by_distance"]),
        reach=Reach(**summary["reach"]),
        model=lm.describe(),
        paths=paths,
    )
    if procs.is_main:
        title = " ".join(filter(None, [task.name, spec]))
        plot_accuracy_vs_distance(
            {spec or "model": result.by_distance}, paths["accuracy_vs_distance"],
            trained_length, config.reach_accuracy, title,
        )  # fmt: skip
        write_result(out / "summary.json", "probes", result)
    procs.barrier()
    return result


def _prepare_stages(
    stages: list[_Stage],
    task: TaskSpec,
    fmt: PromptFormat,
    config: ProbeConfig,
    overwrite: bool,
    procs: Processes,
    progress: bool,
) -> None:
    """Give every stage its haystacks and its answered probes (`_prepare`).

    The main process checks the stage files and builds the haystacks; the others take them
    (``Processes.on_main``), so only one process reads or clears the folders."""

    def prepare() -> list[tuple[Any, Any]]:
        # Every length's haystacks first (a length they do not fit is refused here), then
        # the stage folders: a refused run leaves every folder as it found it.
        built = [
            [build_haystack(task, fmt, config, stage.length, h) for h in range(config.haystacks)]
            for stage in tqdm(stages, desc="haystacks", unit="length", disable=not progress)
        ]
        for stage, haystacks in zip(stages, built, strict=True):
            _prepare(stage, haystacks, overwrite)
        return [(s.haystacks, s.records) for s in stages]

    for stage, (haystacks, records) in zip(stages, procs.on_main(prepare), strict=True):
        stage.haystacks, stage.records = haystacks, records


def _complete_stages(
    stages: list[_Stage],
    by_length: list[dict[str, Any]],
    procs: Processes,
    command: str,
    spec: str | None,
    seed: int,
) -> None:
    """Add each stage's haystack count, mean prefix size and digest to its entry of
    ``by_length`` (in place: the entries are the run summary's), and (main process) write
    the entry as the stage's summary.json, now complete."""
    for stage, entry in zip(stages, by_length, strict=True):
        haystacks = stage.haystacks or []
        entry["haystacks"] = len(haystacks)
        entry["mean_prefix_tokens"] = float(np.mean([len(h.prefix) for h in haystacks]))
        entry["stage"] = stage.fingerprint
        if procs.is_main:
            meta = run_metadata(command, spec=spec, seed=seed)
            write_result(
                stage.directory / "summary.json", "probe-stage",
                {**entry, "complete": True}, meta=meta, provenance=stage.provenance,
            )  # fmt: skip
