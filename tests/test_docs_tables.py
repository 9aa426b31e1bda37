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
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    shutil.copytree(
        ROOT / "experiments", root / "experiments",
        ignore=lambda d, names: [
            n for n in names
            if (Path(d) / n).is_file() and not n.endswith((".json", ".jsonl", "README.md", ".py"))
        ],
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
        # the experiments' READMEs
        ("experiments/extend_8x/results.json",
         lambda d: d["methods"]["linear"]["tasks"]["kv1_shakespeare"]["256"], "mean",
         "extend-8x-kv1"),
        ("experiments/two_stage/results.json",
         lambda d: d["recipes"]["adarope->lora"]["bpb"]["1024"], "mean", "two-stage"),
        ("experiments/pretrain_encodings/results.json",
         lambda d: d["encodings"]["nope"]["final_loss"], "mean", "pretrain-encodings"),
        ("experiments/smollm2_16k/results.json",
         lambda d: d["methods"]["adarope"], "eval_s", "16k-all"),
        ("experiments/smollm2_16k/remaps/kernel/results.json",
         lambda d: d["methods"]["dca"]["stages"]["perplexity"], "wall_s", "16k-remaps-kernel"),
        ("experiments/smollm2_16k/ood/compare.json",
         lambda d: d["summary"]["dca"]["kjv"]["8192"]["ppl"], "mean", "16k-ood-by-length"),
        ("experiments/smollm2_32k/final/compare.json",
         lambda d: d["summary"]["rope"]["kjv"]["16384"]["ppl"], "mean", "32k-baseline"),
        ("experiments/smollm2_32k/final/eval/tuned-yarn/s1/kjv/ppl.json",
         lambda d: d["results"][0], "perplexity", "32k-every-run"),
        ("experiments/smollm2_32k/final/eval/dca/s0/probes/summary.json",
         lambda d: d["by_length"][1], "high", "32k-retrieval"),
    ],
)  # fmt: skip
def test_a_number_changed_in_a_file_makes_its_table_stale(tmp_path, source, where, key, table):
    root = _copy(tmp_path)
    _edit(root / source, where, key)
    stale = tables.stale(root)
    assert table in {name for line in stale for name in line.split(": ")[1].split(", ")}, stale


def test_the_copy_is_up_to_date_and_writing_makes_a_stale_copy_up_to_date(tmp_path, capsys):
    """The copy the tests above edit gives the committed tables; after an edit in the same
    process (a file read before), --check fails and writing the tables makes them what the
    files give."""
    root = _copy(tmp_path)
    assert tables.stale(root) == []
    _edit(root / "experiments/smollm2_32k/final/eval/tuned-yarn/s1/kjv/ppl.json",
          lambda d: d["results"][0], "perplexity")  # fmt: skip
    assert tables.main(["--check"], root=root) == 1
    assert tables.main([], root=root) == 0
    assert "tables written to experiments/smollm2_32k/README.md" in capsys.readouterr().out
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
    with pytest.raises(
        tables.SourceError, match=r"x.md: unknown table 'nope'; known: architectures"
    ):
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


# ------------------------------------------------------------ a result file missing or malformed
def _documents(root: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in tables.documents(root)}


def _drop_recipes(path: Path) -> None:
    data = json.loads(path.read_text())
    del data["recipes"]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("spoil", "said"),
    [
        (lambda path: path.unlink(), "experiments/two_stage/results.json: missing"),
        (lambda path: path.write_text('{"config": {'),
         "experiments/two_stage/results.json: not JSON (Expecting property name"),
        (lambda path: path.write_text("[1, 2]"),
         "experiments/two_stage/results.json: expected a JSON object, found a list"),
        (_drop_recipes, "experiments/two_stage/results.json: no field 'recipes' (table two-stage"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("argv", [[], ["--check"]])
def test_a_missing_or_malformed_file_is_one_line_exit_2_and_nothing_written(
    tmp_path, capsys, spoil, said, argv
):
    """Write all or nothing: a table of README.md (rendered before the experiments' READMEs)
    is stale too, and stays as it was."""
    root = _copy(tmp_path)
    _edit(root / "benchmarks/results.json", _first_row, "ratio")
    spoil(root / "experiments/two_stage/results.json")
    before = _documents(root)
    assert tables.main(argv, root=root) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("docs.tables: "), err
    assert said in err
    assert _documents(root) == before


def test_a_document_naming_an_unknown_table_is_one_line_exit_2(tmp_path, capsys):
    root = _copy(tmp_path)
    page = root / "docs/performance.md"
    page.write_text(page.read_text() + "\n<!-- table: nope -->\n<!-- /table: nope -->\n")
    before = _documents(root)
    assert tables.main([], root=root) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "docs/performance.md: unknown table 'nope'" in err, err
    assert _documents(root) == before


def test_a_module_of_the_mutation_scope_without_a_count_is_listed(tmp_path):
    """The modules [tool.mutmut] mutates that the record lacks; one dropped from the record
    joins them."""
    root = _copy(tmp_path)
    listed = {r[0] for r in _rows(tables.mutation_not_run(root))}
    assert "`ropekit.encodings.rope`" not in listed
    record = json.loads((root / "docs/mutation.json").read_text())
    del record["modules"]["ropekit.encodings.rope"]
    (root / "docs/mutation.json").write_text(json.dumps(record))
    assert {r[0] for r in _rows(tables.mutation_not_run(root))} == listed | {
        "`ropekit.encodings.rope`"
    }
