"""SmolLM2-135M (L0 = 8192; installed by ``ropekit models install smollm2-135m``), one thread,
each candidate against the reference in the same run:

1. *Remaps.* A 16,384-token forward with a KV cache (as scoring runs it; logits of the last
   token only, so the stack is what is timed) of every remap against the unmodified model, at
   2x; DCA and STRING, whose bands follow L0, also at 4x and 8x (their spec's
   ``original_length`` set to 4096 and 2048: the bands of a model trained that long; ReRoPE's
   and Self-Extend's windows do not depend on L0). Then one decoding step on that cache
   (16,384 cached tokens), and a training step (forward + backward, every weight) at 4,096
   tokens with the 8x bands (L0 = 512: every method crosses its band boundaries there).
2. *Reduced precision.* The unmodified model's 16k forward in bfloat16 against float32, and
   its held-out perplexity (Shakespeare, single documents: 8 windows of 2048 tokens and 1 of
   16,384, the same tokens) in bfloat16 against float32: what the speed costs.
3. *Schedules cost nothing extra.* Peak resident memory of a 16,384-token forward, patched
   with ``yarn:factor=2`` against unpatched, each in a fresh process with the command line's
   allocator setting (``ropekit.allocator``), and without it for comparison.

Each forward runs once (minutes each), candidates interleaved with the reference, so a change
of load during the run falls on both. Skipped when the model is not installed. The parts run
alone too: ``python -m benchmarks smollm2-memory smollm2-precision smollm2-remaps`` (each
merges its rows into results.json as it finishes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from .common import Result

MODEL = "smollm2-135m"
LENGTH = 16384
TRAIN_LENGTH = 4096
REMAPS = ("rerope", "rerope:leaky=16", "self-extend", "dca", "string")
BY_RATIO = {
    4: ("dca:original_length=4096", "string:original_length=4096"),
    8: ("dca:original_length=2048", "string:original_length=2048"),
}
TRAIN = {
    m: m.split(":")[0] + ":original_length=512" + (",leaky=16" if "leaky" in m else "")
    for m in REMAPS
}
TRAIN["string"] = "string:original_length=512,window=64"  # S = 168 must exceed its window

# A fresh process: load, patch (or not), one forward, print the peak resident memory (MiB
# above the loaded model) and the torch allocation peak.
_MEMORY = """
import json, sys, torch
torch.set_num_threads(1)
from ropekit.allocator import bound_resident_memory
from ropekit.backbone import open_backbone
spec, length, bounded = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
if bounded:
    bound_resident_memory()
backbone = open_backbone("smollm2-135m")
if spec != "none":
    backbone.set_encoding(spec)
ids = torch.randint(0, 49152, (1, length), generator=torch.Generator().manual_seed(0))
def status(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1])  # kB
# A short forward first pages in the memory-mapped weights; loading peaks above a 16k
# forward (ru_maxrss never falls), so the peak is reset to now (Linux: writing 5 to
# clear_refs resets VmHWM) and read after the forward.
with torch.no_grad():
    backbone.model(ids[:, :16], use_cache=False, logits_to_keep=1)
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
with torch.no_grad():
    backbone.model(ids, use_cache=False, logits_to_keep=1)
print(json.dumps({"resident_mib": (status("VmHWM") - before) / 1024}))
"""


def _name(spec: str) -> str:
    return spec.split(":")[0] + (" leaky" if "leaky" in spec else "")


def _open(spec: str | None, dtype: torch.dtype = torch.float32):
    from ropekit.backbone import open_backbone

    backbone = open_backbone(MODEL)
    if spec is not None:
        backbone.set_encoding(spec)
    if dtype != torch.float32:
        backbone.cast(dtype)
    return backbone


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _prefill_and_step(backbone, ids: torch.Tensor) -> tuple[float, float]:
    """(seconds of the prefill of ids[:-1] with a cache, median seconds of one more token)."""
    cache = backbone.new_cache()
    n = ids.shape[1] - 1
    with torch.no_grad():
        prefill = _timed(lambda: backbone.run(ids[:, :-1], cache, None, None, last_only=True))
        steps = []
        for _ in range(5):
            steps.append(_timed(lambda: backbone.run(ids[:, -1:], cache, None, None, True)))
            backbone.crop_cache(cache, n)
    return prefill, sorted(steps)[2]


def _train_step(backbone, ids: torch.Tensor) -> float:
    model = backbone.model
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    out = _timed(lambda: model(ids, labels=ids, use_cache=False).loss.backward())
    model.zero_grad(set_to_none=True)
    model.eval()
    return out


def _remap_rows(ids: torch.Tensor, train_ids: torch.Tensor) -> list[Result]:
    rows = []
    for ratio, specs in ((2, REMAPS), *BY_RATIO.items()):
        rope = _prefill_and_step(_open(None), ids)
        for spec in specs:
            prefill, step = _prefill_and_step(_open(spec), ids)
            note = (
                f"SmolLM2-135M fp32, 1 x {LENGTH - 1} with a DynamicCache, {ratio}x "
                f"({spec}): {prefill:.1f} s vs the unmodified model's {rope[0]:.1f} s"
            )
            target = 1.3 if spec.startswith("dca") else 1.5
            rows.append(
                Result(
                    f"smollm2 time forward {_name(spec)} vs rope at {LENGTH}, {ratio}x",
                    prefill / rope[0],
                    target,
                    note,
                )
            )
            rows.append(
                Result(
                    f"smollm2 time decode step {_name(spec)} vs rope, {LENGTH - 1} cached, "
                    f"{ratio}x",
                    step / rope[1],
                    1.5,
                    f"one token after the prefill (median of 5, cache cropped back each time): "
                    f"{step * 1e3:.0f} ms vs {rope[1] * 1e3:.0f} ms",
                )
            )
    rope_train = _train_step(_open(None), train_ids)
    for spec in REMAPS:
        t = _train_step(_open(TRAIN[spec]), train_ids)
        rows.append(
            Result(
                f"smollm2 time train step {_name(spec)} vs rope at {TRAIN_LENGTH}, 8x",
                t / rope_train,
                2.0,
                f"forward + backward, every weight, 1 x {TRAIN_LENGTH}, {TRAIN[spec]}: "
                f"{t:.1f} s vs {rope_train:.1f} s",
            )
        )
    return rows


def _precision_rows(ids: torch.Tensor) -> list[Result]:
    from ropekit.evals import PerplexityConfig
    from ropekit.evals.perplexity import run_perplexity

    times, ppl = {}, {}
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        backbone = _open(None, dtype)
        with torch.no_grad():
            t = _timed(lambda b=backbone: b.model(ids, use_cache=False, logits_to_keep=1))
        times.setdefault(dtype, []).append(t)
        if dtype not in ppl:
            config = PerplexityConfig((LENGTH // 8, LENGTH), n_tokens=LENGTH, single_documents=True)
            with tempfile.TemporaryDirectory() as out:
                result = run_perplexity(backbone, config, out, data="shakespeare", progress=False)
            ppl[dtype] = {r.length: r.perplexity for r in result.result.results}
    f32 = sum(times[torch.float32]) / 2  # float32 timed before and after bfloat16
    bf16 = times[torch.bfloat16][0]
    diffs = {n: ppl[torch.bfloat16][n] / ppl[torch.float32][n] - 1 for n in ppl[torch.float32]}
    ppl_note = "; ".join(
        f"{n}: {ppl[torch.float32][n]:.3f} fp32, {ppl[torch.bfloat16][n]:.3f} bf16 "
        f"({100 * d:+.2f}%)"
        for n, d in sorted(diffs.items())
    )
    return [
        Result(
            f"smollm2 time forward bfloat16 vs float32 at {LENGTH}",
            bf16 / f32,
            None,
            f"the unmodified model, 1 x {LENGTH}, no cache: {bf16:.1f} s vs {f32:.1f} s "
            "(float32 the mean of a run before and one after)",
        ),
        *[
            Result(
                f"smollm2 perplexity bfloat16 / float32 at {n}",
                1 + d,
                None,
                f"held-out Shakespeare, single documents, 8 windows of {LENGTH // 8} and 1 of "
                f"{LENGTH} (the same tokens): {ppl_note}",
            )
            for n, d in sorted(diffs.items())
        ],
    ]


def _memory(spec: str, bounded: bool) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY, spec, str(LENGTH), "1" if bounded else "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["resident_mib"]


def _memory_rows() -> list[Result]:
    rows = []
    for bounded in (True, False):
        plain, patched = _memory("none", bounded), _memory("yarn:factor=2", bounded)
        how = "the command line's allocator setting" if bounded else "glibc's default malloc"
        rows.append(
            Result(
                f"smollm2 peak resident memory patched vs unpatched at {LENGTH}"
                + ("" if bounded else ", default malloc"),
                patched / plain,
                1.05 if bounded else None,
                f"fresh process each, {how}, one forward of {LENGTH} tokens (last logits), MiB "
                f"above the loaded model: yarn:factor=2 {patched:.0f}, unpatched {plain:.0f}",
            )
        )
    return rows


def _inputs() -> tuple[torch.Tensor, torch.Tensor] | None:
    """The 16k and 4k token ids every part uses, or None (said) when the model is missing."""
    try:
        _open(None)
    except (OSError, ValueError) as e:
        print(f"smollm2: skipped, {MODEL} is not available ({e})")
        return None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (1, LENGTH), generator=g)
    return ids, torch.randint(0, 49152, (1, TRAIN_LENGTH), generator=g)


def _part(rows: Callable[[torch.Tensor, torch.Tensor], list[Result]]):
    """A benchmark part: CPU only, skipped without the model."""

    def run(device: str = "cpu") -> list[Result]:
        if device != "cpu":
            print("smollm2: CPU rows only (this benchmark measures the CPU kernels)")
            return []
        inputs = _inputs()
        return [] if inputs is None else rows(*inputs)

    return run


# Each part alone (``python -m benchmarks smollm2-precision``; a part is 30-90 CPU minutes),
# or all three (``smollm2``).
run_memory = _part(lambda ids, train_ids: _memory_rows())
run_precision = _part(lambda ids, train_ids: _precision_rows(ids))
run_remaps = _part(_remap_rows)
run = _part(
    lambda ids, train_ids: [*_memory_rows(), *_precision_rows(ids), *_remap_rows(ids, train_ids)]
)
