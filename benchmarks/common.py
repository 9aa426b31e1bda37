"""Timing helpers: ratios measured side by side in one run, never absolute thresholds.

Holds: best_time (median of repeats after warm-up), Result, write_results.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).with_name("results.json")


def best_time(fn: Callable[[], object], repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in seconds; interleave the candidates being compared."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class Result:
    name: str
    ratio: float  # ropekit / reference; lower is better
    target: float | None
    note: str

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.ratio <= self.target


def print_table(results: list[Result]) -> None:
    print(f"{'benchmark':<58} {'ratio':>7} {'target':>7}  met  note")
    for r in results:
        target = "-" if r.target is None else f"{r.target:.2f}"
        met = {True: "yes", False: "NO", None: "-"}[r.met]
        print(f"{r.name:<58} {r.ratio:>7.3f} {target:>7}  {met:<4} {r.note}")


def write_results(results: list[Result], device: str, path: Path = RESULTS) -> None:
    """Merge this run's results (keyed by name and device) into results.json."""
    old = json.loads(path.read_text()) if path.exists() else []
    names = {(r.name, device) for r in results}
    kept = [o for o in old if (o["name"], o.get("device")) not in names]
    rows = kept + [{**asdict(r), "device": device} for r in results]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=2) + "\n")
    tmp.replace(path)
