"""The statistics of a comparison and its recommendation, as pure functions of the numbers.

The question: which method should serve N tokens, and what does it cost at L0? The rule:

- **Cost at L0** of a method: the relative change of its whole-window perplexity at L0 against
  the unmodified model's (rope), averaged over the evaluation domains (so +0.01 = 1% worse).
- **Score at N**: the mean, over domains, of its last-quarter NLL at N (nats per token): the
  far positions of each window, which is what extension is for (a whole-window number mixes
  in the first 3/4 of the window, which the original context already covers).
- **Eligible** methods cost at most ``margin`` at L0. The recommended method is the eligible
  one with the lowest score at N.
- **Resolved?** The recommendation is against the runner-up (the next eligible method): their
  last-quarter NLLs at N are compared window by window (the same held-out windows for every
  method; a trained method's value is its mean over seeds), and the lead counts as resolved
  when the mean paired difference exceeds twice its standard error (about a 95% one-sided
  bound on a normal approximation) and is at least ``min_difference`` nats (methods that
  agree to rounding have a standard error near 0, so a lead of 1e-6 would otherwise count).
  The standard error is the larger of two: over windows (at least 2), and from blocks of
  positions within the windows (batch means of each window's last-quarter differences, at
  least 8 blocks per window, blocks of 64 tokens merged by doubling while 8 remain, the
  largest error kept: a blocking analysis, so correlation between neighbouring tokens cannot
  shrink it). The block error says whether the lead is more than noise on these windows'
  text; the window error, whether it holds from document to document. Without blocks (results
  written before they were kept) at least 3 windows are needed. Otherwise the comparison says
  that no difference is resolved at this sample size, names the two, and gives the numbers.
  Where a trained method was scored at several seeds, the spread over training runs is added:
  each seed's paired difference (its mean over the same windows), their standard error over
  seeds, added in quadrature to the error above (which says how the lead varies with the text
  read; this, with the training run). Seeds pair by position, as a comparison trains every
  method at the same seeds on the same samples; a method with one row (untrained) is paired
  with each of the other's seeds. A method scored at one seed adds no spread: its lead may be
  that seed's.
- **Collapsed** methods, whose score at N is more than ln 3 nats above the best eligible
  score (far-position perplexity at least 3x the best's: the method has left its trained
  range), are reported as collapsed, never as the runner-up: the recommendation is compared
  with the closest eligible method that has not collapsed, and when every other eligible
  method has collapsed the lead is resolved by the collapse itself.
- A domain with no held-out document long enough for a length (single-document windows) is
  not scored at that length by any method, and is left out of that length's means.

Per serving engine (``per_engine``): the best eligible method that engine serves exactly
(by ``ropekit inspect``'s rules, ``ropekit.serve.serving``), with its score and its distance
from the recommended one, so a user who must serve with vLLM or llama.cpp reads what to
deploy there and what it costs against the overall best.

Retrieval accuracy is reported beside it with Wilson score intervals
(``ropekit.evals.intervals``, the one implementation), not folded into the rule: a method that
wins on perplexity and loses retrieval is shown as such.

Holds: mean_std, pooled_accuracy, pooled_bin, method_retrieval, out_of_race, retrieval_note,
cost_at, score_at, paired_windows, paired_blocks, paired_seeds, block_error, paired_difference,
recommend, per_engine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ropekit.evals.intervals import CONFIDENCE, accuracy_entry, difference_interval
from ropekit.evals.perplexity import QUARTER_BLOCK
from ropekit.evals.probe_summary import (
    Accuracy,
    NeedleAccuracy,
    PairedProbes,
    Reach,
    accuracy_text,
    reach,
)

from .record import (
    BeyondMargin,
    Difference,
    DistanceRetrieval,
    EngineAnswer,
    EngineChoice,
    MethodRetrieval,
    SeedBin,
    Stop,
    TableEntry,
    Verdict,
)

COLLAPSE_NATS = math.log(3.0)  # a score this far above the best: far-position ppl >= 3x
MIN_BLOCKS = 8  # blocks per window that a block length needs before its error is used


def mean_std(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (0 for one value) and count."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        return {"mean": None, "std": None, "n": 0}
    m = sum(values) / n
    std = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": m, "std": std, "n": n}


def pooled_accuracy(
    entries: Sequence[Mapping[str, Any]], confidence: float = CONFIDENCE
) -> dict[str, Any]:
    """One accuracy of several runs' {correct, n} (a trained method's seeds): correct and n
    are summed and the Wilson interval is taken of the sums, so the interval is that of all
    the probes together, not an average of narrower per-seed intervals."""
    correct, n = sum(int(e["correct"]) for e in entries), sum(int(e["n"]) for e in entries)
    return {**accuracy_entry(correct, n, confidence), "runs": len(entries)}


def _pooled(per_seed: Sequence[NeedleAccuracy]) -> dict[str, Any]:
    """``pooled_accuracy`` of several seeds' entries, with the wrong answers that name another
    needle and the substring rule's accuracy pooled like the probes (None when a seed's
    summary did not count them)."""
    pooled = pooled_accuracy(
        [{"correct": e.correct, "n": e.n} for e in per_seed], per_seed[0].confidence
    )
    others = [e.other_needle for e in per_seed]
    nearest = [e.nearest_needle for e in per_seed]
    substring = [e.substring for e in per_seed]
    return {
        **pooled,
        "other_needle": None if None in others else sum(o or 0 for o in others),
        "nearest_needle": None if None in nearest else sum(o or 0 for o in nearest),
        "substring": None if None in substring else _summed(substring),  # type: ignore[arg-type]
    }


def pooled_bin(per_seed: Sequence[SeedBin], low: int, high: int) -> DistanceRetrieval:
    """One distance bin (low, high] pooled over its seeds (`_pooled`); its mean distance is
    that of all their probes."""
    mean = sum(e.mean_distance * e.n for e in per_seed) / sum(e.n for e in per_seed)
    return DistanceRetrieval(
        **_pooled(per_seed), low_distance=low, high_distance=high, mean_distance=mean,
        per_seed=tuple(per_seed),
    )  # fmt: skip


def method_retrieval(
    by_distance: Sequence[DistanceRetrieval],
    edges: Sequence[int],
    accuracy: float,
    trained_at: int,
) -> MethodRetrieval:
    """A method's pooled bins (``edges``: the probes' bin edges), their reach at ``accuracy``
    (``evals.probe_summary.reach``) and the probes of the bins from the first edge at or past the
    trained length on, pooled: each probe is in one bin, so each is counted once."""
    scored = [
        {"low_distance": b.low_distance, "high_distance": b.high_distance, "accuracy": b.accuracy}
        for b in by_distance
    ]
    past_from = next((e for e in edges if e >= trained_at), None)
    past = [b for b in by_distance if past_from is not None and b.low_distance >= past_from]
    return MethodRetrieval(
        by_distance=tuple(by_distance),
        reach=Reach(**reach(scored, edges, accuracy)) if by_distance else None,
        past_from=past_from,
        past=_summed(past) if past else None,
    )


def _summed(accuracies: Sequence[Accuracy]) -> Accuracy:
    """One accuracy of several: correct and n summed, one interval (as pooled_accuracy)."""
    correct, n = sum(a.correct for a in accuracies), sum(a.n for a in accuracies)
    return Accuracy(**accuracy_entry(correct, n, accuracies[0].confidence))


def out_of_race(verdict: Verdict, stops: Mapping[str, Stop]) -> Verdict:
    """``verdict``, made on the methods still in the race, with its sentence naming those that
    left it and why: they were not candidates, so without them "every other method ...
    collapses" would read as a statement about every method compared."""
    if not stops:
        return verdict
    gone = "; ".join(f"{m} after round {s.round} ({s.reason})" for m, s in stops.items())
    sentence = f"{verdict.sentence} Out of the race, so not candidates: {gone}."
    return dataclasses.replace(verdict, sentence=sentence)


def retrieval_note(
    retrieval: Mapping[str, MethodRetrieval], verdict: Verdict, paired: PairedProbes | None = None
) -> str | None:
    """The recommended method's and the runner-up's retrieval past the trained length (their
    probes at needle distances past it, pooled) with their reach, and the interval of their
    difference, as supporting numbers beside the rule; None without a winner or probes that
    far. ``paired``: the two methods' answers past the trained length joined probe by probe
    (``compare.assemble`` reads them where each was probed once, on the same probes), whose
    interval is Newcombe's for paired data; without it, Newcombe's for two independent samples
    of the pooled accuracies (the wider one where their answers go together)."""
    past = {
        m: p
        for m in (verdict.winner, verdict.runner_up)
        if m in retrieval and (p := retrieval[m].past) is not None
    }
    if not past:
        return None

    def text(m: str, accuracy: Accuracy) -> str:
        found = retrieval[m].reach
        reached = "" if found is None else f", reach {found.distance:,} at {found.accuracy:g}"
        return f"{m} {accuracy_text(accuracy)}{reached}"

    first = next(iter(past))
    level = past[first].confidence
    note = (
        f"Retrieval past the trained length (needles more than {retrieval[first].past_from:,} "
        f"tokens back: accuracy, {level:.0%} Wilson interval, correct/probes; the reach: the "
        "farthest distance up to which every bin scores the accuracy named), beside the rule, "
        f"not part of it: {'; '.join(text(m, p) for m, p in past.items())}"
    )
    if len(past) < 2:
        return note + "."
    a, b = past.values()
    low, high = difference_interval(a.correct, a.n, b.correct, b.n, level)
    how = "Newcombe's interval"
    if paired is not None:
        low, high = paired.interval()
        how = f"Newcombe's interval for paired probes: both answered the same {paired.n}"
    told = "tells them apart" if low > 0 or high < 0 else "does not tell them apart"
    return (
        f"{note}; the difference {a.accuracy - b.accuracy:+.2f} [{low:+.2f}, {high:+.2f}] "
        f"({how}) {told}."
    )


# table[method][domain][length]: the per-seed numbers of one cell (compare.record.TableEntry)
Table = Mapping[str, Mapping[str, Mapping[int, TableEntry]]]


def _cell(table: Table, method: str, domain: str, length: int) -> TableEntry | None:
    """``table[method][domain][length]``, or None where no document of the domain holds the
    length (or the method is not scored on the domain)."""
    rows = table[method].get(domain, {})
    return rows.get(length)


def cost_at(table: Table, method: str, baseline: str, length: int) -> float | None:
    """Mean over domains of ppl(method) / ppl(baseline) - 1 at ``length`` (seed means), the
    domains scored at ``length`` only; None when none is."""
    ratios = []
    for domain in table[method]:
        mine = _cell(table, method, domain, length)
        base = _cell(table, baseline, domain, length)
        if mine is None or base is None:  # no document of the domain holds the length
            continue
        ratios.append(mean_std(mine.ppl)["mean"] / mean_std(base.ppl)["mean"] - 1)
    return sum(ratios) / len(ratios) if ratios else None


def _window_means(entry: TableEntry) -> list[float]:
    """Per-window last-quarter NLL, averaged over seeds (the windows are the same)."""
    return [sum(ws) / len(ws) for ws in zip(*entry.last_quarter_windows, strict=True)]


def score_at(table: Table, method: str, length: int) -> float | None:
    """Mean over the domains scored at ``length`` of the last-quarter NLL there (nats per
    token); None when none is."""
    values = []
    for domain in table[method]:
        entry = _cell(table, method, domain, length)
        if entry is None:  # no document of the domain holds the length
            continue
        windows = _window_means(entry)
        values.append(sum(windows) / len(windows))
    return sum(values) / len(values) if values else None


def _scored_by_both(
    table: Table, a: str, b: str, length: int
) -> Iterator[tuple[TableEntry, TableEntry]]:
    """``a``'s and ``b``'s entries at ``length`` in every domain that scored both there."""
    for domain in table[a]:
        mine, theirs = _cell(table, a, domain, length), _cell(table, b, domain, length)
        if mine is not None and theirs is not None:
            yield mine, theirs


def paired_windows(table: Table, a: str, b: str, length: int) -> list[float]:
    """Per-window last-quarter NLL of ``a`` minus ``b`` at ``length``, every domain's windows."""
    return [
        x - y
        for mine, theirs in _scored_by_both(table, a, b, length)
        for x, y in zip(_window_means(mine), _window_means(theirs), strict=True)
    ]


def paired_seeds(table: Table, a: str, b: str, length: int) -> list[float]:
    """Per seed, ``a``'s last-quarter NLL minus ``b``'s at ``length``, averaged over every
    domain's windows (the mean of ``paired_windows``, taken one seed at a time). Seeds pair by
    position; a method with one row is paired with each of the other's. Raises ValueError for
    two methods scored at different numbers of seeds, both more than one: they do not pair."""
    pairs = list(_scored_by_both(table, a, b, length))
    counts = {len(e.last_quarter_windows) for pair in pairs for e in pair}
    if len(counts - {1}) > 1:
        raise ValueError(
            f"{a} and {b} are scored at {length} with {' and '.join(map(str, sorted(counts)))} "
            "seeds: seeds pair by position, so both need the same seeds (or one a single row)"
        )
    seeds = max(counts, default=0)

    def row(entry: TableEntry, k: int) -> tuple[float, ...]:
        runs = entry.last_quarter_windows
        return runs[k] if len(runs) > 1 else runs[0]

    out = []
    for k in range(seeds):
        diffs = [x - y for mine, theirs in pairs
                 for x, y in zip(row(mine, k), row(theirs, k), strict=True)]  # fmt: skip
        out.append(sum(diffs) / len(diffs))
    return out


def _window_blocks(entry: TableEntry) -> list[np.ndarray] | None:
    """Per-window last-quarter block means, averaged over seeds; None when a seed has none."""
    per_seed = entry.last_quarter_blocks  # None per seed: ppl.json older than the blocks
    if any(b is None for b in per_seed):
        return None
    return [np.mean(np.asarray(ws, dtype=float), axis=0) for ws in zip(*per_seed, strict=True)]


def paired_blocks(table: Table, a: str, b: str, length: int) -> list[np.ndarray] | None:
    """Per window (every domain's), the block means of ``a``'s last quarter minus ``b``'s at
    ``length``; None when either lacks blocks anywhere."""
    diffs = []
    for mine, theirs in _scored_by_both(table, a, b, length):
        ours, others = _window_blocks(mine), _window_blocks(theirs)
        if ours is None or others is None:
            return None
        diffs += [x - y for x, y in zip(ours, others, strict=True)]
    return diffs or None


def block_error(windows: Sequence[np.ndarray], base: int = QUARTER_BLOCK) -> dict | None:
    """The standard error of the mean over windows of each window's mean, from the blocks
    within the windows: Var = sum over windows of s_w^2 / m_w, over W^2 (s_w^2 the variance of
    window w's m_w block means, batch means). Blocks are merged in pairs while every window
    keeps MIN_BLOCKS, and the largest error over block lengths is kept (blocking analysis:
    it grows with the block length until blocks are longer than the correlation, then levels).
    None when a window has fewer than MIN_BLOCKS blocks."""
    best, scale = None, 1
    while min(len(w) for w in windows) // scale >= MIN_BLOCKS:
        merged = [w[: len(w) // scale * scale].reshape(-1, scale).mean(1) for w in windows]
        var = sum(m.var(ddof=1) / len(m) for m in merged) / len(merged) ** 2
        if best is None or math.sqrt(var) > best["se_blocks"]:
            best = {"se_blocks": math.sqrt(var), "block_tokens": base * scale,
                    "blocks": sum(len(m) for m in merged)}  # fmt: skip
        scale *= 2
    return best


def _error(diffs: list[float], blocks: list[np.ndarray] | None, seeds: list[float]) -> Difference:
    """The paired difference's mean and standard error (module docstring: the rule)."""
    stats = mean_std(diffs)
    n = stats["n"]
    windows = stats["std"] / math.sqrt(n) if n > 1 else None
    within = block_error(blocks) if blocks is not None else None
    if within is not None:
        se = max(within["se_blocks"], windows or 0.0)
    else:
        se = windows if n >= 3 else None
    spread = mean_std(seeds)
    runs = spread["std"] / math.sqrt(spread["n"]) if spread["n"] > 1 else None
    if se is not None and runs is not None:  # independent sources: text read, training run
        se = math.hypot(se, runs)
    within = within or {"se_blocks": None, "block_tokens": None, "blocks": None}
    return Difference(**stats, se=se, se_windows=windows, **within, se_seeds=runs,
                      seeds=spread["n"])  # fmt: skip


def paired_difference(table: Table, a: str, b: str, length: int) -> Difference:
    """``a``'s last-quarter NLL minus ``b``'s at ``length``, paired window by window over every
    domain that scored both, with the rule's standard error (module docstring): what the
    verdict states between the recommended method and the runner-up, for any two methods."""
    return _error(
        paired_windows(table, a, b, length),
        paired_blocks(table, a, b, length),
        paired_seeds(table, a, b, length),
    )


def _error_text(d: Difference) -> str:
    """`` ± 0.0123 s.e. from 40 blocks of 256 tokens within the windows`` (or ``over
    windows``), ``and over 3 seeds`` where their spread is in it; or nothing."""
    if d.se is None:
        return ""
    source = (
        f"from {d.blocks} blocks of {d.block_tokens} tokens within the windows"
        if d.se_blocks is not None and d.se_blocks >= (d.se_windows or 0.0)
        else "over windows"
    )
    if d.se_seeds is not None:
        source += f" and over {d.seeds} seeds"
    return f" ± {d.se:.4f} s.e. {source}"


def _collapsed(ranked: Sequence[str], scores: Mapping[str, Any]) -> list[str]:
    """The methods after the first of ``ranked`` whose score is COLLAPSE_NATS above its."""
    return [m for m in ranked[1:] if scores[m] - scores[ranked[0]] > COLLAPSE_NATS]


def _over_collapsed(out: Verdict, winner: str, collapsed: Sequence[str]) -> str:
    """The verdict when every other eligible method has collapsed at N."""
    scores, costs = out.scores, out.costs
    target, short = out.target_length, out.short_length
    gone = ", ".join(f"{m} (last-quarter perplexity {math.exp(scores[m]):.1f})" for m in collapsed)
    return (
        f"Use {winner} at {target} tokens: last-quarter perplexity at {target} "
        f"{math.exp(scores[winner]):.1f} (NLL {scores[winner]:.4f}), costing "
        f"{costs[winner]:+.1%} at {short} tokens; every other method within "
        f"{out.margin:.1%} collapses there: {gone}."
    )


def recommend(
    table: Table,
    methods: Sequence[str],
    baseline: str,
    short: int,
    target: int,
    margin: float,
    *,
    min_difference: float = 0.005,
    trained: Collection[str] = (),
) -> Verdict:
    """The recommendation at ``target`` with at most ``margin`` cost at ``short`` (module
    docstring): the rule's numbers and one sentence. ``trained``: the methods that were
    trained, so a resolved lead of one trained at a single seed says its error lacks the
    spread over training runs."""
    costs = {m: cost_at(table, m, baseline, short) for m in methods}
    scores = {m: score_at(table, m, target) for m in methods}
    eligible = sorted(
        (
            m
            for m in methods
            if costs[m] is not None and scores[m] is not None and costs[m] <= margin
        ),
        key=lambda m: scores[m],
    )
    out = Verdict(
        rule=__doc__.split("The rule:", 1)[1].split("Retrieval accuracy", 1)[0].strip(),
        margin=margin, min_difference=min_difference, short_length=short,
        target_length=target, baseline=baseline,
        costs=costs, scores=scores, eligible=tuple(eligible), winner=None,
        runner_up=None, difference=None, resolved=False, collapsed=(), sentence="",
    )  # fmt: skip
    if not eligible:
        none = f"No method costs at most {margin:.1%} at {short} tokens; none is recommended."
        return dataclasses.replace(out, sentence=none)
    winner = eligible[0]
    collapsed = _collapsed(eligible, scores)
    out = dataclasses.replace(out, winner=winner, collapsed=tuple(collapsed))
    eligible = [m for m in eligible if m not in collapsed]
    if len(eligible) == 1 and collapsed:
        return dataclasses.replace(
            out, resolved=True, sentence=_over_collapsed(out, winner, collapsed)
        )
    if len(eligible) == 1:
        return dataclasses.replace(
            out,
            resolved=True,
            sentence=(
                f"{winner} is the only method within {margin:.1%} of the unmodified model at "
                f"{short} tokens (last-quarter NLL at {target}: {scores[winner]:.4f})."
            ),
        )
    return _paired_verdict(out, table, winner, eligible[1], trained)


def _paired_verdict(
    out: Verdict, table: Table, winner: str, runner: str, trained: Collection[str]
) -> Verdict:
    """``recommend``'s verdict between the two best eligible methods: the paired difference,
    its error, and the sentence that says whether the lead is resolved."""
    target, short, costs, scores = out.target_length, out.short_length, out.costs, out.scores
    stats = paired_difference(table, winner, runner, target)
    se = stats.se
    n_windows = f"{stats.n} window{'s' * (stats.n != 1)}"
    resolved = se is not None and stats.mean + 2 * se < 0 and -stats.mean >= out.min_difference
    out = dataclasses.replace(out, runner_up=runner, difference=stats, resolved=resolved)
    lead = (
        f"last-quarter NLL at {target} {scores[winner]:.4f} against {runner}'s "
        f"{scores[runner]:.4f} (paired over {n_windows}: "
        f"{stats.mean:+.4f}{_error_text(stats)})"
    )
    cost = f"costing {costs[winner]:+.1%} at {short} tokens"
    if out.collapsed:
        lead += f"; collapsed at {target}: {', '.join(out.collapsed)}"
    if resolved:
        sentence = f"Use {winner} at {target} tokens: {lead}, {cost}."
        if stats.n < 3:  # resolved within these windows' text only
            sentence += (
                f" The error is from within {n_windows}: more "
                "held-out spans (spans) would say whether the lead holds across documents."
            )
        once = [m for m in (winner, runner) if m in trained and stats.seeds == 1]
        if once:  # the training run's spread is not in the error (module docstring)
            sentence += (
                f" {' and '.join(once)} {'was' if len(once) == 1 else 'were'} trained at one "
                "seed, so the error lacks the spread over training runs: more seeds (seeds) "
                "would say whether the lead is more than that seed's."
            )
        return dataclasses.replace(out, sentence=sentence)
    sentence = (
        f"No difference is resolved at this sample size between {winner} and {runner} at "
        f"{target} tokens: {lead}; {winner} is ahead, {cost}."
    )
    if se is None:  # neither 3 paired windows nor blocks within them
        sentence += (
            f" {n_windows} at {target} cannot resolve a "
            f"lead (the rule needs at least 3, or {MIN_BLOCKS} blocks of {QUARTER_BLOCK} tokens "
            "in each window's last quarter): score more held-out spans (spans)."
        )
    return dataclasses.replace(out, sentence=sentence)


# served[method][engine]: whether the engine serves the method exactly, and why not
Served = Mapping[str, Mapping[str, EngineAnswer]]


def per_engine(verdict: Verdict, served: Served) -> dict[str, EngineChoice]:
    """For each engine in ``served`` ({method: {engine: answer}}), the best eligible method it
    serves exactly; ``behind`` is its score at N minus the recommended method's (nats). A
    method it does not serve exactly is passed over, with the reason kept for the
    recommended one; an engine that serves no eligible method gets ``method`` None. Where a
    method over the cost margin scores better at N than the eligible one it serves (or it
    serves none), ``beyond_margin`` names the best such method with its score and cost, so a
    user bound to that engine sees the trade rather than only a collapsed baseline."""
    engines = list(dict.fromkeys(e for row in served.values() for e in row))
    return {engine: _engine_entry(verdict, served, engine) for engine in engines}


def _answer(served: Served, method: str | None, engine: str) -> EngineAnswer | None:
    """``served[method][engine]``, or None where that engine was not asked about it."""
    row = served.get(method, {})
    return row.get(engine)


def _engine_entry(verdict: Verdict, served: Served, engine: str) -> EngineChoice:
    best, scores, costs = verdict.winner, verdict.scores, verdict.costs
    target, short = verdict.target_length, verdict.short_length

    def serves(m: str) -> bool:
        answer = _answer(served, m, engine)
        return answer is not None and answer.exact

    pick = next((m for m in verdict.eligible if serves(m)), None)
    told = _answer(served, best, engine)
    why = told.why if told is not None else None
    ceiling = math.inf if pick is None else scores[pick]
    over = sorted(
        (m for m in scores if m not in verdict.eligible and scores[m] is not None
         and m in costs and costs[m] is not None and serves(m) and scores[m] < ceiling),
        key=lambda m: scores[m],
    )  # fmt: skip
    beyond = BeyondMargin(over[0], scores[over[0]], costs[over[0]]) if over else None
    entry = EngineChoice(
        method=pick, score=None, cost=None, behind=None,
        why_not_best=why if why and pick != best else None, beyond_margin=beyond, sentence="",
    )  # fmt: skip
    if pick is None:
        text = f"{engine}: serves none of the eligible methods exactly" + (
            f" ({why})" if why else ""
        )
    else:
        behind = scores[pick] - scores[best]
        entry = dataclasses.replace(entry, score=scores[pick], cost=costs[pick], behind=behind)
        same = " (the recommended method)" if pick == best else (
            f", {behind:+.4f} nats behind {best}"
        )  # fmt: skip
        if pick != best and pick in _collapsed([best, pick], scores):  # left its range at N
            same += f" (collapsed at {target})"
        text = (
            f"{engine}: {pick}{same}; last-quarter NLL at {target} {scores[pick]:.4f}, "
            f"costing {costs[pick]:+.1%} at {short} tokens"
        )
    if over:
        text += (
            f"; over the cost margin it serves {over[0]} (last-quarter NLL {scores[over[0]]:.4f}, "
            f"costing {costs[over[0]]:+.1%})"
        )
    return dataclasses.replace(entry, sentence=text + ".")
