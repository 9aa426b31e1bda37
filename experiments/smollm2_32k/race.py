"""Racing replayed on experiments D and E: what ``compare.race`` would have stopped, what it
would have recommended, and what it would have spent, from their committed files alone.

Reads each comparison's compare.json (the per-window last-quarter NLL at N, per seed), its
ppl.json files where committed (each span's whole-window NLL at L0; experiment D's folder keeps
none, and with one span per domain the table's NLL is that span's), and times.jsonl (each job's
recorded seconds). No model is run. A perplexity job's seconds are split evenly over its
spans (they are the same size, read the same way), so a method stopped after round r spends
r / K of them; its probes are not run; training and rate selection are spent in full (a
method needs its runs before its first window).

    python -m experiments.smollm2_32k.race      # writes experiments/smollm2_32k/race.md

Holds: replay, main.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from ropekit.compare.race import RaceRule, Stop, race
from ropekit.compare.record import CompareResult, TableEntry
from ropekit.compare.verdict import recommend
from ropekit.evals.perplexity import PerplexityResult
from ropekit.results import read_record, read_records

HERE = Path(__file__).parent
FOLDERS = {
    "D (smollm2_16k/ood, 2x)": HERE.parent / "smollm2_16k/ood",
    "E (smollm2_32k/final, 4x)": HERE / "final",
}


def _cut(entry: TableEntry, rounds: int) -> TableEntry:
    """``entry`` with the windows of its first ``rounds`` spans (one window at N per span)."""
    return dataclasses.replace(
        entry,
        last_quarter_windows=tuple(w[:rounds] for w in entry.last_quarter_windows),
        last_quarter_blocks=tuple(b and b[:rounds] for b in entry.last_quarter_blocks),
    )


def _l0(record: CompareResult, folder: Path, label: str, rounds: int) -> list[float]:
    """``label``'s whole-window NLL at L0 per round and domain (seeds averaged)."""
    spans = record.compare_config.spans
    out = []
    for r in range(rounds):
        for domain in record.domains:
            entry = record.entry(label, domain, record.trained_at)
            if entry is None:
                continue
            if spans == 1:  # the table's NLL is the one span's
                out.append(sum(entry.nll) / len(entry.nll))
                continue
            values = []
            for path in sorted(folder.glob(f"eval/{label}/s*/{domain}/ppl.json")):
                row = next(
                    x for x in read_record(path, PerplexityResult).results
                    if x.length == record.trained_at
                )  # fmt: skip
                assert row.spans is not None and len(row.spans) == spans
                values.append(row.spans[r].nll)
            out.append(sum(values) / len(values))
    return out


def replay(folder: Path) -> dict[str, Any]:
    """The race on the comparison in ``folder``: each stop, the verdict on the methods left,
    and the seconds spent against the recorded total."""
    record = read_record(folder / "compare.json", CompareResult)
    config, n = record.compare_config, record.target_length
    rounds = config.spans
    rule = RaceRule(rounds, config.margin, config.min_difference)
    methods = [m.label for m in record.methods]

    def table_after(r: int) -> dict:
        return {
            m: {d: {n: _cut(rows[n], r)} for d, rows in record.table[m].items() if n in rows}
            for m in methods
        }

    l0 = {r: {m: _l0(record, folder, m, r) for m in methods} for r in range(1, rounds + 1)}
    stops = race(methods, record.baseline, n, rule, table_after, l0.__getitem__)
    left = [m for m in methods if m not in stops]
    verdict = recommend(
        {m: record.table[m] for m in left}, left, record.baseline, record.trained_at, n,
        config.margin, min_difference=config.min_difference,
        trained=[m.label for m in record.methods if m.trained],
    )  # fmt: skip
    spent, total = _seconds(folder, record, stops, rounds)
    return {
        "rule": rule, "stops": stops, "left": left, "verdict": verdict,
        "committed": record.verdict, "spent": spent, "total": total,
    }  # fmt: skip


def _seconds(
    folder: Path, record: CompareResult, stops: dict[str, Stop], rounds: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per kind of job: racing's and the recorded ones (times.jsonl)."""
    spent: dict[str, float] = {}
    total: dict[str, float] = {}
    for entry in read_records(folder / "times.jsonl"):
        if "seconds" not in entry:
            continue
        kind, _, rest = entry["job"].partition(" ")
        label = rest.split(" ")[0] if kind == "select" else rest.split("/")[1]
        share = 1.0
        if label in stops and kind == "eval":
            share = stops[label].round / rounds
        elif label in stops and kind == "probes":
            share = 0.0
        total[kind] = total.get(kind, 0.0) + entry["seconds"]
        spent[kind] = spent.get(kind, 0.0) + entry["seconds"] * share
    return spent, total


def _markdown(name: str, result: dict[str, Any]) -> list[str]:
    rule, verdict, committed = result["rule"], result["verdict"], result["committed"]
    spent, total = sum(result["spent"].values()), sum(result["total"].values())
    lines = [
        f"## {name}",
        "",
        f"{rule.rounds} round{'s' * (rule.rounds != 1)} planned (spans per domain); "
        f"z = {rule.z:.3f} (one-sided alpha {rule.alpha} over {rule.rounds} looks).",
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
        f"- Compute: {spent / 3600:.1f} h of the {total / 3600:.1f} h recorded "
        f"({spent / total:.0%}); per kind, racing / recorded: "
        + ", ".join(
            f"{kind} {result['spent'][kind] / 3600:.1f} / {t / 3600:.1f} h"
            for kind, t in result["total"].items()
        )
        + ".",
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
    for name, folder in FOLDERS.items():
        lines += _markdown(name, replay(folder))
    args.out.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
