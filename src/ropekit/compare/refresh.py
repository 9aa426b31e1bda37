"""A finished comparison's compare.json brought up to this ropekit's verdict and report,
computing no score: ``ropekit report DIR`` on a compare folder.

Which engines serve each method exactly depends on its encoding's form, not on the values
training reached: a shared schedule stays one schedule (exported as per-dimension factors),
a per-head one stays per-head, a remap stays a remap. So a comparison written before the
per-engine verdict (``verdict.per_engine``) gets it from its methods' specs at its first seed
and rate, asked of ``ropekit.serve.serving`` (the rules of ``ropekit inspect``). A trained
method is asked at a generic point of its parameters, not at its initialization: there, every
head of a per-head AdaRoPE still holds the same YaRN schedule and its temperatures are 1, which
any engine serves, while trained heads differ (measured: 7.9 max |d log p| at 9216 when served
as their nearest shared schedule). Each trainable positional parameter is moved by 1% of its
scale (seeded), which keeps shared parameters shared. The scores, the rule's numbers and the
provenance stay as written; the record says it was amended and by what. The same asking
redoes a comparison's engine answers when asked (``ropekit report DIR --engines``): the rules
are this version's, and a newer version may serve more (experiment D's comparison was run
before the vLLM plugin served the remaps).

Holds: refresh_comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ropekit.backbone import open_backbone
from ropekit.encodings import PositionEncoding
from ropekit.results import read_record, write_result
from ropekit.train.extend import resolve_method

from .assemble import COMPARE_JSON, engine_answers
from .config import CompareConfig
from .record import CompareResult, EngineAnswer, Method
from .report import write_report
from .verdict import per_engine


def refresh_comparison(
    folder: str | Path, *, engines: bool = False, log: Callable[[str], None] = print
) -> tuple[Path, Path]:
    """Add what ``folder``'s compare.json lacks (which engines serve each method, the verdict
    per engine), rewrite it atomically, and write report.md and report.html from it; returns
    the report's paths. ``engines``: ask the engines again even where it has their answers
    (the serving rules of the ropekit that ran it may be older: experiment D's comparison
    predates the vLLM plugin's remaps). Raises ResultError for a file that is not a
    comparison."""
    path = Path(folder) / COMPARE_JSON
    data = read_record(path, CompareResult)  # migrated from an older layout in memory
    if data.served is None or engines:
        config = data.compare_config
        why = "predates the per-engine verdict" if data.served is None else "asked again"
        log(f"{path} {why}: asking each engine about its {len(data.methods)} methods on "
            f"{config.model} (no score is recomputed)")  # fmt: skip
        served = _served(config, data.methods)
        verdict = data.verdict
        if verdict is not None:
            verdict = dataclasses.replace(verdict, serving=per_engine(verdict, served))
        command = f"ropekit report {folder}" + " --engines" * engines
        what = "added" if data.served is None else "replaced"
        amended = {"command": command, what: ["served", "verdict.serving"]}
        data = dataclasses.replace(
            data, served=served, verdict=verdict, meta={**data.meta, "amended": amended}
        )
        write_result(path, "compare", data)
    return write_report(data, folder)


def _served(config: CompareConfig, methods: Sequence[Method]) -> dict[str, dict[str, EngineAnswer]]:
    """{label: {engine: answer}} for each method's encoding, untrained."""
    probe = open_backbone(config.model)
    out = {}
    for method in methods:
        extension = config.extension_config(method.spec, config.seeds[0], config.lrs[0])
        encoding = resolve_method(probe, extension)[0]
        if method.trained:
            _move_off_initialization(encoding)
        out[method.label] = engine_answers(probe, config.target_length, encoding)
    return out


@torch.no_grad()
def _move_off_initialization(encoding: PositionEncoding, relative: float = 0.01) -> None:
    """Move every trainable parameter of ``encoding`` by ``relative`` of its mean magnitude,
    in a seeded random direction (module docstring: the form of a trained method, not its
    initialization's coincidences)."""
    generator = torch.Generator().manual_seed(0)
    for p in encoding.parameters():
        if p.requires_grad:
            scale = p.abs().mean().clamp_min(1.0) * relative
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale)
