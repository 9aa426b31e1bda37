"""A raced comparison's rounds: what each method scored in each round, and the race on them.

With ``CompareConfig.race`` on, round r scores one window at N of one held-out domain
(`plan.race_cells`: span by span, each span over every domain; its ``ppl.json`` in
``eval/<label>/s<seed>/<domain>/round-<r>/``, `PerplexityConfig.part`), at every seed, for the
methods still in. Once every method in round r has its round, the stopping
rule (`race.race`, over rounds 1..r) decides who goes on; the plan (`plan.jobs`) reads
``entrants`` to yield the next round's jobs, and the probes of those who finished the race.
A method's numbers so far are its rounds joined (`joined`): the windows and numbers a whole
reading of those spans gives, so a method that finishes the race enters the verdict with
every window, as without racing.

Holds: Rounds, race_rule, joined.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence

from ropekit.evals import PerplexityResult
from ropekit.evals.perplexity import LengthScore

from .assemble import Scores, length_entries
from .config import CompareConfig
from .plan import BASELINE, ResolvedMethod, race_cells
from .race import RaceRule, race
from .record import Race, Stop


def race_rule(
    config: CompareConfig, domains: Mapping[str, tuple[int, ...]], trained_at: int
) -> RaceRule:
    """The rule a comparison of ``config`` races by, its rounds the windows at N (spans x
    scored domains: `plan.race_cells`); a domain whose windows do not come in spans of N
    tokens (lengths without N, the rule's score, or one that does not divide it) refused in
    one line naming it. Without L0 among the lengths no cost is known, and no method is
    stopped as over the margin."""
    n = config.target_length
    for domain, lengths in domains.items():
        if lengths and (n not in lengths or math.lcm(*lengths) != n):
            raise ValueError(
                f"race=on is not allowed here: domain {domain} is scored at {list(lengths)}; "
                f"racing needs N={n} among a domain's lengths, each dividing N (its rounds "
                "are its spans of N tokens); use --race off"
            )
    scored = [d for d, lengths in domains.items() if lengths]
    return RaceRule(config.spans * len(scored), config.margin, config.min_difference)


class Rounds:
    """The rounds of one raced comparison, as its jobs finish (module docstring)."""

    def __init__(
        self,
        rule: RaceRule,
        baseline: str,
        seeds: Mapping[str, tuple[int, ...]],
        cells: Sequence[tuple[int, str]],
        lengths: tuple[int, int],
    ) -> None:
        self.rule, self.baseline, self.seeds, self.cells = rule, baseline, seeds, tuple(cells)
        self.domains = list(dict.fromkeys(d for _, d in cells))  # scored, in order
        self.trained_at, self.target = lengths
        self.results: dict[str, dict[int, dict[int, Scores]]] = {}  # label, round, seed, domain
        self.stops: dict[str, Stop] = {}
        self.decided = 0  # rounds scored by every method in them, and decided

    @classmethod
    def of(
        cls,
        config: CompareConfig,
        methods: Sequence[ResolvedMethod],
        domains: Mapping[str, tuple[int, ...]],
        trained_at: int,
    ) -> Rounds:
        """The rounds of the comparison of ``config`` (canonical) and its resolved methods,
        scored on ``domains`` (domain -> lengths), before any is scored."""
        rule = race_rule(config, domains, trained_at)
        seeds = {m.label: config.seeds if m.trained else (0,) for m in methods}
        baseline = next(m.label for m in methods if m.spec == BASELINE)
        scored = [d for d, lengths in domains.items() if lengths]
        cells = race_cells(config.spans, scored)
        return cls(rule, baseline, seeds, cells, (trained_at, config.target_length))

    def entrants(self, r: int) -> set[str] | None:
        """The methods scored in round ``r`` (r = rounds + 1: those who finished the race);
        None while the round before is not decided."""
        if r - 1 > self.decided:
            return None
        return {m for m in self.seeds if m not in self.stops or self.stops[m].round >= r}

    def planned(self, r: int) -> set[str]:
        """The most round ``r`` can score: its entrants once decided, else every method not
        stopped yet (for the plan's cost)."""
        entrants = self.entrants(r)
        return entrants if entrants is not None else set(self.seeds) - set(self.stops)

    def add(self, label: str, r: int, seed: int, domain: str, result: PerplexityResult) -> bool:
        """Take in one job of round ``r``; True when that completes the round, which is then
        decided (`stops` holds who left in it)."""
        by_seed = self.results.setdefault(label, {}).setdefault(r, {})
        by_seed.setdefault(seed, {})[domain] = result
        before = self.decided
        while self._complete(self.decided + 1):  # rounds may finish out of order (--join)
            self.decided += 1
            self.stops = race(
                list(self.seeds), self.baseline, self.target, self.rule, self._table,
                self._l0, looks=self.decided,
            )  # fmt: skip
        return self.decided > before

    def _complete(self, r: int) -> bool:
        entrants = self.entrants(r)
        if entrants is None or r > self.rule.rounds:
            return False
        return all(s in self.results.get(m, {}).get(r, {}) for m in entrants for s in self.seeds[m])

    def scores(self, label: str, rounds: int | None = None) -> dict[int, Scores]:
        """seed -> domain -> ``label``'s windows of rounds 1..``rounds`` (None: every decided
        round it was scored in) joined, for the domains it has a window of."""
        mine = self.results.get(label, {})
        last = min(self.decided if rounds is None else rounds, max(mine, default=0))
        return {
            s: {
                d: joined([mine[r][s][d] for r in range(1, last + 1) if self.cells[r - 1][1] == d])
                for d in {domain for _, domain in self.cells[:last]}
            }
            for s in self.seeds[label]
        }

    def _table(self, r: int) -> dict:
        """The table of rounds 1..r of the methods scored in round r (race.race's view)."""
        entrants = self.entrants(r) or set()
        domains = [d for d in self.domains if d in {domain for _, domain in self.cells[:r]}]
        return {
            m: {d: length_entries([by[d] for by in self.scores(m, r).values()]) for d in domains}
            for m in self.seeds
            if m in entrants
        }

    def _l0(self, r: int) -> dict[str, list[float]]:
        """label -> its whole-window NLL at L0 per round of rounds 1..r, seeds averaged (the
        methods scored in round r)."""
        out = {}
        for m in self.entrants(r) or set():
            rows = [
                [_row(self.results[m][k][s][d], self.trained_at) for s in self.seeds[m]]
                for k, (_, d) in enumerate(self.cells[:r], 1)
            ]
            out[m] = [statistics.fmean(x.nll for x in seeds) for seeds in rows if seeds[0]]
        return out

    def record(self) -> Race:
        """The race as compare.json records it."""
        rule = self.rule
        return Race(rule.rounds, self.decided, rule.alpha, rule.z, dict(self.stops))


def _row(result: PerplexityResult, length: int) -> LengthScore | None:
    return next((row for row in result.results if row.length == length), None)


def joined(parts: Sequence[PerplexityResult]) -> PerplexityResult:
    """Consecutive parts of one reading (`PerplexityConfig.part` 0, 1, ...) as the reading of
    them all: windows, spans and blocks in order, means over the parts' equal numbers of
    targets and windows (what one reading of those spans computes, to float rounding)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    rows = [_joined_rows([p.results[i] for p in parts]) for i in range(len(first.results))]
    spans = None if first.spans is None else tuple(s for p in parts for s in p.spans or ())
    config = first.config
    if first.start is not None:  # joined text: the parts are one stretch from the first's start
        tokens = first.results[0].tokens * len(parts)
        config = dataclasses.replace(config, n_tokens=tokens)
    return dataclasses.replace(
        first, results=tuple(rows), spans=spans, config=config,
        documents=None if spans is None else len({s.document for s in spans}),
    )  # fmt: skip


def _joined_rows(rows: Sequence[LengthScore]) -> LengthScore:
    """One length's row of several parts (each the same number of targets and windows)."""
    tokens, n_bytes = sum(r.tokens for r in rows), sum(r.bytes for r in rows)
    total = sum(r.nll * r.tokens for r in rows)
    nll = total / tokens
    windows = [w for r in rows for w in r.last_quarter_nll_windows or ()]
    blocks = [b for r in rows for b in r.last_quarter_nll_blocks or ()]
    curves = [r.position_nll for r in rows if r.position_nll is not None]
    curve = None
    if len(curves) == len(rows):  # a bin's mean over equal numbers of windows per part
        bins = zip(*(c.nll for c in curves), strict=True)
        curve = dataclasses.replace(curves[0], nll=tuple(map(statistics.fmean, bins)))
    quarter = rows[0].last_quarter_nll is not None
    kept_blocks = rows[0].last_quarter_nll_blocks is not None
    return dataclasses.replace(
        rows[0], windows=sum(r.windows for r in rows), tokens=tokens, bytes=n_bytes, nll=nll,
        perplexity=math.exp(nll), bits_per_token=nll / math.log(2),
        bits_per_byte=total / math.log(2) / n_bytes,
        last_quarter_nll=statistics.fmean(windows) if quarter else None,
        last_quarter_nll_std=statistics.pstdev(windows) if quarter else None,
        last_quarter_nll_windows=tuple(windows) if quarter else None,
        last_quarter_nll_blocks=tuple(blocks) if kept_blocks else None,
        position_nll=curve,
        spans=None if rows[0].spans is None else tuple(s for r in rows for s in r.spans or ()),
    )  # fmt: skip
