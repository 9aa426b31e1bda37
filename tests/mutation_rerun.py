"""Run mutants by name, one fresh pytest process each, and record the outcome where mutmut
keeps it (not a test; the fallback when ``mutmut run NAMES`` stalls).

mutmut 3.8.1 forks its workers; here its forked children blocked on a lock (futex wait, no
CPU) after the first few mutants of a run, each then recorded as a timeout: tqdm's
multiprocessing lock, shared by the forks, left held by a worker killed while drawing a bar
(tests/conftest.py now gives tqdm a lock per process). This does what a mutmut worker does,
without the fork: the
mutant's tests are mutmut's own selection for its function (``mutants/mutmut-stats.json``),
fastest first; ``MUTANT_UNDER_TEST`` names the mutant and ``mutants/src`` comes first on the
path, with no compiling (``ROPEKIT_COMPILE=never``, as ``make mutation``); pytest stops at the
first failure; the exit code goes into the function's module's ``.meta`` file as mutmut
writes it (1 killed, 0 survived, 33 no tests, 36 timeout), so ``mutmut results`` and
``tests/mutation.py`` read it as they read mutmut's own.

Usage: python -m tests.mutation_rerun NAMES.txt   (from the repository root; one
NAME__mutmut_N per line)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.mutation import module_of

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"
NO_TESTS, TIMEOUT = 33, 36  # mutmut's exit codes for these outcomes
LIMIT_S = 900  # wall seconds per mutant before it counts as a timeout


def function_of(name: str) -> str:
    """The mangled function of a mutant: ``ropekit.m.x_f__mutmut_3`` -> ``ropekit.m.x_f``."""
    return name.rpartition("__mutmut_")[0]


def meta_of(name: str) -> Path:
    """The results file of the mutant's module, under mutants/src."""
    module = module_of(name)
    return MUTANTS / "src" / (module.replace(".", "/") + ".py.meta")


def tests_of(name: str, stats: dict) -> list[str]:
    """mutmut's test selection for the mutant's function, fastest first."""
    tests = stats["tests_by_mangled_function_name"].get(function_of(name), [])
    return sorted(tests, key=lambda t: stats["duration_by_test"].get(t, 0.0))


def run(name: str, tests: list[str]) -> int:
    """pytest's exit code for the mutant's tests (NO_TESTS, TIMEOUT as mutmut records them)."""
    if not tests:
        return NO_TESTS
    # ROPEKIT_COMPILE=never as `make mutation`: torch.compile cannot copy mutmut's trampoline
    env = dict(
        os.environ, MUTANT_UNDER_TEST=name, PYTHONPATH=str(MUTANTS / "src"),
        ROPEKIT_COMPILE="never",
    )  # fmt: skip
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, timeout=LIMIT_S,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return TIMEOUT
    return done.returncode


def main(names_file: Path) -> None:
    stats = json.loads((MUTANTS / "mutmut-stats.json").read_text())
    names = [line.strip() for line in names_file.read_text().splitlines() if line.strip()]
    for name in names:
        meta = meta_of(name)
        if not meta.exists():
            raise SystemExit(f"{name}: no {meta} (run `mutmut run` once to generate the mutants)")
        start = time.perf_counter()
        code = run(name, tests_of(name, stats))
        data = json.loads(meta.read_text())  # reread: the file is small, the runs are long
        data["exit_code_by_key"][name] = code
        meta.write_text(json.dumps(data, indent=4))
        print(f"{code:4d} {time.perf_counter() - start:6.1f} s  {name}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
