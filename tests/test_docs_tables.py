"""docs/tables.py: every table of measured numbers in README.md and docs/ is what the committed
files give, and a number changed in a file makes its table stale."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from docs import tables

ROOT = Path(__file__).resolve().parents[1]


def test_every_generated_table_equals_what_the_committed_files_give():
    assert tables.stale() == [], "regenerate with `python -m docs.tables`"


def test_every_table_is_placed_somewhere_and_every_placed_table_exists():
    placed = {
        m["name"]
        for path in tables.documents(ROOT)
        for m in tables.MARKED.finditer(path.read_text())
    }
    assert placed == set(tables.TABLES)


def _copy(root: Path) -> Path:
    """The documents and the files the tables read, under ``root``."""
    shutil.copytree(
        ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("*.py", "__pycache__")
    )
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copytree(
        ROOT / "experiments", root / "experiments",
        ignore=lambda d, names: [n for n in names if "." in n and not n.endswith(".json")],
    )  # fmt: skip
    (root / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks/results.json", root / "benchmarks/results.json")
    (root / "tests").mkdir()
    shutil.copy(ROOT / "tests/mutation_equivalent.txt", root / "tests/mutation_equivalent.txt")
    (root / "src").symlink_to(ROOT / "src")
    return root


def _first_row(data: dict) -> dict:
    return data["rows"][0]


def _edit(path: Path, where, key: str) -> None:
    """Change one number in ``path``: ``where(data)[key]``."""
    data = json.loads(path.read_text())
    holder = where(data)
    holder[key] = holder[key] * 1.5 + 1
    path.write_text(json.dumps(data))


E_TARGET = (
    "experiments/smollm2_32k/final/compare.json",
    lambda d: d["table"]["adarope"]["kjv"]["32768"]["last_quarter_windows"][0],
    0,
)


@pytest.mark.parametrize(
    ("source", "where", "key", "table"),
    [
        ("benchmarks/results.json", _first_row, "ratio", "benchmarks-cpu"),
        ("experiments/rope_vs_sinusoidal/results.json",
         lambda d: d["bits_per_byte"]["rope"]["1024"], "mean", "results-rope-vs-sinusoidal"),
        ("experiments/extend_8x/results.json",
         lambda d: d["methods"]["adarope"]["bpb"]["1024"], "mean", "results-extend-8x"),
        ("experiments/smollm2_16k/remaps/results.json",
         lambda d: d["methods"]["dca"]["perplexity"]["16384"], "perplexity", "results-16k"),
        (*E_TARGET, "results-32k"),
        ("experiments/smollm2_16k/ood/compare.json",
         lambda d: d["verdict"]["costs"], "dca", "results-16k-ood"),
        ("docs/serving/serving.json",
         lambda d: d["results"]["yarn"]["vllm"]["9216"], "max", "serving"),
        ("docs/serving/vllm_remaps.json",
         lambda d: d["rows"]["dca (chunkllama scale)"]["9216"], "max", "vllm-remaps"),
        ("docs/serving/vllm_remaps.json",
         lambda d: d["speed"]["rows"]["dca (chunkllama scale)"]["lengths"]["9216"],
         "decode_ratio", "vllm-remaps-speed"),
        ("docs/mutation.json",
         lambda d: d["modules"]["ropekit.encodings.bands_fused"], "killed", "mutation"),
    ],
)  # fmt: skip
def test_a_number_changed_in_a_file_makes_its_table_stale(tmp_path, source, where, key, table):
    root = _copy(tmp_path)
    assert tables.stale(root) == []
    _edit(root / source, where, key)
    stale = tables.stale(root)
    assert stale and all(table in line for line in stale), stale
    assert tables.main(["--check"], root=root) == 1
    assert tables.main([], root=root) == 0
    assert tables.stale(root) == []


def test_check_names_the_stale_document_and_writes_nothing(tmp_path, capsys):
    root = _copy(tmp_path)
    readme = root / "docs/mutation.md"
    text = readme.read_text().replace("| 8213 |", "| 8214 |")
    readme.write_text(text)
    assert tables.main(["--check"], root=root) == 1
    assert "docs/mutation.md: mutation" in capsys.readouterr().out
    assert readme.read_text() == text


def test_an_unknown_table_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"x.md: unknown table 'nope'; known: architectures"):
        tables.render("<!-- table: nope -->\n<!-- /table: nope -->", ROOT, "x.md")


def _rows(markdown: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in markdown.splitlines()[2:]
        if line.startswith("|")
    ]


def test_the_mutation_table_adds_up_and_counts_every_mutant_not_killed_by_reason():
    text = tables.mutation(ROOT)
    header = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    statuses = [header.index(s) for s in tables.STATUSES]
    reasons = [header.index(r) for r, _ in tables.REASONS] + [header.index("unexplained")]
    not_killed = [header.index(s) for s in ("suspicious", "survived", "no tests")]
    for row in _rows(text):
        number = [int(row[i]) for i in statuses]
        assert int(row[1]) == sum(number), row  # the columns add to the mutants
        assert sum(int(row[i]) for i in not_killed) == sum(int(row[i]) for i in reasons), row


def test_a_mutant_not_killed_without_a_reason_is_counted_as_unexplained(tmp_path):
    root = _copy(tmp_path)
    record = json.loads((root / "docs/mutation.json").read_text())
    record["not_killed"]["ropekit.results.x_new__mutmut_1"] = "survived"
    record["modules"]["ropekit.results"]["survived"] += 1
    (root / "docs/mutation.json").write_text(json.dumps(record))
    row = next(r for r in _rows(tables.mutation(root)) if r[0] == "`ropekit.results`")
    assert row[-1] == "1"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("NOT equivalent, caught but labelled 'suspicious': ...", "caught (a crash)"),
        (".to(None) instead of .to(device): only observable with a second device", "CPU-only"),
        ("CPU-equivalent only (not equivalent on CUDA; killed there by ...)", "CPU-only"),
        ("rounding-only (not strictly equivalent): ...", "rounding-only"),
        ("cost-only: a sub-block height from the band's width", "cost or layout only"),
        ("strict=None is falsy like strict=False: the same check", "equivalent"),
    ],
)
def test_each_reason_is_read_from_its_words(text, reason):
    assert tables.reason_of(text) == reason


def test_a_comparisons_untrained_rows_are_its_summary():
    """Parity with `ropekit compare`'s own summary: for one run, exp of the mean last-quarter
    NLL over the windows is the summary's last-quarter perplexity."""
    path = "experiments/smollm2_32k/final/compare.json"
    data = json.loads((ROOT / path).read_text())
    rows = {r[0].strip("`"): r for r in _rows(tables.comparison(path)(ROOT))}
    target = str(data["target_length"])
    for method in (m for m in data["methods"] if not m["trained"]):
        for i, domain in enumerate(data["domains"]):
            mean = data["summary"][method["label"]][domain][target]["last_quarter_ppl"]["mean"]
            assert rows[method["label"]][2 + i] == f"{mean:.2f}"
