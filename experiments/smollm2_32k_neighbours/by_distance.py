"""Issue 58's retrieval by needle distance, read as experiment E's redo reads its own
(``experiments.smollm2_32k.by_distance``) from ``retrieval.sh``'s answers beside E's: every
method answers the same 56 probes (E's haystacks, needles and cut points), so each new method
pairs probe by probe with the method of E's it is asked against.

    python -m experiments.smollm2_32k_neighbours.by_distance [--retrieval DIR]
                                                             [--e-retrieval DIR] [--figure PNG]

The methods are probed one after another as time allows, in an order fixed before the first
answer (README, "Two decisions"), so one may finish sessions before the next: a method is
tabulated once it has answered all 56 probes and a pair once both of its methods have, never
a part of either. What is tabulated was fixed before any answer was read (METHODS, PAIRS).

Holds: METHODS, PAIRS, finished, main.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from experiments.smollm2_32k import by_distance as e
from experiments.smollm2_32k.contrasts import linked

HERE = Path(__file__).parent
RETRIEVAL = HERE / "retrieval"
# retrieval.sh's LABELS, in its order (test_experiments checks the two agree)
METHODS = (
    "adarope-leaky-rerope",
    "cope",
    "logn",
    "harpe",
    "ssmax",
    "llama4-temperature",
    "cope-12",
    "hardclip",
)
# Each new method against the method of E's its question names (README's table): the learned
# method over the free remap against the free remap; clipping against YaRN x4; the fixed
# temperatures and bases against AdaRoPE.
PAIRS = (
    ("adarope-leaky-rerope", "leaky-rerope"),
    ("cope", "yarn-x4"),
    ("logn", "adarope"),
    ("harpe", "adarope"),
    ("ssmax", "adarope"),
    ("llama4-temperature", "adarope"),
    ("cope-12", "yarn-x4"),
    ("hardclip", "yarn-x4"),
)


def finished(folder: Path, methods: tuple[str, ...]) -> tuple[str, ...]:
    """The methods of ``methods`` that have answered all their probes, in their order."""
    return tuple(p.method for p in e.progress(folder, methods) if p.answered == e.HAYSTACKS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--retrieval", type=Path, default=RETRIEVAL, help="retrieval.sh's folder")
    parser.add_argument("--e-retrieval", type=Path, default=e.RETRIEVAL,
                        help="E's redo's folder, whose methods the pairs name")  # fmt: skip
    parser.add_argument("--figure", type=Path, help="also draw accuracy vs distance here (PNG)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = linked([args.retrieval, args.e_retrieval], Path(tmp))
        e.print_progress(folder, METHODS)
        done = finished(folder, METHODS + tuple(dict.fromkeys(b for _, b in PAIRS)))
        pairs = tuple((a, b) for a, b in PAIRS if a in done and b in done)
        if not pairs:
            print("No new method and the method it is asked against have both finished: no table.")
            return
        methods = tuple(dict.fromkeys(m for pair in pairs for m in pair))
        e.print_tables(folder, methods, pairs)
        if args.figure is not None:
            print(f"Figure: {e.figure(folder, args.figure, methods)}")


if __name__ == "__main__":
    main()
