"""Retrieval accuracy as a function of needle distance: K needles near the start of one
haystack, each asked from its own cut point of one cached prefill.

Holds:
- `ProbeConfig`: lengths, needles per haystack (K), haystacks per length, where the needles
  sit, the grain of the cut points, the distance bins, the reach's accuracy, task, seed.
- `Probe`, `ProbeHaystack`: one haystack of a length with its K needles, each with its cut
  point and question, as token ids (`build_haystack`).
- `answer_probes(lm, haystack, stop)`: prefill the haystack once (up to its longest cut),
  answer every question from the cache cropped to its cut; `answer_haystacks` does so for
  several haystacks in turn; `answer_separately` is the reference, one prompt (the cut
  haystack + question) per probe read from scratch.
- `exact_match(prediction, value)`: the score of one probe.
- `summarize_records`, `reach`: accuracy per distance bin with Wilson intervals over
  independent probes, and the farthest distance up to which every bin holds.
- `trained_window`, `floor_note`: the probes within the trained length pooled, and the
  warning that the task is beyond the model where its positions are trained.
- `plot_accuracy_vs_distance`: accuracy against distance, one line per method, the trained
  length marked.
- `run_probes(model, config, out_dir, ...)`: the staged, resumable evaluation
  (`ropekit eval probes`), per-probe JSONL, a summary, the figure; the summary is a
  `ProbesResult` (the ``probes`` kind at `VERSION`: `Accuracy` overall, `LengthAccuracy`
  per haystack length, `DistanceAccuracy` per distance bin, the `Reach`).

Why distances: a needle at depth d of an L-token haystack asked from its end measures a
distance of (1 - d) L, not L; experiment E's "32k" probes (one needle at depth 0.5) asked
about needles 16k back. Here a probe's distance is measured, per probe: tokens from the
needle's first token to the question's first (`Probe.distance`), and every table is by it.

Why cut points: a probe's cost is its prefill. With attention causal, the KV cache of the
first c tokens of a haystack is what the haystack cut at c leaves, so questions asked from
several cut points of one prefill measure several distances for the price of one forward.
The K needles sit at seeded depths in [0, ``needles_within``] and each is asked once, from
its own cut point: the cut points are multiples of the grain behind every needle, one drawn
in each of K equal strata (so the distances spread over the haystack), dealt to the needles
in a seeded order. The prefill reads up to the longest cut in chunks that divide every cut
(`adapters.chunk_dividing`), and the questions are asked from the longest cut to the
shortest, the cache cropped (`Backbone.crop_cache`) to each; a chunk's keys and values
depend only on the chunks before it, and each ran at the length it runs at in a fresh read,
so the cropped cache is, bit for bit, the fresh prefill of the cut haystack in those chunks,
for every encoding (dynamic schedules and distance remaps included; tested per family, and
against one forward without a cache, exact where a cache is: ``ropekit.model.cache``).

Independent probes: every probe has its own needle, key and value (drawn from seed, task,
length and haystack), so no value is asked at two distances or two lengths, and a bin's
Wilson interval counts each probe once. The other K - 1 needles of a haystack are its
distractors (RULER's multikey setting): a model that copies the needle nearest the question
instead of binding keys to values (SmolLM2-135M: experiment D) fails them at every distance,
and the wrong answers that name another needle's value are counted (`distractor_answers`).
For such a model only K = 1 (one probe per prefill) measures distance: with one visible
needle per question, the distances one prefill of N tokens can measure sum to at most N.

The format is a registered niah-style task (`evals/tasks.py`): its haystack (noise, essay,
corpus:<data> or needles), key and value types, digits and preamble; its number of keys is
replaced by K, and it must ask one value of one key (`n_values = n_queries = 1`).
`kv1_shakespeare` is the retrieval training mixture's kv record (3-letter keys, 4-digit
values), so a model trained on that mixture is probed in distribution. A question follows
the haystack cut mid-text, on a new line, as RULER's template puts it after the haystack.

Score: exact match of the first word of the answer line (trailing punctuation and quotes
stripped, case ignored) with the value: "4819302." is right, "48193021" and "the value is
4819302" are not. RULER's substring rule is recorded beside it (`contains`) and each bin has
its accuracy by that rule too (`substring`: "4819302.0000" is right by it). Accuracies come
with Wilson score intervals (`evals/intervals.py`). The reach is the upper edge of the last
bin of the run of bins, from the shortest distance on, at or above ``reach_accuracy``.

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
the files. Summaries from before distances (version 4: needles at evenly spaced depths, all
asked from the end) still read, without distance bins or reach.
"""

from __future__ import annotations

import inspect
import itertools
import json
import math
import os
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
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
from ropekit.figures import figure, save
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
PROBES_VERSION = 2  # 2: needles near the start, each asked from its own cut point
_TRAILING = ".,;:!?\"')]"
# The default grain of cut points: a 64th of the longest length, so K needles fit K cuts.
GRAIN_SHARE = 64
_LEADING = "\"'(["


@dataclass(frozen=True)
class ProbeConfig:
    """Settings of a many-probes retrieval evaluation. Lengths count the model's tokens."""

    lengths: tuple[int, ...]  # haystack lengths (tokens, longest question and answer included)
    # K: needles per haystack, each with its own key and value, each asked once from its own
    # cut point of the one prefill; the other K - 1 are its distractors
    needles: int = 5
    haystacks: int = 4  # H: haystacks per length; H x K probes per length for H long prefills
    # the needles sit at seeded depths in [0, needles_within] of the haystack, so the cut
    # points behind them measure distances up to nearly the whole length
    needles_within: float = 0.05
    # cut points are multiples of it (tokens), so the prefill's chunks end at each; None: the
    # largest power of two at most the longest length / GRAIN_SHARE (512 at 32k)
    grain: int | None = None
    bins: int = 8  # distance bins: equal widths over (0, longest length]
    reach_accuracy: float = 0.8  # reach: the farthest bin up to which every bin scores this
    # the format: a registered niah-style task (haystack text, key and value types, digits,
    # preamble); kv1_shakespeare is the retrieval training mixture's kv record
    task: str = "niah_single_2"
    seed: int = 0  # draws keys, values, needle depths and cut points
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
        for name in ("needles", "haystacks", "bins"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; allowed: an integer >= 1")
        if self.grain is not None and (
            isinstance(self.grain, bool) or not isinstance(self.grain, int) or self.grain < 1
        ):
            raise ValueError(
                f"grain={self.grain!r} is not allowed; allowed: None or an integer >= 1"
            )
        if self.max_new_tokens is not None and (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens!r} is not allowed; allowed: None or an "
                "integer >= 1"
            )
        for name, low_open in (("needles_within", False), ("reach_accuracy", True)):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not ((0.0 < value <= 1.0) if low_open else (0.0 <= value < 1.0))
            ):
                allowed = "0 < value <= 1" if low_open else "0 <= value < 1"
                raise ValueError(f"{name}={value!r} is not allowed; allowed: {allowed}")
        if isinstance(self.confidence, bool) or not 0.0 < self.confidence < 1.0:
            raise ValueError(
                f"confidence={self.confidence!r} is not allowed; allowed: 0 < confidence < 1"
            )
        probe_task(self.task)  # an unknown or unsuitable task fails here, not at the first stage

    @property
    def cut_grain(self) -> int:
        """The grain cut points are multiples of (``grain``, or its default)."""
        if self.grain is not None:
            return self.grain
        return 1 << max(0, (max(self.lengths) // GRAIN_SHARE).bit_length() - 1)

    def expected_reads(self, length: int) -> tuple[int, ...]:
        """The tokens each of the H haystacks of ``length`` can be expected to read, for the
        cost said before the work starts (the haystacks are built later): a haystack is read
        up to its longest cut, drawn in the top of K equal strata of the cut points behind its
        needles (``_cut_points``), so spread evenly over that top 1/K: one needle reads about
        half the haystack on average, 12 nearly all of it."""
        start = self.needles_within * length  # the needles end about here at the latest
        top = (length - start) / self.needles
        return tuple(round(length - top + top * (i + 0.5) / self.haystacks)
                     for i in range(self.haystacks))  # fmt: skip

    @property
    def bin_edges(self) -> tuple[int, ...]:
        """The distance bins' edges (tokens): bin i holds distances in (edge i, edge i + 1]."""
        longest = max(self.lengths)
        return tuple(round(i * longest / self.bins) for i in range(self.bins + 1))


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
    """One needle of a haystack and the question that asks for it from its cut point."""

    needle: int  # index of the needle in its haystack (the order keys were drawn)
    depth: float  # requested depth (0 = start of the haystack, 1 = end), drawn near the start
    key: str
    value: str
    needle_position: int  # token index where the needle starts in the prefix
    needle_depth: float  # measured: share of the haystack's tokens before the needle
    cut: int  # the prefix tokens the question follows (a multiple of the grain, or all)
    question: tuple[int, ...]  # ids after the cut prefix: question and answer prefix
    max_new_tokens: int

    @property
    def distance(self) -> int:
        """Tokens from the needle's first token to the question's first: what it measures."""
        return self.cut - self.needle_position


@dataclass(frozen=True)
class ProbeHaystack:
    """A haystack of one length with its needles: every probe's prompt is the prefix cut at
    the probe's cut point, then its question."""

    length: int
    index: int  # h: draws the needles (with the length: no value is asked at two lengths)
    prefix: tuple[int, ...]  # preamble and haystack with the needles, BOS or chat header first
    probes: tuple[Probe, ...]
    units: int  # haystack units used

    def prompt(self, probe: Probe) -> list[int]:
        """The full prompt of one probe, as the one-prompt-per-probe reference reads it."""
        return [*self.prefix[: probe.cut], *probe.question]


def _budget(fmt: PromptFormat, value: str, max_new_tokens: int | None) -> int:
    """Generation budget of one answer: the ideal answer's tokens plus slack (tasks.py)."""
    if max_new_tokens is not None:
        return max_new_tokens
    n = len(fmt.tokenizer.encode(f" {value}."))
    return n + max(ANSWER_SLACK_MIN, math.ceil(ANSWER_SLACK_FRACTION * n))


def build_haystack(
    spec: TaskSpec, fmt: PromptFormat, config: ProbeConfig, length: int, index: int
) -> ProbeHaystack:
    """Haystack ``index`` of ``length`` tokens with ``config.needles`` needles near its start,
    each asked from its own cut point: the most haystack units with which the prefix, the
    longest question and its answer budget fit. Randomness comes from (seed, task, length,
    index) only, so every probe of a run has its own key and value. TaskDoesNotFit when even
    an empty haystack with the needles is too long, or the prefix has fewer cut points behind
    the needles than there are needles."""
    args = _niah_args(spec)
    key_type, value_type = args["key_type"], args["value_type"]
    digits = args["value_digits"]
    K = config.needles
    rng = np.random.default_rng(
        [config.seed, stable_hash(spec.name), stable_hash("probes"), length, index]
    )
    keys = _key_source(key_type, _seed(rng)).take(K)
    values = _value_source(value_type, digits, _seed(rng), exclude=keys).take(K)
    depths = [float(d) for d in rng.uniform(0.0, config.needles_within, K)]
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
    cuts = _cut_points(rng, max(ends), len(prefix), K, config.cut_grain, spec.name, length)
    probes = [
        Probe(
            needle=k,
            depth=depths[k],
            key=keys[k],
            value=values[k],
            needle_position=starts[k],
            needle_depth=needle_depths[k],
            cut=cuts[k],
            question=tuple(fmt.tokenizer.encode(tails[k])),
            max_new_tokens=budgets[k],
        )
        for k in range(K)
    ]
    return ProbeHaystack(length, index, tuple(prefix), tuple(probes), n)


def _cut_points(
    rng: np.random.Generator,
    needles_end: int,
    prefix: int,
    K: int,
    grain: int,
    task: str,
    length: int,
) -> list[int]:
    """K distinct cut points, multiples of ``grain`` from the end of the last needle to the end
    of the prefix (and the end itself if they are too few): one drawn in each of K equal
    strata of them (so the distances spread over the whole haystack, not by chance), dealt
    to the needles in a seeded order."""
    first = max(grain, -(-needles_end // grain) * grain)  # every needle lies before every cut
    grid = np.arange(first, prefix + 1, grain)
    if len(grid) < K and prefix >= needles_end:
        # A haystack too short for its needles and the grain (a few filler tokens, if any,
        # after them) asks from the end of its prefix too: the prefill ends there whatever
        # the grain, so the question follows exactly the prefix, as a one-cut probe does.
        grid = np.union1d(grid, [prefix])
    if len(grid) < K:
        raise TaskDoesNotFit(
            f"{K} needles of task {task!r} need {K} cut points (multiples of grain={grain}) "
            f"behind them; length={length} holds {len(grid)}; allowed: fewer needles, a "
            "smaller grain or a longer length"
        )
    picked = [int(rng.choice(stratum)) for stratum in np.array_split(grid, K)]
    return [picked[int(i)] for i in rng.permutation(K)]


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
    """How many wrong answers name the value of another needle of the same haystack that the
    question could see (before its cut) (``other_needle``), and how many of those the needle
    nearest the question (``nearest_needle``, the largest needle position before the cut). A
    model that copies the latest needle whatever the key fails the binding of key to value,
    not the distance: a small base model does so inside its own window (SmolLM2-135M:
    experiment D's README), which makes K > 1 needles per haystack a test it cannot pass at
    any distance."""
    haystacks: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for r in records:
        haystacks.setdefault((r.get("length"), r["haystack"]), []).append(r)
    other = nearest = 0
    for group in haystacks.values():
        for r in group:
            if r["correct"]:
                continue
            cut = r.get("cut", math.inf)  # a record from before the cut points: the whole prefix
            seen = [o for o in group if o["needle_position"] < cut]
            last = max(seen, key=lambda o: o["needle_position"])
            named = [o for o in seen if o is not r and exact_match(r["pred"], o["value"])]
            other += bool(named)
            nearest += any(o is last for o in named)
    return {"other_needle": other, "nearest_needle": nearest}


def _needle_entry(records: Sequence[dict[str, Any]], confidence: float) -> dict[str, Any]:
    """An accuracy with the wrong answers naming another needle and the substring rule's."""
    return {
        **_accuracy(records, confidence),
        **distractor_answers(records),
        "substring": _substring(records, confidence),
    }


def summarize_records(
    records: Sequence[dict[str, Any]],
    edges: Sequence[int],
    reach_accuracy: float,
    confidence: float = CONFIDENCE,
) -> dict[str, Any]:
    """From per-probe records carrying "length", "distance", "correct" (and "contains" for
    RULER's substring rule): the accuracy overall, per haystack length and per distance bin
    (``edges``: bin i holds distances in (edges[i], edges[i + 1]]; empty bins left out),
    each with its Wilson interval over its probes, every probe counted once in each (a
    probe has its own needle, key and value); and the reach (`reach`)."""
    if not records:
        raise ValueError("records=[] is not allowed; allowed: at least one answered probe")
    edges = list(edges)
    outside = [r["distance"] for r in records if not edges[0] < r["distance"] <= edges[-1]]
    if outside:
        raise ValueError(
            f"distance {outside[0]} is outside the bins ({edges[0]}, {edges[-1]}]; allowed: "
            "bins that cover every probe's distance"
        )
    by_distance = []
    for low, high in itertools.pairwise(edges):
        inside = [r for r in records if low < r["distance"] <= high]
        if inside:
            mean = float(np.mean([r["distance"] for r in inside]))
            entry = {"low_distance": low, "high_distance": high, "mean_distance": mean}
            by_distance.append({**_needle_entry(inside, confidence), **entry})
    return {
        "overall": _accuracy(records, confidence),
        "by_length": [
            {"length": n, **_needle_entry(at, confidence)}
            for n in sorted({r["length"] for r in records})
            if (at := [r for r in records if r["length"] == n])
        ],
        "by_distance": by_distance,
        "reach": reach(by_distance, edges, reach_accuracy),
    }


def reach(
    by_distance: Sequence[dict[str, Any]], edges: Sequence[int], accuracy: float
) -> dict[str, Any]:
    """The farthest distance up to which retrieval holds: the upper edge of the last bin of
    the run of bins, from the shortest on, whose accuracy is at least ``accuracy``; a bin
    without probes or one below ends the run (0: the shortest bin is below). The point
    accuracies decide, so a reach is as noisy as its bins (their intervals beside it)."""
    scored = {(e["low_distance"], e["high_distance"]): e["accuracy"] for e in by_distance}
    farthest = 0
    for low, high in itertools.pairwise(edges):
        if scored.get((low, high), -1.0) < accuracy:
            break
        farthest = high
    return {"distance": farthest, "accuracy": accuracy}


def trained_window(by_distance: Sequence[Any], trained_length: int | None) -> TrainedWindow | None:
    """The probes of the distance bins (``DistanceAccuracy`` or compare's pooled bins) that
    end within ``trained_length``, pooled, each probe once; None without a trained length or
    without such a bin. Where the model's positions are trained, its retrieval is what an
    extension of them sets out to keep past that length: when even these probes score
    resolvably below the reach's accuracy, the task (its needles, its haystack) is beyond the
    model, and a reach measures that, not the positions (``floor_note``)."""
    if trained_length is None:
        return None
    inside = [b for b in by_distance if b.high_distance <= trained_length]
    if not inside:
        return None
    correct, n = sum(b.correct for b in inside), sum(b.n for b in inside)
    return TrainedWindow(
        up_to=max(b.high_distance for b in inside),
        accuracy=Accuracy(**accuracy_entry(correct, n, inside[0].confidence)),
    )


def floor_note(window: TrainedWindow | None, reach_accuracy: float, needles: int) -> str | None:
    """What a reader must know when the probes inside the trained window score resolvably
    below the reach's accuracy (the upper end of their interval under it), else None: the
    model misses the task where its positions are trained, so a reach at that accuracy
    cannot measure how far the positions hold (experiment E's redo: SmolLM2-135M scored 5/24
    within its 8k window with 12 needles per essay haystack)."""
    if window is None or window.accuracy.high >= reach_accuracy:
        return None
    remedies = "a lower reach accuracy or an easier task"
    if needles > 1:
        remedies = f"fewer needles per haystack (1: no distractors to bind among), {remedies}"
    return (
        f"inside the trained window (needles up to {window.up_to:,} tokens back) the probes "
        f"score {accuracy_text(window.accuracy)}, resolvably below the reach's "
        f"{reach_accuracy:g}: the model misses this task where its positions are trained, so "
        "its reach says nothing about them; read the accuracy past that length against this "
        f"one, or probe with {remedies}"
    )


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


def accuracy_text(entry: Accuracy) -> str:
    """``0.70 [0.48, 0.85] (14/20)``: an accuracy, its interval and its probes."""
    return f"{entry.accuracy:.2f} [{entry.low:.2f}, {entry.high:.2f}] ({entry.correct}/{entry.n})"


@dataclass(frozen=True)
class TrainedWindow:
    """The probes at distances within the trained length, pooled (`trained_window`)."""

    up_to: int  # the upper edge of the last bin they fill (tokens)
    accuracy: Accuracy


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
        return _typed(cls, entry)


@dataclass(frozen=True)
class DistanceAccuracy(NeedleAccuracy):
    """One distance bin: the probes whose question starts in (low, high] tokens after its
    needle's first token, each counted once."""

    low_distance: int
    high_distance: int
    mean_distance: float  # of its probes


@dataclass(frozen=True)
class Reach:
    """The farthest distance (tokens) up to which every distance bin scores at least
    ``accuracy`` (`reach`); 0 when the shortest bin does not."""

    distance: int
    accuracy: float


VERSION = 5  # 5: by distance; 4: the substring rule per length; 3: typed; 2: untyped
SCORING = (
    "exact match of the answer's first word with the value (trailing punctuation stripped, "
    "case ignored); also RULER's substring rule (the value anywhere in the answer, case "
    "ignored)"
)


def _from_v2(data: dict[str, Any]) -> dict[str, Any]:
    """The untyped layout: summaries written before the distractor counts lack them."""
    entries = [{"other_needle": None, "nearest_needle": None, **e} for e in data["by_length"]]
    return {**data, "by_length": entries}


def _from_v3(data: dict[str, Any]) -> dict[str, Any]:
    """Before the substring rule was summed: unknown here (None). Its answers hold it, so a
    rerun in the folder (no model call once every probe is answered) writes it."""
    return {**data, "by_length": [{**e, "substring": None} for e in data["by_length"]]}


def _from_v4(data: dict[str, Any]) -> dict[str, Any]:
    """Before distances: K needles at evenly spaced depths, all asked from the end of their
    haystack, so a length's probes measured distances of about (1 - depth) x length (one
    needle: half the length). Their distances were not recorded per probe: no distance bins
    and no reach (None); the depth entries are dropped (the file keeps them), and the config
    reads with today's defaults for the settings it did not have."""
    config = {**_CONFIG_DEFAULTS, **data["config"]}
    kept = {k: v for k, v in data.items() if k not in ("depths", "by_depth", "cells")}
    paths = {k: v for k, v in data["paths"].items() if k != "heatmap"}
    return {**kept, "config": config, "paths": paths, "by_distance": [], "reach": None,
            "trained_length": None}  # fmt: skip


_CONFIG_DEFAULTS = {"needles_within": 0.05, "grain": None, "bins": 8, "reach_accuracy": 0.8}


@register("probes", VERSION, {2: _from_v2, 3: _from_v3, 4: _from_v4})
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
    probes_per_length: int  # K x H
    prefills_per_length: int  # H
    scoring: str  # the rule, in words
    trained_length: int | None  # the model's training length (the figure marks it)
    overall: Accuracy
    by_length: tuple[LengthAccuracy, ...]  # per haystack length: its probes at all distances
    by_distance: tuple[DistanceAccuracy, ...]  # () in a summary from before distances
    reach: Reach | None  # None in a summary from before distances
    model: dict[str, Any]  # LanguageModel.describe()
    paths: dict[str, str]  # summary, accuracy_vs_distance

    def at(self, length: int) -> LengthAccuracy:
        """The entry of ``length``; KeyError naming the lengths probed when it is not one."""
        for entry in self.by_length:
            if entry.length == length:
                return entry
        raise KeyError(f"length {length} is not probed here: {[e.length for e in self.by_length]}")


def plot_accuracy_vs_distance(
    runs: Mapping[str, Sequence[DistanceAccuracy]],
    path: str | Path,
    trained_length: int | None = None,
    reach_accuracy: float | None = None,
    title: str = "",
) -> Path:
    """Accuracy against needle distance, one line per run (method), at each bin's mean
    distance with its (asymmetric) Wilson interval as error bars; the trained length a
    vertical line (distances past it are extrapolation), the reach's accuracy a dashed one."""
    fig, axes = figure(7.2, 4.4)
    ax = axes[0, 0]
    for i, (label, entries) in enumerate(runs.items()):
        xs = [e.mean_distance for e in entries]
        ys = [e.accuracy for e in entries]
        below = [e.accuracy - e.low for e in entries]
        above = [e.high - e.accuracy for e in entries]
        shift = 1.0 + 0.01 * (i - (len(runs) - 1) / 2)  # methods side by side, not on top
        ax.errorbar([x * shift for x in xs], ys, yerr=[below, above], marker="o", ms=4,
                    capsize=3, lw=1.4, label=label)  # fmt: skip
    if trained_length is not None:
        label = f"trained length {trained_length:,}"
        ax.axvline(trained_length, color="gray", lw=1.2, label=label)
    if reach_accuracy is not None:
        label = f"reach at {reach_accuracy:g}"
        ax.axhline(reach_accuracy, color="gray", ls="--", lw=1, label=label)
    level = next((f"{100 * e.confidence:g}%" for es in runs.values() for e in es), "")
    ax.set(
        xlabel="needle distance (tokens from the needle to the question)",
        ylabel=f"accuracy ({level} Wilson interval)",
        ylim=(-0.03, 1.03),
        title=title,
    )
    ax.legend(fontsize=7)
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
        by_distance=tuple(_typed(DistanceAccuracy, e) for e in summary["by_distance"]),
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


def _typed(cls: type[NeedleAccuracy], entry: dict[str, Any]) -> Any:
    """A `summarize_records` entry as ``cls``, its substring rule's accuracy typed too."""
    substring = entry["substring"] and Accuracy(**entry["substring"])
    return cls(**{**entry, "substring": substring})


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
