"""Every table of measured numbers in README.md, docs/ and the experiments' READMEs, written
from the committed files.

A generated table sits between two markers in a Markdown file::

    <!-- table: NAME -->
    ...written by `python -m docs.tables`...
    <!-- /table: NAME -->

``TABLES`` maps each NAME to the function that renders it from the repository's committed
files (experiments' result JSON, benchmarks/results.json, docs/serving/*.json,
docs/mutation.json, ``ropekit.hf.archs.ARCHS``): nothing in a table is typed by hand.
``python -m docs.tables`` rewrites every marked region; ``python -m docs.tables --check``
writes nothing and exits 1 naming each table that differs from what the files give (make test
runs the same check, tests/test_docs_tables.py). ``make docs`` runs it before building the site.
A file a table reads that is missing or malformed (or a document naming an unknown table) is
one line naming the file and what was expected, exit 2, and no document is written.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ropekit.utils import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
MARKED = re.compile(
    r"(?P<open><!-- table: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)"
    r"(?P<close><!-- /table: (?P=name) -->)",
    re.S,
)


def markdown(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


class SourceError(Exception):
    """A file a table reads is missing or not what the table expects, or a document names an
    unknown table: one line naming the file and what was expected."""


class _Record(dict):
    """A JSON object that names its file and the field when a table reads a field it lacks."""

    def __init__(self, path: str, pairs: list[tuple[str, object]]) -> None:
        super().__init__(pairs)
        self.path = path

    def __missing__(self, key: str):
        raise SourceError(f"{self.path}: no field {key!r}")


def _json(root: Path, path: str) -> dict:
    """The committed JSON file ``path`` (relative to ``root``) as an object."""
    try:
        text = (root / path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SourceError(f"{path}: missing (a committed result file)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SourceError(f"{path}: unreadable ({e})") from None
    try:
        data = json.loads(text, object_pairs_hook=lambda pairs: _Record(path, pairs))
    except json.JSONDecodeError as e:
        raise SourceError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise SourceError(f"{path}: expected a JSON object, found a {type(data).__name__}")
    return data


def _mean_std(stat: dict, digits: int = 3) -> str:
    """``mean ± std`` over seeds, or the mean alone for one run."""
    if stat.get("std") and stat.get("n", len(stat.get("values", []))) > 1:
        return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"
    return f"{stat['mean']:.{digits}f}"


# ------------------------------------------------------------------------------ results
def rope_vs_sinusoidal(root: Path) -> str:
    """Validation bits per byte by evaluation length, mean ± std over seeds."""
    data = _json(root, "experiments/rope_vs_sinusoidal/results.json")
    bpb = data["bits_per_byte"]
    lengths = list(next(iter(bpb.values())))
    return markdown(
        ["encoding", *lengths],
        ([name, *(_mean_std(bpb[name][n]) for n in lengths)] for name in bpb),
    )


EXTEND_8X_ROWS = ("rope", "yarn", "tuned-yarn", "adarope-global", "adarope")


def extend_8x(root: Path) -> str:
    """The global controls against AdaRoPE: trained parameters, bits per byte at L and 8L."""
    data = _json(root, "experiments/extend_8x/results.json")
    lengths = [str(min(map(int, data["methods"]["rope"]["bpb"]))), data["longest"]]
    return markdown(
        ["method", "spec", "trained params", *(f"bpb @{n}" for n in lengths)],
        (
            [
                f"`{name}`",
                f"`{m['spec']}`",
                m["trainable"],
                *(_mean_std(m["bpb"][n]) for n in lengths),
            ]
            for name in EXTEND_8X_ROWS
            for m in [data["methods"][name]]
        ),
    )


def _ppl(stat: dict | float) -> str:
    """A perplexity: a float (one deterministic run), or mean ± std over seeds."""
    return f"{stat:.2f}" if isinstance(stat, float) else _mean_std(stat, 2)


def smollm2_16k(root: Path) -> str:
    """Experiment D in domain: the schedules and trained methods (results.json) and the
    training-free remaps (remaps/results.json), on the same held-out Shakespeare span."""
    folder = "experiments/smollm2_16k"
    rows = []
    for path, trained_of in (("results.json", "trainable"), ("remaps/results.json", None)):
        for label, m in _json(root, f"{folder}/{path}")["methods"].items():
            if path != "results.json" and label == "rope":  # scored once, in results.json
                continue
            ppl = m["perplexity"]
            rows.append(
                [f"`{label}`", f"`{m['spec']}`", m[trained_of] if trained_of else 0,
                 *(_ppl(ppl[n]["perplexity"]) for n in ("2048", "16384")),
                 _ppl(ppl["16384"]["last_quarter_perplexity"])]
            )  # fmt: skip
    return markdown(
        ["method", "spec", "trained params", "ppl @2048", "ppl @16384", "last-quarter ppl @16384"],
        rows,
    )


def extend_8x_paired(root: Path) -> str:
    """Paired differences of bits per byte at the longest length (mean ± std over seeds)."""
    data = _json(root, "experiments/extend_8x/results.json")
    n = data["longest"]
    return markdown(
        ["paired difference", f"bpb @{n}"],
        (
            [name, f"{d[n]['mean']:+.3f} ± {d[n]['std']:.3f}"]
            for name, d in data["paired_bpb_differences"].items()
        ),
    )


def _seed_lq_ppl(entry) -> list[float]:
    """Per seed: exp of the mean last-quarter NLL over its windows (a comparison's
    ``TableEntry``)."""
    return [math.exp(sum(w) / len(w)) for w in entry.last_quarter_windows]


def _range(values: list[float], digits: int) -> str:
    lo, hi = min(values), max(values)
    return (
        f"{lo:.{digits}f}"
        if round(lo, digits) == round(hi, digits)
        else f"{lo:.{digits}f}-{hi:.{digits}f}"
    )


def _comparison(root: Path, path: str):
    """The committed compare.json ``path`` read as ropekit reads it (``read_record``: an older
    format migrated, so a table reads one layout whatever version wrote the file)."""
    from ropekit.compare.record import CompareResult
    from ropekit.results import ResultError, read_record

    if not (root / path).is_file():
        raise SourceError(f"{path}: missing (a committed result file)")
    try:
        return read_record(root / path, CompareResult)
    except (ResultError, OSError, ValueError) as e:
        raise SourceError(f"{path}: not a comparison ropekit reads ({e})") from None


def _correct_of(e) -> str:
    """``7/12 [0.32, 0.81]``: correct of probes and the Wilson interval of an ``Accuracy``."""
    return f"{e.correct}/{e.n} [{e.low:.2f}, {e.high:.2f}]"


def _retrieval_columns(data) -> tuple[list[str], Callable[[str], list[str]]]:
    """A comparison's retrieval as table columns, each labelled with the distance it measured.
    By needle distance (compare.json 8 on): the probes past the trained length, pooled, with
    their Wilson interval, and the method's reach. Written before distances: the per-haystack
    table, its column naming the haystack and, for one needle at depth 0.5 asked from the end,
    the distance that needle sat back (about n / 2, not n)."""
    if data.retrieval:
        accuracy = next(
            (r.reach.accuracy for r in data.retrieval.values() if r.reach is not None), None
        )

        def by_distance(label: str) -> list[str]:
            r = data.retrieval.get(label)
            if r is None:
                return ["-", "-"]
            past = "-" if r.past is None else _correct_of(r.past)
            return [past, "-" if r.reach is None else f"{r.reach.distance}"]

        reach = "reach" if accuracy is None else f"reach (bins >= {accuracy:.0%})"
        return [f"passkey, needle > {data.trained_at} back", f"{reach}, tokens"], by_distance
    lengths = sorted({n for by_length in data.length_retrieval.values() for n in by_length})
    one_needle = data.probes is not None and data.probes.needles == 1

    def label(n: int) -> str:
        return f"passkey, needle ~{n // 2} back" if one_needle else f"passkey, haystack {n}"

    def by_length(method: str) -> list[str]:
        cells = data.length_retrieval.get(method, {})
        return [f"{cells[n].correct}/{cells[n].n}" if n in cells else "-" for n in lengths]

    return [label(n) for n in lengths], by_length


def comparison(path: str) -> Callable[[Path], str]:
    """A `ropekit compare` result as one row per method, best far-position score first:
    last-quarter perplexity at the target length per domain (the seeds' range for trained
    methods), the cost at the trained length (whole-window perplexity against the unmodified
    model's, averaged over domains) and, where probed, the passkey answers labelled by the
    needle distance they measured (``_retrieval_columns``)."""

    def render(root: Path) -> str:
        data = _comparison(root, path)
        verdict, target = data.verdict, data.target_length
        scores = verdict.scores
        labels = sorted(
            (m.label for m in data.methods),
            key=lambda label: (scores.get(label) is None, scores.get(label) or 0.0),
        )
        trained = {m.label: m.trained for m in data.methods}
        probed, retrieval = _retrieval_columns(data)
        header = [
            "method",
            "trained",
            *(f"LQ ppl @{target} {d}" for d in data.domains),
            f"cost @{verdict.short_length}",
            *probed,
        ]
        rows = []
        for label in labels:
            cells = [
                f"`{label}`",
                f"{len(_seed_lq_ppl(data.table[label][data.domains[0]][target]))} seeds"
                if trained[label]
                else "-",
            ]
            for domain in data.domains:
                cells.append(_range(_seed_lq_ppl(data.table[label][domain][target]), 2))
            cost = verdict.costs.get(label)
            cells.append("-" if label == data.baseline or cost is None else f"{cost:+.1%}")
            rows.append(cells + retrieval(label))
        return markdown(header, rows)

    return render


def headline(path: str) -> Callable[[Path], str]:
    """A comparison in one line per method: its far-position perplexity at the target (exp of
    the verdict's score, the mean last-quarter NLL over domains), its cost at the trained
    length and its passkeys at the farthest distance probed (``_retrieval_columns``)."""

    def render(root: Path) -> str:
        data = _comparison(root, path)
        verdict = data.verdict
        scores = verdict.scores
        trained = {m.label: m.trained for m in data.methods}
        probed, retrieval = _retrieval_columns(data)
        rows = []
        for label in sorted(scores, key=lambda m: (scores[m] is None, scores[m] or 0.0)):
            cost = verdict.costs.get(label)
            rows.append(
                [f"`{label}`", "yes" if trained[label] else "no", f"{math.exp(scores[label]):.1f}",
                 "-" if label == data.baseline or cost is None else f"{cost:+.1%}",
                 retrieval(label)[-1 if data.length_retrieval else 0]]
            )  # fmt: skip
        return markdown(
            ["method", "trained", f"far-position ppl @{data.target_length}",
             f"cost @{data.trained_at}", probed[-1 if data.length_retrieval else 0]],
            rows,
        )  # fmt: skip

    return render


def engines(path: str) -> Callable[[Path], str]:
    """A comparison's answer per engine: the best method within the cost margin that the
    engine serves exactly, how far behind the recommended method it is, and the best it serves
    over the margin."""

    def render(root: Path) -> str:
        data = _json(root, path)
        verdict = data["verdict"]
        best = verdict["scores"][verdict["winner"]]
        rows = []
        for engine, c in verdict["serving"].items():
            over = c["beyond_margin"]
            rows.append(
                [engine, f"`{c['method']}`" if c["method"] else "none",
                 "-" if c["behind"] is None else f"{c['behind']:+.3f}",
                 f"`{over['method']}` ({over['cost']:+.1%}, {over['score'] - best:+.3f})"
                 if over else "-"]
            )  # fmt: skip
        return markdown(
            ["engine", f"best it serves within {verdict['margin']:.0%}", "nats behind",
             "best it serves over the margin (cost, nats behind)"],
            rows,
        )  # fmt: skip

    return render


def _difference(d: dict) -> str:
    if not d:
        return "-"
    if d["se"] is None:
        return f"{d['mean']:+.3f} (no error: one window)"
    return f"{d['mean']:+.3f} ± {d['se']:.3f}"


def verdicts(root: Path) -> str:
    """Each committed comparison's verdict with its scope: windows, domains, seeds, probes and
    the trained methods' budget (samples, learning rates tried)."""
    rows = []
    for name, path in COMPARISONS.items():
        data = _json(root, path)
        v, config, d = data["verdict"], data["config"], data["verdict"]["difference"] or {}
        probes = data["probes"]
        rows.append(
            [name, f"{data['trained_at']} -> {data['target_length']}", ", ".join(data["domains"]),
             d.get("n", "-"), len(config["seeds"]),
             f"{config['samples']} samples"
             + (f" as PoSE windows of {config['pose_window']}" if config.get("pose") else "")
             + f"; lr {' or '.join(map(str, config['lrs']))}",
             f"{probes['probes_per_run']} per length" if probes else "-",
             f"`{v['winner']}` vs `{v['runner_up']}`",
             _difference(d), "yes" if v["resolved"] else "**no**"]
        )  # fmt: skip
    return markdown(
        ["comparison", "tokens", "domains", "windows paired", "seeds", "training per seed",
         "passkeys", "winner vs runner-up", "last-quarter NLL difference", "resolved"],
        rows,
    )  # fmt: skip


# ------------------------------------------------------------------- experiment READMEs
# The tables of experiments/*/README.md, from the result files beside them; each renders what
# the experiment's own results.md renders from the same file (its run.py), so the README and
# results.md agree by construction.
def _stat(stat: dict | None, digits: int = 3, percent: bool = False) -> str:
    """experiments.common.fmt: ``mean ± std`` (the mean alone for one run; ``-`` when none)."""
    if stat is None:
        return "-"
    scale, unit, d = (100, "%", 0) if percent else (1, "", digits)
    text = f"{scale * stat['mean']:.{d}f}{unit}"
    return text + (f" ± {scale * stat['std']:.{d}f}" if stat["n"] > 1 else "")


def _lengths(data: dict, key: str = "eval_lengths") -> list[str]:
    return [str(n) for n in data["config"][key]]


def _bpb_table(path: str, entries: str, params: Sequence[tuple[str, Callable[[dict], str]]]):
    """One row per entry of ``data[entries]``: its parameter columns, then bits per byte at
    every evaluated length (mean ± std over seeds)."""

    def render(root: Path) -> str:
        data = _json(root, path)
        lengths = _lengths(data)
        return markdown(
            ["method", *(name for name, _ in params), *(f"bpb @{n}" for n in lengths)],
            (
                [
                    f"`{name}`",
                    *(cell(m) for _, cell in params),
                    *(_stat(m["bpb"][n]) for n in lengths),
                ]
                for name, m in data[entries].items()
            ),
        )

    return render


def _paired_table(path: str, key: str, unit: str, digits: int = 3):
    """Paired differences by seed (a minus b; mean ± std over seeds) at every length."""

    def render(root: Path) -> str:
        data = _json(root, path)
        lengths = _lengths(data)
        return markdown(
            [f"difference ({unit}, paired by seed; negative: the first better)",
             *(f"@{n}" for n in lengths)],
            ([name, *(_stat(d[n], digits) for n in lengths)] for name, d in data[key].items()),
        )  # fmt: skip

    return render


def _task_table(path: str, entries: str, task: str):
    """Retrieval accuracy of ``task`` per length (mean ± std over seeds, in percent)."""

    def render(root: Path) -> str:
        data = _json(root, path)
        lengths = _lengths(data, "task_lengths")
        return markdown(
            ["method", *(f"{task} @{n}" for n in lengths)],
            (
                [f"`{name}`", *(_stat(m["tasks"][task].get(n), percent=True) for n in lengths)]
                for name, m in data[entries].items()
            ),
        )

    return render


def _trained_params(m: dict) -> str:
    return f"{m['trainable']:,}"


def _lr(m: dict) -> str:
    return f"{m['lr']:g}" if "lr" in m else "-"


def pretrain_encodings(root: Path) -> str:
    """Experiment A: parameters, final training loss, bits per byte at every length and each
    retrieval task at the training length (mean ± std over seeds)."""
    data = _json(root, "experiments/pretrain_encodings/results.json")
    lengths, tasks = _lengths(data), data["config"]["tasks"]
    task_lengths = _lengths(data, "task_lengths")
    return markdown(
        ["encoding", "parameters", "final train loss", *(f"bpb @{n}" for n in lengths),
         *(f"{t} @{n}" for t in tasks for n in task_lengths)],
        (
            [f"`{name}`", f"{m['parameters']:,}", _stat(m["final_loss"]),
             *(_stat(m["bpb"][n]) for n in lengths),
             *(_stat(m["tasks"][t][n], percent=True) for t in tasks for n in task_lengths)]
            for name, m in data["encodings"].items()
        ),
    )  # fmt: skip


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def smollm2_16k_all(root: Path) -> str:
    """Experiment D: every method's perplexity (whole window and last quarter) per length, its
    cost against the unmodified model at the shortest length, training and evaluation time
    (experiments/smollm2_16k/run.py's table)."""
    data = _json(root, "experiments/smollm2_16k/results.json")
    lengths, methods = _lengths(data), data["methods"]
    first, base = lengths[0], methods["rope"]["perplexity"]
    rows = []
    for name, m in methods.items():
        ppl, took = m["perplexity"], m["extend_s"]
        rows.append(
            [f"`{name}`", f"{m['trainable']:,}",
             "0" if not m["trained"] else _minutes(took["mean"]),
             str(ppl[lengths[0]]["perplexity"]["n"]) if m["trained"] else "-",
             *(_stat(ppl[n]["perplexity"], 2) for n in lengths),
             *(_stat(ppl[n]["last_quarter_perplexity"], 2) for n in lengths),
             f"{ppl[first]['perplexity']['mean'] / base[first]['perplexity']['mean'] - 1:+.1%}",
             _minutes(m["eval_s"])]
        )  # fmt: skip
    return markdown(
        ["method", "trained params", "train time", "seeds", *(f"ppl @{n}" for n in lengths),
         *(f"last-quarter ppl @{n}" for n in lengths), f"vs rope @{lengths[0]}", "eval time"],
        rows,
    )  # fmt: skip


def smollm2_16k_tasks(root: Path) -> str:
    """Experiment D's retrieval: one sample per cell (hit or miss), trained methods at seed 0."""
    data = _json(root, "experiments/smollm2_16k/results.json")
    tasks, lengths = data["config"]["tasks"], _lengths(data, "task_lengths")
    return markdown(
        ["method", *(f"{t} @{n}" for n in lengths for t in tasks)],
        (
            [f"`{name}`",
             *(f"{m['tasks'][n][t]['score']:.0%}" if n in m["tasks"] else "-"
               for n in lengths for t in tasks)]
            for name, m in data["methods"].items()
        ),
    )  # fmt: skip


def _probe(p: dict | None) -> str:
    return f"{p['correct']}/{p['n']} [{p['low']:.2f}, {p['high']:.2f}]" if p else "-"


def remaps(path: str) -> Callable[[Path], str]:
    """The training-free remap rows (experiments/smollm2_16k/remaps.py's table): perplexity,
    retrieval with Wilson intervals, each stage's wall time and the peak memory of the
    measured stages; then what was not run."""

    def render(root: Path) -> str:
        data = _json(root, path)
        cfg = data["config"]
        lengths = list(next(iter(data["methods"].values()))["perplexity"])
        tasks = [*cfg["tasks"], *cfg["probe_tasks"]]
        probes = [str(n) for n in cfg["probe_lengths"]]
        rows = []
        for job in data["methods"].values():
            ppl, stages = job["perplexity"], job["stages"]
            retrieval = [
                s["wall_s"] for name, s in stages.items() if name not in ("attach", "perplexity")
            ]
            rows.append(
                [f"`{job['label']}`", *(f"{ppl[n]['perplexity']:.2f}" for n in lengths),
                 f"{ppl[lengths[-1]]['last_quarter_perplexity']:.2f}",
                 *(_probe(job["probes"].get(t, {}).get(n)) for t in tasks for n in probes),
                 _minutes(stages["perplexity"]["wall_s"]),
                 _minutes(sum(retrieval)) if retrieval else "-",
                 f"{max(s['peak_gib'] for n, s in stages.items() if n != 'attach'):.2f} GiB"]
            )  # fmt: skip
        text = markdown(
            ["method", *(f"ppl @{n}" for n in lengths), f"last quarter @{lengths[-1]}",
             *(f"{t} @{n}" for t in tasks for n in probes), "ppl time", "retrieval time",
             "peak memory"],
            rows,
        )  # fmt: skip
        # remaps.py's check that the rows compare: a method experiment D scored too, rerun here
        d = _json(root, "experiments/smollm2_16k/results.json")["methods"]
        again = {
            j["label"]: [j["perplexity"][n]["perplexity"] for n in lengths]
            for j in data["methods"].values()
            if j["label"] in d and not d[j["label"]]["trained"]
        }
        if again:
            text += "\nReproduction: the same methods rerun here against experiment D's "
            text += "committed perplexities (same windows).\n\n" + markdown(
                ["method", *(f"here @{n}" for n in lengths), *(f"D @{n}" for n in lengths)],
                (
                    [f"`{label}`", *(f"{v:.2f}" for v in here),
                     *(f"{d[label]['perplexity'][n]['perplexity']['mean']:.2f}" for n in lengths)]
                    for label, here in again.items()
                ),
            )  # fmt: skip
        if data["not_run"]:
            text += f"\nNot run: {', '.join(f'`{m}`' for m in data['not_run'])}.\n"
        return text

    return render


def remaps_kernel(root: Path) -> str:
    """The remaps' perplexity stage on the eager reference kernel (remaps/results.json) and on
    the fused kernel (remaps/kernel/results.json), and the fused run against the unmodified
    model's where both ran in the same invocation (the ``--only`` of the file's command; a
    method merged from an earlier invocation ran beside other work: no ratio)."""
    eager = _json(root, "experiments/smollm2_16k/remaps/results.json")["methods"]
    kernel = _json(root, "experiments/smollm2_16k/remaps/kernel/results.json")
    command = kernel["meta"]["command"].split()
    together = command[command.index("--only") + 1].split(",") if "--only" in command else []
    fused = kernel["methods"]
    rope = fused["rope"]["stages"]["perplexity"]["wall_s"]
    return markdown(
        ["method", "eager kernel", "fused kernel", "fused / unmodified model, same invocation"],
        (
            [f"`{name}`", _minutes(eager[name]["stages"]["perplexity"]["wall_s"]),
             _minutes(f["stages"]["perplexity"]["wall_s"]),
             f"{f['stages']['perplexity']['wall_s'] / rope:.2f}" if name in together else "-"]
            for name, f in fused.items() if name in eager
        ),
    )  # fmt: skip


def compare_by_length(path: str) -> Callable[[Path], str]:
    """A comparison on one domain: whole-window perplexity at every length, last-quarter
    perplexity at the target (mean ± std over a trained method's seeds) and the cost at the
    trained length (the verdict's)."""

    def render(root: Path) -> str:
        data = _json(root, path)
        (domain,) = data["domains"]
        lengths, target = [str(n) for n in data["lengths"]], str(data["target_length"])
        costs = data["verdict"]["costs"]

        def cell(stat: dict) -> str:
            return _stat(stat, 2)

        return markdown(
            ["method", "seeds", *(f"ppl @{n}" for n in lengths),
             f"last-quarter ppl @{target}", f"cost @{data['trained_at']} vs rope"],
            (
                [f"`{m['label']}`", str(s[lengths[0]]["ppl"]["n"]) if m["trained"] else "-",
                 *(cell(s[n]["ppl"]) for n in lengths), cell(s[target]["last_quarter_ppl"]),
                 "-" if m["label"] == data["baseline"] else f"{costs[m['label']]:+.1%}"]
                for m in data["methods"]
                for s in [data["summary"][m["label"]][domain]]
            ),
        )  # fmt: skip

    return render


def _contrasts_module():
    """experiments/smollm2_32k/contrasts.py, the script the README names as these tables' source."""
    from experiments.smollm2_32k import contrasts

    return contrasts


def _forget_files() -> None:
    """contrasts.py reads each ppl.json once per process; a pass of the generator reads them
    afresh (a file may have changed since the last pass in the same process: the tests)."""
    _contrasts_module()._ppl.cache_clear()


EXTEND_8X = "experiments/extend_8x/results.json"
TWO_STAGE = "experiments/two_stage/results.json"
E_FINAL = "experiments/smollm2_32k/final"


def e_baseline(root: Path) -> str:
    """Experiment E's unmodified model: whole-window perplexity per domain and length."""
    data = _json(root, f"{E_FINAL}/compare.json")
    lengths = [str(n) for n in data["lengths"]]
    summary = data["summary"][data["baseline"]]
    return markdown(
        ["domain (held-out documents)", *(f"ppl @{n}" for n in lengths)],
        (
            [f"{d} ({', '.join(w['document'].split('/', 1)[1] for w in data['held_out'][d])})",
             *(f"{summary[d][n]['ppl']['mean']:.2f}" for n in lengths)]
            for d in data["domains"]
        ),
    )  # fmt: skip


def e_every_run(root: Path) -> str:
    """Experiment E, every run per seed and domain: last-quarter perplexity at the target and
    whole-window perplexity at L0 (experiments/smollm2_32k/contrasts.py's table)."""
    c, final = _contrasts_module(), root / E_FINAL
    length = _json(root, f"{E_FINAL}/compare.json")["target_length"]
    heads = [f"{d} LQ @{length}" for d in c.DOMAINS] + [f"{d} @{c.L0}" for d in c.DOMAINS]
    return markdown(
        ["method", "seed", *heads],
        (
            [method, seed, *(f"{cells[d][0]:.2f}" if d in cells else "-" for d in c.DOMAINS),
             *(f"{cells[d][1]:.2f}" if d in cells else "-" for d in c.DOMAINS)]
            for method, seed, cells in c.per_seed(final, length)
        ),
    )  # fmt: skip


def e_standing(root: Path) -> str:
    """Experiment E, each method best first: the verdict's score and its cost at L0."""
    c, final = _contrasts_module(), root / E_FINAL
    length = _json(root, f"{E_FINAL}/compare.json")["target_length"]
    return markdown(
        ["method", "seeds", f"NLL @{length}", "exp", f"cost @{c.L0}"],
        (
            [method, n, f"{score:.4f}", f"{math.exp(score):.2f}",
             "-" if cost is None else f"{cost:+.1%}"]
            for method, n, score, cost in c.standing(final, c.scored_seeds(final), length)
        ),
    )  # fmt: skip


def e_contrasts(root: Path) -> str:
    """Experiment E's paired differences at the target (contrasts.py's table)."""
    c, final = _contrasts_module(), root / E_FINAL
    length = _json(root, f"{E_FINAL}/compare.json")["target_length"]
    seeds = c.scored_seeds(final)
    rows = []
    for a, b, d in c.contrasts(final, length):
        each = c.paired_seeds(c.pair_table(final, seeds, a, b), a, b, length)
        call = ("yes" if c.resolved(d) else "no") + (
            " (one seed)" if c.one_seed(final, a, b, d) else ""
        )
        rows.append(
            [a, b, d.n, d.seeds, f"{d.mean:+.4f}", "-" if d.se is None else f"{d.se:.4f}",
             "-" if d.se_seeds is None else f"{d.se_seeds:.4f}", f"{math.exp(d.mean):.3f}",
             call, ", ".join(f"{x:+.4f}" for x in each)]
        )  # fmt: skip
    return markdown(
        ["a", "b", "windows", "seeds", "a - b", "s.e.", "of it, seeds", "perplexity ratio",
         f"resolved (\\|a - b\\| > 2 s.e., >= {c.MIN_DIFFERENCE})", "a - b per seed"],
        rows,
    )  # fmt: skip


def e_retrieval(root: Path) -> str:
    """Experiment E's passkey per method and length (seed 0): correct of probes by exact match,
    Wilson 95% interval, RULER's substring rule in brackets where it differs."""
    c = _contrasts_module()
    probed = c.retrieval(root / E_FINAL)
    lengths = sorted({e.length for entries in probed.values() for e in entries})

    def cell(e) -> str:
        if e is None:
            return "-"
        text = _correct_of(e)
        if e.substring is not None and e.substring.correct != e.correct:
            text += f" ({e.substring.correct}/{e.n} by substring)"
        return text

    return markdown(
        ["method", *(f"@{n}" for n in lengths)],
        (
            [method, *(cell({e.length: e for e in entries}.get(n)) for n in lengths)]
            for method, entries in probed.items()
        ),
    )


def _by_distance_module():
    """experiments/smollm2_32k/by_distance.py, the script E's retrieval README names."""
    from experiments.smollm2_32k import by_distance

    return by_distance


E_RETRIEVAL = "experiments/smollm2_32k/retrieval"


def e_retrieval_progress(root: Path) -> str:
    """E's retrieval redo: how far each method has got (haystacks answered, of them past the
    trained length, their mean cut) and the wall time they took, from its answers; the hours
    left priced haystack by haystack from what the same haystacks took the other methods
    (by_distance.seconds_left)."""
    d = _by_distance_module()
    rows = d.progress(root / E_RETRIEVAL)
    seconds_left = d.seconds_left(rows)

    def row(p) -> list[str]:
        left = seconds_left[p.method]
        left = "-" if left is None else f"{left / 3600:.1f}"
        return [
            p.method, f"{p.answered} of {d.HAYSTACKS}", p.past,
            "-" if p.mean_cut is None else f"{p.mean_cut:,.0f}",
            "-" if p.median_seconds is None else f"{p.median_seconds:,.0f}",
            f"{p.total_seconds / 3600:.1f}", left,
        ]  # fmt: skip

    return markdown(
        ["method", "haystacks answered", f"past {d.L0:,}", "mean cut (tokens)",
         "median wall time a haystack (s)", "wall time so far (h)", "hours left, estimated"],
        (row(p) for p in rows),
    )  # fmt: skip


def _not_yet(d, folder: Path) -> str | None:
    """The line that stands for a table of E's retrieval redo until every method has
    answered every probe (by_distance.complete); None once they have."""
    if d.complete(folder):
        return None
    finished = sum(p.answered == d.HAYSTACKS for p in d.progress(folder))
    return (
        f"Fills in once every method has answered all its probes ({finished} of "
        f"{len(d.METHODS)} have; progress above).\n"
    )


def e_retrieval_by_distance(root: Path) -> str:
    """E's retrieval redo per method: correct of probes per needle-distance bin, those past
    the trained length pooled (Wilson 95%), and the reaches (by_distance.by_method)."""
    d, folder = _by_distance_module(), root / E_RETRIEVAL
    if (line := _not_yet(d, folder)) is not None:
        return line
    bins = list(itertools.pairwise(d.CONFIG.bin_edges))
    heads = [f"{lo // 1024}-{hi // 1024}k" for lo, hi in bins]
    heads += [f"past {d.L0:,} (95%)", *(f"reach at {a:g}" for a in d.REACH_ACCURACIES)]

    def row(method: str, r) -> list[str]:
        at = {(b.low_distance, b.high_distance): b for b in r.by_distance}
        cells = [f"{b.correct}/{b.n}" if (b := at.get(e)) else "-" for e in bins]
        label = f"{method} (the floor)" if method == d.FLOOR else method
        return [label, *cells, _correct_of(r.past), *(f"{x.distance:,}" for x in r.reaches)]

    return markdown(
        ["method", *heads],
        (row(m, r) for m, r in d.by_method(folder).items()),
    )


def e_retrieval_distance_contrasts(root: Path) -> str:
    """E's retrieval redo, the verdict's pairs past the trained length: a minus b with
    Newcombe's paired 95% interval (the unpaired one beside it)."""
    d, folder = _by_distance_module(), root / E_RETRIEVAL
    if (line := _not_yet(d, folder)) is not None:
        return line
    rows = []
    for a, b, p in d.contrasts(folder):
        low, high = p.interval()
        u_low, u_high = p.unpaired_interval()
        told = "yes" if low > 0 or high < 0 else "no"
        rows.append(
            [a, b, f"{p.correct_a}/{p.n}", f"{p.correct_b}/{p.n}",
             f"{p.both}, {p.only_a}, {p.only_b}, {p.neither}", f"{p.difference:+.2f}",
             f"[{low:+.2f}, {high:+.2f}]", told, f"[{u_low:+.2f}, {u_high:+.2f}]"]
        )  # fmt: skip
    return markdown(
        ["a", "b", "a right", "b right", "both, a only, b only, neither", "a - b",
         "95% interval (paired)", "told apart", "unpaired interval"],
        rows,
    )  # fmt: skip


def e_retrieval_contrasts_by_bin(root: Path) -> str:
    """E's retrieval redo, the verdict's pairs in each needle-distance bin: a minus b with
    Newcombe's paired 95% interval (by_distance.contrasts_by_bin)."""
    d, folder = _by_distance_module(), root / E_RETRIEVAL
    if (line := _not_yet(d, folder)) is not None:
        return line
    bins = list(itertools.pairwise(d.CONFIG.bin_edges))

    def cell(p) -> str:
        if p is None:
            return "-"
        low, high = p.interval()
        return f"{p.difference:+.2f} [{low:+.2f}, {high:+.2f}] ({p.n})"

    return markdown(
        ["a - b", *(f"{lo // 1024}-{hi // 1024}k" for lo, hi in bins)],
        ([f"{a} - {b}", *(cell(per_bin.get(e)) for e in bins)]
         for a, b, per_bin in d.contrasts_by_bin(folder)),
    )  # fmt: skip


# ---------------------------------------------------------------------------- benchmarks
def _met(ratio: float, target: float | None) -> str:
    if target is None:
        return "-"
    return "yes" if ratio <= target else f"**no** ({ratio:.3f})"


def benchmarks(device: str) -> Callable[[Path], str]:
    """The rows of benchmarks/results.json measured on ``device`` (a prefix of its name), but
    the distance remaps' (summarized by ``remap_summary``)."""

    def render(root: Path) -> str:
        rows = [
            r for r in _json(root, "benchmarks/results.json")["rows"]
            if r["device"].startswith(device) and not REMAP.search(r["name"])
        ]  # fmt: skip
        return markdown(
            ["benchmark (ratio = ropekit / reference, lower is better)", "ratio", "target", "met"],
            (
                [
                    r["name"],
                    f"{r['ratio']:.2f}",
                    "-" if r["target"] is None else f"{r['target']:.2f}",
                    _met(r["ratio"], r["target"]),
                ]
                for r in rows
            ),
        )

    return render


REMAP = re.compile(r" (rerope leaky|rerope|self-extend|dca|string) ")


def remap_summary(device: str) -> Callable[[Path], str]:
    """The remap rows of ``device`` with the method left out of their names, one row per
    group: the five remaps' range of ratios, their targets, and how many met them."""

    def render(root: Path) -> str:
        groups: dict[str, list[dict]] = {}
        for r in _json(root, "benchmarks/results.json")["rows"]:
            if r["device"].startswith(device) and REMAP.search(r["name"]):
                groups.setdefault(REMAP.sub(" remaps ", r["name"], count=1), []).append(r)
        rows = []
        for name, rs in groups.items():
            ratios = [r["ratio"] for r in rs]
            targets = sorted({r["target"] for r in rs if r["target"] is not None})
            met = sum(r["ratio"] <= r["target"] for r in rs if r["target"] is not None)
            judged = sum(r["target"] is not None for r in rs)
            rows.append(
                [name, _range(ratios, 2), len(rs),
                 " / ".join(f"{t:.2f}" for t in targets) or "-",
                 f"{met} of {judged}" if judged else "-"]
            )  # fmt: skip
        return markdown(
            ["benchmark (ratio = remap / plain RoPE)", "range", "remaps", "targets", "met"], rows
        )

    return render


# ------------------------------------------------------------------------------- serving
def _serving_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if "error" in row:
        return "refused: " + row["error"].split(";")[0][:60]
    if "inv_freq_rel" in row:
        return f"freq {row['inv_freq_rel']:.1e}, attn {row['attention_factor_rel']:.1e} (relative)"
    if "per_head" in row:
        return f"ppl {row['per_head']:.3f} -> {row['nearest']:.3f}"
    exact = "" if row.get("within_tolerance", True) else " **(not exact)**"
    return f"{row['max']:.1e} / {row['mean']:.1e}{exact}"


def serving(root: Path) -> str:
    """`make test-serving`'s record: max / mean |log p| difference per method and engine."""
    data = _json(root, "docs/serving/serving.json")
    lengths = [str(n) for n in data["lengths"]]
    return markdown(
        ["method", "engine", *(f"max / mean @{n}" for n in lengths)],
        (
            [method, engine, *(_serving_cell(rows.get(n)) for n in lengths)]
            for method, engines in data["results"].items()
            for engine, rows in engines.items()
            if not engine.startswith("_")
        ),
    )


def serving_run(root: Path) -> str:
    """What the serving record was measured with: versions and the run's wall time."""
    data = _json(root, "docs/serving/serving.json")
    rows = [[name, version] for name, version in data["versions"].items()]
    rows.append(["whole run", f"{data['total_seconds'] / 60:.0f} minutes"])
    return markdown(["", "serving record (docs/serving/serving.json)"], rows)


def serving_floors(root: Path) -> str:
    """Each engine's tolerance: 5 x its largest float32 noise floor at each length."""
    data = _json(root, "docs/serving/serving.json")
    lengths = [str(n) for n in data["lengths"]]
    return markdown(
        ["engine", *(f"tolerance max / mean @{n}" for n in lengths)],
        (
            [engine, *(f"{t[n]['max']:.1e} / {t[n]['mean']:.1e}" for n in lengths)]
            for engine, t in data["tolerance"].items()
        ),
    )


def vllm_remaps(root: Path) -> str:
    """The distance remaps on vLLM with ropekit's plugin: agreement with ropekit's patched
    model (chunked prefill, then tokens decoded from the prefix cache). Speed is its own table
    (``vllm_remaps_speed``)."""
    data = _json(root, "docs/serving/vllm_remaps.json")
    lengths = [str(n) for n in data["lengths"]]
    return markdown(
        ["remap (vLLM + ropekit's plugin)", *(f"max / mean @{n}" for n in lengths),
         f"{data['decoded']} decoded @{lengths[-1]}"],
        (
            [f"`{row['spec']}`" + (" (earlier run)" if row.get("earlier_run") else ""),
             *(_serving_cell(row[n]) for n in lengths),
             _serving_cell(row["decode"])]
            for row in data["rows"].values()
        ),
    )  # fmt: skip


def vllm_remaps_speed(root: Path) -> str:
    """The plugin's speed against stock vLLM serving YaRN x2, from one side-by-side run
    (``benchmarks/serving.py``): tokens per second of CPU time and the ratio to stock per
    prompt length, and the decoding step's largest ops (self CPU ms per step, 9216 tokens)."""
    speed = _json(root, "docs/serving/vllm_remaps.json")["speed"]
    if isinstance(speed, str):  # no side-by-side run recorded: the record says why
        return markdown(["speed"], [[speed]])
    rows = speed["rows"]
    lengths = list(next(iter(rows.values()))["lengths"])

    def cell(t: dict, what: str) -> str:
        return f"{t[what + '_tok_s']:.{0 if what == 'prefill' else 2}f} ({t[what + '_ratio']:.2f}x)"

    def ops(profile: dict) -> str:
        top = sorted(profile["self_ms_per_step"].items(), key=lambda kv: -kv[1])[:4]
        return ", ".join(f"{name.split('::')[-1]} {ms:.0f}" for name, ms in top)

    return markdown(
        ["engine", *(f"{what} tok/s @{n}" for n in lengths for what in ("prefill", "decode")),
         "decoding step's largest ops @9216 (ms)", "load"],
        (
            [name, *(cell(row["lengths"][n], what) for n in lengths
                     for what in ("prefill", "decode")),
             ops(row["profile"]), f"{row['load_1m']:.1f}"]
            for name, row in rows.items()
        ),
    )  # fmt: skip


# ------------------------------------------------------------------------------ mutation
STATUSES = ("killed", "suspicious", "survived", "no tests", "timeout", "not checked")
# Why a mutant not killed is listed as equivalent, read from its line in
# tests/mutation_equivalent.txt: the first rule whose words the reason holds.
REASONS = (
    ("caught (a crash)", ("caught but labelled",)),
    ("CPU-only", ("cpu-equivalent only", "cpu-only", "another device", "second device")),
    ("rounding-only", ("rounding",)),
    ("cost or layout only", ("cost-only", "layout")),
    ("equivalent", ("",)),
)


def reason_of(text: str) -> str:
    text = text.lower()
    return next(name for name, words in REASONS if any(w in text for w in words))


def equivalents(root: Path) -> dict[str, str]:
    """{mutant: reason} from tests/mutation_equivalent.txt."""
    out = {}
    for line in (root / "tests/mutation_equivalent.txt").read_text(encoding="utf-8").splitlines():
        name, _, reason = line.strip().partition(": ")
        if "__mutmut_" in name and not name.startswith("#"):
            out[name] = reason
    return out


def mutation(root: Path) -> str:
    """Per module: mutants by mutmut's status, the score, and those not killed by reason."""
    data = _json(root, "docs/mutation.json")
    why = equivalents(root)
    reasons = [name for name, _ in REASONS]
    rows, totals = [], dict.fromkeys([*STATUSES, *reasons, "unexplained"], 0)
    for module, counts in sorted(data["modules"].items()):
        alive = [n for n in data["not_killed"] if re.split(r"\.x[_ǁ]", n, maxsplit=1)[0] == module]
        by_reason = dict.fromkeys([*reasons, "unexplained"], 0)
        for name in alive:
            by_reason[reason_of(why[name]) if name in why else "unexplained"] += 1
        judged = sum(counts.values()) - counts.get("timeout", 0) - counts.get("not checked", 0)
        for key, value in [*counts.items(), *by_reason.items()]:
            totals[key] += value
        rows.append(
            [f"`{module}`", sum(counts.values()), *(counts.get(s, 0) for s in STATUSES),
             f"{counts.get('killed', 0) / judged:.1%}", *by_reason.values()]
        )  # fmt: skip
    judged = sum(totals[s] for s in STATUSES) - totals["timeout"] - totals["not checked"]
    rows.append(
        ["**all**", sum(totals[s] for s in STATUSES), *(totals[s] for s in STATUSES),
         f"{totals['killed'] / judged:.1%}", *(totals[r] for r in [*reasons, "unexplained"])]
    )  # fmt: skip
    return markdown(["module", "mutants", *STATUSES, "score", *reasons, "unexplained"], rows)


def mutation_not_run(root: Path) -> str:
    """The modules of ``[tool.mutmut]``'s scope (pyproject.toml) that have a function and no
    count in docs/mutation.json: added, or first given a function, after the recorded run, so
    how well their tests fail is not measured yet."""
    import tomllib

    scope = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    recorded = _json(root, "docs/mutation.json")["modules"]
    rows = []
    for pattern in scope["tool"]["mutmut"]["only_mutate"]:
        for path in sorted(root.glob(pattern)):
            module = ".".join(path.relative_to(root / "src").with_suffix("").parts)
            functions = len(re.findall(r"^\s*def ", path.read_text(encoding="utf-8"), re.M))
            if module not in recorded and functions:
                rows.append([f"`{module}`", functions])
    return markdown(["module not in the record", "functions"], rows or [["none", "-"]])


# --------------------------------------------------------------------------- architectures
ROTATION_WORDS = {
    "all": "every layer",
    "rope_flags": "layers flagged in `no_rope_layers` (the others NoPE)",
    "sliding": "sliding-window layers (global layers NoPE)",
}


# How stock vLLM serves a family (ropekit.hf.archs.VLLM_SERVES), for the table.
VLLM_WORDS = {
    "native": "its model file",
    "transformers": "its Transformers backend",
    "none": "not in its registry",
}


def architectures(root: Path) -> str:
    """The Hugging Face model types ropekit patches, a row per registry row
    (``ropekit.hf.archs.ARCHS``, the registry in the code, not a file: ``root`` has no say)."""
    from ropekit.hf.archs import ARCHS
    from ropekit.serve.gguf_file import writable

    def remaps(arch) -> str:
        why = [f"{what} (`{field}`)" if field else what for what, field in arch.extras]
        why += ["q/k norm after the rotation"] if arch.norm_after_rotation else []
        return "yes" if not why else "refused where on: " + ", ".join(why)

    rows = (
        [
            f"`{a.model_type}`",
            ROTATION_WORDS[a.rotation],
            a.pairing,
            "every rotating type" if a.recipe is None else ", ".join(f"`{k}`" for k in a.recipe),
            remaps(a),
            VLLM_WORDS[a.vllm],
            "ropekit's writer" if writable(a.model_type) else "llama.cpp's converter",
        ]
        for a in (ARCHS[name] for name in sorted(ARCHS))
    )
    header = [
        "model_type", "rotates", "pairing", "a spec covers by default", "distance remaps",
        "stock vLLM 0.32", "GGUF",
    ]  # fmt: skip
    return markdown(header, rows)


COMPARISONS = {
    "D, out of domain": "experiments/smollm2_16k/ood/compare.json",
    "E": "experiments/smollm2_32k/final/compare.json",
}

TABLES: dict[str, Callable[[Path], str]] = {
    "architectures": architectures,
    "results-rope-vs-sinusoidal": rope_vs_sinusoidal,
    "results-extend-8x": extend_8x,
    "results-extend-8x-paired": extend_8x_paired,
    "results-16k": smollm2_16k,
    "results-16k-ood": comparison(COMPARISONS["D, out of domain"]),
    "results-32k": comparison(COMPARISONS["E"]),
    "results-verdicts": verdicts,
    "headline": headline(COMPARISONS["E"]),
    "engines-16k-ood": engines(COMPARISONS["D, out of domain"]),
    "engines-32k": engines(COMPARISONS["E"]),
    "benchmarks-cpu": benchmarks("cpu"),
    "benchmarks-remaps-cpu": remap_summary("cpu"),
    "benchmarks-remaps-cuda": remap_summary("NVIDIA"),
    "serving": serving,
    "serving-run": serving_run,
    "serving-floors": serving_floors,
    "vllm-remaps": vllm_remaps,
    "vllm-remaps-speed": vllm_remaps_speed,
    "mutation": mutation,
    "mutation-not-run": mutation_not_run,
    "extend-8x-all": _bpb_table(
        EXTEND_8X, "methods",
        [("trained params", _trained_params), ("lr", _lr)],
    ),
    "extend-8x-paired-all": _paired_table(
        EXTEND_8X, "paired_bpb_differences", "bpb"
    ),
    "extend-8x-kv1": _task_table(EXTEND_8X, "methods", "kv1_shakespeare"),
    "two-stage": _bpb_table(
        TWO_STAGE, "recipes",
        [("stage 1 params", lambda m: f"{m['stage1_trainable']:,}"),
         ("stage 2 params", lambda m: f"{m['stage2_trainable']:,}")],
    ),
    "two-stage-paired": _paired_table(
        TWO_STAGE, "paired_bpb_differences", "bpb"
    ),
    "two-stage-kv1": _task_table(TWO_STAGE, "recipes", "kv1_shakespeare"),
    "pretrain-encodings": pretrain_encodings,
    "16k-all": smollm2_16k_all,
    "16k-tasks": smollm2_16k_tasks,
    "16k-paired": _paired_table(
        "experiments/smollm2_16k/results.json", "paired_perplexity_differences", "perplexity", 2
    ),
    "16k-remaps": remaps("experiments/smollm2_16k/remaps/results.json"),
    "16k-remaps-kernel": remaps_kernel,
    "16k-ood-by-length": compare_by_length(COMPARISONS["D, out of domain"]),
    "32k-baseline": e_baseline,
    "32k-every-run": e_every_run,
    "32k-standing": e_standing,
    "32k-contrasts": e_contrasts,
    "32k-retrieval": e_retrieval,
    "32k-retrieval-progress": e_retrieval_progress,
    "32k-retrieval-by-distance": e_retrieval_by_distance,
    "32k-retrieval-distance-contrasts": e_retrieval_distance_contrasts,
    "32k-retrieval-contrasts-by-bin": e_retrieval_contrasts_by_bin,
}  # fmt: skip


def documents(root: Path) -> list[Path]:
    """README.md, the documentation pages and the experiments' READMEs."""
    return [
        root / "README.md",
        *sorted((root / "docs").rglob("*.md")),
        *sorted((root / "experiments").glob("**/README.md")),
    ]


def render(text: str, root: Path, where: str = "") -> str:
    """``text`` with every marked table written from the files under ``root``; SourceError
    when a table cannot be: a document names an unknown table, or a file is missing or lacks
    what its table reads."""

    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in TABLES:
            raise SourceError(f"{where}: unknown table {name!r}; known: {', '.join(TABLES)}")
        try:
            return match["open"] + TABLES[name](root) + match["close"]
        except SourceError as e:
            raise SourceError(f"{e} (table {name} in {where})") from None
        except OSError as e:  # a folder a table lists (contrasts.py's eval/)
            raise SourceError(f"{e.filename}: {e.strerror} (table {name} in {where})") from None
        except (KeyError, IndexError, TypeError, ValueError) as e:
            # a field of the wrong type or shape, or ropekit.results' one line naming the file
            raise SourceError(f"table {name} in {where}: {type(e).__name__}: {e}") from None

    return MARKED.sub(fill, text)


def rendered(root: Path) -> dict[Path, tuple[str, str]]:
    """Each document: (its text, its text with every table written); all rendered before
    anything is written, so a file that fails leaves every document as it was."""
    _forget_files()
    out = {}
    for path in documents(root):
        text = path.read_text(encoding="utf-8")
        out[path] = (text, render(text, root, str(path.relative_to(root))))
    return out


def stale(root: Path = ROOT) -> list[str]:
    """The documents whose tables differ from what the files give, with the tables named."""
    out = []
    for path, (text, new) in rendered(root).items():
        if new != text:
            old = {m["name"]: m["body"] for m in MARKED.finditer(text)}
            names = [m["name"] for m in MARKED.finditer(new) if old.get(m["name"]) != m["body"]]
            out.append(f"{path.relative_to(root)}: {', '.join(names)}")
    return out


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--check"]):
        print("usage: python -m docs.tables [--check]", file=sys.stderr)
        return 2
    try:
        if argv == ["--check"]:
            differ = stale(root)
            for line in differ:
                print(f"out of date: {line} (regenerate: python -m docs.tables)")
            return 1 if differ else 0
        documents = rendered(root)
    except SourceError as e:
        print(f"docs.tables: {e}", file=sys.stderr)
        return 2
    written = []
    for path, (text, new) in documents.items():
        if new != text:
            atomic_write_text(path, new)
            written.append(str(path.relative_to(root)))
    print(f"tables written to {', '.join(written)}" if written else "every table is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
