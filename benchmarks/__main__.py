"""`python -m benchmarks` (what `make bench` runs): every benchmark, a table of ratios, and
benchmarks/results.json (name, ratio, target, note, device)."""

from __future__ import annotations

import platform

import torch

from . import rotary
from .common import RESULTS, print_table, write_results


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    label = torch.cuda.get_device_name() if device == "cuda" else f"cpu {platform.machine()}"
    results = rotary.run(device)
    print(f"device: {label}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print_table(results)
    write_results(results, label)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
