"""Result JSON found in a run folder, and one report section per kind of result.

Holds:
- `Result`: one result file (its kind, path relative to the run folder, parsed JSON).
- `KINDS`: kind -> section title, in report order.
- `discover(root)`: every result JSON under ``root``, recursively.
- `SECTIONS`: kind -> section builder ``(results, root) -> blocks``; `fmt`, `length_table`.

A file's kind is the ``kind`` its writer recorded (``ropekit.results``), never guessed from
its name: ``demo`` (`ropekit demo`), ``pretrain`` (`ropekit pretrain`), ``extend``
(`ropekit extend`), ``perplexity`` (`ropekit eval ppl`), ``tasks`` (`ropekit eval
needle|passkey|ruler`), ``probes`` (`ropekit eval probes`), ``analysis`` (`ropekit
analyze`), ``experiment`` (an experiment's results) and ``schedules`` (`ropekit schedules`).
Task and probe stages and training summaries are parts of those runs, not sections of their
own.

A section is a table of every result of its kind (one row per file, labelled by its folder)
followed by the PNGs written beside those files; when a section holds several results, each
result's figures are collapsed under its label.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ropekit.analysis.record import AnalysisResult
from ropekit.evals.perplexity import PerplexityResult
from ropekit.evals.probe_summary import ProbesResult
from ropekit.evals.runner import TasksResult
from ropekit.results import ResultError, read_record, read_result, result_kind
from ropekit.train.extend import ExtendRecord
from ropekit.train.search import SearchRecord

from .demo_record import DemoResult
from .document import Block, Details, Figure, Heading, Table, Text, figure_problem

if TYPE_CHECKING:
    from ropekit.evals.probe_summary import Accuracy

# kind -> section title, in the order sections appear.
KINDS: dict[str, str] = {
    "demo": "Demo: context extension at a glance",
    "pretrain": "Pretraining",
    "extend": "Context extension",
    "search": "Searched RoPE factors (LongRoPE-style, no training)",
    "perplexity": "Perplexity and bits per byte vs length",
    "tasks": "Retrieval tasks",
    "probes": "Retrieval probes (many per prefill, Wilson intervals)",
    "analysis": "Head analysis",
    "experiment": "Experiment results",
    "schedules": "Frequency schedules",
}
# kind -> its record class, for the typed kinds (``ropekit.results.register``): a file of one
# is read as that class, migrated from an older version; the others are read as dicts. Imported
# by plain imports, so the layer test sees each edge (results.py imports no owner: issue 55).
RECORDS: dict[str, type] = {
    "demo": DemoResult,
    "extend": ExtendRecord,
    "search": SearchRecord,
    "perplexity": PerplexityResult,
    "tasks": TasksResult,
    "probes": ProbesResult,
    "analysis": AnalysisResult,
}
# Folders that hold checkpoints or caches, never results.
_SKIP_DIRS = {"checkpoints", "__pycache__", "adapter", "model"}


@dataclass(frozen=True)
class Result:
    kind: str
    path: Path  # relative to the run folder
    # a typed kind's record (``ropekit.results.read_record``), else the file's content
    data: Any

    @property
    def label(self) -> str:
        """The result's folder relative to the run folder ("." for the folder itself)."""
        return self.path.parent.as_posix()


def discover(root: str | Path) -> list[Result]:
    """Every result file under ``root`` (recursively) of a kind the report shows, sorted by
    kind then path. Files that are not results of this format are passed over."""
    root = Path(root)
    found = []
    for path in root.rglob("*.json"):
        relative = path.relative_to(root)
        if any(p in _SKIP_DIRS or p.startswith(".") for p in relative.parts[:-1]):
            continue
        if figure_problem(root, relative.as_posix()) is not None:
            continue  # a link, or a file outside the run folder: not this run's result
        kind = result_kind(path)
        if kind not in KINDS:
            continue
        record = RECORDS.get(kind)
        try:
            data = read_result(path, kind) if record is None else read_record(path, record)
        except ResultError:
            continue  # an older format, or a file being written
        found.append(Result(kind, relative, data))
    order = list(KINDS)
    return sorted(found, key=lambda r: (order.index(r.kind), r.path.as_posix()))


# ----------------------------------------------------------------------------- formatting
def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: numbers with ``digits`` decimals (ints as is), None and NaN as "-"."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} s"


def length_table(
    labels: Sequence[str],
    first: Sequence[Sequence[str]],
    values: Sequence[Mapping[int, Any]],
    headers: Sequence[str],
    digits: int = 3,
    caption: str = "",
) -> Table:
    """Rows of leading cells followed by one column per length (the union over rows)."""
    lengths = sorted({int(n) for row in values for n in row})
    rows = []
    for label, cells, by_length in zip(labels, first, values, strict=True):
        by_int = {int(n): v for n, v in by_length.items()}
        rows.append([label, *cells, *(fmt(by_int.get(n), digits) for n in lengths)])
    return Table([*headers, *(str(n) for n in lengths)], rows, caption)


def figures_beside(result: Result, root: Path, extra: Iterable[str] = ()) -> list[Figure]:
    """The PNGs in the result's folder (and ``extra`` paths relative to it), as figures."""
    folder = root / result.path.parent
    paths = sorted(folder.glob("*.png")) + [folder / e for e in extra]
    seen, figures = set(), []
    for p in paths:
        if p.is_file() and p not in seen and not p.name.startswith("."):
            seen.add(p)
            rel = p.relative_to(root).as_posix()
            figures.append(Figure(rel, rel))
    return figures


def _figures(results: Sequence[Result], root: Path, extra: Callable[[Result], list[str]]) -> list:
    """Every result's figures: inline for one result, collapsed per result for several."""
    per_result = [(r, figures_beside(r, root, extra(r))) for r in results]
    if len(results) == 1:
        return per_result[0][1]
    return [Details(f"figures of {r.label}", figs) for r, figs in per_result if figs]


def _no_extra(result: Result) -> list[str]:
    return []


# ----------------------------------------------------------------------------- sections
def pretrain_section(results: Sequence[Result], root: Path) -> list[Block]:
    rows, stages = [], []
    for r in results:
        d = r.data
        rows.append(
            [
                r.label,
                f"`{d['encoding']}`",
                fmt(d["parameters"]),
                fmt(d["model"]["context_length"]),
                fmt(d["steps"]),
                fmt(d["tokens"]),
                fmt(d["final_loss"], 4),
                fmt(d["tokens_per_s"], 0),
                fmt(None if d["mfu"] is None else 100 * d["mfu"], 1),
                _seconds(d["elapsed_s"]),
            ]
        )
        stages += [
            [
                r.label,
                st["name"],
                fmt(st["context"]),
                fmt(st["steps"]),
                fmt(st["batch_size"]),
                f"{100 * st['retrieval_ratio']:.0f}%",
                fmt(st["final_loss"], 4),
                _seconds(st["elapsed_s"]),
            ]
            for st in d["stages"]
        ]
    headers = ["run", "encoding", "parameters", "context", "steps", "tokens", "final loss"]
    blocks: list[Block] = [
        Table(
            [*headers, "tokens/s", "MFU %", "time"],
            rows,
            "Final loss: the training loss of the last step (nats per token, answer-weighted "
            "when the run mixed in retrieval records).",
        )
    ]
    if stages:
        blocks.append(
            Table(
                ["run", "stage", "context", "steps", "batch", "with records", "loss", "time"],
                stages,
                "Pretraining stages, in order, on one model.",
            )
        )
    return [*blocks, *_figures(results, root, _no_extra)]


def extend_section(results: Sequence[Result], root: Path) -> list[Block]:
    rows = []
    for r in results:
        d: ExtendRecord = r.data
        c = d.extend_config
        rows.append(
            [
                r.label,
                f"`{d.spec}`",
                fmt(d.trained_at),
                fmt(c.target_length),
                str(c.mode),
                fmt(c.samples),
                fmt(d.trainable.total),
                fmt(d.final_loss, 4),
                _seconds(d.elapsed_s),
            ]
        )
    headers = ["run", "encoding", "trained at", "target", "mode", "samples", "trained params"]
    table = Table([*headers, "final loss", "time"], rows, "Backbone frozen in positional mode.")
    return [table, *_figures(results, root, _no_extra)]


def search_section(results: Sequence[Result], root: Path) -> list[Block]:
    records: list[SearchRecord] = [r.data for r in results]
    seeds = sorted({name for d in records for name in d.baselines})
    rows = [
        [
            r.label,
            fmt(d.config.target_length),
            fmt(d.forwards),
            fmt(d.nll, 4),
            *(fmt(d.baselines.get(name), 4) for name in seeds),  # a seed it did not score: -
        ]
        for r, d in zip(results, records, strict=True)
    ]
    caption = (
        "Mean NLL (nats/token) on the scoring samples (training split) of the best searched "
        "factors and of the search's seeds, at the target length."
    )
    headers = ["run", "target", "forwards", "searched", *seeds]
    return [Table(headers, rows, caption), *_figures(results, root, _no_extra)]


def perplexity_section(results: Sequence[Result], root: Path) -> list[Block]:
    tables: list[Block] = []
    records: list[PerplexityResult] = [r.data for r in results]
    for metric in dict.fromkeys(d.metric for d in records):
        mine = [(r, d) for r, d in zip(results, records, strict=True) if d.metric == metric]
        tables.append(
            length_table(
                [r.label for r, _ in mine],
                [[f"`{d.spec}`", fmt(d.results[0].tokens)] for _, d in mine],
                [d.headlines() for _, d in mine],
                ["run", "encoding", "targets"],
                digits=3 if metric == "bits_per_byte" else 2,
                caption=f"{metric.replace('_', ' ')} by context length (the same held-out "
                "targets at every length; lower is better)",
            )
        )
    # Say where the windows came from (issue 19: single documents, said in the report).
    for r, d in zip(results, records, strict=True):
        if d.spans:
            tables.append(
                Text(
                    f"{r.label}: every window inside one held-out document ({len(d.spans)} spans "
                    f"of {fmt(d.spans[0].tokens)} tokens in {d.documents} documents)."
                )
            )
    return [*tables, *_figures(results, root, _no_extra)]


def tasks_section(results: Sequence[Result], root: Path) -> list[Block]:
    labels, first, values = [], [], []
    records: list[TasksResult] = [r.data for r in results]
    for r, d in zip(results, records, strict=True):
        for name, task in d.tasks.items():
            labels.append(r.label)
            first.append(
                [
                    f"`{d.spec}`",
                    name,
                    fmt(task.scores[0].n if task.scores else None),
                    fmt(task.effective_length),
                ]
            )
            values.append(task.by_length())
    table = length_table(
        labels,
        first,
        values,
        ["run", "encoding", "task", "samples/length", "effective length"],
        digits=2,
        caption="Accuracy by context length (exact match of the recalled value).",
    )
    skipped = [
        f"{r.label}: {name} skipped at {s.length} ({s.reason})"
        for r, d in zip(results, records, strict=True)
        for name, task in d.tasks.items()
        for s in task.skipped
    ]
    blocks: list[Block] = [table]
    if skipped:
        blocks.append(Text("Skipped: " + "; ".join(skipped)))

    def heatmaps(r: Result) -> list[str]:
        return [f"{name}/heatmap.png" for name in r.data.tasks]

    return [*blocks, *_figures(results, root, heatmaps)]


def _interval(entry: Accuracy) -> str:
    """ "0.85 [0.64, 0.95]": an accuracy and its Wilson interval."""
    return f"{entry.accuracy:.2f} [{entry.low:.2f}, {entry.high:.2f}]"


def probes_section(results: Sequence[Result], root: Path) -> list[Block]:
    """Accuracy per needle distance bin and the reach, per haystack length, each with its
    Wilson interval, from the ``probes`` summaries (``ropekit.evals.probes``)."""
    records: list[ProbesResult] = [r.data for r in results]
    by_length = length_table(
        [r.label for r in results],
        [
            [f"`{d.spec}`", d.task.name, fmt(d.probes_per_length), fmt(d.prefills_per_length)]
            for d in records
        ],
        [{e.length: _interval(e) for e in d.by_length} for d in records],
        ["run", "encoding", "task", "probes/length", "prefills/length"],
        caption="Accuracy by haystack length (exact match of the recalled value) with its "
        f"{100 * records[0].config.confidence:g}% Wilson score interval, over the probes at "
        "every distance a haystack of that length asks (a haystack's needles sit near its "
        "start, each asked from its own cut point of one prefill).",
    )
    bins = sorted({(e.low_distance, e.high_distance) for d in records for e in d.by_distance})
    rows = []
    for r, d in zip(results, records, strict=True):
        cells = {(e.low_distance, e.high_distance): _interval(e) for e in d.by_distance}
        reach = "-" if d.reach is None else f"{d.reach.distance:,} (>= {d.reach.accuracy:g})"
        rows.append([r.label, f"`{d.spec}`", reach, *(cells.get(b, "-") for b in bins)])
    by_distance = Table(
        ["run", "encoding", "reach", *(f"distance ({low:,}, {high:,}]" for low, high in bins)],
        rows,
        "Accuracy by needle distance (tokens from the needle to the question), each probe "
        "counted once; reach: the farthest distance up to which every bin scores the stated "
        "accuracy ('-': a summary from before distances were measured).",
    )
    return [by_length, by_distance, *_figures(results, root, _no_extra)]


def analysis_section(results: Sequence[Result], root: Path) -> list[Block]:
    from ropekit.analysis import summary_lines

    blocks: list[Block] = []
    for r in results:
        if len(results) > 1:
            blocks.append(Heading(r.label, 3))
        d: AnalysisResult = r.data
        blocks += [Text(line) for line in summary_lines(d)]
        influence = d.influence  # None: not measured (the analysis says why)
        names = {"freq": "AdaFreq", "scale": "AdaScale"}
        rows = [
            [names[kind], u.label, fmt(u.delta_nll, 4)]
            for kind, section in (influence.kinds() if influence is not None else {}).items()
            for u in section.top[:5]
        ]
        if rows:
            assert influence is not None
            blocks.append(
                Table(
                    ["parameters reverted", "head", "Δ NLL (nats/token)"],
                    rows,
                    f"Most influential heads at {influence.target_length} tokens: NLL "
                    "increase when one head's learned parameters return to their init.",
                )
            )
    return [*blocks, *_figures(results, root, _no_extra)]


def _mean_std_tables(data: Mapping[str, Any]) -> list[Table]:
    """Tables of {row: {column: {mean, std}}} mappings in an experiment's results."""
    tables = []
    for key, value in data.items():
        if not (isinstance(value, dict) and value):
            continue
        inner = list(value.values())
        if not all(isinstance(v, dict) and v for v in inner):
            continue
        cells = [c for v in inner for c in v.values()]
        if not all(isinstance(c, dict) and "mean" in c for c in cells):
            continue
        columns = list(dict.fromkeys(k for v in inner for k in v))
        rows = []
        for name, by_column in value.items():
            row = [name]
            for col in columns:
                c = by_column.get(col)
                row.append("-" if c is None else f"{fmt(c['mean'])} ± {fmt(c.get('std'))}")
            rows.append(row)
        tables.append(Table([key, *columns], rows, f"{key.replace('_', ' ')}: mean ± std"))
    return tables


def _record_table(name: str, records: Sequence[Mapping[str, Any]]) -> Table | None:
    """A list of flat records (every value a scalar) as a table."""
    if not records or not all(isinstance(r, dict) for r in records):
        return None
    columns = list(dict.fromkeys(k for r in records for k in r))
    if any(isinstance(r.get(c), dict | list) for r in records for c in columns):
        return None
    rows = [[fmt(r.get(c)) for c in columns] for r in records]
    return Table(columns, rows, name)


def experiment_section(results: Sequence[Result], root: Path) -> list[Block]:
    blocks: list[Block] = []
    for r in results:
        blocks.append(Heading(r.label if r.label != "." else root.resolve().name, 3))
        d = r.data
        config = d.get("config") or {}
        if isinstance(config.get("description"), str):
            blocks.append(Text(config["description"]))
        scalars = [[k, fmt(v, 4)] for k, v in d.items() if isinstance(v, int | float | str)]
        if scalars:
            blocks.append(Table(["quantity", "value"], scalars))
        blocks += _mean_std_tables(d)
        for key, value in d.items():
            table = _record_table(key, value) if isinstance(value, list) else None
            if table is not None:
                blocks.append(table)
    return [*blocks, *_figures(results, root, _no_extra)]


def schedules_section(results: Sequence[Result], root: Path) -> list[Block]:
    blocks: list[Block] = []
    for r in results:
        d = r.data
        rows = [
            [
                f"`{m['spec']}`",
                fmt(m["inv_freq"][-1], 6),
                fmt(m["wavelength"][-1], 0),
                fmt(m["attention_factor"], 4),
                # schedules.json written before the pairs were counted lacks them
                str(len(m["unseen_pairs"])) if "unseen_pairs" in m else "-",
            ]
            for m in d["methods"]
        ]
        blocks.append(
            Table(
                [
                    "method",
                    "slowest θ (rad/token)",
                    "longest wavelength (tokens)",
                    "attn factor",
                    "pairs past their trained angles at the target",
                ],
                rows,
                f"{r.label}: head dim {d['head_dim']}, base {fmt(d['base'], 0)}, "
                f"factor {d['factor']}, original length {d['original_length']}",
            )
        )
    return [*blocks, *_figures(results, root, _no_extra)]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def demo_section(results: Sequence[Result], root: Path) -> list[Block]:
    """The demo's comparison: one row per method, every number read from ``demo.json``."""
    blocks: list[Block] = []
    for r in results:
        d: DemoResult = r.data
        if d.outcome is None:
            blocks.append(Text(f"The demo in {r.label} has not finished ({d.status})."))
            continue
        folder, config, base = r.path.parent, d.config, d.outcome.base
        lengths = config.lengths
        reused = "reused from the cache" if base.reused else "trained by this run"
        stages = "; then ".join(
            f"{fmt(st.steps)} steps on {st.context}-byte samples, "
            f"{100 * st.retrieval_ratio:.0f}% carrying a retrieval record"
            for st in base.stages
        )
        blocks.append(
            Text(
                f"A {fmt(base.parameters)}-parameter byte-level decoder "
                f"(`{base.encoding}`) trained at L = {config.context} bytes ({reused}: "
                f"{stages}; final training loss {fmt(base.final_loss, 3)} nats) is "
                f"extended to {config.target_length} bytes by each method, then evaluated at "
                f"{', '.join(map(str, lengths))} bytes on held-out text ({config.data}). Trained "
                f"methods see the same {config.extend_samples} samples of "
                f"{config.target_length} bytes from the training split, with the backbone frozen."
            )
        )
        tasks = list(config.tasks)
        headers = ["method", "trained params"]
        headers += [f"bpb @{n}" for n in lengths]
        headers += [f"{t} @{n}" for t in tasks for n in lengths]
        rows = []
        for m in d.outcome.methods:
            # A length a task does not fit is missing from its scores: shown as "-".
            row = [m.name, fmt(m.trainable)]
            row += [fmt(m.bpb[n]) for n in lengths]
            row += [_pct(m.score(t, n)) for t in tasks for n in lengths]
            rows.append(row)
        blocks.append(
            Table(
                headers,
                rows,
                "Bits per byte (lower is better) and retrieval accuracy by evaluation length "
                f"(bytes); {config.task_samples} samples per length for each task.",
            )
        )
        blocks += [Text(note) for note in d.outcome.notes]
        blocks.append(
            Table(
                ["method", "encoding", "extension time"],
                [[m.name, f"`{m.spec}`", _seconds(m.extend_s)] for m in d.outcome.methods],
            )
        )
        for name, caption in d.outcome.figures.items():
            path = (folder / name).as_posix()
            if (root / path).is_file():
                blocks.append(Figure(path, caption))
        blocks.append(
            Table(
                ["stage", "wall time"],
                [[k, _seconds(v)] for k, v in d.outcome.timings.items()],
                f"Wall time on {d.meta['machine']}.",
            )
        )
    return blocks


SECTIONS: dict[str, Callable[[Sequence[Result], Path], list[Block]]] = {
    "demo": demo_section,
    "pretrain": pretrain_section,
    "extend": extend_section,
    "search": search_section,
    "perplexity": perplexity_section,
    "tasks": tasks_section,
    "probes": probes_section,
    "analysis": analysis_section,
    "experiment": experiment_section,
    "schedules": schedules_section,
}
