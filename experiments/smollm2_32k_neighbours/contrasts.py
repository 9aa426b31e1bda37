"""Issue 58's contrasts (must 3), read as experiment E's are (``experiments.smollm2_32k.
contrasts``: the verdict's paired last-quarter NLL difference at 32k over every window of every
domain, with its standard error and the seeds' spread) from this comparison's folder, which
holds E's five finished methods beside the new ones (run.sh copies them in). Nothing is
computed that the comparison has not scored, so a contrast reads as it forms.

    python -m experiments.smollm2_32k_neighbours.contrasts [--final DIR] [--figure PNG]

Holds: PAIRS, main.
"""

from __future__ import annotations

from pathlib import Path

from experiments.smollm2_32k import contrasts as e

HERE = Path(__file__).parent
# The contrasts (README's table), fixed before anything was scored: each fixed
# temperature (over YaRN x4, where AdaRoPE starts) against the learned one, AdaRoPE, its global
# control and the schedule it is added to; fixed per-head bases against learned per-head
# frequencies; clipping against YaRN x4; AdaRoPE trained in Leaky ReRoPE's bands against
# Leaky ReRoPE. Whether anything beats Leaky ReRoPE at all is the comparison's own verdict
# (compare.json: the recommended method and its lead over the runner-up) and the standing.
PAIRS = (
    ("logn", "adarope"),
    ("ssmax", "adarope"),
    ("llama4-temperature", "adarope"),
    ("logn", "adarope-global"),
    ("ssmax", "adarope-global"),
    ("llama4-temperature", "adarope-global"),
    ("logn", "yarn-x4"),
    ("ssmax", "yarn-x4"),
    ("llama4-temperature", "yarn-x4"),
    ("harpe", "adarope"),
    ("cope", "yarn-x4"),
    ("hardclip", "yarn-x4"),
    ("cope-12", "yarn-x4"),
    ("adarope-leaky-rerope", "leaky-rerope"),
)


def main(argv: list[str] | None = None) -> None:
    e.main(argv, PAIRS, HERE / "final", "python -m experiments.smollm2_32k_neighbours.contrasts")


if __name__ == "__main__":
    main()
