"""Synthetic retrieval records woven into natural text, so that small models learn to retrieve.

Holds `RetrievalConfig`, `Role`, `Records` and `draw_records` (what to insert), `weave` (where
to insert it), and `RetrievalSample` (where things ended up, for tests and analysis).

Two kinds of record, plain ASCII with digits and short upper-case keys:
- passkey: "The pass key is 48213. Remember it." ... "What is the pass key? The pass key is 48213."
- kv: several facts "The value of key XJQ is 7734." ... "What is the value of key XJQ? The value
  of key XJQ is 7734." (`n_queries` facts are asked, each at most once).

The records go at uniformly random depths of a sample of natural text and the queries close
the sample, so the distance from record to query is spread over the whole context and only
attention that reaches that far can answer.

Every token has a `Role`, which sets its label and loss weight:
- TEXT: ordinary next-token loss, weight 1;
- RANDOM: a digit or key letter drawn at random (in a record, or the key a query asks for).
  No model can predict it, so it gets label -100 and weight 0 instead of adding pure noise;
- ANSWER: the recalled value, weight `answer_weight` (an answer-weighted loss).

Text pieces begin with their space (" 48213", " XJQ"), the way BPE vocabularies split words, so
records tokenize alike alone and in running text.
"""

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from ropekit.data.tokenizers import Tokenizer

KINDS: tuple[str, ...] = ("passkey", "kv")
_LETTERS = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))


class Role(IntEnum):
    TEXT = 0
    RANDOM = 1
    ANSWER = 2


Piece = tuple[str, Role]


@dataclass(frozen=True)
class RetrievalConfig:
    """How many samples carry retrieval records, and what the records look like."""

    ratio: float = 0.0  # fraction of samples that carry records, in [0, 1]
    kinds: tuple[str, ...] = KINDS  # each retrieval sample draws one kind uniformly
    n_facts: int = 4  # kv: facts per sample
    n_queries: int = 1  # kv: distinct facts asked about at the end, 1..n_facts
    answer_weight: float = 1.0  # loss weight of answer tokens (ordinary tokens weigh 1)
    passkey_digits: int = 5
    value_digits: int = 4
    key_letters: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "kinds", tuple(self.kinds))  # accept a list
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio={self.ratio!r} is not allowed; allowed: 0 <= ratio <= 1")
        if not self.kinds or any(k not in KINDS for k in self.kinds):
            raise ValueError(
                f"kinds={self.kinds!r} is not allowed; allowed: a non-empty subset of {KINDS}"
            )
        for name in ("n_facts", "passkey_digits", "value_digits", "key_letters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed; allowed: >= 1")
        if not 1 <= self.n_queries <= self.n_facts:
            raise ValueError(
                f"n_queries={self.n_queries!r} is not allowed; allowed: 1..n_facts={self.n_facts}"
            )
        if self.answer_weight < 0:
            raise ValueError(f"answer_weight={self.answer_weight!r} is not allowed; allowed: >= 0")
        if len(_LETTERS) ** self.key_letters < self.n_facts:
            raise ValueError(
                f"key_letters={self.key_letters} gives fewer distinct keys than "
                f"n_facts={self.n_facts}; allowed: 26 ** key_letters >= n_facts"
            )


@dataclass(frozen=True)
class Records:
    """What one retrieval sample inserts: records (in order of depth) and the closing query."""

    kind: str
    records: list[list[Piece]]
    query: list[Piece]
    answers: list[str]  # recalled values, one per query, in query order
    sources: list[int]  # for each answer, the index of the record that holds it


@dataclass(frozen=True)
class RetrievalSample:
    """Where the records and answers of one woven sample are (token positions)."""

    kind: str
    record_spans: tuple[tuple[int, int], ...]  # input positions [start, stop) of each record
    query_start: int  # input position where the closing query begins
    answer_spans: tuple[tuple[int, int], ...]  # label positions [start, stop) of each answer
    answers: tuple[str, ...]  # recalled values (digits), one per answer span
    sources: tuple[int, ...]  # index in record_spans of the record holding each answer


def _digits(rng: np.random.Generator, n: int) -> str:
    return "".join(map(str, rng.integers(0, 10, size=n)))


def _keys(rng: np.random.Generator, n: int, letters: int) -> list[str]:
    codes = rng.choice(len(_LETTERS) ** letters, size=n, replace=False)  # distinct keys
    shape = (len(_LETTERS),) * letters
    return ["".join(_LETTERS[np.array(np.unravel_index(c, shape))]) for c in codes]


def _passkey(rng: np.random.Generator, config: RetrievalConfig) -> Records:
    key = " " + _digits(rng, config.passkey_digits)
    record = [("\nThe pass key is", Role.TEXT), (key, Role.RANDOM), (". Remember it.\n", Role.TEXT)]
    query = [
        ("\nWhat is the pass key? The pass key is", Role.TEXT),
        (key, Role.ANSWER),
        (".\n", Role.TEXT),
    ]
    return Records("passkey", [record], query, [key.strip()], [0])


def _kv(rng: np.random.Generator, config: RetrievalConfig) -> Records:
    keys = [" " + k for k in _keys(rng, config.n_facts, config.key_letters)]
    values = [" " + _digits(rng, config.value_digits) for _ in keys]
    records = [
        [
            ("\nThe value of key", Role.TEXT),
            (key, Role.RANDOM),
            (" is", Role.TEXT),
            (value, Role.RANDOM),
            (".\n", Role.TEXT),
        ]
        for key, value in zip(keys, values, strict=True)
    ]
    asked = rng.choice(config.n_facts, size=config.n_queries, replace=False).tolist()
    query = []
    for i in asked:
        query += [
            ("\nWhat is the value of key", Role.TEXT),
            (keys[i], Role.RANDOM),  # which fact is asked is itself random
            ("? The value of key", Role.TEXT),
            (keys[i], Role.TEXT),  # copied from just before: predictable
            (" is", Role.TEXT),
            (values[i], Role.ANSWER),
            (".\n", Role.TEXT),
        ]
    return Records("kv", records, query, [values[i].strip() for i in asked], asked)


def draw_records(rng: np.random.Generator, config: RetrievalConfig) -> Records:
    """Draw the kind (uniformly from `config.kinds`) and the records of one sample."""
    kind = config.kinds[int(rng.integers(len(config.kinds)))]
    return _passkey(rng, config) if kind == "passkey" else _kv(rng, config)


def _encode(pieces: list[Piece], tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    roles: list[int] = []
    for text, role in pieces:
        piece_ids = tokenizer.encode(text)
        ids += piece_ids
        roles += [int(role)] * len(piece_ids)
    return ids, roles


def records_length(records: Records, tokenizer: Tokenizer) -> int:
    """Tokens the records and the query take in a sample."""
    return sum(len(_encode(p, tokenizer)[0]) for p in [*records.records, records.query])


def weave(
    filler: np.ndarray,
    records: Records,
    tokenizer: Tokenizer,
    rng: np.random.Generator,
    at_least_back: int = 0,
) -> tuple[np.ndarray, np.ndarray, RetrievalSample]:
    """Insert `records` into `filler` (L,) at uniform random depths and end with the query.

    Returns tokens (L,), roles (L,) and where everything went. The sample keeps length L: the
    filler is cut to leave room. Answer spans are label positions (token position - 1).
    ``at_least_back``: every record is followed by at least this many filler tokens before
    the query (its depth uniform over what is left), so its answer is at least that far back.
    """
    length = len(filler)
    encoded = [_encode(r, tokenizer) for r in records.records]
    query_ids, query_roles = _encode(records.query, tokenizer)
    n_fill = length - sum(len(ids) for ids, _ in encoded) - len(query_ids)
    if n_fill < 1:
        raise ValueError(
            f"a {records.kind} sample needs {length - n_fill} tokens of records and query but "
            f"has {length}; allowed: a longer context, or fewer facts (n_facts)"
        )
    if not 0 <= at_least_back <= n_fill:
        raise ValueError(
            f"at_least_back={at_least_back} is not allowed: a {records.kind} sample of "
            f"{length} tokens has {n_fill} tokens of text to put between its records and the "
            f"query; allowed: 0 to {n_fill}"
        )
    # Independent uniform cut points in the filler: each record's depth is uniform.
    cuts = sorted(int(c) for c in rng.integers(0, n_fill - at_least_back + 1, size=len(encoded)))
    tokens, roles, spans = [], [], []
    position, previous = 0, 0
    for cut, (ids, piece_roles) in zip(cuts, encoded, strict=True):
        tokens += [filler[previous:cut], ids]
        roles += [np.full(cut - previous, Role.TEXT), piece_roles]
        position += cut - previous
        spans.append((position, position + len(ids)))
        position += len(ids)
        previous = cut
    tokens += [filler[previous:n_fill], query_ids]
    roles += [np.full(n_fill - previous, Role.TEXT), query_roles]
    query_start = position + n_fill - previous
    # Answer k is the k-th run of ANSWER roles in the query.
    answer_at = np.flatnonzero(np.asarray(query_roles) == Role.ANSWER)
    runs = np.split(answer_at, np.flatnonzero(np.diff(answer_at) > 1) + 1)
    answer_spans = tuple(
        (query_start + int(r[0]) - 1, query_start + int(r[-1])) for r in runs if len(r)
    )
    info = RetrievalSample(
        kind=records.kind,
        record_spans=tuple(spans),
        query_start=query_start,
        answer_spans=answer_spans,
        answers=tuple(records.answers),
        sources=tuple(records.sources),
    )
    out_tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens])
    out_roles = np.concatenate([np.asarray(r, dtype=np.int64) for r in roles])
    return out_tokens, out_roles, info
