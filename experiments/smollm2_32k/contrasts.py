"""Experiment E's contrasts, from what the comparison has scored so far: for each pair the
issue asks about, the last-quarter NLL difference at 32k, paired window by window over every
domain both methods are scored on, with the verdict's standard error
(``ropekit.compare.verdict.paired_difference``: the larger of the error over windows and the
one from blocks of positions within them, with the spread over paired seeds added).

``ropekit compare`` states this difference for the recommended method and its runner-up only,
and writes compare.json at the end of a stage; this reads each finished ppl.json, so a lead
can be read as it forms. A method's seeds are those scored on every domain; two trained
methods are compared at the seeds both have (paired, as the comparison trains them), an
untrained method's one run against each of a trained method's. Nothing is computed that the
comparison has not scored.

    python -m experiments.smollm2_32k.contrasts [--final DIR] [--also DIR ...] [--length N]
                                                [--figure PNG]

``--also experiments/smollm2_32k/stage2`` reads stage 2's methods too before they are merged
into final/ (a method both folders hold is read from --final).

Retrieval beside it (``retrieval``, ``retrieval_contrasts``): each probed method's passkey
accuracy per length (exact match, and RULER's substring rule where it differs) from its
finished probes summary, and for the same pairs the difference of their accuracies pooled
over the probe lengths, with Newcombe's 95% interval (``ropekit.evals.difference_interval``:
for independent samples, the wider one for methods asked the same probes).

It also prints every run scored so far, seed by seed, on each domain it is scored on (a
partial table: ``per_seed``), so the tables of the README are copied from the files, not typed.

``--figure`` draws the same numbers (``figure``): each contrast with its interval of 2
standard errors, and each method's score seed by seed beside its mean, so a lead and the
seeds' spread that decides it are read at a glance.

Holds: L0, BASELINE, BEST_FREE, PAIRS, MIN_DIFFERENCE, scored_seeds, pair_table, best_free,
standing, seed_scores, contrasts, one_seed, resolved, retrieval, retrieval_contrasts, per_seed,
union, linked, figure, main.
"""

from __future__ import annotations

import argparse
import functools
import math
import tempfile
from pathlib import Path

from ropekit.compare.assemble import length_entries
from ropekit.compare.config import CompareConfig
from ropekit.compare.record import Difference, TableEntry
from ropekit.compare.verdict import cost_at, paired_difference, paired_seeds, score_at
from ropekit.evals.intervals import difference_interval
from ropekit.evals.perplexity import PerplexityResult
from ropekit.evals.probe_summary import LengthAccuracy, ProbesResult
from ropekit.figures import figure as canvas
from ropekit.figures import save
from ropekit.results import read_record

HERE = Path(__file__).parent
DOMAINS = ("shakespeare", "kjv", "sotu")
L0 = 8192  # SmolLM2-135M's trained length: where the verdict takes the cost
BASELINE = "rope"  # the unmodified model: the cost at L0 is against it; it extends nothing
# Stands for the training-free method with the best score at the length compared (the lowest
# mean over domains of the last-quarter NLL, ``compare.verdict.score_at``), whichever it is
# once stage 2 has scored its methods.
BEST_FREE = "best-free"
# The question (head-wise AdaRoPE against its global control, tuned YaRN and the best
# training-free method), then each learned or searched schedule against YaRN x4, the schedule
# every trained method starts from (did learning or searching improve on it?), and the best
# free method against it.
PAIRS = (
    ("adarope", "adarope-global"),
    ("adarope", "tuned-yarn"),
    ("adarope", BEST_FREE),
    ("adarope", "yarn-x4"),
    ("adarope-global", "yarn-x4"),
    ("adarope-global", BEST_FREE),
    ("tuned-yarn", "yarn-x4"),
    ("searched", "yarn-x4"),
    (BEST_FREE, "yarn-x4"),
)

# The least lead the verdict counts as resolved (CompareConfig's default, which E keeps).
MIN_DIFFERENCE = CompareConfig.min_difference

Table = dict[str, dict[str, dict[int, TableEntry]]]
Pairs = tuple[tuple[str, str], ...]  # (a, b): a minus b; BEST_FREE may stand for a method


def scored_seeds(final: Path) -> dict[str, list[int]]:
    """Each method's seeds scored on every domain (methods with none are left out)."""
    seeds = {}
    for method in sorted(p.name for p in (final / "eval").iterdir() if p.is_dir()):
        done = sorted(
            int(s.name[1:])
            for s in (final / "eval" / method).glob("s[0-9]*")
            if all((s / d / "ppl.json").is_file() for d in DOMAINS)
        )
        if done:
            seeds[method] = done
    return seeds


def _trained(final: Path, method: str) -> bool:
    """Whether the comparison trains ``method`` (``compare.plan.run_folder``: per rate)."""
    return any((final / "methods" / method).glob("lr-*"))


@functools.cache
def _ppl(path: Path) -> PerplexityResult:
    """One finished ppl.json, read once per run (every pair, the standing and the best free
    method read the same files)."""
    return read_record(path, PerplexityResult)


def pair_table(final: Path, seeds: dict[str, list[int]], a: str, b: str) -> Table:
    """table[method][domain][length] of ``a`` and ``b``: each at its scored seeds, or, when
    both are trained, at the seeds both have, in order (so the verdict pairs them)."""
    runs = {a: seeds[a], b: seeds[b]}
    if _trained(final, a) and _trained(final, b):
        common = sorted(set(seeds[a]) & set(seeds[b]))
        runs = {a: common, b: common}
    table: Table = {}
    for method, done in runs.items():
        table[method] = {
            domain: length_entries([
                _ppl(final / "eval" / method / f"s{s}" / domain / "ppl.json") for s in done
            ])
            for domain in DOMAINS
        }  # fmt: skip
    return table


def best_free(final: Path, seeds: dict[str, list[int]], length: int) -> str | None:
    """The training-free method (not the unmodified model) with the lowest score at
    ``length``; None when none is scored there."""
    scores = {}
    for method in seeds:
        if method != BASELINE and not _trained(final, method):
            score = score_at(pair_table(final, seeds, method, method), method, length)
            if score is not None:
                scores[method] = score
    return min(scores, key=scores.get) if scores else None


def standing(
    final: Path, seeds: dict[str, list[int]], length: int
) -> list[tuple[str, int, float, float | None]]:
    """Each method scored at ``length``, best first: (method, seeds, score, cost), the score
    as the verdict takes it (mean over domains of the last-quarter NLL at ``length``) and the
    cost at L0 as the verdict takes it (mean over domains of the whole-window perplexity
    against the unmodified model's, minus 1); the cost is None without the baseline."""
    rows = []
    for method in seeds:
        base = BASELINE if BASELINE in seeds else method
        table = pair_table(final, seeds, method, base)
        score = score_at(table, method, length)
        if score is not None:
            cost = cost_at(table, method, BASELINE, L0) if BASELINE in seeds else None
            rows.append((method, len(seeds[method]), score, cost))
    return sorted(rows, key=lambda row: row[2])


def seed_scores(final: Path, seeds: dict[str, list[int]], length: int) -> dict[str, list[float]]:
    """Each method's score at ``length`` (the verdict's: mean over domains of the last-quarter
    NLL), one per scored seed, in seed order; a method not scored at ``length`` is left out."""
    out = {}
    for method, done in seeds.items():
        scores = [score_at(pair_table(final, {method: [s]}, method, method), method, length)
                  for s in done]  # fmt: skip
        if all(score is not None for score in scores):
            out[method] = scores
    return out


def contrasts(final: Path, length: int, pairs: Pairs = PAIRS) -> list[tuple[str, str, Difference]]:
    """Each pair of ``pairs`` that both methods have been scored for: (a, b, a minus b),
    BEST_FREE replaced by ``best_free`` (a pair that becomes a method against itself, or one
    listed already, is left out); two trained methods with no seed in common are left out."""
    seeds = scored_seeds(final)
    free = best_free(final, seeds, length)
    out = []
    named = dict.fromkeys(tuple(free if m == BEST_FREE else m for m in pair) for pair in pairs)
    for a, b in (pair for pair in named if pair[0] != pair[1]):
        if a in seeds and b in seeds:
            table = pair_table(final, seeds, a, b)
            if table[a][DOMAINS[0]]:  # a seed in common
                out.append((a, b, paired_difference(table, a, b, length)))
    return out


def one_seed(final: Path, a: str, b: str, d: Difference) -> bool:
    """Whether ``d`` rests on one seed of a trained method: its error then holds no seeds'
    spread, and its call says the windows agree at that seed, not that the lead holds."""
    return d.seeds == 1 and (_trained(final, a) or _trained(final, b))


def resolved(d: Difference) -> bool:
    """The verdict's rule: the mean difference beyond 2 standard errors and at least
    MIN_DIFFERENCE nats."""
    return d.se is not None and abs(d.mean) > 2 * d.se and abs(d.mean) >= MIN_DIFFERENCE


def retrieval(final: Path) -> dict[str, tuple[LengthAccuracy, ...]]:
    """Each method whose probes have finished (at seed 0, the one probed): its accuracy per
    probe length, from its summary.json."""
    out = {}
    for summary in sorted((final / "eval").glob("*/s0/probes/summary.json")):
        out[summary.parents[2].name] = read_record(summary, ProbesResult).by_length
    return out


def retrieval_contrasts(
    final: Path, length: int, pairs: Pairs = PAIRS
) -> list[tuple[str, str, int, int, int, tuple[float, float]]]:
    """For each pair of ``pairs`` (``BEST_FREE`` as at ``length`` in perplexity) whose probes both
    finished: a, b, a's and b's correct answers pooled over the probe lengths, the probes
    each, and the 95% interval of the difference of the two accuracies (Newcombe's)."""
    probed = retrieval(final)
    free = best_free(final, scored_seeds(final), length)
    out = []
    for a, b in pairs:
        a, b = (free if m == BEST_FREE else m for m in (a, b))
        if a in probed and b in probed and a != b:
            k_a, k_b = (sum(e.correct for e in probed[m]) for m in (a, b))
            n = sum(e.n for e in probed[a])
            if n != sum(e.n for e in probed[b]):
                raise ValueError(f"{a} and {b} were asked different numbers of probes")
            out.append((a, b, k_a, k_b, n, difference_interval(k_a, n, k_b, n)))
    return out


def per_seed(final: Path, length: int) -> list[tuple[str, int, dict[str, tuple[float, float]]]]:
    """Every run with a finished ppl.json on some domain, in the folder's order: (method,
    seed, {domain: (last-quarter perplexity at ``length``, whole-window perplexity at L0)}),
    the first the exp of the mean over windows of each last quarter's NLL (the verdict's
    score, per domain); a domain not finished yet is left out."""
    rows = []
    for method in sorted(p.name for p in (final / "eval").iterdir() if p.is_dir()):
        runs = sorted((final / "eval" / method).glob("s[0-9]*"), key=lambda s: int(s.name[1:]))
        for run in runs:
            cells = {}
            for domain in DOMAINS:
                path = run / domain / "ppl.json"
                if path.is_file():
                    by_length = {r.length: r for r in _ppl(path).results}
                    far, near = by_length.get(length), by_length.get(L0)
                    if far is not None and near is not None and far.last_quarter_nll is not None:
                        cells[domain] = (math.exp(far.last_quarter_nll), near.perplexity)
            if cells:
                rows.append((method, int(run.name[1:]), cells))
    return rows


def union(folders: list[Path], into: Path) -> Path:
    """A comparison's folder in ``into`` that holds every method of ``folders`` (links to their
    eval/ and methods/ entries), a method two folders hold taken from the first."""
    for sub in ("eval", "methods"):
        linked([folder / sub for folder in folders], into / sub)
    return into


def linked(folders: list[Path], into: Path) -> Path:
    """``into`` holding a link to every folder inside ``folders`` (those that exist), a name
    two of them hold taken from the first."""
    into.mkdir(parents=True, exist_ok=True)
    for folder in folders:
        for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
            if entry.is_dir() and not (into / entry.name).exists():
                (into / entry.name).symlink_to(entry.resolve(), target_is_directory=True)
    return into


def figure(final: Path, length: int, path: Path, pairs: Pairs = PAIRS) -> Path:
    """Two panels: each contrast of ``pairs`` (a minus b, the verdict's last-quarter NLL at
    ``length``) with its interval of 2 standard errors, red where the verdict's rule resolves
    it, hollow where a trained method has one seed, the band of MIN_DIFFERENCE around 0 grey;
    and each method's score seed by seed (dots) with their mean (a bar), best at the top,
    trained methods red, training-free ones blue; a score past the axis is written at its
    edge."""
    seeds = scored_seeds(final)
    rows = contrasts(final, length, pairs)
    scores = seed_scores(final, seeds, length)
    fig, axes = canvas(11.0, 0.42 * max(len(rows), len(scores)) + 1.8, 1, 2)
    ax = axes[0, 0]
    for y, (a, b, d) in enumerate(reversed(rows)):
        color = "#d62728" if resolved(d) else "#777777"
        ax.errorbar(d.mean, y, xerr=2 * (d.se or 0.0), fmt="o", color=color, capsize=3,
                    mfc="white" if one_seed(final, a, b, d) else color)  # fmt: skip
    ax.axvspan(-MIN_DIFFERENCE, MIN_DIFFERENCE, color="#dddddd", zorder=0)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)), [f"{a} - {b}" for a, b, _ in reversed(rows)], fontsize=8)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel(f"a - b, last-quarter NLL at {length} (nats/token; < 0: a better)", fontsize=9)
    ax.set_title("paired differences, 2 s.e.\n(red: resolved; hollow: one seed)", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax = axes[0, 1]
    order = sorted(scores, key=lambda m: sum(scores[m]) / len(scores[m]), reverse=True)
    best = min(min(v) for v in scores.values())
    edge = best + 1.0  # nats: 2.7x the best perplexity; a collapsed method runs off the axis
    for y, method in enumerate(order):
        values = scores[method]
        color = "#d62728" if _trained(final, method) else "#1f77b4"
        if method == BASELINE:
            color = "#444444"
        mean = sum(values) / len(values)
        if mean > edge:
            ax.text(edge, y, f"{mean:.2f} \u2192", ha="right", va="center", fontsize=8)
            continue
        ax.plot([mean, mean], [y - 0.3, y + 0.3], color=color, lw=2.5)
        ax.plot(values, [y] * len(values), "o", color=color, ms=5, alpha=0.7)
    ax.set(xlim=(best - 0.1, edge), ylim=(-0.6, len(order) - 0.4))
    ax.set_yticks(range(len(order)), [f"{m} ({len(scores[m])})" for m in order], fontsize=8)
    ax.set_xlabel(f"score: last-quarter NLL at {length}, mean over the domains", fontsize=9)
    ax.set_title("each method (seeds): seeds as dots, their mean as a bar\n"
                 "(red: trained; blue: training-free)", fontsize=9)  # fmt: skip
    ax.grid(axis="x", alpha=0.3)
    return save(fig, path)


def main(
    argv: list[str] | None = None,
    pairs: Pairs = PAIRS,
    final: Path = HERE / "final",
    prog: str = "python -m experiments.smollm2_32k.contrasts",
) -> None:
    """The tables (and figure) of ``pairs`` for the comparison in ``final`` unless --final
    names another: E's by default; another experiment on E's design passes its own."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--final", type=Path, default=final,
                        help="the comparison's folder (default: the committed one)")  # fmt: skip
    parser.add_argument("--also", type=Path, action="append", default=[],
                        help="another comparison's folder whose methods are read too (stage "
                        "2's before the merge); repeatable")  # fmt: skip
    parser.add_argument("--length", type=int, default=32768, help="the length compared")
    parser.add_argument("--figure", type=Path,
                        help="draw the contrasts and each method's seeds in this PNG")  # fmt: skip
    args = parser.parse_args(argv)
    for flag, folder in [("--final", args.final), *(("--also", f) for f in args.also)]:
        if not (folder / "eval").is_dir():
            parser.error(f"{flag} {folder} is not a comparison's folder (it has no eval/)")
    with tempfile.TemporaryDirectory() as tmp:
        if args.also:
            args.final = union([args.final, *args.also], Path(tmp))
        _print(parser, args, pairs)


def _print(parser: argparse.ArgumentParser, args: argparse.Namespace, pairs: Pairs) -> None:
    """main's tables of ``pairs``, for the folder ``args.final``."""
    seeds = scored_seeds(args.final)
    tables = [pair_table(args.final, seeds, m, m)[m] for m in seeds]
    scored = sorted({n for table in tables for rows in table.values() for n in rows})
    if args.length not in scored:
        parser.error(f"--length {args.length} is not scored there; the lengths are {scored}")
    print(
        f"Last-quarter NLL at {args.length}, a minus b (nats per token; negative: a better), "
        f"paired over the windows of {', '.join(DOMAINS)} and over the seeds both trained "
        "methods have (an untrained method: its one run); the error is the verdict's, with the "
        "seeds' spread where there are 2 or more; resolved as the verdict's rule resolves a "
        f"lead: |mean| > 2 s.e. and at least {MIN_DIFFERENCE} nats; '(one seed)': a trained "
        "method there has one seed scored, so the error holds no seeds' spread and the call "
        "says the windows agree at that seed, not that the lead holds over seeds; per seed: "
        "the difference at each seed both have, over the same windows (an untrained method's "
        "one run against each of a trained method's seeds).\n"
    )
    print("| a | b | windows | seeds | a - b | s.e. | of it, seeds | ppl ratio | resolved | "
          "a - b per seed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for a, b, d in contrasts(args.final, args.length, pairs):
        table = pair_table(args.final, seeds, a, b)
        each = ", ".join(f"{x:+.4f}" for x in paired_seeds(table, a, b, args.length))
        se = f"{d.se:.4f}" if d.se is not None else "-"
        spread = f"{d.se_seeds:.4f}" if d.se_seeds is not None else "-"
        call = "yes" if resolved(d) else "no"
        if one_seed(args.final, a, b, d):
            call += " (one seed)"
        print(f"| {a} | {b} | {d.n} | {d.seeds} | {d.mean:+.4f} | {se} | {spread} | "
              f"{math.exp(d.mean):.3f} | {call} | {each} |")  # fmt: skip
    print(
        f"\nEach method, best first: the verdict's score (last-quarter NLL at {args.length}, "
        f"mean over the domains; its exp beside it) and cost (whole-window perplexity at {L0} "
        f"against {BASELINE}'s, mean over the domains); a trained method over its seeds.\n"
    )
    print(f"| method | seeds | NLL @{args.length} | exp | cost @{L0} |")
    print("|---|---|---|---|---|")
    for method, n, score, cost in standing(args.final, seeds, args.length):
        shown = f"{cost:+.1%}" if cost is not None else "-"
        print(f"| {method} | {n} | {score:.4f} | {math.exp(score):.2f} | {shown} |")
    print(
        f"\nEvery run scored so far, per domain: last-quarter perplexity at {args.length} "
        f"(exp of the mean over windows of each last quarter's NLL), whole-window perplexity "
        f"at {L0}; '-': not scored yet.\n"
    )
    heads = [f"{d} LQ @{args.length}" for d in DOMAINS] + [f"{d} @{L0}" for d in DOMAINS]
    print(f"| method | seed | {' | '.join(heads)} |")
    print(f"|---|---|{'---|' * len(heads)}")
    for method, seed, cells in per_seed(args.final, args.length):
        values = [f"{cells[d][0]:.2f}" if d in cells else "-" for d in DOMAINS]
        values += [f"{cells[d][1]:.2f}" if d in cells else "-" for d in DOMAINS]
        print(f"| {method} | {seed} | {' | '.join(values)} |")
    _print_retrieval(args.final, args.length, pairs)
    print(f"\nScored: {', '.join(f'{m} (seeds {s})' for m, s in seeds.items())}")
    print(
        f"Best training-free method at {args.length}: {best_free(args.final, seeds, args.length)}"
    )
    if args.figure is not None:
        print(f"Figure: {figure(args.final, args.length, args.figure, pairs)}")


def _print_retrieval(final: Path, length: int, pairs: Pairs) -> None:
    """main's retrieval tables: accuracy per method and length, and the pairs' differences."""
    probed = retrieval(final)
    if not probed:
        return
    lengths = sorted({e.length for entries in probed.values() for e in entries})
    print(
        "\nRetrieval (the one-needle passkey, seed 0): correct of probes per length by exact "
        "match, RULER's substring rule in brackets where it differs; methods whose probes "
        "have finished.\n"
    )
    print(f"| method | {' | '.join(f'@{n}' for n in lengths)} |")
    print(f"|---|{'---|' * len(lengths)}")
    for method, entries in probed.items():
        at = {e.length: e for e in entries}
        cells = []
        for n in lengths:
            e = at.get(n)
            cell = "-" if e is None else f"{e.correct}/{e.n}"
            if e is not None and e.substring is not None and e.substring.correct != e.correct:
                cell += f" ({e.substring.correct}/{e.n})"
            cells.append(cell)
        print(f"| {method} | {' | '.join(cells)} |")
    print(
        "\nThe pairs' retrieval, pooled over the probe lengths: a minus b in accuracy, with "
        "Newcombe's 95% interval of the difference (told apart: the interval excludes 0).\n"
    )
    print("| a | b | a | b | a - b | 95% interval | told apart |")
    print("|---|---|---|---|---|---|---|")
    for a, b, k_a, k_b, n, (low, high) in retrieval_contrasts(final, length, pairs):
        apart = "yes" if low > 0 or high < 0 else "no"
        print(f"| {a} | {b} | {k_a}/{n} | {k_b}/{n} | {(k_a - k_b) / n:+.2f} | "
              f"[{low:+.2f}, {high:+.2f}] | {apart} |")  # fmt: skip


if __name__ == "__main__":
    main()
