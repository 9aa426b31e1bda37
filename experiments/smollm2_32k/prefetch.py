"""Experiment E's training runs, ahead of the comparison, in a second process.

``ropekit compare`` runs its jobs one after another and scores the untrained methods before it
trains anything. On two cores this module trains the comparison's trained methods in a second
process: the training jobs of the comparison's own plan (``ropekit.compare.plan.jobs``: their
folders, their canonical specs), so that the comparison finds each run finished and reuses it
(``extend`` with ``resume``: a run of other settings there is refused, never reused). By
default it trains the first seed at every candidate rate (what the rate is chosen from);
``--seeds 1,2 --lr 0.04`` trains the other seeds at the rate chosen.

    python -m experiments.smollm2_32k.prefetch [--seeds S,...] [--lr LR]

Holds: main.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ropekit.allocator import bound_resident_memory
from ropekit.backbone import open_backbone
from ropekit.compare import from_file
from ropekit.compare.plan import jobs, resolve_methods
from ropekit.train.extend import extend

HERE = Path(__file__).parent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.smollm2_32k.prefetch")
    parser.add_argument("--config", type=Path, default=HERE / "compare.json", help="the config")
    parser.add_argument("--out", type=Path, default=HERE / "final", help="the comparison folder")
    parser.add_argument("--seeds", default=None, help="seeds (default: the config's first)")
    parser.add_argument("--lr", type=float, default=None, help="one rate (default: every one)")
    args = parser.parse_args(argv)
    config = from_file(args.config)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [config.seeds[0]]
    if args.lr is not None and args.lr not in config.lrs:
        parser.error(f"--lr {args.lr:g} is not one of the config's rates {list(config.lrs)}")
    torch.set_num_threads(1)
    bound_resident_memory()
    probe = open_backbone(config.model)
    methods = resolve_methods(config, probe)
    canonical = config.canonical(probe.training_length)
    # the comparison's own training jobs (plan.jobs): the later seeds at the rate given
    chosen = {m.label: args.lr for m in methods if m.trained and args.lr is not None}
    for job in jobs(canonical, args.out, methods, {}, chosen, probed=False):
        if job.kind != "training" or not job.method.trained or job.seed not in seeds:
            continue
        if args.lr is not None and job.lr != args.lr:
            continue
        print(f"{job.method.label}: seed {job.seed}, lr {job.lr:g} -> {job.folder}", flush=True)
        extend(
            open_backbone(config.model),
            canonical.extension_config(job.method.spec, job.seed, job.lr),
            job.folder, resume=True, command="experiments.smollm2_32k.prefetch",
        )  # fmt: skip


if __name__ == "__main__":
    main()
