"""Evaluation throughput of the needle runner: ``run_needle`` on the default 1.8M reference
decoder (random weights: the answers are wrong, the work is the same), against a plain greedy
loop (``Decoder.generate``, one prompt at a time) over prompts of the same lengths generating
the same number of tokens. Ratio = runner time / plain-loop time; tokens/s (prompt + generated
tokens per second) in the note. The runner's time includes making the haystack samples,
tokenizing, scoring and writing its files; the time it spends drawing its two figures (a
heatmap and accuracy vs length, a fixed cost per run whatever the model) is measured apart,
and a second ratio leaves it out.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ropekit.evals import EvalConfig, run_needle
from ropekit.evals import runner as plots  # holds the figure functions the runner calls
from ropekit.model import Decoder, DecoderConfig

from .common import Result, compare


def _records(out: Path, name: str) -> list[dict]:
    rows = []
    for path in sorted(out.rglob(name)):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


@contextmanager
def timing_figures(spent: list[float]) -> Iterator[None]:
    """Add the seconds the runner spends in its figure functions to ``spent`` (the runner
    looks them up in ropekit.evals.plots at each call, so wrapping the module's names works)."""
    names = ("plot_heatmap", "plot_accuracy_vs_length")
    originals = {name: getattr(plots, name) for name in names}

    def timed(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        return wrapper

    for name, fn in originals.items():
        setattr(plots, name, timed(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(plots, name, fn)


def run(device: str = "cpu", lengths: tuple[int, ...] = (256, 512)) -> list[Result]:
    torch.manual_seed(0)
    model = Decoder(DecoderConfig()).to(device).eval()
    depths = (0.0, 0.5, 1.0)
    tmp = Path(tempfile.mkdtemp(prefix="ropekit-bench-"))
    runs = iter(range(1_000_000))

    def runner():
        out = tmp / f"run{next(runs)}"  # a fresh folder: nothing to resume
        config = EvalConfig(tuple(lengths), samples=1, depths=tuple(depths))
        run_needle(model, config, out, progress=False)
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

    figures: list[float] = []  # seconds in the figure functions, over the timed runs only
    timed_runs = []

    def timed_runner():
        timed_runs.append(1)
        with timing_figures(figures):
            return runner()

    try:
        t = compare({"runner": timed_runner, "plain": plain}, repeats=3, warmup=0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    drawing = sum(figures) / len(timed_runs)  # per run; figures cost the same every run
    note = (
        f"{len(prompts)} needle prompts at {'/'.join(map(str, lengths))} tokens, "
        f"{sum(generated)} generated: runner {tokens / t['runner']:,.0f} tokens/s, "
        f"plain loop {tokens / t['plain']:,.0f} tokens/s; drawing the run's 2 figures takes "
        f"{drawing:.2f} s of a {t['runner']:.2f} s run (a fixed cost per run)"
    )
    ratio = t["runner"] / t["plain"]
    without = (t["runner"] - drawing) / t["plain"]
    return [
        Result("needle runner vs plain generate loop: time", ratio, None, note),
        Result(
            "needle runner without its figures vs plain generate loop: time",
            without,
            None,
            "the runner's time less the measured figure drawing: sample making, tokenizing, "
            "batched generation (4 prompts per forward; the plain loop runs one), scoring and "
            "JSON files",
        ),
    ]
