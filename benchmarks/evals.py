"""Evaluation throughput of the needle runner: ``run_needle`` on the default 1.8M reference
decoder (random weights: the answers are wrong, the work is the same), against a plain greedy
loop (``Decoder.generate``, one prompt at a time) over prompts of the same lengths generating
the same number of tokens. Ratio = runner time / plain-loop time; tokens/s (prompt + generated
tokens per second) in the note. The runner's time includes making the haystack samples,
tokenizing, scoring and writing its files.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from ropekit.evals import run_needle
from ropekit.model import Decoder, DecoderConfig

from .common import Result, compare


def _records(out: Path, name: str) -> list[dict]:
    rows = []
    for path in sorted(out.rglob(name)):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def run(device: str = "cpu", lengths: tuple[int, ...] = (256, 512)) -> list[Result]:
    torch.manual_seed(0)
    model = Decoder(DecoderConfig()).to(device).eval()
    depths = (0.0, 0.5, 1.0)
    tmp = Path(tempfile.mkdtemp(prefix="ropekit-bench-"))
    runs = iter(range(1_000_000))

    def runner():
        out = tmp / f"run{next(runs)}"  # a fresh folder: nothing to resume
        run_needle(model, None, lengths, depths, samples=1, out_dir=out, progress=False)
        return out

    first = runner()
    prompts = [r["n_tokens"] for r in _records(first, "data.jsonl")]
    generated = [r["n_generated"] for r in _records(first, "pred.jsonl")]
    tokens = sum(prompts) + sum(generated)
    pairs = [
        (torch.randint(0, 256, (1, n), device=device), g)
        for n, g in zip(prompts, generated, strict=True)
    ]

    def plain():
        for ids, new in pairs:
            model.generate(ids, max_new_tokens=new)

    try:
        t = compare({"runner": runner, "plain": plain}, repeats=3, warmup=0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    note = (
        f"{len(prompts)} needle prompts at {'/'.join(map(str, lengths))} tokens, "
        f"{sum(generated)} generated: runner {tokens / t['runner']:,.0f} tokens/s, "
        f"plain loop {tokens / t['plain']:,.0f} tokens/s"
    )
    ratio = t["runner"] / t["plain"]
    return [Result("needle runner vs plain generate loop: time", ratio, None, note)]
