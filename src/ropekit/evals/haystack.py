"""Haystacks, needle insertion and the random pieces tasks are made of.

Holds:
- `Haystack`: text cut into units (a word with the whitespace after it, or one line); a
  context is the first n units (repeating the text when n runs past its end) with pieces
  (needles) inserted at depths, snapped to the nearest sentence or line end.
- `Context`: the built text and where each inserted piece went.
- `load_haystack(name)`: "noise" (the classic passkey filler of repeated grass/sky/sun
  sentences), "essay" (Paul Graham essays, the standard needle-in-a-haystack text), or
  "corpus:<data>" (the held-out documents of any ropekit data spec, e.g. corpus:shakespeare).
- `Distinct`: an endless, seeded stream of distinct strings (keys, values, words, codes).
- Piece makers: `number`, `uuid`, `letters`, `word_pool`, `pseudo_word`, `and_list`.

Text is kept ASCII where the sources allow (curly quotes and dashes are replaced), so byte-level
models see one byte per character.
"""

from __future__ import annotations

import functools
import re
import uuid as _uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# The passkey filler of Mohtashami & Jaggi (2023, "Landmark Attention"), also RULER's "repeat"
# haystack: content-free, so only the needle carries information.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

HAYSTACKS = ("noise", "essay", "corpus:<data>")

# A piece snaps to a sentence end at most n / SNAP_FRACTION units (and SNAP_UNITS) away from
# its depth, else it goes between two words: depth stays within 2.5% of the context.
SNAP_FRACTION = 40
SNAP_UNITS = 64

_UNIT = re.compile(r"\S+\s*")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s*$")
# Mis-decoded Windows-1252 punctuation in the essays, and typographic characters, to ASCII.
_ASCII = str.maketrans(
    {
        "\x91": "'",
        "\x92": "'",
        "\x93": '"',
        "\x94": '"',
        "\x96": "-",
        "\x97": "--",
        "\xa0": " ",
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2013": "-",
        "\u2014": "--",
        "\u2026": "...",
    }
)


def to_ascii(text: str) -> str:
    return text.translate(_ASCII)


@dataclass(frozen=True)
class Context:
    """A built context: its text and the character span of each inserted piece, in the order
    the pieces were given."""

    text: str
    spans: tuple[tuple[int, int], ...]


class Haystack:
    """Units of filler text and the rule for inserting pieces between them.

    `units` is a fixed sequence (repeated past its end) or a function i -> unit that makes
    them on demand (a haystack made of distractor needles).
    """

    def __init__(self, name: str, units: Sequence[str] | Callable[[int], str]):
        self.name = name
        self._units = units
        if not callable(units) and not units:
            raise ValueError(f"haystack {name!r} holds no text")

    def unit(self, i: int) -> str:
        if callable(self._units):
            return self._units(i)
        return self._units[i % len(self._units)]

    def is_boundary(self, i: int, n: int) -> bool:
        """Can a piece go before unit i of an n-unit context? At both ends, and after a unit
        that ends a sentence or a line."""
        if i <= 0 or i >= n:
            return True
        previous = self.unit(i - 1)
        return "\n" in previous or _SENTENCE_END.search(previous) is not None

    def snap(self, depth: float, n: int) -> int:
        """Unit index for a piece at `depth` (0 = start, 1 = end) of an n-unit context: the
        nearest boundary to round(depth * n) within n / SNAP_FRACTION units (at most
        SNAP_UNITS), else that word boundary itself."""
        target = round(depth * n)
        for distance in range(min(SNAP_UNITS, n // SNAP_FRACTION) + 1):
            for i in (target - distance, target + distance):
                if 0 <= i <= n and self.is_boundary(i, n):
                    return i
        return target

    def context(self, n: int, pieces: Sequence[tuple[float, str]]) -> Context:
        """The first n units with each (depth, text) piece inserted on its own line.

        Pieces at one boundary keep their given order. The haystack's whitespace next to a
        piece is replaced by one newline on each side (the piece itself is inserted as given),
        so a piece reads the same at any depth.
        """
        slots = sorted(
            ((self.snap(depth, n), k) for k, (depth, _) in enumerate(pieces)),
        )
        blocks: list[tuple[str, int | None]] = []  # (text, piece index or None)
        previous = 0
        for slot, k in slots:
            blocks.append(("".join(self.unit(i) for i in range(previous, slot)).strip(), None))
            blocks.append((pieces[k][1], k))
            previous = slot
        blocks.append(("".join(self.unit(i) for i in range(previous, n)).strip(), None))
        parts, spans, offset = [], [(0, 0)] * len(pieces), 0
        for text, k in blocks:
            if not text:
                continue
            if parts:
                parts.append("\n")
                offset += 1
            if k is not None:
                spans[k] = (offset, offset + len(text))
            parts.append(text)
            offset += len(text)
        return Context("".join(parts), tuple(spans))


@functools.cache
def _text_units(name: str) -> tuple[str, ...]:
    if name == "noise":
        text = NOISE
    elif name == "essay":
        from ropekit.data import load_corpus

        text = "\n\n".join(d.text for d in load_corpus("essays", "all"))
    elif name.startswith("corpus:") and len(name) > len("corpus:"):
        from ropekit.data import validation_documents

        text = "\n\n".join(d.text for d in validation_documents(name.removeprefix("corpus:")))
    else:
        raise ValueError(
            f"haystack={name!r} is not allowed; allowed: {', '.join(HAYSTACKS)} (e.g. "
            "corpus:shakespeare)"
        )
    # A context starts at a unit, so whitespace belongs after a word, never before one.
    units = tuple(_UNIT.findall(to_ascii(text).strip() + " "))
    return units


def load_haystack(name: str) -> Haystack:
    """A text haystack by name (see the module docstring); read once per process."""
    return Haystack(name, _text_units(name))


# ----------------------------------------------------------------------------- pieces
class Distinct:
    """An endless stream of distinct strings: item i is fixed once drawn, so any prefix of the
    stream is a pure function of the seed (a context of n units never depends on how many
    units were asked for before)."""

    def __init__(
        self,
        make: Callable[[np.random.Generator], str],
        seed: int,
        exclude: Iterable[str] = (),
    ):
        self._make = make
        self._rng = np.random.default_rng(seed)
        self._seen = set(exclude)
        self._items: list[str] = []

    def __getitem__(self, i: int) -> str:
        while len(self._items) <= i:
            for _ in range(1000):
                item = self._make(self._rng)
                if item not in self._seen:
                    break
            else:
                raise ValueError("ran out of distinct items; allowed: a larger alphabet")
            self._seen.add(item)
            self._items.append(item)
        return self._items[i]

    def take(self, n: int, start: int = 0) -> list[str]:
        return [self[i] for i in range(start, start + n)]


def number(rng: np.random.Generator, digits: int) -> str:
    """A `digits`-digit decimal number without a leading zero (a reader may drop one)."""
    return str(int(rng.integers(1, 10))) + "".join(map(str, rng.integers(0, 10, digits - 1)))


def uuid(rng: np.random.Generator) -> str:
    """A random version-4 UUID drawn from `rng` (so it follows the seed)."""
    bits = int(rng.integers(0, 2**63)) << 65 | int(rng.integers(0, 2**63)) << 2
    return str(_uuid.UUID(int=bits, version=4))


def letters(rng: np.random.Generator, n: int) -> str:
    """n random upper-case letters (the retrieval mixture's keys look like "XJQ")."""
    return "".join(chr(65 + int(c)) for c in rng.integers(0, 26, n))


_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def pseudo_word(rng: np.random.Generator, syllables: int = 3) -> str:
    """A pronounceable non-word ("bakotu"): words beyond the real vocabulary."""
    return "".join(
        _CONSONANTS[int(rng.integers(len(_CONSONANTS)))] + _VOWELS[int(rng.integers(5))]
        for _ in range(syllables)
    )


# The most frequent words of the essays ("that", "which", "were") are left out of the pool:
# as keys ("the value of key were") they read as grammar, not as names.
FREQUENT_WORDS_LEFT_OUT = 300


@functools.cache
def word_pool() -> tuple[str, ...]:
    """Distinct lower-case English words of 4-10 letters from the essays, the most frequent
    ones left out, sorted (about 6.5k)."""
    from ropekit.data import load_corpus

    text = " ".join(to_ascii(d.text) for d in load_corpus("essays", "all"))
    counts = Counter(w.lower() for w in re.findall(r"\b[A-Za-z]{4,10}\b", text))
    frequent = {w for w, _ in counts.most_common(FREQUENT_WORDS_LEFT_OUT)}
    return tuple(sorted(w for w in counts if w not in frequent))


def words(seed: int, exclude: Iterable[str] = ()) -> Distinct:
    """Distinct words: real words from `word_pool` in a seeded order, then pseudo-words."""
    pool = word_pool()
    order = iter(np.random.default_rng(seed).permutation(len(pool)).tolist())

    def make(rng: np.random.Generator) -> str:
        index = next(order, None)
        return pseudo_word(rng) if index is None else pool[index]

    return Distinct(make, seed, exclude)


def and_list(items: Sequence[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]
