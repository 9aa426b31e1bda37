"""Perplexity and bits per byte against context length, and NLL against token position.

Holds:
- `PerplexityConfig`: lengths, how many tokens to score, sliding-window stride, batching.
- `PerplexityResult` (ppl.json, the ``perplexity`` kind at `VERSION`), its rows
  `LengthScore` (with `PositionCurve` and per-span `SpanScore`) and `Span`s.
- `evaluate_perplexity(lm, stream, config)`: the numbers, as a `PerplexityResult`.
- `run_perplexity(model, config, out_dir, ...)`: held-out data in, `ppl.json` and `ppl.png`
  out (`ropekit eval ppl`), resumable window by window (`WindowStore`); a `PerplexityRun`.
  `plot_perplexity` draws ppl.png.
  Called once per domain with the same model, it takes the domain's tokenized `stream`
  (`heldout_stream(domain, tokenizer)`, made once per domain and tokenizer) and the model as
  a Backbone (whose weight digest is computed once).
- `windows_read(config, shared)`: the windows of each length read in a reading of their own
  (a plan's cost estimate).
- `document_spans(stream, tokenizer, span, count, context, rng)`: the single-document spans;
  `check_single_documents(stream, tokenizer, config)` asks, without a model, whether they fit
  (`DocumentsTooShort` when not).

Every length scores the SAME target tokens: one span of `n_tokens` tokens cut from a fixed
held-out stream, a multiple of every length, tiled by non-overlapping windows of each length.
The stream joins the held-out documents end to end, so a long window may cross from one
document into an unrelated one. With `single_documents`, the targets are instead
n_tokens / lcm(lengths) spans of lcm(lengths) tokens (the shortest span every length tiles),
each inside one held-out document (the token before it too, when there is no BOS): drawn
(seeded) from the documents at least that long, spread over as many of them as there are
spans (several non-overlapping spans per document only when documents run short), the same
spans at every length. The result names each span's document and offset and gives the
numbers per span beside the overall ones.
A window of length L reads L tokens and is scored on L targets (the token before the window,
or BOS, is its first input), so lengths differ only in how much context each target sees.
With `stride`, windows overlap (sliding evaluation): each scores only its last `stride`
targets, which then all see at least L - stride tokens of context.

Units: NLL in nats per token. Bits per byte = total NLL / ln 2 / UTF-8 bytes of the targets;
for a byte tokenizer this is exactly bits per token. Token models report perplexity as the
headline and bits per byte beside it (comparable across tokenizers). "Last quarter" is the
mean NLL of each window's last L/4 targets: where extra context can help most, so it is where
long-context gains and failures show first. Each window's last quarter is also kept as the
means of consecutive blocks of `QUARTER_BLOCK` targets (`last_quarter_nll_blocks`), so that a
paired comparison can take its standard error from positions within the windows as well as
from windows (`ropekit.compare.verdict`).

Windows of several lengths that start at the same target (each span's first window at every
length, and every window that starts where a longer one does) are prefixes of the longest of
them: with a model that has ``prefix_nll`` (`BackboneLM`), whole windows read one at a time
(``batch_tokens`` < 2 x length) are scored in that longest window's reading, each row bit for
bit the one its own forward gives, so nothing a result records changes. A length-following
encoding reads each window alone (``Backbone.prefix_nll``). Measured: 0.76 of the time for
SmolLM2-135M at 2k, 4k and 8k over one 8k span (`python -m benchmarks perplexity`).

Several processes (`accelerate launch`, `torchrun`) split each length's windows into
contiguous shares, gather the per-window NLL in order and sum it as one process would; the
main process writes the files.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ropekit.data import heldout_stream
from ropekit.data.streams import TokenStream
from ropekit.data.tokenizers import ByteTokenizer, Tokenizer
from ropekit.distributed import Processes, shard
from ropekit.distributed import processes as current_processes
from ropekit.evals.adapters import LanguageModel, as_language_model, place_on
from ropekit.evals.prompts import default_prefix
from ropekit.figures import figure, length_axis, save
from ropekit.results import (
    check_replaceable,
    digest,
    read_record,
    register,
    run_metadata,
    to_json,
    write_result,
)
from ropekit.utils import atomic_write_bytes, atomic_write_text

# Default number of windows of the longest length that the scored span holds.
WINDOWS_AT_MAX = 4
WINDOWS = "windows"  # run_perplexity's folder of the windows scored so far (WindowStore)
# Targets per block of a window's last quarter. Per-token NLL is correlated only over a few
# tokens (SmolLM2-135M on held-out Shakespeare, 12 windows of 8k: autocorrelation 0.10 at lag
# 1, 0.06 at 4, 0.01 from 8 on), so 64-token block means are nearly independent; the verdict
# merges them into longer blocks and keeps the largest error (blocking analysis).
QUARTER_BLOCK = 64


@dataclass(frozen=True)
class PerplexityConfig:
    """What to score. Lengths are in the model's tokens (bytes for byte models)."""

    lengths: tuple[int, ...]  # context lengths to evaluate, e.g. (256, 512, 1024, 2048)
    # Targets scored at every length; a multiple of lcm(lengths). None: the smallest multiple
    # of lcm(lengths) that holds WINDOWS_AT_MAX windows of the longest length.
    n_tokens: int | None = None
    stride: int | None = None  # sliding windows: new targets per window; None: no overlap
    batch_tokens: int = 8192  # tokens per forward: batch = max(1, batch_tokens // length)
    position_bins: int = 48  # log-spaced bins of the NLL-vs-position curve kept in the JSON
    seed: int = 0  # picks where the span starts in the held-out stream
    bos: bool | None = None  # windows start with BOS; None: if the tokenizer adds one itself
    # Score spans of lcm(lengths) tokens each inside one held-out document, from several
    # documents (none crosses into another); off: one span of the documents joined end to end.
    single_documents: bool = False
    # Score only part i (from 0) of the n_tokens / lcm(lengths) parts of lcm(lengths) targets
    # (with single documents: span i), exactly the windows a whole reading scores there: a
    # comparison that races scores its windows in rounds (ropekit.compare.race). None: all.
    part: int | None = None

    def __post_init__(self) -> None:
        lengths = tuple(self.lengths)
        if not lengths or any(not isinstance(n, int) or n < 2 for n in lengths):
            raise ValueError(
                f"lengths={self.lengths!r} is not allowed; allowed: one or more integers >= 2"
            )
        object.__setattr__(self, "lengths", tuple(sorted(set(lengths))))
        lcm = math.lcm(*self.lengths)
        if self.n_tokens is None:
            n = lcm * math.ceil(WINDOWS_AT_MAX * max(self.lengths) / lcm)
            object.__setattr__(self, "n_tokens", n)
        elif not isinstance(self.n_tokens, int) or self.n_tokens < 1 or self.n_tokens % lcm:
            raise ValueError(
                f"n_tokens={self.n_tokens!r} is not allowed; allowed: a positive multiple of "
                f"lcm(lengths)={lcm}, so that every length scores the same tokens"
            )
        if self.stride is not None and not 1 <= self.stride <= min(self.lengths):
            raise ValueError(
                f"stride={self.stride!r} is not allowed; allowed: None or 1..{min(self.lengths)} "
                "(the shortest length)"
            )
        parts = self.n_tokens // lcm
        if self.part is not None and not (
            isinstance(self.part, int) and 0 <= self.part < parts and self.stride is None
        ):
            raise ValueError(
                f"part={self.part!r} is not allowed; allowed: None, or 0..{parts - 1} (the "
                "parts of lcm(lengths) targets) without a stride"
            )
        for name in ("batch_tokens", "position_bins"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed; allowed: >= 1")


@dataclass(frozen=True)
class PositionCurve:
    """Binned NLL against target position in the windows (``position_bins`` log bins)."""

    start: tuple[int, ...]  # first position of each bin
    stop: tuple[int, ...]  # one past its last
    nll: tuple[float, ...]  # mean NLL of the bin (nats per token)


@dataclass(frozen=True)
class Span:
    """One single-document span of targets (``single_documents``)."""

    document: str
    offset: int  # first target, in the document
    start: int  # first target, in the stream
    tokens: int
    bytes: int  # UTF-8 bytes of its targets


@dataclass(frozen=True)
class SpanScore:
    """One span's numbers at one length (its windows are a contiguous share of the rows)."""

    document: str
    nll: float  # nats per token
    perplexity: float
    bits_per_byte: float
    last_quarter_nll: float | None  # None with a stride


@dataclass(frozen=True)
class LengthScore:
    """Every number at one context length. The last-quarter fields and the curve are None
    with a stride (overlapping windows score only their tail)."""

    length: int
    windows: int
    tokens: int  # targets scored (the same at every length)
    bytes: int  # their UTF-8 bytes
    nll: float  # nats per token
    perplexity: float
    bits_per_token: float
    bits_per_byte: float
    last_quarter_nll: float | None  # mean over windows of each last quarter's mean NLL
    last_quarter_nll_std: float | None
    last_quarter_nll_windows: tuple[float, ...] | None  # per window
    # per window: block means of QUARTER_BLOCK targets; None in a file written before them
    last_quarter_nll_blocks: tuple[tuple[float, ...], ...] | None
    position_nll: PositionCurve | None
    spans: tuple[SpanScore, ...] | None  # per span (single documents); None otherwise

    def headline(self, metric: str) -> float:
        """The value of ``metric`` (a PerplexityResult's: perplexity or bits_per_byte)."""
        if metric not in ("perplexity", "bits_per_byte"):
            raise ValueError(f"metric={metric!r} is not allowed; use perplexity or bits_per_byte")
        return self.perplexity if metric == "perplexity" else self.bits_per_byte


VERSION = 3  # 3: typed, every field written (2: the untyped layout)


def _from_v2(data: dict[str, Any]) -> dict[str, Any]:
    """The untyped layout: spans and documents only with single documents, the rows' spans
    likewise, and rows written before the last quarter's blocks were kept lack them."""
    data = {"spans": None, "documents": None, **data}
    data["results"] = [
        {"last_quarter_nll_blocks": None, "spans": None, **row} for row in data["results"]
    ]
    return data


@register("perplexity", VERSION, {2: _from_v2})
@dataclass(frozen=True)
class PerplexityResult:
    """ppl.json: what ``run_perplexity`` writes (``evaluate_perplexity`` returns the same with
    empty ``meta``, ``provenance`` and ``model``, and no ``data`` or ``spec``)."""

    meta: dict[str, Any]  # run_metadata
    provenance: dict[str, Any]  # model, data, config: what a rerun must match to reuse it
    metric: str  # the headline: "perplexity" (token models) or "bits_per_byte" (byte models)
    tokenizer: str
    bos: bool  # windows start with BOS
    start: int | None  # the one span's first target (documents joined); None: single documents
    config: PerplexityConfig
    results: tuple[LengthScore, ...]  # by length, ascending
    spans: tuple[Span, ...] | None  # single documents: the spans; None otherwise
    documents: int | None  # single documents: how many documents the spans lie in
    data: str | tuple[str, ...] | None  # the held-out data spec (None: a stream was given)
    spec: str | None  # the encoding spec the model carried, as the caller named it
    seed: int
    model: dict[str, Any]  # LanguageModel.describe()

    def at(self, length: int) -> LengthScore:
        """The row of ``length``; KeyError naming the lengths scored when it is not one."""
        for row in self.results:
            if row.length == length:
                return row
        raise KeyError(f"length {length} is not scored here; lengths: {self.lengths}")

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(row.length for row in self.results)

    def headlines(self) -> dict[int, float]:
        """length -> the headline metric."""
        return {row.length: row.headline(self.metric) for row in self.results}


@dataclass(frozen=True)
class PerplexityRun:
    """What ``run_perplexity`` returns: the result and where it is (or was found)."""

    result: PerplexityResult
    json: Path  # ppl.json
    png: Path  # ppl.png
    reused: bool  # found there, made by this model, data and config: nothing was scored


class DocumentsTooShort(ValueError):
    """The held-out documents cannot hold the single-document spans asked for: none is long
    enough (``capacity`` 0) or all together hold fewer than ``count`` spans of ``span``
    targets. A ValueError, so callers that only report it need nothing else."""

    def __init__(self, message: str, *, span: int, capacity: int, count: int) -> None:
        super().__init__(message)
        self.span, self.capacity, self.count = span, capacity, count


def _windows(start: int, span: int, length: int, stride: int | None) -> list[tuple[int, int]]:
    """(target_end, n_scored) of each window over targets [start, start + span): the window
    covers targets [end - length, end) and scores the last n_scored of them."""
    if stride is None:
        return [(start + (i + 1) * length, length) for i in range(span // length)]
    windows, end = [(start + length, length)], start + length
    while end < start + span:
        new_end = min(end + stride, start + span)
        windows.append((new_end, new_end - end))
        end = new_end
    return windows


def _separator_tokens(tokenizer: Tokenizer) -> int:
    """Tokens of the separator a stream puts between documents (`data.streams`)."""
    separator = tokenizer.separator
    return len(tokenizer.encode(separator)) if isinstance(separator, str) else 1


def document_spans(
    stream: TokenStream,
    tokenizer: Tokenizer,
    span: int,
    count: int,
    context: int,
    rng: np.random.Generator,
) -> list[tuple[int, int]]:
    """``count`` spans of ``span`` target tokens, each with ``context`` tokens before it (1
    without BOS: the first target's input), inside one document of ``stream``: (document
    index, stream index of the first target), sorted by position.

    Documents with room for one span (``span + context`` tokens, separator excluded) take the
    spans in turns, in a seeded order, so ``count`` spans lie in ``count`` documents when that
    many are long enough; a document gets several (non-overlapping) only when there are fewer.
    Within a document its m spans sit at seeded offsets: the slack (room - m spans) is cut
    at m sorted uniform points, one gap before each span. ValueError, naming the longest
    document, when none is long enough or all together cannot hold ``count`` spans."""
    need = span + context
    starts = stream.doc_starts.tolist()
    n_docs = len(starts) - 1
    sep = _separator_tokens(tokenizer)
    # Document d's own tokens: [starts[d], starts[d+1]) less the separator after it.
    bounds = [(starts[d], starts[d + 1] - (sep if d < n_docs - 1 else 0)) for d in range(n_docs)]
    room = [max(0, b - a) for a, b in bounds]
    capacity = [r // need for r in room]
    longest = max(range(n_docs), key=lambda d: room[d])
    if capacity[longest] == 0:
        raise DocumentsTooShort(
            f"single_documents=True needs a held-out document of at least {need} tokens (a span "
            f"of lcm(lengths)={span} targets{' and the token before it' if context else ''}); "
            f"the longest of the {n_docs} held-out documents, {stream.names[longest]!r}, holds "
            f"{room[longest]}; allowed: lengths whose lcm fits it, or longer documents",
            span=span, capacity=0, count=count,
        )  # fmt: skip
    if sum(capacity) < count:
        raise DocumentsTooShort(
            f"n_tokens={count * span} is not allowed with single_documents=True: the held-out "
            f"documents hold at most {sum(capacity)} spans of {span} tokens; allowed: n_tokens "
            f"<= {sum(capacity) * span}, or more held-out documents",
            span=span, capacity=sum(capacity), count=count,
        )  # fmt: skip
    order = [int(d) for d in rng.permutation(n_docs) if capacity[int(d)] > 0]
    taken = dict.fromkeys(order, 0)
    while sum(taken.values()) < count:  # in turns: one more span for each document with room
        for d in order:
            if taken[d] < capacity[d] and sum(taken.values()) < count:
                taken[d] += 1
    spans = []
    for d in order:
        m = taken[d]
        if m == 0:
            continue
        cuts = np.sort(rng.integers(0, room[d] - m * need + 1, size=m))
        first = bounds[d][0]
        spans += [(d, first + int(cut) + j * need + context) for j, cut in enumerate(cuts)]
    return sorted(spans, key=lambda s: s[1])


def _bin_edges(length: int, bins: int) -> np.ndarray:
    """Log-spaced bin edges over positions [0, length): fine near the start, where NLL falls
    fastest, and coarse far out."""
    edges = np.unique(np.round(np.geomspace(1, length + 1, bins + 1)).astype(int) - 1)
    edges[0], edges[-1] = 0, length
    return np.unique(edges)


class WindowStore:
    """The NLL rows of the windows scored so far, kept in a folder so that an evaluation
    killed part way (a 32k window of SmolLM2 takes about 13 minutes on one core) resumes at
    the next window. Each batch of windows is one ``.npz`` file (float64 rows, no pickle),
    named by its length and first window, written atomically. The folder belongs to one
    provenance (``key``, a digest of what the numbers depend on): files of another are
    deleted unread, so a row is only ever reused for exactly what made it. ``run_perplexity``
    removes the folder once ``ppl.json`` is written."""

    KEY = "key.txt"

    def __init__(self, folder: str | os.PathLike[str], key: str) -> None:
        self.folder = Path(folder)
        self.key = key
        marker = self.folder / self.KEY
        # The key is written with the first window, so a run that saves none (a full disk,
        # an error before the first window) leaves no folder behind.
        self._keyed = marker.is_file() and marker.read_text().strip() == key
        if self.folder.is_dir() and not self._keyed:
            for old in self.folder.glob("*.npz"):
                old.unlink()
            marker.unlink(missing_ok=True)

    def _path(self, length: int, end: int) -> Path:
        return self.folder / f"{length}-{end}.npz"

    def load(self, length: int, end: int) -> list[torch.Tensor] | None:
        path = self._path(length, end)
        if not self._keyed or not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                return [torch.from_numpy(data[f"r{i}"].copy()) for i in range(len(data.files))]
        except (OSError, ValueError, KeyError):
            return None  # a damaged file (the kill came mid-write elsewhere): score again

    def save(self, length: int, end: int, rows: list[torch.Tensor]) -> None:
        """Write one batch's rows (atomically: a full disk is one line naming the file and
        leaves no temporary file); the first save also writes the key."""
        buffer = io.BytesIO()
        np.savez(buffer, **{f"r{i}": r.numpy() for i, r in enumerate(rows)})
        try:
            atomic_write_bytes(self._path(length, end), buffer.getvalue())
            if not self._keyed:  # after the window: a window without its key is never read
                atomic_write_text(self.folder / self.KEY, self.key + "\n")
                self._keyed = True
        except BaseException:
            if not self._keyed:  # nothing of this run is kept: no folder either
                shutil.rmtree(self.folder, ignore_errors=True)
            raise


def _score_windows(
    lm: LanguageModel,
    ids: torch.Tensor,
    windows: list[tuple[int, int]],
    length: int,
    batch_tokens: int,
    bos: list[int] | None,
    bar: tqdm,
    store: WindowStore | None = None,
    known: dict[tuple[int, int], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """NLL (float64) of the scored targets of each window, `batch_tokens` per forward; a
    batch ``store`` holds already is read back instead of scored, and a window ``known``
    holds (by length and end: scored in a longer window, `_score_prefixes`) is taken from it.

    Without a stride every target of a window is scored, so each row is the whole window's
    NLL by position, which the position curve and the last-quarter numbers need."""
    known = known or {}
    batch = max(1, batch_tokens // length)
    rows: list[torch.Tensor] = []
    for b in range(0, len(windows), batch):
        chunk = windows[b : b + batch]
        if len(chunk) == 1 and (length, chunk[0][0]) in known:  # read in a longer window
            rows.append(known[length, chunk[0][0]])
            continue
        kept = None if store is None else store.load(length, chunk[0][0])
        if kept is not None and [len(r) for r in kept] == [n for _, n in chunk]:
            rows += kept
            bar.update(len(chunk))
            continue
        inputs = [_window_input(ids, end, length, bos) for end, _ in chunk]
        nll = lm.token_nll(torch.stack(inputs)).double()  # (B, length)
        # Copies, not views: a view would carry its whole batch along when gathered.
        new = [row[length - n :].clone() for row, (_, n) in zip(nll, chunk, strict=True)]
        if store is not None:
            store.save(length, chunk[0][0], new)
        rows += new
        bar.update(len(chunk))
    return rows


def _window_input(ids: torch.Tensor, end: int, length: int, bos: list[int] | None) -> torch.Tensor:
    """The ids a window of ``length`` targets ending at ``end`` reads, with its targets: BOS
    then the targets, or the token before them then the targets (length + 1 ids)."""
    if bos is not None:
        return torch.cat([torch.tensor(bos), ids[end - length : end]])
    return ids[end - length - 1 : end]


def _prefix_groups(
    plan: dict[int, list[tuple[int, int]]], config: PerplexityConfig
) -> list[list[tuple[int, int]]]:
    """(length, end) of the windows that start at the same target, shortest first, for each
    target where more than one starts: whole windows (no stride) read one at a time (a batch
    has its own chunk length), each a prefix of the longest."""
    if config.stride is not None:
        return []
    starts: dict[int, list[tuple[int, int]]] = {}
    for length, windows in plan.items():
        if config.batch_tokens // length <= 1:
            for end, _ in windows:
                starts.setdefault(end - length, []).append((length, end))
    return [sorted(group) for group in starts.values() if len(group) > 1]


def windows_read(config: PerplexityConfig, shared: bool = True) -> dict[int, int]:
    """How many windows of each length `evaluate_perplexity` reads in a reading of their own,
    for a plan's cost estimate: every window, less, with ``shared`` (a model that has
    ``prefix_nll``, an encoding that does not follow the length), those read in a longer
    window's reading (`_prefix_groups`), of which only a last partial chunk is read apart."""
    parted = config.single_documents or config.part is not None
    span = math.lcm(*config.lengths) if parted else config.n_tokens
    plan = {length: _windows(0, span, length, config.stride) for length in config.lengths}
    read = {length: len(windows) for length, windows in plan.items()}
    for group in _prefix_groups(plan, config) if shared else []:
        for length, _ in group[:-1]:
            read[length] -= 1
    count = 1 if config.part is not None else config.n_tokens // span
    return {length: n * count for length, n in read.items()}


def _score_prefixes(
    lm: LanguageModel,
    ids: torch.Tensor,
    groups: list[list[tuple[int, int]]],
    bos: list[int] | None,
    bar: tqdm,
    store: WindowStore | None = None,
) -> dict[tuple[int, int], torch.Tensor]:
    """NLL (float64) of every window of ``groups`` by (length, end), each group's windows not
    in ``store`` read in its longest one's reading (``lm.prefix_nll``), bit for bit the rows
    `_score_windows` gives, and saved to ``store`` one by one as it would save them."""
    rows: dict[tuple[int, int], torch.Tensor] = {}
    for group in groups:
        missing = []
        for length, end in group:
            kept = None if store is None else store.load(length, end)
            if kept is not None and [len(r) for r in kept] == [length]:
                rows[length, end] = kept[0]
                bar.update(1)
            else:
                missing.append((length, end))
        if not missing:
            continue
        longest, end = missing[-1]
        read = lm.prefix_nll(_window_input(ids, end, longest, bos), [n for n, _ in missing])
        for (length, end), row in zip(missing, read, strict=True):
            rows[length, end] = row.double()
            if store is not None:
                store.save(length, end, [rows[length, end]])
            bar.update(1)
    return rows


def _per_span(
    rows: list[torch.Tensor],
    last_quarter: list[float] | None,
    spans: tuple[Span, ...],
) -> tuple[SpanScore, ...]:
    """Each span's numbers: its windows are a contiguous, equal share of the rows."""
    per = len(rows) // len(spans)
    out = []
    for i, span in enumerate(spans):
        mine = rows[i * per : (i + 1) * per]
        total = float(sum(float(r.sum()) for r in mine))
        nll = total / span.tokens
        quarter = None if last_quarter is None else last_quarter[i * per : (i + 1) * per]
        out.append(
            SpanScore(
                document=span.document,
                nll=nll,
                perplexity=math.exp(nll),
                bits_per_byte=total / math.log(2) / span.bytes,
                last_quarter_nll=None if quarter is None else float(np.mean(quarter)),
            )
        )
    return tuple(out)


def _summarize(
    length: int,
    windows: list[tuple[int, int]],
    rows: list[torch.Tensor],
    span: int,
    n_bytes: int,
    config: PerplexityConfig,
    spans: tuple[Span, ...] | None = None,
) -> LengthScore:
    """One length's numbers from the NLL rows of all its windows (and, given the document
    ``spans`` the windows tile in order, each span's).

    The sums walk the windows in the batches a single process scores them in, so one or
    several processes give bit-identical numbers whenever their NLL rows are."""
    batch = max(1, config.batch_tokens // length)
    total = 0.0
    position_sum = torch.zeros(length, dtype=torch.float64)
    last_quarter: list[float] = []
    blocks: list[tuple[float, ...]] = []
    for b in range(0, len(rows), batch):
        chunk = rows[b : b + batch]
        for row in chunk:
            total += float(row.sum())
        if config.stride is None:
            nll = torch.stack(chunk)  # (B, length)
            position_sum += nll.sum(0)
            quarter = length - length // 4
            last_quarter += nll[:, quarter:].mean(1).tolist()
            blocks += [_block_means(row[quarter:]) for row in nll]
    mean = total / span
    result = LengthScore(
        length=length,
        windows=len(windows),
        tokens=span,
        bytes=n_bytes,
        nll=mean,
        perplexity=math.exp(mean),
        bits_per_token=mean / math.log(2),
        bits_per_byte=total / math.log(2) / n_bytes,
        last_quarter_nll=None,
        last_quarter_nll_std=None,
        last_quarter_nll_windows=None,
        last_quarter_nll_blocks=None,
        position_nll=None,
        spans=None,
    )
    if config.stride is None:
        curve = (position_sum / len(windows)).numpy()
        edges = _bin_edges(length, config.position_bins)
        result = replace(
            result,
            last_quarter_nll=float(np.mean(last_quarter)),
            last_quarter_nll_std=float(np.std(last_quarter)),
            last_quarter_nll_windows=tuple(last_quarter),
            last_quarter_nll_blocks=tuple(blocks),
            position_nll=PositionCurve(
                start=tuple(edges[:-1].tolist()),
                stop=tuple(edges[1:].tolist()),
                nll=tuple(float(curve[a:b].mean()) for a, b in itertools.pairwise(edges)),
            ),
        )
    if spans is not None:
        quarter = last_quarter if config.stride is None else None
        result = replace(result, spans=_per_span(rows, quarter, spans))
    return result


def _block_means(quarter: torch.Tensor) -> tuple[float, ...]:
    """Means of consecutive QUARTER_BLOCK-target blocks of one window's last quarter (the last
    block shorter when the quarter is not a multiple)."""
    return tuple(float(b.mean()) for b in quarter.split(QUARTER_BLOCK))


def _uses_bos(tokenizer: Tokenizer, config: PerplexityConfig) -> bool:
    """Whether windows start with BOS: the config's choice, else the tokenizer's own habit."""
    return bool(default_prefix(tokenizer)) if config.bos is None else config.bos


def check_single_documents(
    stream: TokenStream, tokenizer: Tokenizer, config: PerplexityConfig
) -> None:
    """Raise `DocumentsTooShort` when ``stream``'s documents cannot hold the spans that
    ``config`` (single_documents=True) scores, without a model call; a caller can then choose
    other lengths before anything is written. Capacity does not depend on the seed."""
    span = math.lcm(*config.lengths)
    context = 0 if _uses_bos(tokenizer, config) else 1
    rng = np.random.default_rng(config.seed)
    document_spans(stream, tokenizer, span, config.n_tokens // span, context, rng)


@dataclass(frozen=True)
class _Targets:
    """The target tokens every length scores: spans of ``span`` tokens of the stream."""

    span: int  # targets per span: n_tokens, or lcm(lengths) with single documents
    starts: list[int]  # stream index of each span's first target
    start: int | None  # the one span's first target (documents joined); None: single documents
    spans: tuple[Span, ...] | None  # single documents: each span; None otherwise


def evaluate_perplexity(
    lm: LanguageModel,
    stream: TokenStream,
    config: PerplexityConfig,
    progress: bool = True,
    *,
    processes: Processes | None = None,
    store: WindowStore | None = None,
) -> PerplexityResult:
    """Score `lm` on `stream` at every length of `config` (see the module docstring): the
    result without metadata, provenance, data spec or model (``run_perplexity`` adds them).

    Launched as several processes (`accelerate launch`, `torchrun`), each scores a share of
    the windows and every process returns the whole result. `processes` defaults to the
    current run's (`ropekit.distributed.processes()`). `store` keeps each scored window's
    rows so that a rerun resumes at the first window not scored (``WindowStore``)."""
    use_bos, prefix = _window_start(lm.tokenizer, stream, config)
    context = 0 if use_bos else 1  # without BOS, the first target's input precedes it
    rng = np.random.default_rng(config.seed)
    if config.single_documents:
        targets = _document_targets(stream, lm.tokenizer, config, context, rng)
    else:
        targets = _joined_targets(stream, config, context, rng)
    span, starts = targets.span, targets.starts
    n_bytes = sum(stream.n_bytes(a, a + span) for a in starts)
    plan = {
        L: [w for a in starts for w in _windows(a, span, L, config.stride)] for L in config.lengths
    }
    procs = processes if processes is not None else current_processes()
    place_on(lm, procs.device)
    scored = _score_shares(lm, stream.ids, plan, config, prefix, procs, progress, store)
    results = []
    for length, windows in plan.items():
        rows = [row for share in scored for row in share[length]]  # every window, in order
        total = span * len(starts)
        results.append(_summarize(length, windows, rows, total, n_bytes, config, targets.spans))
    spans = targets.spans
    return PerplexityResult(
        meta={},
        provenance={},
        metric="bits_per_byte" if isinstance(lm.tokenizer, ByteTokenizer) else "perplexity",
        tokenizer=lm.tokenizer.name,
        bos=use_bos,
        start=targets.start,
        config=config,
        results=tuple(results),
        spans=spans,
        documents=None if spans is None else len({s.document for s in spans}),
        data=None,
        spec=None,
        seed=config.seed,
        model={},
    )


def _window_start(
    tokenizer: Tokenizer, stream: TokenStream, config: PerplexityConfig
) -> tuple[bool, list[int] | None]:
    """(whether windows start with BOS, the BOS id as a one-token list or None), after
    refusing a stream of another tokenizer, or BOS for a tokenizer whose default prefix is not
    a single id (BOS stands in as each window's first input, so it must be one token)."""
    if stream.tokenizer != tokenizer.name:
        raise ValueError(
            f"stream tokenizer={stream.tokenizer!r} is not allowed for a model read with "
            f"{tokenizer.name!r}; allowed: a stream encoded with the model's tokenizer"
        )
    bos = default_prefix(tokenizer)
    use_bos = _uses_bos(tokenizer, config)
    if use_bos and len(bos) != 1:
        raise ValueError(
            f"bos=True is not allowed for tokenizer {tokenizer.name!r}: it adds {list(bos)} "
            "by default, not a single BOS id; allowed: bos=False"
        )
    return use_bos, list(bos) if use_bos else None


def _document_targets(
    stream: TokenStream,
    tokenizer: Tokenizer,
    config: PerplexityConfig,
    context: int,
    rng: np.random.Generator,
) -> _Targets:
    """n_tokens / lcm(lengths) spans of lcm(lengths) targets, each inside one held-out
    document (`document_spans`): lcm(lengths) is the shortest span every length tiles."""
    span = math.lcm(*config.lengths)
    count = config.n_tokens // span
    drawn = document_spans(stream, tokenizer, span, count, context, rng)
    spans = tuple(
        Span(
            document=stream.names[d],
            offset=first - int(stream.doc_starts[d]),
            start=first,
            tokens=span,
            bytes=stream.n_bytes(first, first + span),
        )
        for d, first in drawn
    )
    if config.part is not None:  # one span of those drawn: the same as in the whole
        drawn, spans = drawn[config.part : config.part + 1], spans[config.part : config.part + 1]
    return _Targets(span, [first for _, first in drawn], None, spans)


def _joined_targets(
    stream: TokenStream, config: PerplexityConfig, context: int, rng: np.random.Generator
) -> _Targets:
    """One span of n_tokens targets at a seeded place in the documents joined end to end,
    with ``context`` tokens (the first target's input, without BOS) before it."""
    span = config.n_tokens
    need = span + context
    if len(stream) < need:
        raise ValueError(
            f"n_tokens={span} is not allowed: the held-out stream holds {len(stream)} "
            f"tokens and {need} are needed; allowed: n_tokens <= "
            f"{len(stream) - need + span}, or more held-out data"
        )
    start = context + int(rng.integers(0, len(stream) - need + 1))
    if config.part is not None:  # one part of the stretch: the same targets as in the whole
        lcm = math.lcm(*config.lengths)
        return _Targets(lcm, [start + config.part * lcm], start + config.part * lcm, None)
    return _Targets(span, [start], start, None)


def _score_shares(
    lm: LanguageModel,
    ids: torch.Tensor,
    plan: dict[int, list[tuple[int, int]]],
    config: PerplexityConfig,
    prefix: list[int] | None,
    procs: Processes,
    progress: bool,
    store: WindowStore | None = None,
) -> list[dict[int, list[torch.Tensor]]]:
    """Every process's NLL rows per length, in rank order (``Processes.each``).

    Each process scores a contiguous share of every length's windows; the shares are
    gathered in rank order, so every process then sums exactly what one process would."""
    mine = {L: shard(windows, procs.rank, procs.world) for L, windows in plan.items()}
    bar = tqdm(
        total=sum(len(w) for w in mine.values()),
        desc="perplexity",
        unit="window",
        disable=not (progress and procs.is_main),
    )

    def score_mine() -> dict[int, list[torch.Tensor]]:
        groups = _prefix_groups(mine, config) if hasattr(lm, "prefix_nll") else []
        known = _score_prefixes(lm, ids, groups, prefix, bar, store)
        return {
            L: _score_windows(lm, ids, windows, L, config.batch_tokens, prefix, bar, store, known)
            for L, windows in mine.items()
        }

    scored = procs.each(score_mine)
    bar.close()
    return scored


def run_perplexity(
    model: Any,
    config: PerplexityConfig,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    data: str | list[str] = "shakespeare",
    stream: TokenStream | None = None,
    spec: str | None = None,
    command: str = "",
    progress: bool = True,
    overwrite: bool = False,
    processes: Processes | None = None,
) -> PerplexityRun:
    """Evaluate on the held-out documents of `data` and write `ppl.json` and `ppl.png` into
    `out_dir`. `model` is a Backbone, a Decoder, a Hugging Face causal LM or a
    `LanguageModel` (with `tokenizer` when it has none); `spec` names its encoding in the
    result. Returns the result with its paths. `stream`: the held-out documents of `data`
    already tokenized with the model's tokenizer (`heldout_stream(data, tokenizer)`), so a
    caller evaluating several models on one domain tokenizes it once; None tokenizes here.

    The result's provenance is the model (`Backbone.identity`), the held-out tokens (a digest)
    and the config: a `ppl.json` of exactly that provenance is returned as it is, without a
    model call; one of another model, data or config is refused, naming the field, unless
    `overwrite`. Under `accelerate launch` or `torchrun` the processes share the windows (see
    `evaluate_perplexity`), all return the result and the main process writes the files;
    `processes` defaults to the current run's."""
    lm = as_language_model(model, tokenizer)
    if stream is None:
        stream = heldout_stream(data, lm.tokenizer)
    elif stream.tokenizer != lm.tokenizer.name:
        raise ValueError(
            f"stream tokenizer={stream.tokenizer!r} is not allowed for a model read with "
            f"{lm.tokenizer.name!r}; allowed: heldout_stream(data, the model's tokenizer)"
        )
    settings = asdict(config)
    # Left out at their defaults, so results made before the fields existed are still reused.
    if not config.single_documents:
        del settings["single_documents"]
    if config.part is None:
        del settings["part"]
    provenance = {
        "model": lm.identity(),
        "data": {"spec": data, "tokens": stream.digest(), "n_tokens": len(stream)},
        "config": settings,
    }
    if getattr(lm, "scores_in_one_forward", False):
        # A length-following encoding is scored one forward per window (Backbone.token_nll);
        # results made when it was scored in chunks through the cache lack this and are not
        # reused for it. Absent for every other encoding, whose numbers did not change.
        provenance["scoring"] = "one forward per window"
    out = Path(out_dir)
    json_path, png = out / "ppl.json", out / "ppl.png"
    procs = processes if processes is not None else current_processes()
    if check_replaceable(json_path, "perplexity", provenance, overwrite=overwrite):
        result = read_record(json_path, PerplexityResult)
        if procs.is_main:  # the run that wrote the JSON failed (a full disk) or died after it
            if not png.is_file():
                plot_perplexity(result, png)
            shutil.rmtree(out / WINDOWS, ignore_errors=True)  # spent: the result holds them
        return PerplexityRun(result, json_path, png, True)
    # One process resumes window by window; several share the windows by rank, and a share
    # depends on how many there are, so they score afresh (and write no windows).
    store = WindowStore(out / WINDOWS, digest(provenance)) if procs.world == 1 else None
    result = replace(
        evaluate_perplexity(lm, stream, config, progress, processes=procs, store=store),
        meta=run_metadata(command, spec=spec, seed=config.seed),
        provenance=json.loads(to_json(provenance)),  # as the file holds it (lists, not tuples)
        data=data if isinstance(data, str) else tuple(data),
        spec=spec,
        model=lm.describe(),
    )
    # Every process holds the whole result; one writes it, the others wait for the files.
    if procs.is_main:
        write_result(json_path, "perplexity", result)
        plot_perplexity(result, png)
    procs.barrier()
    if store is not None:  # the result holds every row's numbers now: the windows are spent
        shutil.rmtree(store.folder, ignore_errors=True)
    return PerplexityRun(result, json_path, png, False)


def plot_perplexity(result: PerplexityResult, path: str | Path) -> Path:
    """ppl.png: the headline metric vs length, NLL vs token position, last-quarter NLL vs
    length."""
    rows = result.results
    metric = result.metric
    lengths = [r.length for r in rows]
    fig, axes = figure(14, 4.2, 1, 3)
    ax_m, ax_p, ax_q = axes[0]

    ax_m.plot(lengths, [r.headline(metric) for r in rows], "o-", lw=1.6)
    length_axis(ax_m, lengths, rotate=True)
    ax_m.set(xlabel="context length (tokens)", ylabel=metric.replace("_", " "))
    ax_m.set_title(f"{metric.replace('_', ' ')} vs length (same {rows[0].tokens} targets)")

    for r in rows:
        curve = r.position_nll
        if curve is None:
            continue
        middle = [(a + b - 1) / 2 + 1 for a, b in zip(curve.start, curve.stop, strict=True)]
        ax_p.plot(middle, curve.nll, lw=1.3, label=f"L={r.length}")
    ax_p.set(xscale="log", xlabel="target position in window + 1", ylabel="NLL (nats/token)")
    ax_p.set_title("NLL vs position")
    if ax_p.lines:
        ax_p.legend(fontsize=7)

    quarter = [r for r in rows if r.last_quarter_nll is not None]
    if quarter:
        ax_q.errorbar(
            [r.length for r in quarter],
            [r.last_quarter_nll for r in quarter],
            yerr=[r.last_quarter_nll_std for r in quarter],
            fmt="o-",
            capsize=3,
        )
        length_axis(ax_q, [r.length for r in quarter], rotate=True)
    ax_q.set(xlabel="context length (tokens)", ylabel="NLL (nats/token)")
    ax_q.set_title("last-quarter NLL per window (mean ± sd)")
    fig.suptitle(f"{result.spec or ''} {result.tokenizer}".strip(), fontsize=9)
    return save(fig, path, dpi=120)
