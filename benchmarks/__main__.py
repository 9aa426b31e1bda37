"""`python -m benchmarks` (what `make bench` runs): every benchmark, a table of ratios, and
benchmarks/results.json (a ``benchmarks`` result of ``ropekit.results``: its rows are name,
ratio, target, note, device; ``common.read_results`` reads them as ``Row``).

`python -m benchmarks rotary memory` runs only the named modules (results.json keeps the
other rows). Modules: rotary, training, memory, bands, hf, evals, probes, perplexity, smollm2
(the last three on SmolLM2-135M; smollm2 is also three parts, smollm2-memory,
smollm2-precision and smollm2-remaps, of 30-90 CPU minutes each; probes-shared is probes'
second row).

Threads: one by default (``--threads N`` to change). This machine is shared with long
experiments; with two threads and other jobs on the two cores, OpenMP's parallel regions wait
for a descheduled thread at every barrier, and a 0.65 s training step took 1.5-7 s, which no
median makes comparable. Single-threaded, steps are slowed evenly by sharing and the
side-by-side ratios repeat (within a few percent between runs).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from types import SimpleNamespace

import torch

from . import bands, evals, hf, memory, perplexity, probes, rotary, smollm2, training
from .common import RESULTS, print_table, write_results

MODULES = {
    "rotary": rotary,
    "training": training,
    "memory": memory,
    "bands": bands,
    "hf": hf,
    "evals": evals,
    "probes": probes,
    "perplexity": perplexity,
    "smollm2": smollm2,
    # smollm2's parts, each alone (its rows merged into results.json when it finishes)
    "smollm2-memory": SimpleNamespace(run=smollm2.run_memory),
    "smollm2-precision": SimpleNamespace(run=smollm2.run_precision),
    "smollm2-remaps": SimpleNamespace(run=smollm2.run_remaps),
    # probes' second row alone
    "probes-shared": SimpleNamespace(run=probes.run_shared),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"modules: {', '.join(MODULES)} (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    names = args.names or [n for n in MODULES if "-" not in n]  # a part runs in its whole
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; allowed: {', '.join(MODULES)}")
    if args.threads < 1:
        parser.error(f"--threads={args.threads} is not allowed; it must be >= 1")
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # a GPU run happens on another machine with its own torch: the label says which
    label = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
        if device == "cuda"
        else f"cpu {platform.machine()}"
    )
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    results = []
    for name in names:
        start = time.perf_counter()
        rows = MODULES[name].run(device)
        results += rows
        write_results(rows, label)  # each module's rows kept as soon as it finishes
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    after = os.getloadavg() if hasattr(os, "getloadavg") else None
    torch_version = "" if device == "cuda" else f", torch {torch.__version__}"  # in the label
    print(f"device: {label}{torch_version}, threads {torch.get_num_threads()}")
    if load is not None and after is not None:
        print(
            f"load average (1 min) {load[0]:.2f} at start, {after[0]:.2f} at end, "
            f"on {os.cpu_count()} CPUs"
        )
    print_table(results)
    write_results(results, label)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
