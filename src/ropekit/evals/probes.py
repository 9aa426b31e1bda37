"""Many retrieval probes per long forward: K needles in one haystack, each asked from the same
cached prefix.

Holds:
- `ProbeConfig`: lengths, needles per haystack (K), haystacks per length, task, seed, budget.
- `Probe`, `ProbeHaystack`: one haystack of a length with its K needles and their questions,
  as token ids (`build_haystack`).
- `answer_probes(lm, haystack, stop)`: prefill the haystack once, answer every question from
  that cached prefix (the KV cache cropped back after each); `answer_haystacks` does so for
  several haystacks in turn, reading the chunks a haystack shares with the one before it
  once; `answer_separately` is the reference, one full prompt (haystack + question) per
  probe.
- `exact_match(prediction, value)`: the score of one probe.
- `run_probes(model, config, out_dir, ...)`: the staged, resumable evaluation
  (`ropekit eval probes`), per-probe JSONL, a summary with Wilson intervals, figures; the
  summary is a `ProbesResult` (the ``probes`` kind at `VERSION`: its `TaskRecord`, the
  `Accuracy` overall, `LengthAccuracy`, `DepthAccuracy` and `CellAccuracy` entries).

Why: a needle-in-a-haystack sample costs one long prefill, so a length x depth grid with
enough probes to be an accuracy (>= 20 per length) costs 20 long prefills per length. Here a
haystack of L tokens carries K needles "The value of key <key> is <value>." at K depths
(evenly spaced over [0, 1], depth 0 = start), the prefix (preamble + haystack) is read once
into the KV cache, and each question "What is the value of key <key>? The value of key <key>
is" runs after it, is answered greedily, and is then cropped off the cache
(`Backbone.crop_cache`), so the next question sees exactly the prefix again. The other K - 1
needles are distractors of the asked one (RULER's multikey setting). H haystacks per length
give H x K probes for H prefills; the needles of haystack h are the same at every length (only
the filler around them grows), as in the task runner. The haystacks of a length differ only
from their first needle on, so each reads again only from there: the whole chunks it shares
with the haystack before it stay in the cache (`answer_haystacks`; bit for bit a fresh
prefill's). With one needle in the middle each later haystack keeps about half its tokens,
its cheaper half (its attention reaches half as far): 5 haystacks of 8k on SmolLM2-135M took
0.85 of the time of each prefilled alone (benchmarks/probes.py).

The format is a registered niah-style task (`evals/tasks.py`): its haystack (noise, essay,
corpus:<data> or needles), key and value types, digits and preamble; its number of keys is
replaced by K, and it must ask one value of one key (`n_values = n_queries = 1`).
`kv1_shakespeare` is the retrieval training mixture's kv record (3-letter keys, 4-digit
values), so a model trained on that mixture is probed in distribution.

Equal to one prompt per probe: every probe's prompt is the prefix's ids followed by its
question's ids (tokenized apart, so all probes share the prefix token for token), and the
reference decodes exactly that prompt from scratch. Attention is causal, so the question's
logits are those of the full prompt: for static encodings the answers are the same up to
float noise (tested). Dynamic schedules (dynamic NTK, LongRoPE) past the original length read
the haystack at the length it was prefilled with, as any cached decoding does (see
`ropekit.model.cache`); the reference's chunked prefill does too, only at other chunk
boundaries.

Score: exact match of the first word of the answer line (trailing punctuation and quotes
stripped, case ignored) with the value: "4819302." is right, "48193021" and "the value is
4819302" are not. RULER's substring rule is recorded beside it (`contains`) and each length
has its accuracy by that rule too (`substring`: "4819302.0000" is right by it). Accuracies come
with Wilson score intervals (`evals/intervals.py`). Beside each length's accuracy, the wrong
answers that name another needle's value, and how many of those the needle nearest the
question (`distractor_answers`): a model that copies the latest needle has not read the
haystack worse at that length, it cannot bind keys to values at all, and then only one
needle per haystack (H prefills for H probes) measures its reach.

Output layout:

    out_dir/
      summary.json              kind "probes": accuracy per length, per depth, per cell,
                                overall, each with its Wilson interval
      accuracy_vs_length.png    accuracy with its interval
      heatmap.png               accuracy over length x depth
      <length>/summary.json     kind "probe-stage": the stage's provenance and score
      <length>/probes.jsonl     one record per answered probe (its needle, prompt sizes,
                                answer, score, the stage digest), rewritten after each haystack

Resuming and provenance, as in `evals/runner.py`: a stage's provenance is what its probes
depend on (generator versions, task, K, H, length, seed, tokenizer, prompt format, answer
budget) and the model (`Backbone.identity`); its `summary.json` records it from the start and
every record carries its digest. A rerun regenerates the haystacks (deterministic, checked
against the records) and prefills only those with unanswered probes: a finished run makes no
model call. A stage of other settings or another model is refused, naming the field, unless
`overwrite`. Several processes (`accelerate launch`, `torchrun`) take the haystacks in turns
and the main process writes the files.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
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
from ropekit.evals.haystack import Haystack, load_haystack
from ropekit.evals.intervals import CONFIDENCE, accuracy_entry
from ropekit.evals.plots import plot_heatmap
from ropekit.evals.prompts import PromptFormat
from ropekit.evals.scoring import clean_prediction, match_all
from ropekit.evals.stages import Stage
from ropekit.evals.tasks import (
    ANSWER_SLACK_FRACTION,
    ANSWER_SLACK_MIN,
    BASE_TASKS,
    GENERATOR_VERSION,
    KEY_TYPES,
    VALUE_TYPES,
    TaskDoesNotFit,
    TaskRecord,
    TaskSpec,
    _check_choice,
    _check_min,
    _key_source,
    _largest_fitting,
    _seed,
    _value_source,
    get_task,
    stable_hash,
)
from ropekit.figures import figure, length_axis, save
from ropekit.results import (
    ProvenanceMismatch,
    check_replaceable,
    read_records,
    register,
    run_metadata,
    to_json,
    write_records,
    write_result,
)

# Bump when the haystacks or questions built for the same settings change: stored probes of
# another version are then refused instead of mixed with new ones.
PROBES_VERSION = 1
_TRAILING = ".,;:!?\"')]"
_LEADING = "\"'(["


@dataclass(frozen=True)
class ProbeConfig:
    """Settings of a many-probes retrieval evaluation. Lengths count the model's tokens."""

    lengths: tuple[int, ...]  # prompt lengths (tokens, longest question and answer included)
    needles: int = 5  # K: keys with values per haystack, at K evenly spaced depths; each asked once
    haystacks: int = 4  # H: haystacks per length; H x K probes per length for H long prefills
    # the format: a registered niah-style task (haystack text, key and value types, digits,
    # preamble); kv1_shakespeare is the retrieval training mixture's kv record
    task: str = "niah_single_2"
    seed: int = 0  # draws keys, values and which needle sits at which depth
    max_new_tokens: int | None = None  # answer budget (tokens); None: each value's length + slack
    chat: bool = False  # wrap prompts in the tokenizer's chat template (instruction models)
    confidence: float = CONFIDENCE  # level of the Wilson score intervals

    def __post_init__(self) -> None:
        lengths = tuple(self.lengths)
        if not lengths or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths
        ):
            raise ValueError(
                f"lengths={self.lengths!r} is not allowed; allowed: one or more integers >= 1"
            )
        object.__setattr__(self, "lengths", tuple(sorted(set(lengths))))
        for name in ("needles", "haystacks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; allowed: an integer >= 1")
        if self.max_new_tokens is not None and (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens!r} is not allowed; allowed: None or an "
                "integer >= 1"
            )
        if isinstance(self.confidence, bool) or not 0.0 < self.confidence < 1.0:
            raise ValueError(
                f"confidence={self.confidence!r} is not allowed; allowed: 0 < confidence < 1"
            )
        probe_task(self.task)  # an unknown or unsuitable task fails here, not at the first stage

    @property
    def depths(self) -> tuple[float, ...]:
        """The K needle depths: k / (K - 1), or the middle for one needle."""
        k = self.needles
        return tuple(i / (k - 1) for i in range(k)) if k > 1 else (0.5,)


def probe_task(task: str | TaskSpec) -> TaskSpec:
    """The registered task whose format the probes use; ValueError unless it is niah-style
    and asks one value of one key."""
    spec = get_task(task)
    args = _niah_args(spec) if spec.base == "niah" else {}
    if spec.base != "niah" or args["n_values"] != 1 or args["n_queries"] != 1:
        raise ValueError(
            f"task={spec.name!r} is not allowed for probes: it is a {spec.base} task"
            + (
                f" asking {args['n_queries']} key(s) with {args['n_values']} value(s)"
                if args
                else ""
            )
            + "; allowed: a niah task asking one value of one key (niah_single_1/2/3, "
            "niah_multikey_1/2/3, kv1_shakespeare, kv_shakespeare)"
        )
    _check_choice("key_type", args["key_type"], KEY_TYPES)
    _check_choice("value_type", args["value_type"], VALUE_TYPES)
    _check_min("value_digits", args["value_digits"], 1)
    return spec


def _niah_args(spec: TaskSpec) -> dict[str, Any]:
    """The task's arguments over ``tasks.niah``'s defaults."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(BASE_TASKS["niah"]).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {**defaults, **spec.args}


# ----------------------------------------------------------------------------- haystacks
@dataclass(frozen=True)
class Probe:
    """One needle of a haystack and the question that asks for it."""

    needle: int  # index of the needle in its haystack (the order keys were drawn)
    depth: float  # requested depth (0 = start of the haystack, 1 = end)
    key: str
    value: str
    needle_position: int  # token index where the needle starts in the prefix
    needle_depth: float  # measured: share of the haystack's tokens before the needle
    question: tuple[int, ...]  # ids after the prefix: question and answer prefix
    max_new_tokens: int


@dataclass(frozen=True)
class ProbeHaystack:
    """A haystack of one length with its needles: every probe's prompt is prefix + question."""

    length: int
    index: int  # h: draws the needles (the same at every length)
    prefix: tuple[int, ...]  # preamble and haystack with the needles, BOS or chat header first
    probes: tuple[Probe, ...]
    units: int  # haystack units used

    def prompt(self, probe: Probe) -> list[int]:
        """The full prompt of one probe, as the one-prompt-per-probe reference reads it."""
        return [*self.prefix, *probe.question]


def _budget(fmt: PromptFormat, value: str, max_new_tokens: int | None) -> int:
    """Generation budget of one answer: the ideal answer's tokens plus slack (tasks.py)."""
    if max_new_tokens is not None:
        return max_new_tokens
    n = len(fmt.tokenizer.encode(f" {value}."))
    return n + max(ANSWER_SLACK_MIN, math.ceil(ANSWER_SLACK_FRACTION * n))


def build_haystack(
    spec: TaskSpec, fmt: PromptFormat, config: ProbeConfig, length: int, index: int
) -> ProbeHaystack:
    """Haystack ``index`` of ``length`` tokens with ``config.needles`` needles: the most
    haystack units with which the prefix, the longest question and its answer budget fit.
    Randomness comes from (seed, task, index) only. TaskDoesNotFit when even an empty
    haystack with the needles is too long."""
    args = _niah_args(spec)
    key_type, value_type = args["key_type"], args["value_type"]
    digits = args["value_digits"]
    K = config.needles
    rng = np.random.default_rng([config.seed, stable_hash(spec.name), stable_hash("probes"), index])
    keys = _key_source(key_type, _seed(rng)).take(K)
    values = _value_source(value_type, digits, _seed(rng), exclude=keys).take(K)
    # Which needle sits at which depth: a seeded permutation, so depth and draw order differ.
    depths = [config.depths[int(i)] for i in rng.permutation(K)]
    texts = _ProbeTexts(
        fmt=fmt,
        preamble=args["preamble"],
        hay=_haystack(args["haystack"], rng, key_type, value_type, digits, keys, values),
        pieces=[
            (d, f"The value of key {k} is {v}.")
            for d, k, v in zip(depths, keys, values, strict=True)
        ],
        questions=[(f"What is the value of key {k}?", f"The value of key {k} is") for k in keys],
    )
    budgets = [_budget(fmt, v, config.max_new_tokens) for v in values]
    n = _units_that_fit(texts, budgets, length, spec.name)
    prefix_text, tails, start = texts.split(n)
    context = texts.hay.context(n, texts.pieces)
    chars = [start, start + len(context.text)]
    chars += [start + a for a, _ in context.spans] + [start + b for _, b in context.spans]
    n_prefix, positions = fmt.locate(prefix_text, chars)
    prefix = fmt.encode(prefix_text)
    if len(prefix) != n_prefix:  # locate and encode tokenize the same text
        raise AssertionError(f"prefix of {len(prefix)} tokens located as {n_prefix}")
    context_start, context_end = positions[0], positions[1]
    starts, ends = positions[2 : 2 + K], positions[2 + K :]
    needle_depths = _needle_depths(context_start, context_end, starts, ends)
    probes = [
        Probe(
            needle=k,
            depth=depths[k],
            key=keys[k],
            value=values[k],
            needle_position=starts[k],
            needle_depth=needle_depths[k],
            question=tuple(fmt.tokenizer.encode(tails[k])),
            max_new_tokens=budgets[k],
        )
        for k in range(K)
    ]
    return ProbeHaystack(length, index, tuple(prefix), tuple(probes), n)


@dataclass(frozen=True)
class _ProbeTexts:
    """The texts of one haystack's prompts before tokenizing: preamble, then the first n
    haystack units with the needle ``pieces`` at their depths, then each question."""

    fmt: PromptFormat
    preamble: str
    hay: Haystack
    pieces: list[tuple[float, str]]  # (depth, needle sentence)
    questions: list[tuple[str, str]]  # (question, answer prefix)

    def split(self, n: int) -> tuple[str, list[str], int]:
        """(prefix text, question texts, character where the context starts) with n units.

        Every probe's prompt is rendered whole and cut where its question starts; the text
        before the cut must be the same for every question, or they could not share one
        cached prefix (a chat template may render it differently): ValueError."""
        context = self.hay.context(n, self.pieces).text
        prefix_text, tails, start = None, [], 0
        for question, answer_prefix in self.questions:
            text, offset = self.fmt.render(f"{self.preamble}{context}\n{question}", answer_prefix)
            cut = offset + len(self.preamble) + len(context)
            if prefix_text is None:
                prefix_text, start = text[:cut], offset + len(self.preamble)
            elif text[:cut] != prefix_text:
                raise ValueError(
                    f"the chat template of {self.fmt.tokenizer.name!r} renders the text before "
                    "the question differently for each question, so the probes cannot share a "
                    "prefix; allowed: chat=False"
                )
            tails.append(text[cut:])
        assert prefix_text is not None
        return prefix_text, tails, start


def _units_that_fit(texts: _ProbeTexts, budgets: list[int], length: int, task: str) -> int:
    """The most haystack units with which the prefix, then the longest question with its
    answer budget (one budget per needle), fit in ``length`` tokens; TaskDoesNotFit when even
    the prefix without haystack does not."""
    fmt = texts.fmt
    _, tails, _ = texts.split(0)
    tail_ids = [fmt.tokenizer.encode(t) for t in tails]
    room = length - max(len(t) + b for t, b in zip(tail_ids, budgets, strict=True))
    smallest = len(fmt.encode(texts.split(0)[0]))
    if smallest > room:
        raise TaskDoesNotFit(
            f"{len(budgets)} needles of task {task!r} do not fit length={length}: the prefix "
            f"without haystack takes {smallest} tokens and the longest question with its answer "
            f"{length - room}; allowed: length >= {smallest + length - room}, or fewer needles"
        )
    return _largest_fitting(lambda u: len(fmt.encode(texts.split(u)[0])), 0, room)


def _needle_depths(
    context_start: int, context_end: int, starts: list[int], ends: list[int]
) -> list[float]:
    """Each needle's measured depth: the share of the haystack's tokens before it, the
    needles themselves not counted (as ``tasks.generate_sample``); 0 for an empty haystack.

    ``starts`` / ``ends``: token index where each needle starts and ends in the prefix;
    ``context_start`` / ``context_end``: where the haystack (needles included) does."""
    sizes = [b - a for a, b in zip(starts, ends, strict=True)]
    filler = context_end - context_start - sum(sizes)
    depths = []
    for start in starts:
        before = start - context_start
        before -= sum(size for s, size in zip(starts, sizes, strict=True) if s < start)
        depths.append(before / filler if filler > 0 else 0.0)
    return depths


def _haystack(
    name: str,
    rng: np.random.Generator,
    key_type: str,
    value_type: str,
    digits: int,
    keys: list[str],
    values: list[str],
) -> Haystack:
    """The filler: a named text haystack, or (``needles``, RULER's multikey 2 and 3) lines of
    distractor needles sharing no key or value with the real ones, as ``tasks.niah`` makes."""
    if name != "needles":
        return load_haystack(name)
    taken = [*keys, *values]
    keys_out = _key_source(key_type, _seed(rng), exclude=taken)
    values_out = _value_source(value_type, digits, _seed(rng), exclude=taken)
    return Haystack("needles", lambda i: f"The value of key {keys_out[i]} is {values_out[i]}.\n")


# ----------------------------------------------------------------------------- answering
def exact_match(prediction: str, value: str) -> bool:
    """Whether the first word of ``prediction`` (quotes and brackets around it and trailing
    punctuation stripped, case ignored) is ``value`` (module docstring)."""
    words = prediction.split()
    return bool(words) and words[0].lstrip(_LEADING).rstrip(_TRAILING).lower() == value.lower()


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
    haystack in turn, yielded haystack by haystack: one prefill of its prefix, then each
    question after the same cached prefix; the chunks a prefix shares with the haystack
    before it (the filler up to the first needle) are read once
    (``LanguageModel.greedy_after_prefixes``)."""
    return lm.greedy_after_prefixes(
        (
            PrefixQuestions(
                hay.prefix, [p.question for p in hay.probes], [p.max_new_tokens for p in hay.probes]
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
    """The reference: each probe's full prompt (prefix + question) decoded on its own, one
    prefill per probe (``LanguageModel.greedy``)."""
    return [lm.greedy([haystack.prompt(p)], p.max_new_tokens, stop)[0] for p in haystack.probes]


# ----------------------------------------------------------------------------- stages
@dataclass
class _Stage(Stage):
    kind: ClassVar[str] = "probe-stage"
    records_file: ClassVar[str] = "probes.jsonl"
    settings: ClassVar[str] = (
        "task, needles, haystacks, seed, tokenizer, prompt format, answer budget"
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
        if hay is None or (r["key"], r["value"], r["prefix_tokens"]) != (
            probe.key,
            probe.value,
            len(hay.prefix),
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
            "prefix_tokens": len(haystack.prefix),
            "prompt_tokens": len(haystack.prefix) + len(probe.question),
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


# ----------------------------------------------------------------------------- summaries
def _accuracy(
    records: Sequence[dict[str, Any]], confidence: float, rule: str = "correct"
) -> dict[str, Any]:
    """The accuracy of ``records`` by ``rule``, the field each answer's verdict is in."""
    return accuracy_entry(sum(bool(r[rule]) for r in records), len(records), confidence)


def _substring(records: Sequence[dict[str, Any]], confidence: float) -> dict[str, Any] | None:
    """The accuracy by RULER's substring rule (``contains``: the value anywhere in the answer,
    case ignored), from the answers' own records; None if any answer did not record it."""
    if any("contains" not in r for r in records):
        return None
    return _accuracy(records, confidence, rule="contains")


def distractor_answers(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many wrong answers name the value of another needle of the same haystack
    (``other_needle``), and how many of those the needle nearest the question
    (``nearest_needle``, the largest needle position). A model that copies the latest needle
    whatever the key fails the binding of key to value, not the length: a small base model
    does so inside its own window (SmolLM2-135M: experiment D's README), which makes K > 1
    needles per haystack a test it cannot pass at any length."""
    haystacks: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for r in records:
        haystacks.setdefault((r.get("length"), r["haystack"]), []).append(r)
    other = nearest = 0
    for group in haystacks.values():
        last = max(group, key=lambda r: r["needle_position"])
        for r in group:
            if r["correct"]:
                continue
            named = [o for o in group if o is not r and exact_match(r["pred"], o["value"])]
            other += bool(named)
            nearest += any(o is last for o in named)
    return {"other_needle": other, "nearest_needle": nearest}


def summarize_records(
    records: Sequence[dict[str, Any]], confidence: float = CONFIDENCE
) -> dict[str, Any]:
    """Accuracy (with its Wilson interval) per length, per depth (all lengths pooled), per
    (length, depth) cell and overall, from per-probe records carrying "length", "depth",
    "correct" and "needle_depth"; per length also by RULER's substring rule, from "contains"."""
    if not records:
        raise ValueError("records=[] is not allowed; allowed: at least one answered probe")
    lengths = sorted({r["length"] for r in records})
    depths = sorted({r["depth"] for r in records})

    def group(**where: Any) -> list[dict[str, Any]]:
        return [r for r in records if all(r[k] == v for k, v in where.items())]

    return {
        "overall": _accuracy(records, confidence),
        "by_length": [
            {
                "length": n,
                **_accuracy(at, confidence),
                **distractor_answers(at),
                "substring": _substring(at, confidence),
            }
            for n in lengths
            if (at := group(length=n))
        ],
        "by_depth": [
            {
                "depth": d,
                **_accuracy(group(depth=d), confidence),
                "needle_depth": float(np.mean([r["needle_depth"] for r in group(depth=d)])),
            }
            for d in depths
        ],
        "cells": [
            {"length": n, "depth": d, **_accuracy(cell, confidence)}
            for n in lengths
            for d in depths
            if (cell := group(length=n, depth=d))
        ],
    }


# ----------------------------------------------------------------------------- the record
@dataclass(frozen=True)
class Accuracy:
    """An accuracy with its Wilson interval (``evals.intervals.accuracy_entry``)."""

    correct: int
    n: int
    accuracy: float
    low: float
    high: float
    confidence: float


@dataclass(frozen=True)
class NeedleAccuracy(Accuracy):
    """An accuracy of needle probes (exact match) with its wrong answers that name another
    needle's value, and of those the nearest needle's (``distractor_answers``), and the
    accuracy by RULER's substring rule (``substring``: "7432144.0000" counts for 7432144);
    each None in a summary written before it was counted."""

    other_needle: int | None
    nearest_needle: int | None
    substring: Accuracy | None


@dataclass(frozen=True)
class LengthAccuracy(NeedleAccuracy):
    """One length: its accuracy, the wrong answers naming another needle, its stage."""

    length: int
    haystacks: int  # prefills
    mean_prefix_tokens: float
    stage: str  # the stage's digest

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> LengthAccuracy:
        """A `summarize_records` by_length entry, completed by `_complete_stages`."""
        substring = entry["substring"] and Accuracy(**entry["substring"])
        return cls(**{**entry, "substring": substring})


@dataclass(frozen=True)
class DepthAccuracy(Accuracy):
    """One needle depth, all lengths pooled."""

    depth: float
    needle_depth: float  # mean of where the needles actually sit (0 = start)


@dataclass(frozen=True)
class CellAccuracy(Accuracy):
    """One (length, depth) cell."""

    length: int
    depth: float


VERSION = 4  # 4: the substring rule's accuracy per length; 3: typed; 2: the untyped layout
SCORING = (
    "exact match of the answer's first word with the value (trailing punctuation stripped, "
    "case ignored); per length also RULER's substring rule (the value anywhere in the "
    "answer, case ignored)"
)


def _from_v2(data: dict[str, Any]) -> dict[str, Any]:
    """The untyped layout: summaries written before the distractor counts lack them."""
    entries = [{"other_needle": None, "nearest_needle": None, **e} for e in data["by_length"]]
    return {**data, "by_length": entries}


def _from_v3(data: dict[str, Any]) -> dict[str, Any]:
    """Before the substring rule was summed: unknown here (None). Its answers hold it, so a
    rerun in the folder (no model call once every probe is answered) writes it."""
    return {**data, "by_length": [{**e, "substring": None} for e in data["by_length"]]}


@register("probes", VERSION, {2: _from_v2, 3: _from_v3})
@dataclass(frozen=True)
class ProbesResult:
    """summary.json of ``run_probes`` (also what it returns)."""

    meta: dict[str, Any]  # run_metadata
    provenance: dict[str, Any]  # the model: what a rerun in the folder must match
    run: str  # "probes"
    spec: str | None  # the encoding spec the model carried, as the caller named it
    seed: int
    format: str  # the prompt format (PromptFormat.name)
    task: TaskRecord
    config: ProbeConfig
    depths: tuple[float, ...]
    probes_per_length: int  # K x H
    prefills_per_length: int  # H
    scoring: str  # the rule, in words
    overall: Accuracy
    by_length: tuple[LengthAccuracy, ...]
    by_depth: tuple[DepthAccuracy, ...]
    cells: tuple[CellAccuracy, ...]
    model: dict[str, Any]  # LanguageModel.describe()
    paths: dict[str, str]  # summary, accuracy_vs_length, heatmap

    def at(self, length: int) -> LengthAccuracy:
        """The entry of ``length``; KeyError naming the lengths probed when it is not one."""
        for entry in self.by_length:
            if entry.length == length:
                return entry
        raise KeyError(f"length {length} is not probed here: {[e.length for e in self.by_length]}")


def plot_accuracy(by_length: Sequence[LengthAccuracy], path: str | Path, title: str = "") -> Path:
    """Accuracy vs length with its (asymmetric) Wilson interval as error bars; RULER's
    substring rule beside exact match where the two differ at some length."""
    fig, axes = figure(6.8, 4.2)
    ax = axes[0, 0]
    xs = [e.length for e in by_length]
    series: list[tuple[str, list[tuple[int, Accuracy]], str, str]] = [
        ("exact match", [(e.length, e) for e in by_length], "o", "-")
    ]
    if any(e.substring is not None and e.substring.correct != e.correct for e in by_length):
        by_rule = [(e.length, e.substring) for e in by_length if e.substring is not None]
        series.append(("RULER's substring rule", by_rule, "s", "--"))
    for label, points, marker, style in series:
        ys = [a.accuracy for _, a in points]
        below = [a.accuracy - a.low for _, a in points]
        above = [a.high - a.accuracy for _, a in points]
        ax.errorbar([n for n, _ in points], ys, yerr=[below, above], marker=marker, ms=4,
                    capsize=3, lw=1.5, ls=style, label=label)  # fmt: skip
    if len(series) > 1:
        ax.legend(fontsize=8)
    length_axis(ax, xs, rotate=True)
    level = f"{100 * by_length[0].confidence:g}%" if by_length else ""
    ax.set(
        xlabel="context length (tokens)",
        ylabel=f"accuracy ({level} Wilson interval)",
        ylim=(-0.03, 1.03),
        title=title,
    )
    ax.grid(alpha=0.3)
    return save(fig, path)


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
) -> ProbesResult:
    """Probe `model` at every length of `config` into `out_dir` (module docstring); return
    the summary (also `out_dir/summary.json`, kind "probes"). `model` is a Backbone, a
    Decoder, a Hugging Face causal LM or a `BackboneLM` (with `tokenizer` when it has none);
    `spec` names its encoding in the result. Under several processes all return the summary
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
    summary = summarize_records(records, config.confidence)
    _complete_stages(stages, summary["by_length"], procs, command, spec, config.seed)
    paths = {
        "summary": str(out / "summary.json"),
        "accuracy_vs_length": str(out / "accuracy_vs_length.png"),
        "heatmap": str(out / "heatmap.png"),
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
        depths=tuple(config.depths),
        probes_per_length=config.needles * config.haystacks,
        prefills_per_length=config.haystacks,
        scoring=SCORING,
        overall=Accuracy(**summary["overall"]),
        by_length=tuple(LengthAccuracy.from_entry(e) for e in summary["by_length"]),
        by_depth=tuple(DepthAccuracy(**e) for e in summary["by_depth"]),
        cells=tuple(CellAccuracy(**e) for e in summary["cells"]),
        model=lm.describe(),
        paths=paths,
    )
    if procs.is_main:
        title = " ".join(filter(None, [task.name, spec]))
        plot_accuracy(result.by_length, paths["accuracy_vs_length"], title=title)
        cells = [{**c, "score": c["accuracy"]} for c in summary["cells"]]
        plot_heatmap(cells, paths["heatmap"], title=title)
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
