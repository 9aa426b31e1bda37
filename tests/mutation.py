"""Mutation scores per module from mutmut's results (``make mutation`` runs it; not a test).

Reads ``mutmut results --all true`` (one ``module.x_function__mutmut_N: status`` line per
mutant) and writes a Markdown table: per module, the mutants killed by a test, survived, not
reached by any selected test, timed out, and not run (a stopped run), with the score killed /
(mutants run, timeouts excepted: a mutant that loops forever is caught, only by the clock), and
the surviving mutants per function, to be read with ``mutmut show NAME``.

Usage: python tests/mutation.py OUT.md [SECONDS]
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path


def scores(lines: list[str]) -> dict[str, Counter]:
    """{module: Counter(status)} from mutmut's result lines."""
    out: dict[str, Counter] = defaultdict(Counter)
    for line in lines:
        name, _, status = line.strip().rpartition(": ")
        if "__mutmut_" not in name:
            continue
        module = name.split(".x_", 1)[0].split(".xǁ", 1)[0]
        out[module][status] += 1
    return dict(out)


def survivors(lines: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for line in lines:
        name, _, status = line.strip().rpartition(": ")
        if status in ("survived", "no tests"):
            out[name.split("__mutmut_", 1)[0]].append(name.rsplit("_", 1)[1])
    return dict(out)


def main(out: Path, seconds: str | None) -> None:
    done = subprocess.run(
        [Path(sys.executable).with_name("mutmut"), "results", "--all", "true"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    header = "| module | mutants | killed | survived | no tests | timeout | not run | score |"
    rows = [header, "|---" * 8 + "|"]
    for module, c in sorted(scores(lines).items()):
        total = sum(c.values())
        judged = total - c["timeout"] - c["not checked"]  # a stopped run: what it reached
        score = f"{c['killed'] / judged:.1%}" if judged else "-"
        rows.append(
            f"| `{module}` | {total} | {c['killed']} | {c['survived']} | {c['no tests']} | "
            f"{c['timeout']} | {c['not checked']} | {score} |"
        )
    left = [
        f"- `{fn}`: {', '.join(sorted(ids, key=int))}"
        for fn, ids in sorted(survivors(lines).items())
    ]
    timing = f" in {seconds} s on this machine's 2 cores" if seconds else ""
    text = (
        "# Mutation scores\n\n"
        f"`make mutation` (mutmut 3.8.1{timing}; the modules and the tests it runs per mutant "
        "are `[tool.mutmut]` in pyproject.toml). Score: killed / (mutants run - timeouts).\n\n"
        + "\n".join(rows)
        + "\n\n## Mutants not killed (read one with `mutmut show NAME__mutmut_N`)\n\n"
        + "\n".join(left)
        + "\n"
    )
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
