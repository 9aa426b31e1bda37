"""Mutation scores per module from mutmut's results (``make mutation`` runs it; not a test).

Reads ``mutmut results --all true`` (one ``module.x_function__mutmut_N: status`` line per
mutant) and writes the record docs/mutation.json (per module, its mutants by status; the status
of each mutant not killed) and docs/mutation.md: the place of its table, which
``python -m docs.tables`` renders from the record (the score killed / (mutants run, timeouts
excepted: a mutant that loops forever is caught, only by the clock), and the mutants not killed
by reason), then those ``tests/mutation_equivalent.txt`` explains (one
``NAME: why no test can tell it from the original`` line each) with their reason, and the rest
per function, to be read with ``mutmut show NAME``: each of those is a test still to write.

Usage: python tests/mutation.py OUT.md [SECONDS]
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

EQUIVALENT = Path(__file__).with_name("mutation_equivalent.txt")
# mutmut's "suspicious": the test process died (a crash, not a failed assertion)
NOT_KILLED = ("survived", "no tests", "suspicious")
TABLE_OPEN, TABLE_CLOSE = "<!-- table: mutation -->\n", "<!-- /table: mutation -->"


def parse(lines: list[str]) -> dict[str, str]:
    """{mutant name: status} from mutmut's result lines."""
    out = {}
    for line in lines:
        name, _, status = line.strip().rpartition(": ")
        if "__mutmut_" in name:
            out[name] = status
    return out


def module_of(name: str) -> str:
    return name.split(".x_", 1)[0].split(".xǁ", 1)[0]


def scores(status: dict[str, str]) -> dict[str, Counter]:
    """{module: Counter(status)}."""
    out: dict[str, Counter] = defaultdict(Counter)
    for name, s in status.items():
        out[module_of(name)][s] += 1
    return dict(out)


def equivalents(text: str) -> dict[str, str]:
    """{mutant name: reason} from ``NAME: reason`` lines (blank lines and # comments skipped);
    a line without a reason is an error, so no survivor is waved through unexplained."""
    out = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = line.partition(": ")
        if "__mutmut_" not in name or not reason.strip():
            raise ValueError(f"{EQUIVALENT.name}:{number}: expected 'NAME__mutmut_N: reason'")
        out[name] = reason.strip()
    return out


def record(status: dict[str, str]) -> dict:
    """The committed record docs/mutation.json: per module, its mutants by mutmut's status;
    and the status of every mutant not killed (docs.tables renders both, with the reasons)."""
    return {
        "mutmut": "3.8.1",
        "modules": {m: dict(sorted(c.items())) for m, c in sorted(scores(status).items())},
        "not_killed": {n: s for n, s in sorted(status.items()) if s in NOT_KILLED},
    }


def report(status: dict[str, str], explained: dict[str, str], seconds: str | None) -> str:
    """docs/mutation.md: what was run, the table's place (filled by ``python -m docs.tables``
    from docs/mutation.json), the mutants still to kill and the explained ones."""
    unexplained: dict[str, list[str]] = defaultdict(list)
    listed = []
    for name, s in sorted(status.items()):
        if s not in NOT_KILLED:
            continue
        if name in explained:
            listed.append(f"- `{name}` ({s}): {explained[name]}")
        else:
            fn, _, number = name.rpartition("__mutmut_")
            unexplained[fn].append(number)
    left = [
        f"- `{fn}`: {', '.join(sorted(ids, key=int))}" for fn, ids in sorted(unexplained.items())
    ]
    timing = f" in {seconds} s on this machine's 2 cores" if seconds else ""
    return (
        "# Mutation scores\n\n"
        f"`make mutation` (mutmut 3.8.1{timing}; the modules and the tests it runs per mutant "
        "are `[tool.mutmut]` in pyproject.toml). Score: killed / (mutants run - timeouts). "
        "The mutants not killed are counted by the reason their line in "
        "tests/mutation_equivalent.txt gives (listed below); 'unexplained': the rest, still "
        "to kill.\n\n"
        f"{TABLE_OPEN}{TABLE_CLOSE}\n\n"
        "Modules in the scope the record has no count for:\n\n"
        "<!-- table: mutation-not-run -->\n<!-- /table: mutation-not-run -->\n\n"
        "## Mutants not killed, still to kill (read one with `mutmut show NAME__mutmut_N`)\n\n"
        + ("\n".join(left) or "None.")
        + "\n\n## Equivalent mutants\n\n"
        + ("\n".join(listed) or "None.")
        + "\n"
    )


def main(out: Path, seconds: str | None) -> None:
    done = subprocess.run(
        [Path(sys.executable).with_name("mutmut"), "results", "--all", "true"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    explained = equivalents(EQUIVALENT.read_text(encoding="utf-8")) if EQUIVALENT.exists() else {}
    status = parse(done.stdout.splitlines())
    out.with_suffix(".json").write_text(json.dumps(record(status), indent=1) + "\n")
    out.write_text(report(status, explained, seconds), encoding="utf-8")
    print(f"wrote {out.with_suffix('.json')} and {out} (its table: python -m docs.tables)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
