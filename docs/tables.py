"""Every table of measured numbers in README.md and docs/, written from the committed files.

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
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

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


def _json(root: Path, path: str) -> dict:
    return json.loads((root / path).read_text(encoding="utf-8"))


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


def _seed_lq_ppl(entry: dict) -> list[float]:
    """Per seed: exp of the mean last-quarter NLL over its windows (compare's summary)."""
    return [math.exp(sum(w) / len(w)) for w in entry["last_quarter_windows"]]


def _range(values: list[float], digits: int) -> str:
    lo, hi = min(values), max(values)
    return (
        f"{lo:.{digits}f}"
        if round(lo, digits) == round(hi, digits)
        else f"{lo:.{digits}f}-{hi:.{digits}f}"
    )


def comparison(path: str) -> Callable[[Path], str]:
    """A `ropekit compare` result as one row per method, best far-position score first:
    last-quarter perplexity at the target length per domain (the seeds' range for trained
    methods), the cost at the trained length (whole-window perplexity against the unmodified
    model's, averaged over domains) and, where probed, the passkey answers per length."""

    def render(root: Path) -> str:
        data = _json(root, path)
        verdict, target = data["verdict"], str(data["target_length"])
        scores = verdict["scores"]
        labels = sorted(
            (m["label"] for m in data["methods"]),
            key=lambda label: (scores.get(label) is None, scores.get(label) or 0.0),
        )
        trained = {m["label"]: m["trained"] for m in data["methods"]}
        probed = sorted({int(n) for by_length in data["retrieval"].values() for n in by_length})
        header = [
            "method",
            "trained",
            *(f"LQ ppl @{target} {d}" for d in data["domains"]),
            f"cost @{verdict['short_length']}",
            *(f"passkey @{n}" for n in probed),
        ]
        rows = []
        for label in labels:
            cells = [
                f"`{label}`",
                f"{len(_seed_lq_ppl(data['table'][label][data['domains'][0]][target]))} seeds"
                if trained[label]
                else "-",
            ]
            for domain in data["domains"]:
                cells.append(_range(_seed_lq_ppl(data["table"][label][domain][target]), 2))
            cost = verdict["costs"].get(label)
            cells.append("-" if label == data["baseline"] or cost is None else f"{cost:+.1%}")
            for n in probed:
                r = data["retrieval"].get(label, {}).get(str(n))
                cells.append(f"{r['correct']}/{r['n']}" if r else "-")
            rows.append(cells)
        return markdown(header, rows)

    return render


def headline(path: str) -> Callable[[Path], str]:
    """A comparison in one line per method: its far-position perplexity at the target (exp of
    the verdict's score, the mean last-quarter NLL over domains), its cost at the trained
    length and its passkeys at the target."""

    def render(root: Path) -> str:
        data = _json(root, path)
        verdict, target = data["verdict"], str(data["target_length"])
        scores = verdict["scores"]
        trained = {m["label"]: m["trained"] for m in data["methods"]}
        rows = []
        for label in sorted(scores, key=lambda m: (scores[m] is None, scores[m] or 0.0)):
            probe = data["retrieval"].get(label, {}).get(target)
            cost = verdict["costs"].get(label)
            rows.append(
                [f"`{label}`", "yes" if trained[label] else "no", f"{math.exp(scores[label]):.1f}",
                 "-" if label == data["baseline"] or cost is None else f"{cost:+.1%}",
                 f"{probe['correct']}/{probe['n']}" if probe else "-"]
            )  # fmt: skip
        return markdown(
            ["method", "trained", f"far-position ppl @{target}", f"cost @{data['trained_at']}",
             f"passkey @{target}"],
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


# --------------------------------------------------------------------------- architectures
ROTATION_WORDS = {
    "all": "every layer",
    "rope_flags": "layers flagged in `no_rope_layers` (the others NoPE)",
    "sliding": "sliding-window layers (global layers NoPE)",
}


def architectures(root: Path) -> str:
    """The Hugging Face model types ropekit patches, a row per registry row
    (``ropekit.hf.archs.ARCHS``, the registry in the code, not a file: ``root`` has no say)."""
    from ropekit.hf.archs import ARCHS

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
        ]
        for a in (ARCHS[name] for name in sorted(ARCHS))
    )
    header = ["model_type", "rotates", "pairing", "a spec covers by default", "distance remaps"]
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
}


def documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def render(text: str, root: Path, where: str = "") -> str:
    """``text`` with every marked table written from the files under ``root``."""

    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in TABLES:
            raise ValueError(f"{where}: unknown table {name!r}; known: {', '.join(TABLES)}")
        return match["open"] + TABLES[name](root) + match["close"]

    return MARKED.sub(fill, text)


def stale(root: Path = ROOT) -> list[str]:
    """The documents whose tables differ from what the files give, with the tables named."""
    out = []
    for path in documents(root):
        text = path.read_text(encoding="utf-8")
        new = render(text, root, str(path))
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
    if argv == ["--check"]:
        differ = stale(root)
        for line in differ:
            print(f"out of date: {line} (regenerate: python -m docs.tables)")
        return 1 if differ else 0
    written = []
    for path in documents(root):
        text = path.read_text(encoding="utf-8")
        new = render(text, root, str(path))
        if new != text:
            path.write_text(new, encoding="utf-8")
            written.append(str(path.relative_to(root)))
    print(f"tables written to {', '.join(written)}" if written else "every table is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
