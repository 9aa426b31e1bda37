"""Long-context tasks as data: base generators, named variants, and samples that fit a length.

Holds:
- `Draft`: what a base task returns: a context builder (haystack units -> text with needles),
  the question, the answer prefix, the references, the ideal answer.
- `Sample`: one generated prompt with its references and where its needles are; its JSON form
  is a line of `data.jsonl`.
- `TaskSpec`, `TASKS`, `ALIASES`, `RULER_TASKS`, `register_task`, `get_task`: the registry;
  `TaskRecord`: a task as result files record it.
- The base tasks in `BASE_TASKS`: `passkey`, `niah`, `variable_tracking`, `common_words`,
  `frequent_words`.
- `generate_sample(task, fmt, length, index, seed, depth)`: one sample that fits `length`.
- `TaskDoesNotFit`: a task whose smallest sample is longer than the length asked for.

Formats (plain prompts end with the answer prefix; a model continues it):
- passkey, aligned with `ropekit.data.retrieval` so models trained on that mixture are tested
  in distribution: the needle line "The pass key is 48213. Remember it." at a depth of the
  haystack, then "\\nWhat is the pass key? The pass key is".
- niah, in the mixture's key/value style: "The value of key apple is 4819302." and "What is the
  value of key apple? The value of key apple is"; several values: "What are all the values
  of key apple? The values of key apple are"; several keys: "What are the values of keys
  apple, river and tone? The values of keys apple, river and tone are".
- variable_tracking: "VAR QWERT = 48213." then "VAR ASDFG = VAR QWERT." ... "Which variables
  are assigned the value 48213? The variables assigned the value 48213 are".
- common_words: "1. apple 2. river ..." "What are the 10 most common words in the list? The 10
  most common words are"; frequent_words: a text of coded words drawn from a Zipf law.

Adding a task (the contract, as in RULER): write `f(rng, depth, **args) -> Draft` where
`Draft.build(n)` returns the context made of n haystack units (more units, more tokens;
pieces inserted with `Haystack.context`), draw every random choice from `rng` before
returning (so `build` is a pure function of n), add `f` to `BASE_TASKS`, then register named
variants with `register_task(TaskSpec(name, base, args, metric, needle))`. The sample fitter
finds the largest n whose prompt fits the length with the model's own tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from ropekit.evals.haystack import (
    Context,
    Distinct,
    Haystack,
    and_list,
    letters,
    load_haystack,
    number,
    uuid,
    words,
)
from ropekit.evals.prompts import PromptFormat

# Bump when a generator changes what it writes for the same arguments: stored samples made by
# another version are then regenerated instead of silently mixed with new ones.
GENERATOR_VERSION = 1

KEY_TYPES = ("words", "letters", "uuids")
VALUE_TYPES = ("numbers", "words", "uuids")
# Extra generated tokens beyond the ideal answer: room for spacing or a short preamble.
ANSWER_SLACK_MIN = 4
ANSWER_SLACK_FRACTION = 0.25


class TaskDoesNotFit(ValueError):
    """The smallest sample of a task is longer than the requested length."""


@dataclass(frozen=True)
class Draft:
    """One sample before its haystack size is chosen (see "Adding a task")."""

    build: Callable[[int], Context]  # n haystack units -> context; pure in n
    question: str  # ends the body: "What is the pass key?"
    answer_prefix: str  # starts the answer: "The pass key is"
    answer: str  # the ideal continuation, " 48213.": sizes the generation budget
    outputs: tuple[str, ...]  # references the prediction is scored against
    preamble: str = ""  # instruction before the context ("" or a line ending in "\n")
    min_units: int = 0  # fewest haystack units for a valid sample
    primary: int | None = 0  # inserted piece whose depth the sample reports (None: no needle)


@dataclass(frozen=True)
class Sample:
    """One prompt of a task at one length: a line of `data.jsonl`."""

    index: int
    task: str
    length: int  # target length in tokens, answer budget included
    input: str  # the full prompt text (plain or chat-rendered), ending with the answer prefix
    outputs: tuple[str, ...]
    n_tokens: int  # prompt tokens with the model's tokenizer; n_tokens + max_new_tokens <= length
    max_new_tokens: int
    depth: float | None  # requested depth of the primary needle (0 = start of the haystack)
    needle_depth: float | None  # measured: share of the haystack's tokens before that needle
    needle_position: int | None  # token index where that needle starts
    needle_positions: tuple[int, ...]  # token index of every inserted piece, in draft order
    units: int  # haystack units used

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> Sample:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in record.items() if k in names}
        values["outputs"] = tuple(values["outputs"])
        values["needle_positions"] = tuple(values["needle_positions"])
        return cls(**values)


# ----------------------------------------------------------------------------- base tasks
def _key_source(key_type: str, seed: int, exclude: Iterable[str] = ()) -> Distinct:
    if key_type == "words":
        return words(seed, exclude)
    if key_type == "letters":
        return Distinct(lambda rng: letters(rng, 3), seed, exclude)
    return Distinct(uuid, seed, exclude)


def _value_source(value_type: str, digits: int, seed: int, exclude: Iterable[str] = ()) -> Distinct:
    if value_type == "numbers":
        return Distinct(lambda rng: number(rng, digits), seed, exclude)
    if value_type == "words":
        return words(seed, exclude)
    return Distinct(uuid, seed, exclude)


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: {', '.join(allowed)}")


def _check_min(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: an integer >= {minimum}")


def _seed(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2**63))


def passkey(
    rng: np.random.Generator,
    depth: float | None,
    *,
    digits: int = 5,
    haystack: str = "noise",
    preamble: str = "",
) -> Draft:
    """One pass key in a haystack, in the format of ropekit's retrieval training mixture."""
    _check_min("digits", digits, 1)
    key = number(rng, digits)
    hay = load_haystack(haystack)
    needle = f"The pass key is {key}. Remember it."
    return Draft(
        build=lambda n: hay.context(n, [(0.5 if depth is None else depth, needle)]),
        question="What is the pass key?",
        answer_prefix="The pass key is",
        answer=f" {key}.",
        outputs=(key,),
        preamble=preamble,
    )


def niah(
    rng: np.random.Generator,
    depth: float | None,
    *,
    haystack: str = "essay",
    key_type: str = "words",
    value_type: str = "numbers",
    n_keys: int = 1,
    n_values: int = 1,
    n_queries: int = 1,
    value_digits: int = 7,
    preamble: str = "Some keys and their values are hidden in the text. Remember them.\n",
) -> Draft:
    """RULER's needle in a haystack: `n_keys` keys with `n_values` values each, `n_queries` of
    the keys asked for; the other keys are distractors. `haystack="needles"` makes the
    haystack itself of distractor needles (RULER's multikey 2 and 3)."""
    _check_choice("key_type", key_type, KEY_TYPES)
    _check_choice("value_type", value_type, VALUE_TYPES)
    for name, value in (("n_keys", n_keys), ("n_values", n_values), ("n_queries", n_queries)):
        _check_min(name, value, 1)
    _check_min("value_digits", value_digits, 1)
    if n_queries > n_keys:
        raise ValueError(f"n_queries={n_queries} is not allowed; allowed: 1..n_keys={n_keys}")

    keys = _key_source(key_type, _seed(rng)).take(n_keys)
    value_stream = _value_source(value_type, value_digits, _seed(rng), exclude=keys)
    values = [value_stream.take(n_values, start=k * n_values) for k in range(n_keys)]
    # The primary needle (first queried key, first value) sits at `depth`; the rest at random
    # depths, drawn now so that every haystack size places them alike.
    pieces = [
        (float(rng.uniform()), f"The value of key {key} is {value}.")
        for key, key_values in zip(keys, values, strict=True)
        for value in key_values
    ]
    pieces[0] = (0.5 if depth is None else depth, pieces[0][1])

    if haystack == "needles":
        # Distractors share no key or value with the real needles.
        taken = [*keys, *(v for key_values in values for v in key_values)]
        keys_out = _key_source(key_type, _seed(rng), exclude=taken)
        values_out = _value_source(value_type, value_digits, _seed(rng), exclude=taken)

        def unit(i: int) -> str:
            return f"The value of key {keys_out[i]} is {values_out[i]}.\n"

        hay = Haystack("needles", unit)
    else:
        hay = load_haystack(haystack)

    asked = keys[:n_queries]
    outputs = tuple(v for key_values in values[:n_queries] for v in key_values)
    if n_queries == 1 and n_values == 1:
        question = f"What is the value of key {asked[0]}?"
        prefix = f"The value of key {asked[0]} is"
    elif n_queries == 1:
        question = f"What are all the values of key {asked[0]}?"
        prefix = f"The values of key {asked[0]} are"
    else:
        question = f"What are the values of keys {and_list(asked)}?"
        prefix = f"The values of keys {and_list(asked)} are"
    return Draft(
        build=lambda n: hay.context(n, pieces),
        question=question,
        answer_prefix=prefix,
        answer=f" {and_list(list(outputs))}.",
        outputs=outputs,
        preamble=preamble,
    )


def variable_tracking(
    rng: np.random.Generator,
    depth: float | None,
    *,
    haystack: str = "noise",
    n_chains: int = 1,
    n_hops: int = 4,
    value_digits: int = 5,
    preamble: str = "Remember the variables assigned in the text.\n",
) -> Draft:
    """RULER's multi-hop tracing: chains "VAR A = 12345." "VAR B = VAR A." ...; the question
    asks for every variable of the first chain. Statements keep their chain order."""
    _check_min("n_chains", n_chains, 1)
    _check_min("n_hops", n_hops, 1)
    _check_min("value_digits", value_digits, 1)
    names = Distinct(lambda r: letters(r, 5), _seed(rng)).take(n_chains * (n_hops + 1))
    values = Distinct(lambda r: number(r, value_digits), _seed(rng)).take(n_chains)
    pieces = []
    for c in range(n_chains):
        chain = names[c * (n_hops + 1) : (c + 1) * (n_hops + 1)]
        depths = np.sort(rng.uniform(size=n_hops + 1))
        pieces.append((float(depths[0]), f"VAR {chain[0]} = {values[c]}."))
        pieces += [
            (float(d), f"VAR {chain[h + 1]} = VAR {chain[h]}.") for h, d in enumerate(depths[1:])
        ]
    hay = load_haystack(haystack)
    first = tuple(names[: n_hops + 1])
    return Draft(
        build=lambda n: hay.context(n, pieces),
        question=f"Which variables are assigned the value {values[0]}?",
        answer_prefix=f"The variables assigned the value {values[0]} are",
        answer=f" {and_list(list(first))}.",
        outputs=first,
        preamble=preamble,
        primary=None,
    )


def common_words(
    rng: np.random.Generator,
    depth: float | None,
    *,
    n_common: int = 10,
    freq_common: int = 30,
    freq_uncommon: int = 3,
    preamble: str = "Below is a numbered list of words. Some words appear many times.\n",
) -> Draft:
    """RULER's common words extraction: `n_common` words appear `freq_common` times each, the
    uncommon ones (as many as fit) `freq_uncommon` times, in a shuffled numbered list."""
    _check_min("n_common", n_common, 1)
    _check_min("freq_uncommon", freq_uncommon, 1)
    if not isinstance(freq_common, int) or freq_common <= freq_uncommon:
        raise ValueError(
            f"freq_common={freq_common!r} is not allowed; allowed: an integer > "
            f"freq_uncommon={freq_uncommon}"
        )
    stream = words(_seed(rng))
    common = stream.take(n_common)
    shuffle_seed = _seed(rng)

    def build(n: int) -> Context:
        items = common * freq_common + stream.take(n, start=n_common) * freq_uncommon
        order = np.random.default_rng([shuffle_seed, n]).permutation(len(items))
        text = " ".join(f"{i + 1}. {items[j]}" for i, j in enumerate(order))
        return Context(text, ())

    return Draft(
        build=build,
        question=f"What are the {n_common} most common words in the list?",
        answer_prefix=f"The {n_common} most common words are",
        answer=f" {and_list(common)}.",
        outputs=tuple(common),
        preamble=preamble,
        primary=None,
    )


def zipf_counts(n_words: int, alpha: float, n_top: int) -> list[int] | None:
    """Occurrences of each distinct word in a text of `n_words` words drawn from a Zipf law,
    rank 1 first: round(n r^-alpha / H) down to 2 occurrences, then words that occur once.
    The top `n_top` counts are made strictly decreasing and above the rest, so the answer is
    unambiguous; None when `n_words` is too few for that."""
    harmonic = sum(r**-alpha for r in range(1, n_words + 1))
    counts = []
    for rank in range(1, n_words + 1):
        c = int(n_words * rank**-alpha / harmonic)
        if c < 2:
            break
        counts.append(c)
    counts += [1] * max(0, n_top + 1 - len(counts))
    for r in range(n_top - 1, -1, -1):
        counts[r] = max(counts[r], counts[r + 1] + 1)
    filler = n_words - sum(counts)
    if filler < 0:
        return None
    return counts + [1] * filler


def frequent_words(
    rng: np.random.Generator,
    depth: float | None,
    *,
    alpha: float = 2.0,
    n_top: int = 3,
    code_letters: int = 4,
    preamble: str = "Below is a coded text. Some coded words appear many times.\n",
) -> Draft:
    """RULER's frequent words extraction: a text of random coded words whose frequencies follow
    a Zipf law with exponent `alpha`; the question asks for the `n_top` most frequent."""
    _check_min("n_top", n_top, 1)
    _check_min("code_letters", code_letters, 2)
    if not alpha > 1.0:
        raise ValueError(f"alpha={alpha!r} is not allowed; allowed: alpha > 1")
    codes = Distinct(lambda r: letters(r, code_letters).lower(), _seed(rng))
    shuffle_seed = _seed(rng)
    top = codes.take(n_top)
    min_units = next(n for n in range(n_top + 1, 10**6) if zipf_counts(n, alpha, n_top))

    def build(n: int) -> Context:
        counts = zipf_counts(max(n, min_units), alpha, n_top) or []
        items = [codes[r] for r, c in enumerate(counts) for _ in range(c)]
        order = np.random.default_rng([shuffle_seed, n]).permutation(len(items))
        return Context(" ".join(items[j] for j in order), ())

    return Draft(
        build=build,
        question=f"What are the {n_top} most frequent coded words in the text?",
        answer_prefix=f"The {n_top} most frequent coded words are",
        answer=f" {and_list(top)}.",
        outputs=tuple(top),
        preamble=preamble,
        min_units=min_units,
        primary=None,
    )


BASE_TASKS: dict[str, Callable[..., Draft]] = {
    "passkey": passkey,
    "niah": niah,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "frequent_words": frequent_words,
}

METRICS = ("string_match_all", "string_match_part")


# ----------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class TaskRecord:
    """A task as a result file records it (``TaskSpec.to_json``: no description)."""

    name: str
    base: str
    args: dict[str, Any]
    metric: str
    needle: bool


@dataclass(frozen=True)
class TaskSpec:
    """A named variant: a base task with its arguments and how it is scored."""

    name: str
    base: str  # key of BASE_TASKS
    args: Mapping[str, Any] = field(default_factory=dict)  # keyword arguments of the base task
    metric: str = "string_match_all"  # RULER: retrieval, tracing, aggregation use "all"
    needle: bool = False  # samples take a requested depth (depth heatmaps)
    description: str = ""

    def __post_init__(self) -> None:
        _check_choice("base", self.base, tuple(BASE_TASKS))
        _check_choice("metric", self.metric, METRICS)
        object.__setattr__(self, "args", MappingProxyType(dict(self.args)))
        try:  # an unknown argument fails here, not at the first sample
            inspect.signature(BASE_TASKS[self.base]).bind(None, None, **self.args)
        except TypeError as e:
            allowed = list(inspect.signature(BASE_TASKS[self.base]).parameters)[2:]
            raise ValueError(
                f"task {self.name!r}: args={dict(self.args)!r} is not allowed ({e}); allowed "
                f"arguments of {self.base}: {', '.join(allowed)}"
            ) from None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "base": self.base,
            "args": dict(self.args),
            "metric": self.metric,
            "needle": self.needle,
        }


TASKS: dict[str, TaskSpec] = {}


def register_task(spec: TaskSpec, overwrite: bool = False) -> TaskSpec:
    """Add a named variant to `TASKS` (`overwrite=True` to replace one)."""
    if spec.name in TASKS and not overwrite:
        raise ValueError(f"task {spec.name!r} is already registered; pass overwrite=True")
    TASKS[spec.name] = spec
    return spec


def _niah(name: str, description: str, **args: Any) -> None:
    register_task(TaskSpec(name, "niah", args, needle=True, description=description))


register_task(
    TaskSpec(
        "passkey",
        "passkey",
        {},
        needle=True,
        description="pass key in repeated noise, the retrieval mixture's format",
    )
)
register_task(
    TaskSpec(
        "passkey_essay",
        "passkey",
        {"haystack": "essay"},
        needle=True,
        description="pass key in Paul Graham essays",
    )
)
# The retrieval mixture's own records (ropekit.data.retrieval) in held-out Shakespeare: a model
# trained on Shakespeare plus that mixture is tested in distribution.
register_task(
    TaskSpec(
        "passkey_shakespeare",
        "passkey",
        {"haystack": "corpus:shakespeare"},
        needle=True,
        description="pass key in held-out Shakespeare plays, the mixture's passkey record",
    )
)
_niah(
    "kv_shakespeare",
    "the mixture's kv records: 4 keys of 3 letters, 4-digit values, held-out Shakespeare",
    haystack="corpus:shakespeare",
    key_type="letters",
    value_digits=4,
    n_keys=4,
    preamble="",
)
# One fact of that record: fits beside text in the demo's L = 128 bytes, where the four facts
# of kv_shakespeare (about 190 bytes) do not.
_niah(
    "kv1_shakespeare",
    "the mixture's kv record, one fact (3-letter key, 4-digit value), held-out Shakespeare",
    haystack="corpus:shakespeare",
    key_type="letters",
    value_digits=4,
    n_keys=1,
    preamble="",
)
_niah("niah_single_1", "one word key, number value, noise haystack", haystack="noise")
_niah("niah_single_2", "one word key, number value, essay haystack (classic NIAH)")
_niah("niah_single_3", "one word key, UUID value, essay haystack", value_type="uuids")
_niah("niah_multikey_1", "one of 4 keys asked, 3 distractors, essay haystack", n_keys=4)
_niah("niah_multikey_2", "haystack made of distractor needles", haystack="needles")
_niah(
    "niah_multikey_3",
    "UUID keys and values, haystack of distractor needles",
    haystack="needles",
    key_type="uuids",
    value_type="uuids",
)
_niah("niah_multivalue", "one key with 4 values, all asked", n_values=4)
_niah("niah_multiquery", "4 keys, all asked", n_keys=4, n_queries=4)
register_task(
    TaskSpec(
        "vt",
        "variable_tracking",
        {"n_chains": 1, "n_hops": 4},
        description="one chain of 4 hops in noise",
    )
)
register_task(
    TaskSpec(
        "cwe",
        "common_words",
        {"n_common": 10, "freq_common": 30, "freq_uncommon": 3},
        description="10 common words x30 among uncommon words x3",
    )
)
register_task(
    TaskSpec(
        "cwe_small",
        "common_words",
        {"n_common": 4, "freq_common": 5, "freq_uncommon": 2},
        description="4 common words x5 among uncommon words x2: fits from ~400 bytes",
    )
)
register_task(
    TaskSpec(
        "fwe",
        "frequent_words",
        {"alpha": 2.0, "n_top": 3},
        description="3 most frequent coded words, Zipf alpha 2",
    )
)

# The synthetic RULER tasks (its two QA tasks need SQuAD/HotpotQA, which ropekit does not ship).
RULER_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)
ALIASES: dict[str, str] = {
    "niah_single": "niah_single_1",
    "niah_multikey": "niah_multikey_1",
    "variable_tracking": "vt",
    "common_words": "cwe",
    "frequent_words": "fwe",
}


def get_task(task: str | TaskSpec) -> TaskSpec:
    """The registered variant `task` (or an alias of one); a TaskSpec is returned as is."""
    if isinstance(task, TaskSpec):
        return task
    name = ALIASES.get(task, task)
    if name not in TASKS:
        raise ValueError(
            f"task={task!r} is not allowed; allowed: {', '.join(TASKS)} "
            f"(aliases: {', '.join(ALIASES)})"
        )
    return TASKS[name]


# ----------------------------------------------------------------------------- fitting
def stable_hash(text: str) -> int:
    """A 32-bit hash that is the same in every process (str hashes are salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=4).digest(), "big")


def answer_budget(fmt: PromptFormat, draft: Draft) -> int:
    """Generation budget: the ideal answer's tokens plus slack."""
    n = len(fmt.tokenizer.encode(draft.answer))
    return n + max(ANSWER_SLACK_MIN, math.ceil(ANSWER_SLACK_FRACTION * n))


def _largest_fitting(count: Callable[[int], int], lo: int, budget: int) -> int:
    """Largest n >= lo with count(n) <= budget, for count non-decreasing in n; count(lo) must
    fit. A count tokenizes a whole prompt (a fifth of a second at 32k tokens), so the search
    keeps a bracket (good fits, bad does not) and guesses where the straight line through what
    it has measured crosses the budget (false position): tokens grow almost linearly with
    units of text, so it closes in within a few counts (seven on average for the essay
    haystacks of 32k, where gallop-and-bisect took seventeen). Two guesses in a row that leave
    more than half the bracket are followed by a bisection, so the worst case stays
    logarithmic. Every n it returns was counted. No unit of text costs less than 1/64 of a
    token, which caps the search."""
    t_lo = count(lo)
    good, t_good = lo, t_lo
    bad, t_bad = lo + 64 * (budget + 1) + 1, None  # None: not counted (past the cap)
    guess, slow = lo + 64, 0  # slow: counts in a row that left more than half the bracket
    while bad - good > 1:
        width = bad - good
        guess = (good + bad) // 2 if slow >= 2 else min(max(guess, good + 1), bad - 1)
        t = count(guess)
        if t <= budget:
            good, t_good = guess, t
        else:
            bad, t_bad = guess, t
        slow = slow + 1 if t_bad is not None and 2 * (bad - good) > width + 1 else 0
        guess = _crossing(lo, t_lo, good, t_good, bad, t_bad, budget)
    return good


def _crossing(
    lo: int, t_lo: int, good: int, t_good: int, bad: int, t_bad: int | None, budget: int
) -> int:
    """The first n the line through the measured counts puts past ``budget``: through the
    bracket's ends once both are counted, else through (lo, good); doubling while units have
    cost nothing."""
    if t_bad is not None:
        x0, t0, x1, t1 = good, t_good, bad, t_bad
    elif t_good > t_lo:
        x0, t0, x1, t1 = lo, t_lo, good, t_good
    else:
        return good + max(64, good - lo)
    return good + math.floor((budget - t_good) * (x1 - x0) / (t1 - t0)) + 1


def _body(draft: Draft, context: Context) -> str:
    return f"{draft.preamble}{context.text}\n{draft.question}"


def generate_sample(
    task: str | TaskSpec,
    fmt: PromptFormat,
    length: int,
    index: int,
    seed: int,
    depth: float | None = None,
    max_new_tokens: int | None = None,
    draw: int | None = None,
) -> Sample:
    """One sample of `task` whose prompt plus its answer budget fits `length` tokens.

    Randomness comes from (seed, task name, draw) only, `draw` defaulting to `index`: a draw
    gives the same needles at every length and depth, so cells of a heatmap differ only in
    where the needle sits. `max_new_tokens` overrides the budget derived from the answer.
    """
    spec = get_task(task)
    _check_min("length", length, 1)
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth!r} is not allowed; allowed: 0 <= depth <= 1")
    rng = np.random.default_rng([seed, stable_hash(spec.name), index if draw is None else draw])
    draft = BASE_TASKS[spec.base](rng, depth, **spec.args)
    budget_new = answer_budget(fmt, draft) if max_new_tokens is None else max_new_tokens
    budget = length - budget_new

    def count(n: int) -> int:
        text, _ = fmt.render(_body(draft, draft.build(n)), draft.answer_prefix)
        return len(fmt.encode(text))

    smallest = count(draft.min_units)
    if smallest > budget:
        raise TaskDoesNotFit(
            f"task {spec.name!r} does not fit length={length}: its smallest prompt takes "
            f"{smallest} tokens and its answer {budget_new}; allowed: length >= "
            f"{smallest + budget_new} with this tokenizer, or a smaller variant"
        )
    n = _largest_fitting(count, draft.min_units, budget)

    context = draft.build(n)
    body = _body(draft, context)
    text, offset = fmt.render(body, draft.answer_prefix)
    start = offset + len(draft.preamble)  # the context's first character in `text`
    k = len(context.spans)
    chars = [start, start + len(context.text)]
    chars += [start + a for a, _ in context.spans] + [start + b for _, b in context.spans]
    n_tokens, positions = fmt.locate(text, chars)
    if n_tokens + budget_new > length:  # the fitter only returns measured sizes
        raise AssertionError(f"sample of {n_tokens}+{budget_new} tokens exceeds {length}")
    context_start, context_end = positions[0], positions[1]
    needles, needle_ends = positions[2 : 2 + k], positions[2 + k :]
    needle_depth = needle_position = None
    if draft.primary is not None and needles:
        # Depth in haystack tokens: the inserted pieces themselves do not count, so depth 1
        # means "after all the filler" however many pieces precede the primary one.
        needle_position = needles[draft.primary]
        sizes = [b - a for a, b in zip(needles, needle_ends, strict=True)]
        haystack_tokens = context_end - context_start - sum(sizes)
        before = needle_position - context_start
        before -= sum(t for p, t in zip(needles, sizes, strict=True) if p < needle_position)
        needle_depth = before / haystack_tokens if haystack_tokens > 0 else 0.0
    return Sample(
        index=index,
        task=spec.name,
        length=length,
        input=text,
        outputs=draft.outputs,
        n_tokens=n_tokens,
        max_new_tokens=budget_new,
        depth=depth,
        needle_depth=needle_depth,
        needle_position=needle_position,
        needle_positions=tuple(needles),
        units=n,
    )
