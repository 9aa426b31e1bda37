"""Retrieval probes' haystacks: K needles near the start of a haystack, each asked from its
own cut point, so one prefill measures several needle distances (`evals.probes` answers them,
`evals.probe_summary` sums them up).

Holds:
- `ProbeConfig`: lengths, needles per haystack (K), haystacks per length, where the needles
  sit, the grain of the cut points, the distance bins, the reach's accuracy, task, seed; what
  each haystack can be expected to read (`expected_reads`).
- `probe_task`: the registered niah-style task a probe asks, checked.
- `Probe`, `ProbeHaystack`: one haystack of a length with its K needles, each with its cut
  point and question, as token ids (`build_haystack`).
- `PROBES_VERSION`: the generator's version, in every stage's provenance.

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
in a seeded order.

Independent probes: every probe has its own needle, key and value (drawn from seed, task,
length and haystack), so no value is asked at two distances or two lengths, and a bin's
Wilson interval counts each probe once. The other K - 1 needles of a haystack are its
distractors (RULER's multikey setting): a model that copies the needle nearest the question
instead of binding keys to values (SmolLM2-135M: experiment D) fails them at every distance,
and the wrong answers that name another needle's value are counted
(`probe_summary.distractor_answers`). For such a model only K = 1 (one probe per prefill)
measures distance: with one visible needle per question, the distances one prefill of N
tokens can measure sum to at most N.

The format is a registered niah-style task (`evals/tasks.py`): its haystack (noise, essay,
corpus:<data> or needles), key and value types, digits and preamble; its number of keys is
replaced by K, and it must ask one value of one key (`n_values = n_queries = 1`).
`kv1_shakespeare` is the retrieval training mixture's kv record (3-letter keys, 4-digit
values), so a model trained on that mixture is probed in distribution. A question follows
the haystack cut mid-text, on a new line, as RULER's template puts it after the haystack.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ropekit.evals.haystack import Haystack, load_haystack
from ropekit.evals.intervals import CONFIDENCE
from ropekit.evals.prompts import PromptFormat
from ropekit.evals.tasks import (
    ANSWER_SLACK_FRACTION,
    ANSWER_SLACK_MIN,
    BASE_TASKS,
    KEY_TYPES,
    VALUE_TYPES,
    TaskDoesNotFit,
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

# Bump when the haystacks or questions built for the same settings change: stored probes of
# another version are then refused instead of mixed with new ones.
PROBES_VERSION = 2  # 2: needles near the start, each asked from its own cut point
# The default grain of cut points: a 64th of the longest length, so K needles fit K cuts.
GRAIN_SHARE = 64
READ_QUANTILES = 64  # the most distinct reads ProbeConfig.expected_reads prices


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

    def expected_reads(self, length: int, answered: int = 0) -> dict[int, int]:
        """Tokens read -> how many of the H haystacks of ``length`` can be expected to read
        them, for the cost said before the work starts (the haystacks are built later): a
        haystack is read up to its longest cut, drawn in the top of K equal strata of the cut
        points behind its needles (``_cut_points``), so spread evenly over that top 1/K: one
        needle reads about half the haystack on average, 12 nearly all of it. At most
        ``READ_QUANTILES`` distinct reads (evenly spaced quantiles, the haystacks dealt
        among them), so an absurd H costs nothing to price. ``answered``: haystacks a
        resumed run finds answered (``probes.answered_haystacks``), which it does not read
        again; the rest are priced alike, their own cuts being unknown until they are built."""
        left = max(0, self.haystacks - answered)
        start = self.needles_within * length  # the needles end about here at the latest
        top = (length - start) / self.needles
        m = min(left, READ_QUANTILES)
        reads: dict[int, int] = {}
        for i in range(m):
            tokens = round(length - top + top * (i + 0.5) / m)
            share = left // m + (i < left % m)
            reads[tokens] = reads.get(tokens, 0) + share
        return reads

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
