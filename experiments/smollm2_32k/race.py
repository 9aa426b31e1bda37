"""Racing replayed on experiments D and E: what ``compare.race`` would have stopped, what it
would have recommended, and what it would have spent, from their committed files alone.

Reads each comparison's compare.json (the per-window last-quarter NLL at N, per seed), its
ppl.json files where committed (each span's whole-window NLL at L0; experiment D's folder keeps
none, and with one span per domain the table's NLL is that span's), and times.jsonl (each job's
recorded seconds). No model is run. The rounds are the runner's (``plan.race_cells``: one
window at N of one domain a round); a perplexity job's seconds are split evenly over its spans
(they are the same size, read the same way), so a method stopped after round r spends, on each
domain, the share of its spans scored by then; its probes are not run; training and rate
selection are spent in full (a method needs its runs before its first window). The design
racing had before (a round per span of every domain, ``DESIGNS["span"]``) is replayed beside
it, for its fraction.

    python -m experiments.smollm2_32k.race      # writes experiments/smollm2_32k/race.md

Holds: DESIGNS, replay, main.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from ropekit.compare.plan import race_cells
from ropekit.compare.race import RaceRule, Stop, race
from ropekit.compare.record import CompareResult, TableEntry
from ropekit.compare.verdict import out_of_race, recommend
from ropekit.evals.perplexity import PerplexityResult
from ropekit.results import read_record, read_records

HERE = Path(__file__).parent
FOLDERS = {
    "D (smollm2_16k/ood, 2x)": HERE.parent / "smollm2_16k/ood",
    "E (smollm2_32k/final, 4x)": HERE / "final",
}
Rounds = tuple[tuple[tuple[int, str], ...], ...]  # round r + 1: the (span, domain) windows


def _per_window(spans: int, domains: tuple[str, ...]) -> Rounds:
    """The runner's rounds (``plan.race_cells``): one window a round."""
    return tuple((cell,) for cell in race_cells(spans, domains))


def _per_span(spans: int, domains: tuple[str, ...]) -> Rounds:
    """Racing's first design: round r scored span r of every domain."""
    return tuple(tuple((span, d) for d in domains) for span in range(spans))


# design -> its rounds: the runner's (a round per window), and the one before it.
DESIGNS = {"a round per window": _per_window, "a round per span of every domain": _per_span}


def _cut(entry: TableEntry, windows: int) -> TableEntry:
    """``entry`` with the windows of its first ``windows`` spans (one window at N per span)."""
    return dataclasses.replace(
        entry,
        last_quarter_windows=tuple(w[:windows] for w in entry.last_quarter_windows),
        last_quarter_blocks=tuple(b and b[:windows] for b in entry.last_quarter_blocks),
    )


def _scored(rounds: Rounds, r: int) -> dict[str, int]:
    """domain -> its spans scored in rounds 1..r (each domain's spans come in order)."""
    out: dict[str, int] = {}
    for span, domain in (cell for cells in rounds[:r] for cell in cells):
        out[domain] = max(out.get(domain, 0), span + 1)
    return out


def _l0_values(record: CompareResult, folder: Path, label: str, span: int, domain: str):
    """``label``'s whole-window NLL at L0 on ``span`` of ``domain`` (seeds averaged); None
    where it is not scored at L0."""
    entry = record.entry(label, domain, record.trained_at)
    if entry is None:
        return None
    if record.compare_config.spans == 1:  # the table's NLL is the one span's
        return sum(entry.nll) / len(entry.nll)
    values = []
    for path in sorted(folder.glob(f"eval/{label}/s*/{domain}/ppl.json")):
        row = next(
            x for x in read_record(path, PerplexityResult).results
            if x.length == record.trained_at
        )  # fmt: skip
        assert row.spans is not None and len(row.spans) == record.compare_config.spans
        values.append(row.spans[span].nll)
    return sum(values) / len(values)


def replay(folder: Path, design: str = "a round per window") -> dict[str, Any]:
    """The race on the comparison in ``folder`` with ``design``'s rounds: each stop, the
    verdict on the methods left, and the seconds spent against the recorded total."""
    record = read_record(folder / "compare.json", CompareResult)
    config, n = record.compare_config, record.target_length
    domains = tuple(d for d in record.domains if any(n in record.table[m].get(d, {})
                                                     for m in record.table))  # fmt: skip
    rounds = DESIGNS[design](config.spans, domains)
    rule = RaceRule(len(rounds), config.margin, config.min_difference)
    methods = [m.label for m in record.methods]

    def table_after(r: int) -> dict:
        scored = _scored(rounds, r)
        return {
            m: {
                d: {n: _cut(rows[n], scored[d])}
                for d, rows in record.table[m].items()
                if n in rows and d in scored
            }
            for m in methods
        }

    cells = [cell for group in rounds for cell in group]
    l0_cells = {m: [_l0_values(record, folder, m, span, d) for span, d in cells] for m in methods}

    def l0_after(r: int) -> dict:
        k = sum(len(group) for group in rounds[:r])
        return {m: [v for v in values[:k] if v is not None] for m, values in l0_cells.items()}

    stops = race(methods, record.baseline, n, rule, table_after, l0_after)
    left = [m for m in methods if m not in stops]
    verdict = out_of_race(recommend(
        {m: record.table[m] for m in left}, left, record.baseline, record.trained_at, n,
        config.margin, min_difference=config.min_difference,
        trained=[m.label for m in record.methods if m.trained],
    ), stops)  # fmt: skip
    spent, total, finishers = _seconds(folder, stops, lambda r: _scored(rounds, r), config.spans)
    return {
        "design": design, "rule": rule, "stops": stops, "left": left, "verdict": verdict,
        "committed": record.verdict, "spent": spent, "total": total, "finishers": finishers,
    }  # fmt: skip


def _seconds(
    folder: Path, stops: dict[str, Stop], scored: Any, spans: int
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Seconds per kind of job: racing's and the recorded ones (times.jsonl), and racing's of
    the perplexity and probes of the methods that finish the race; ``scored(r)``: domain ->
    spans scored after round r."""
    spent: dict[str, float] = {}
    total: dict[str, float] = {}
    finishers: dict[str, float] = {}
    for entry in read_records(folder / "times.jsonl"):
        if "seconds" not in entry:
            continue
        kind, _, rest = entry["job"].partition(" ")
        label = rest.split(" ")[0] if kind == "select" else rest.split("/")[1]
        share = 1.0
        if label in stops and kind == "eval":  # eval/<label>/s<seed>/<domain>
            share = scored(stops[label].round).get(rest.split("/")[3], 0) / spans
        elif label in stops and kind == "probes":
            share = 0.0
        total[kind] = total.get(kind, 0.0) + entry["seconds"]
        spent[kind] = spent.get(kind, 0.0) + entry["seconds"] * share
        if label not in stops and kind in ("eval", "probes"):
            finishers[kind] = finishers.get(kind, 0.0) + entry["seconds"]
    return spent, total, finishers


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def _markdown(name: str, result: dict[str, Any], other: dict[str, Any]) -> list[str]:
    rule, verdict, committed = result["rule"], result["verdict"], result["committed"]
    spent, total = sum(result["spent"].values()), sum(result["total"].values())
    before = sum(other["spent"].values())
    fixed = sum(result["spent"].get(k, 0.0) for k in ("train", "select"))
    finishers, stopped = result["finishers"], result["spent"].get("eval", 0.0)
    stopped -= finishers.get("eval", 0.0)
    lines = [
        f"## {name}",
        "",
        f"{rule.rounds} round{'s' * (rule.rounds != 1)} planned ({result['design']}: one window "
        f"at N of one domain, span by span); z = {rule.z:.3f}: each look one-sided at alpha "
        f"{rule.alpha} / {rule.rounds}, alpha spent evenly over the {rule.rounds} planned looks.",
        "",
        "| method | stopped after round | score so far (nats) | why |",
        "|---|---|---|---|",
    ]
    for label, stop in result["stops"].items():
        lines.append(f"| {label} | {stop.round} | {stop.score:.4f} | {stop.reason} |")
    for label in result["left"]:
        lines.append(f"| {label} | - (every round) | | finished the race |")
    same = verdict.winner == committed.winner and verdict.resolved == committed.resolved
    lines += [
        "",
        f"- Racing recommends **{verdict.winner}** (resolved: {verdict.resolved}); the "
        f"committed verdict: **{committed.winner}** (resolved: {committed.resolved}): "
        f"{'the same' if same else 'NOT the same'}.",
        f"- Compute: {_hours(spent)} of the {_hours(total)} recorded ({spent / total:.0%}); per "
        "kind, racing / recorded: "
        + ", ".join(
            f"{kind} {result['spent'][kind] / 3600:.1f} / {t / 3600:.1f} h"
            for kind, t in result["total"].items()
        )
        + f". With {other['design']} (racing's first design) it was {_hours(before)} "
        f"({before / total:.0%}).",
        f"- What racing spends: training and rate selection {_hours(fixed)} (before any "
        f"window); the methods that finish the race ({', '.join(result['left'])}): perplexity "
        f"{_hours(finishers.get('eval', 0.0))}, probes {_hours(finishers.get('probes', 0.0))}; "
        f"the stopped methods' windows {_hours(stopped)}.",
        f"- Racing's verdict: {verdict.sentence}",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.smollm2_32k.race")
    parser.add_argument("--out", type=Path, default=HERE / "race.md", help="the report")
    args = parser.parse_args(argv)
    lines = [
        "# Racing replayed on experiments D and E",
        "",
        "Written by `python -m experiments.smollm2_32k.race` from the committed compare.json, "
        "ppl.json and times.jsonl of each comparison; no model was run. The rule: "
        "`ropekit.compare.race` (module docstring).",
        "",
    ]
    first, *others = DESIGNS
    for name, folder in FOLDERS.items():
        lines += _markdown(name, replay(folder, first), replay(folder, others[0]))
    args.out.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
