"""The comparison's report: Markdown and one self-contained HTML page, with its figures,
every number read from ``compare.json`` (a ``CompareResult``).

Sections: what was compared; the verdict; perplexity at each length on whole windows and on
the last quarter, per domain and averaged over domains; the cost at L0 against the gain at N;
NLL against position at N; retrieval accuracy per needle distance with Wilson intervals, each
method's reach and the accuracy-vs-distance figure (when probed); learning
rates chosen; training and evaluation time.

Holds: write_report.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from ropekit.evals.probe_summary import (
    accuracy_text,
    floor_note,
    plot_accuracy_vs_distance,
    trained_window,
)
from ropekit.figures import figure, plot_vs_length, redraw, save, style
from ropekit.report.document import Block, Figure, Heading, Table, Text, to_html, to_markdown
from ropekit.report.plots import plot_nll_vs_position
from ropekit.utils import atomic_write_text

from .record import BeyondMargin, CompareResult, EngineChoice, Stat, SummaryEntry, Verdict

# The two perplexities of a summary cell, each read by its own accessor (a renamed field of
# SummaryEntry then fails here, not in a string key): (name in figures, accessor, what).
_PPL: tuple[tuple[str, Any, str], ...] = (
    ("ppl", lambda e: e.ppl, "whole window"),
    ("last_quarter_ppl", lambda e: e.last_quarter_ppl, "last quarter"),
)


def _cell(stat: Stat | None, digits: int = 2) -> str:
    if stat is None or stat.mean is None:
        return "-"
    text = f"{stat.mean:.{digits}f}"
    return text + (f" ± {stat.std:.{digits}f}" if stat.n > 1 else "")


def _mean_over_domains(data: CompareResult, label: str, length: int, pick: Any) -> float | None:
    """Geometric mean over the domains scored at ``length`` (as the verdict's means) of the
    statistic ``pick`` reads from a summary cell."""
    by_domain = data.summary[label]
    values = [pick(rows[length]).mean for rows in by_domain.values() if length in rows]
    if any(v is None for v in values) or not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))  # geometric mean


def _summary_cell(data: CompareResult, label: str, domain: str, n: int) -> SummaryEntry | None:
    return data.summary[label].get(domain, {}).get(n)


def _ppl_tables(data: CompareResult) -> list[Block]:
    summary, lengths = data.summary, data.lengths
    labels = [m.label for m in data.methods if m.label in summary]
    blocks: list[Block] = []
    for (_, pick, _), what in zip(_PPL, ("whole windows", "last quarter of each window"),
                                  strict=True):  # fmt: skip
        headers = ["method", *(f"{d} @{n}" for d in data.domains for n in lengths)]
        headers += [f"mean @{n}" for n in lengths]
        rows = []
        for label in labels:
            row = [label]
            cells = [_summary_cell(data, label, d, n) for d in data.domains for n in lengths]
            row += [_cell(None if e is None else pick(e)) for e in cells]
            means = [_mean_over_domains(data, label, n, pick) for n in lengths]
            row += ["-" if m is None else f"{m:.2f}" for m in means]
            rows.append(row)
        caption = (
            f"Perplexity on {what}, held-out text of each domain (mean ± std over seeds for "
            "trained methods; 'mean' is the geometric mean over domains)."
        )
        blocks.append(Table(headers, rows, caption))
    return blocks


def _cost_gain(data: CompareResult, path: Path) -> Path | None:
    verdict = data.verdict
    if verdict is None:
        return None
    order = [*verdict.eligible, *(m for m in verdict.costs if m not in verdict.eligible)]
    points = {
        label: (100 * verdict.costs[label], math.exp(verdict.scores[label]))
        for label in order
        if verdict.costs.get(label) is not None and verdict.scores.get(label) is not None
    }
    return redraw(
        _plot_cost_gain, path, points=points, margin=100 * verdict.margin,
        short_length=verdict.short_length, target_length=verdict.target_length,
    )  # fmt: skip


def _plot_cost_gain(
    path: Path,
    points: dict[str, tuple[float, float]],
    margin: float,
    short_length: int,
    target_length: int,
) -> Path:
    """Each method at (its cost in %, its last-quarter perplexity at the target)."""
    fig, axes = figure(6.4, 4.4)
    ax = axes[0, 0]
    for label, (cost, ppl) in points.items():
        ax.scatter([cost], [ppl], s=30, color=style(label).get("color"))
        ax.annotate(label, (cost, ppl), fontsize=7)
    ax.axvline(margin, color="gray", ls=":", lw=1, label="margin")
    ax.set(
        xlabel=f"cost at {short_length} tokens (% perplexity vs the unmodified model)",
        ylabel=f"last-quarter perplexity at {target_length} (mean over domains)",
        title="Cost at the original length against the far positions at the target",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, path)


def _nll_vs_position(data: CompareResult, domain: str, path: Path) -> Figure | None:
    """NLL against position in the windows of N tokens of ``domain``, one line per method
    (a trained one: the mean over seeds; the windows and bins are the same for all)."""
    n = data.target_length
    curves = {}
    for label in data.table:
        entry = data.entry(label, domain, n)
        seeds = [c for c in entry.position_nll if c] if entry is not None else []
        if seeds:
            nll = tuple(sum(v) / len(seeds) for v in zip(*(c.nll for c in seeds), strict=True))
            curves[label] = dataclasses.replace(seeds[0], nll=nll)  # the same bins for all
    if not curves:
        return None
    # From position N/128 on (the first tokens of a window, with almost no context, are
    # several nats higher for every method and would flatten the rest), and up to a quarter
    # above the highest NLL any method has there inside the original window, so a method that
    # collapses beyond the window leaves the chart instead of flattening it.
    first = max(1, data.target_length // 128)
    shown = [(a, y) for c in curves.values() for a, y in zip(c.start, c.nll, strict=True)
             if a >= first]  # fmt: skip
    inside = [y for a, y in shown if a < data.trained_at]
    ylim = (0.95 * min(y for _, y in shown), 1.25 * max(inside)) if inside else None
    redraw(
        plot_nll_vs_position, path, curves=curves, length=n, train_length=data.trained_at,
        xlim=(first, n), ylim=ylim, title=f"{domain}: ",
    )  # fmt: skip
    return Figure(
        path.name,
        f"{domain}: NLL against position in the {n}-token windows (binned; trained methods "
        f"averaged over seeds), from position {first}. The y axis stops a quarter above the "
        "highest in-window NLL: a line that leaves the top has collapsed there.",
    )


def _figures(data: CompareResult, out: Path) -> list[Figure]:
    summary, figures = data.summary, []
    for domain in data.domains:
        scored = {label: domains[domain] for label, domains in summary.items() if domain in domains}
        if not scored:  # no held-out document of the domain holds any length
            continue
        for key, pick, what in _PPL:
            series = {
                label: {n: pick(e).mean for n, e in rows.items()} for label, rows in scored.items()
            }
            errors = {
                label: {n: pick(e).std for n, e in rows.items()} for label, rows in scored.items()
            }
            name = f"ppl_{key}_{domain}.png".replace("/", "-")
            # A collapsed method (hundreds or thousands against tens) would flatten every
            # other line: the axis stops at 3x the best value at each length's worst.
            lengths = {n for v in series.values() for n, x in v.items() if x}
            best = [min(v[n] for v in series.values() if v.get(n)) for n in lengths]
            top = 3 * max(best) if best else None
            clipped = sorted(
                label for label, v in series.items() if any(top and x > top for x in v.values())
            )
            redraw(
                plot_vs_length, out / name, series=series, errors=errors,
                ylabel=f"perplexity ({what})",
                title=f"{domain}: {what}", train_length=data.trained_at,
                ylim=(None, top) if clipped else None,
            )  # fmt: skip
            note = (
                f" The axis stops at 3x the best method's value; above it: {', '.join(clipped)}."
                if clipped
                else ""
            )
            figures.append(Figure(name, f"{domain}, {what}: perplexity against length.{note}"))
        position = _nll_vs_position(
            data, domain, out / f"nll_position_{domain}.png".replace("/", "-")
        )
        if position is not None:
            figures.append(position)
    cost = _cost_gain(data, out / "cost_vs_gain.png")
    if cost is not None:
        figures.append(Figure(cost.name, "Cost at L0 against the far positions at N."))
    return figures


def _windows_text(data: CompareResult) -> str:
    if data.single_documents:
        return (
            "Windows lie inside single held-out documents (spans of lcm(lengths) tokens, each "
            "in one document; no window joins unrelated texts)."
        )
    return (
        "Windows are cut from the held-out documents joined end to end (one may cross from "
        "one document into another)."
    )


# How many held-out documents a domain's line names before it counts the rest.
_NAMED_DOCUMENTS = 12


def _held_out(data: CompareResult) -> list[Block]:
    """One line per domain, named as the user passed it, naming the held-out documents its
    windows were cut from and where (comparisons written before this have none)."""
    lines = []
    for domain, stretches in data.held_out.items():
        named = [
            f"{s.document} (tokens {s.offset:,}-{s.offset + s.tokens:,})"
            for s in stretches[:_NAMED_DOCUMENTS]
        ]
        rest = len(stretches) - len(named)
        more = f" and {rest} more (compare.json's held_out lists them)" if rest > 0 else ""
        lines.append(f"Held-out text of {domain}: {', '.join(named)}{more}.")
    return [Text(line) for line in lines]


def _skipped(data: CompareResult) -> list[Block]:
    """One line per length a domain's documents could not hold (single documents)."""
    lines = []
    for s in data.skipped:
        if s.capacity == 0:
            why = f"No single document of {s.span} tokens in {s.domain}"
        else:
            why = (
                f"The documents of {s.domain} hold {s.capacity} single-document spans "
                f"of {s.span} tokens, {s.count} needed"
            )
        lines.append(Text(f"{why}: {s.length}-token windows are not scored there."))
    return lines


def _retrieval_cells(data: CompareResult) -> tuple[dict[str, dict[Any, Any]], dict, str]:
    """(label -> column -> its pooled accuracy, column -> its header, what the columns
    measured): per distance bin, or per haystack length for a comparison written before."""
    settings = data.probes
    cells: dict[str, dict[Any, Any]]
    if data.length_retrieval:
        cells = dict(data.length_retrieval)
        columns = {n: f"@{n}" for n in settings.lengths}
        what = (
            f"per haystack length, as written before retrieval was measured by distance: a "
            f"needle at depth d of an n-token haystack, asked from its end, was (1 - d) n "
            f"tokens back (depth 0.5: about n / 2), so @n is not a distance of n. Task "
            f"{settings.task}, {settings.needles} needle(s) (K) in each of "
            f"{settings.haystacks} haystacks (H) per length and run, so "
            f"{settings.probes_per_run} probes per cell per seed"
        )
    else:
        cells = {
            label: {(b.low_distance, b.high_distance): b for b in r.by_distance}
            for label, r in data.retrieval.items()
        }
        bins = sorted({key for by_bin in cells.values() for key in by_bin})
        columns = {(low, high): f"({low:,}, {high:,}]" for low, high in bins}
        lengths = " and ".join(f"{n:,}" for n in settings.lengths)
        what = (
            f"per needle distance bin (tokens from the needle to the question, (low, high]): "
            f"task {settings.task}, {settings.needles} needle(s) (K) near the start of each "
            f"of {settings.haystacks} haystacks (H) of {lengths} tokens per run, each needle "
            "asked once from its own cut point"
        )
    return cells, columns, what


def _retrieval_table(data: CompareResult, out: Path) -> list[Block]:
    """Accuracy per method and needle distance bin, pooled over seeds, with its Wilson
    interval and the probes behind each cell, each method's reach and its probes past the
    trained length, and the accuracy-vs-distance figure; a comparison written before
    distances shows its per-length table as written, saying what its lengths measured."""
    settings = data.probes
    if not settings or not (data.retrieval or data.length_retrieval):
        return []
    cells, columns, what = _retrieval_cells(data)
    labels = [m.label for m in data.methods if m.label in cells]

    def rows(cell: Any) -> list[list[str]]:  # one row per method, one cell per column
        return [
            [label, *(cell(cells[label][k]) if k in cells[label] else "-" for k in columns)]
            for label in labels
        ]

    header = ["method", *columns.values()]
    level = next(iter(cells[labels[0]].values())).confidence
    caption = (
        f"Retrieval accuracy (exact match of the value) with its {level:.0%} Wilson interval "
        f"and correct/probes per cell, {what}; a trained method's seeds are pooled (correct "
        "and probes summed, then one interval). Beside the rule, not in it."
    )
    blocks: list[Block] = [Heading("Retrieval", 2), Table(header, rows(accuracy_text), caption)]
    if data.retrieval and not data.length_retrieval:
        blocks += _reach(data, labels, out)
    # RULER's rule counts an answer holding the value anywhere ("7432144.0000"): shown where
    # it differs from exact match somewhere, "?" where a summary did not count it
    differs = [e for by_key in cells.values() for e in by_key.values()
               if e.substring is not None and e.substring.correct != e.correct]  # fmt: skip
    if differs:
        caption = (
            "Retrieval accuracy by RULER's substring rule (the value anywhere in the answer, "
            'case ignored: "7432144.0000" counts for 7432144), pooled and intervalled as '
            "above; '?' where a summary written before it was counted lacks it."
        )

        def substring(e: Any) -> str:
            return "?" if e.substring is None else accuracy_text(e.substring)

        blocks.append(Table(header, rows(substring), caption))
    if settings.needles > 1:  # distractors: a model may copy a needle, not the asked one

        def wrong(e: Any) -> str:  # a pooled accuracy; "?" where a seed did not count them
            other, nearest = ("?" if v is None else v for v in (e.other_needle, e.nearest_needle))
            return f"{other} of {e.n - e.correct} ({nearest})"

        caption = (
            "Wrong answers that name another needle's value, of all wrong answers (in "
            "brackets: the needle nearest the question). Many of them inside the original "
            "window mean the model fails to bind keys to values at any length (a small base "
            "model copies the latest needle), so this task cannot rank the methods: probe "
            "with one needle per haystack (probe_needles=1) instead."
        )
        blocks.append(Table(header, rows(wrong), caption))
    return blocks


def _reach(data: CompareResult, labels: list[str], out: Path) -> list[Block]:
    """Each method's reach and its probes past the trained length, and the figure of
    accuracy against distance (one line per method, the trained length marked)."""
    retrieval = data.retrieval
    windows = {label: trained_window(retrieval[label].by_distance, data.trained_at)
               for label in labels}  # fmt: skip
    rows = [
        [
            label,
            "-" if (r := retrieval[label]).reach is None else f"{r.reach.distance:,}",
            "-" if (w := windows[label]) is None else accuracy_text(w.accuracy),
            "-" if r.past is None else accuracy_text(r.past),
        ]
        for label in labels
    ]
    reached = next((r.reach for r in retrieval.values() if r.reach is not None), None)
    past_from = next((r.past_from for r in retrieval.values() if r.past_from is not None), None)
    caption = (
        "The reach: the farthest distance (tokens) up to which every distance bin, from the "
        f"nearest on, scores at least {reached.accuracy if reached else '-'} (point "
        "accuracies: as noisy as the bins above). Past the trained length: the probes of "
        f"every bin from {'-' if past_from is None else f'{past_from:,}'} tokens on (the "
        f"first bin edge at or past {data.trained_at:,}), pooled, each probe once; within it: "
        "the bins that end by then, pooled (the unmodified model's: its retrieval where its "
        "positions are trained)."
    )
    header = ["method", "reach (tokens)", f"within {data.trained_at:,}",
              f"past {data.trained_at:,} tokens"]  # fmt: skip
    figure = redraw(
        plot_accuracy_vs_distance, out / "accuracy_vs_distance.png",
        runs={label: retrieval[label].by_distance for label in labels},
        trained_length=data.trained_at, reach_accuracy=reached.accuracy if reached else None,
        title="retrieval by needle distance",
    )  # fmt: skip
    # the task judged where the unmodified model's positions are trained (floor_note)
    window = windows.get(data.baseline)
    note = floor_note(window, reached.accuracy, data.probes.needles) if reached else None
    return [
        Table(header, rows, caption),
        *([Text(f"Warning ({data.baseline}): {note}.")] if note else []),
        Figure(figure.name, "Retrieval accuracy against needle distance, per method."),
    ]


def _serving_table(verdict: Verdict | None) -> list[Block]:
    """Per serving engine, the best eligible method it serves exactly, and why it does not
    serve the recommended one (comparisons written before this have none)."""
    if verdict is None or not verdict.serving or verdict.winner is None:
        return []
    n, short = verdict.target_length, verdict.short_length
    rows = [_serving_row(engine, e) for engine, e in verdict.serving.items()]
    notes = _shared_reasons(rows, column=5)
    caption = (
        f"What each engine serves exactly (within its measured noise floor, by ropekit "
        f"inspect's rules): the best eligible method for it, its last-quarter NLL at {n} (mean "
        f"over domains), nats behind the recommended {verdict.winner}, its cost at {short} "
        "tokens, why the engine does not serve the recommended method, and the best method it "
        "serves over the cost margin where that one scores better at N (NLL, cost)."
    ) + "".join(f" ({i}) {reason}" for i, reason in enumerate(notes, 1))
    header = ["engine", "best it serves", f"NLL @{n}", "behind", f"cost @{short}", "why not best",
              "over the margin"]  # fmt: skip
    return [Table(header, rows, caption)]


def _shared_reasons(rows: list[list[str]], column: int) -> list[str]:
    """The reasons (what follows "<refusal>: ") that several rows give in ``column``, each
    replaced there by "<refusal>: see (k)" (in place), in order: a long reason is read once
    under the table, not once per engine."""
    split = [cell.partition(": ") for cell in (row[column] for row in rows)]
    reasons = [reason for _, _, reason in split]
    shared = list(dict.fromkeys(r for r in reasons if r and reasons.count(r) > 1))
    for row, (head, _, reason) in zip(rows, split, strict=True):
        if reason in shared:
            row[column] = f"{head}: see ({shared.index(reason) + 1})"
    return shared


def _serving_row(engine: str, e: EngineChoice) -> list[str]:
    return [
        engine,
        e.method or "none",
        "-" if e.score is None else f"{e.score:.4f}",
        "-" if e.behind is None else f"{e.behind:+.4f}",
        "-" if e.cost is None else f"{e.cost:+.1%}",
        e.why_not_best or "-",
        _beyond(e.beyond_margin),
    ]


def _beyond(entry: BeyondMargin | None) -> str:
    if entry is None:
        return "-"
    return f"{entry.method} ({entry.score:.4f}, {entry.cost:+.1%})"


def report_blocks(data: CompareResult, out: Path) -> list[Block]:
    c = data.compare_config
    verdict = data.verdict
    trains = any(m.trained for m in data.methods)
    train_data = c.train_data if isinstance(c.train_data, str) else list(c.train_data)
    training = (
        f"Trained methods learn their positional parameters on {c.samples} samples of "
        f"{data.target_length} tokens of {train_data} (training split) per seed "
        f"({len(c.seeds)} seeds, paired), backbone frozen"
        if trains
        else "No method here trains anything"
    )
    blocks: list[Block] = [
        Heading(f"ropekit compare: {c.model} to {data.target_length} tokens", 1),
        Text(
            f"The model was trained at {data.trained_at} tokens. {training}; every method "
            f"is scored on the same held-out windows of "
            f"{', '.join(data.domains)} ({c.spans} span(s) of {data.target_length} "
            f"tokens per domain). {_windows_text(data)} Stage: {data.stage}."
        ),
        *_skipped(data),
        *_held_out(data),
        Heading("Verdict", 2),
        Text(verdict.sentence if verdict else "No verdict yet: the baseline is not scored."),
    ]
    if verdict and verdict.retrieval:
        blocks.append(Text(verdict.retrieval))
    blocks += _serving_table(verdict) + _race_table(data)
    if verdict:  # the rule's bullets, one paragraph each (plain text: no Markdown emphasis)
        blocks.append(Text("How it is decided:"))
        for item in re.split(r"(?:^|\n)- ", verdict.rule):
            if item.strip():
                text = " ".join(item.split()).replace("**", "").replace("``", "`")
                blocks.append(Text("- " + text))
    blocks += [Heading("Perplexity", 2), *_ppl_tables(data), *_retrieval_table(data, out)]
    blocks += [Heading("Figures", 2), *_figures(data, out)]
    if data.lr_search:
        rows = [
            [label, ", ".join(f"{lr:g}: {nll:.4f}" for lr, nll in s.selection_nll.items())
             or "-", f"{s.chosen:g}"]
            for label, s in data.lr_search.items()
        ]  # fmt: skip
        blocks.append(Table(["method", "selection NLL by lr", "chosen lr"], rows))
    return blocks + _time_table(data)


def _race_table(data: CompareResult) -> list[Block]:
    """Where each method left the race (its windows stop there; not a candidate of the
    verdict), or that it finished it."""
    race = data.race
    if race is None:
        return []
    rows = [
        [label, str(s.round), f"{s.score:.4f}", s.reason] for label, s in race.stops.items()
    ] + [
        [m.label, "-", "", "finished the race" if race.decided == race.rounds else "racing"]
        for m in data.methods
        if m.label not in race.stops
    ]
    caption = (
        f"Racing: {race.decided} of {race.rounds} rounds decided (a round: one window at N of "
        f"one domain, span by span); each look one-sided at alpha {race.alpha:g} / "
        f"{race.rounds} (z = {race.z:.3f}); the score is the last-quarter NLL at N over the "
        "windows so far. The rule: ropekit.compare.race."
    )
    header = ["method", "stopped after round", "score so far (nats)", "why"]
    return [Heading("Race", 2), Table(header, rows, caption)]


def _time_table(data: CompareResult) -> list[Block]:
    """Each job's wall time (times.jsonl, ``compare.ledger.Ledger``) and their sum."""
    rows = [[t.job, f"{t.seconds / 60:.1f} min"] for t in data.times]
    total = sum(t.seconds for t in data.times) / 3600
    caption = f"On {data.meta['machine']}; {len(rows)} jobs, {total:.1f} h in all."
    return [Heading("Time", 2), Table(["job", "wall time"], rows, caption)]


def write_report(data: CompareResult, out: str | Path) -> tuple[Path, Path]:
    """report.md and report.html (and the figures) into ``out``; returns the two paths."""
    out = Path(out)
    blocks = report_blocks(data, out)
    md, html = out / "report.md", out / "report.html"
    atomic_write_text(md, to_markdown(blocks, out))
    atomic_write_text(html, to_html(blocks, out, "ropekit compare"))
    return md, html
