"""Experiment E's contrasts, from what the comparison has scored so far: for each pair the
issue asks about, the last-quarter NLL difference at 32k, paired window by window over every
domain both methods are scored on, with the verdict's standard error
(``ropekit.compare.verdict.paired_difference``: the larger of the error over windows and the
one from blocks of positions within them).

``ropekit compare`` states this difference for the recommended method and its runner-up only,
and writes compare.json at the end of a stage; this reads each finished ppl.json, so a lead
can be read as it forms. A trained method's value is its mean over the seeds scored on every
domain (the rule's error is over windows and positions, not seeds: the seeds' spread is
printed beside it). Nothing is computed that the comparison has not scored.

    python -m experiments.smollm2_32k.contrasts [--final DIR] [--length N]

Holds: PAIRS, MIN_DIFFERENCE, scored_table, contrasts, main.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ropekit.compare.config import CompareConfig
from ropekit.compare.record import Difference, TableEntry
from ropekit.compare.run import length_entries
from ropekit.compare.verdict import paired_difference
from ropekit.evals.perplexity import PerplexityResult
from ropekit.results import read_record

HERE = Path(__file__).parent
DOMAINS = ("shakespeare", "kjv", "sotu")
# The question (head-wise AdaRoPE against its global control, tuned YaRN and the best
# training-free method), then what the partial results already show.
PAIRS = (
    ("adarope", "adarope-global"),
    ("adarope", "tuned-yarn"),
    ("adarope", "leaky-rerope"),
    ("adarope-global", "yarn-x4"),
    ("adarope-global", "leaky-rerope"),
    ("tuned-yarn", "yarn-x4"),
    ("leaky-rerope", "yarn-x4"),
)

# The least lead the verdict counts as resolved (CompareConfig's default, which E keeps).
MIN_DIFFERENCE = CompareConfig.min_difference

Table = dict[str, dict[str, dict[int, TableEntry]]]


def scored_table(final: Path) -> tuple[Table, dict[str, list[int]]]:
    """table[method][domain][length] over each method's seeds scored on every domain, and
    those seeds per method (methods with none are left out)."""
    table: Table = {}
    seeds: dict[str, list[int]] = {}
    for method in sorted(p.name for p in (final / "eval").iterdir() if p.is_dir()):
        done = sorted(
            int(s.name[1:])
            for s in (final / "eval" / method).glob("s[0-9]*")
            if all((s / d / "ppl.json").is_file() for d in DOMAINS)
        )
        if not done:
            continue
        seeds[method] = done
        table[method] = {}
        for domain in DOMAINS:
            results = [
                read_record(final / "eval" / method / f"s{s}" / domain / "ppl.json",
                            PerplexityResult)
                for s in done
            ]  # fmt: skip
            table[method][domain] = length_entries(results)
    return table, seeds


def contrasts(table: Table, length: int) -> list[tuple[str, str, Difference]]:
    """Each pair of PAIRS that both methods have been scored for: (a, b, a minus b)."""
    return [(a, b, paired_difference(table, a, b, length))
            for a, b in PAIRS if a in table and b in table]  # fmt: skip


def _seed_spread(table: Table, method: str, length: int) -> str:
    """The spread over seeds of the method's mean last-quarter NLL (domains averaged)."""
    per_seed = []
    n_seeds = len(table[method][DOMAINS[0]][length].last_quarter_windows)
    for k in range(n_seeds):
        means = [sum(e[length].last_quarter_windows[k]) / len(e[length].last_quarter_windows[k])
                 for e in table[method].values()]  # fmt: skip
        per_seed.append(sum(means) / len(means))
    if len(per_seed) < 2:
        return "1 seed"
    mean = sum(per_seed) / len(per_seed)
    std = math.sqrt(sum((v - mean) ** 2 for v in per_seed) / (len(per_seed) - 1))
    return f"{len(per_seed)} seeds, std {std:.4f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.smollm2_32k.contrasts")
    parser.add_argument("--final", type=Path, default=HERE / "final",
                        help="the comparison's folder (default: the committed one)")  # fmt: skip
    parser.add_argument("--length", type=int, default=32768, help="the length compared")
    args = parser.parse_args(argv)
    if not (args.final / "eval").is_dir():
        parser.error(f"--final {args.final} is not a comparison's folder (it has no eval/)")
    table, seeds = scored_table(args.final)
    scored = sorted({n for m in table.values() for d in m.values() for n in d})
    if args.length not in scored:
        parser.error(f"--length {args.length} is not scored there; the lengths are {scored}")
    print(
        f"Last-quarter NLL at {args.length}, a minus b (nats per token; negative: a better), "
        f"paired over the windows of {', '.join(DOMAINS)}; resolved as the verdict's rule "
        f"resolves a lead: |mean| > 2 s.e. and at least {MIN_DIFFERENCE} nats.\n"
    )
    print("| a | b | windows | a - b | s.e. | ppl ratio | resolved | seeds (a; b) |")
    print("|---|---|---|---|---|---|---|---|")
    for a, b, d in contrasts(table, args.length):
        resolved = d.se is not None and abs(d.mean) > 2 * d.se and abs(d.mean) >= MIN_DIFFERENCE
        se = f"{d.se:.4f}" if d.se is not None else "-"
        print(f"| {a} | {b} | {d.n} | {d.mean:+.4f} | {se} | {math.exp(d.mean):.3f} | "
              f"{'yes' if resolved else 'no'} | {_seed_spread(table, a, args.length)}; "
              f"{_seed_spread(table, b, args.length)} |")  # fmt: skip
    print(f"\nScored: {', '.join(f'{m} (seeds {s})' for m, s in seeds.items())}")


if __name__ == "__main__":
    main()
