"""Timing and memory helpers: ratios measured side by side in one run, never absolute
thresholds.

Holds: best_time (median of repeats after warm-up), compare (candidates interleaved round by
round, median of each: load that drifts during a run hits every candidate alike; compare_stats
adds the minimum),
peak_memory (peak bytes of torch allocations while a function runs), Result (a row as a
module measures it), Row (a row of results.json: the result and its device), Benchmarks (the
file, a typed ``benchmarks`` result of ``ropekit.results``), read_results, write_results,
installed_backbone (a packaged model on a device, or None, said, when it is not installed).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ropekit.results import FORMAT_VERSION, read_record, register, run_metadata, write_result

RESULTS = Path(__file__).with_name("results.json")


def installed_backbone(name: str, device: str, benchmark: str) -> Any:
    """The installed model ``name`` on ``device``, or None when it is not available (the
    benchmark is then skipped, said so under its name)."""
    from ropekit.backbone import open_backbone

    try:
        backbone = open_backbone(name)
    except (OSError, ValueError) as e:
        print(f"{benchmark}: skipped, {name} is not available ({e})")
        return None
    backbone.model.to(device)
    return backbone


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


def compare(
    candidates: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 1
) -> dict[str, float]:
    """Median wall time (s) of each candidate, run round-robin: round r times every candidate
    once, so a change of machine load during the run falls on all of them."""
    return {name: med for name, (med, _) in compare_stats(candidates, repeats, warmup).items()}


def compare_stats(
    candidates: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 1
) -> dict[str, tuple[float, float]]:
    """(median, minimum) wall time (s) of each candidate, run round-robin as in ``compare``.
    The minimum is the run least disturbed by other jobs: a second view on a loaded machine."""
    times = timed_rounds(candidates, repeats, warmup)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def timed_rounds(
    candidates: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Wall time (s) of each candidate in each of ``repeats`` rounds; a round times every
    candidate once. Every other round runs them in reverse order, so none always runs first
    after another's caches (with a fixed order, the patched HF forward read 1.07x a Llama's
    at 4k on a quiet machine, 2026-12-06, and 1.00x in pairs of alternating order)."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for r in range(repeats):
        order = list(candidates.items())
        for name, fn in order if r % 2 == 0 else reversed(order):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


@dataclass(frozen=True)
class Paired:
    """``a``'s time over ``b``'s, from rounds that time both back to back: the median of the
    rounds' ratios, so load that drifts between rounds cancels within each (a ratio of the
    two medians pairs no rounds: on a 9-s forward whose rounds spread ±8%, it read 1.05 where
    the paired median read 1.00, GPT-OSS at 4k, 2026-12-06)."""

    ratio: float  # median of the per-round ratios
    quartiles: tuple[float, float]  # their first and third quartile
    a: float  # median time of a (s)
    b: float  # median time of b (s)


def paired(a: Callable[[], object], b: Callable[[], object], repeats: int = 15) -> Paired:
    """``a`` against ``b``, timed in ``repeats`` rounds of alternating order."""
    times = timed_rounds({"a": a, "b": b}, repeats)
    ratios = [x / y for x, y in zip(times["a"], times["b"], strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return Paired(
        statistics.median(ratios), (q1, q3), statistics.median(times["a"]),
        statistics.median(times["b"]),
    )  # fmt: skip


def sync() -> None:
    """Wait for the GPU's queued work (nothing on CPU): a timer read after it counts that work."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def peak_memory(fn: Callable[[], object], device: str, live: Iterable[torch.Tensor] = ()) -> int:
    """Peak bytes held by torch tensors while ``fn`` runs, counting the ``live`` tensors
    (parameters, optimizer state) that exist before it.

    CUDA: ``torch.cuda.max_memory_allocated`` (everything on the device). CPU: the torch
    profiler's allocation events (every allocation and free by torch's CPU allocator, kernels'
    internal buffers included), summed in time order; the peak of that running sum is added to
    ``live``. Tensors made before ``fn`` and not in ``live`` are not counted, so call it with
    gradients cleared (``zero_grad(set_to_none=True)``) and no stray references.
    """
    if device == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats()
        fn()
        sync()
        return torch.cuda.max_memory_allocated()
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    events.sort()
    running = peak = 0
    for _, size in events:
        running += size
        peak = max(peak, running)
    return tensor_bytes(live) + peak


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Result:
    """One benchmark row as a module measures it: a ratio of ropekit to the reference measured
    side by side in one run, its target (None: reported, not held to one) and a note with the
    absolute figures."""

    name: str
    ratio: float  # ropekit / reference; lower is better
    target: float | None
    note: str

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.ratio <= self.target


@dataclass(frozen=True)
class Row(Result):
    """A row of results.json: a result and the device it was measured on (rows are keyed by
    name and device, so a GPU run keeps the CPU rows beside its own)."""

    device: str


# The first layout of the kind (results.json was a bare list of rows before it, converted
# in place when it became a typed result).
@register("benchmarks", FORMAT_VERSION)
@dataclass(frozen=True)
class Benchmarks:
    """benchmarks/results.json: every row measured so far, in the order they were merged."""

    meta: dict  # run_metadata of the last run that merged rows
    provenance: dict  # empty: a row's note says what it ran on
    rows: tuple[Row, ...]


def read_results(path: Path = RESULTS) -> Benchmarks | None:
    """The rows results.json holds (None when there is none yet)."""
    return read_record(path, Benchmarks) if path.exists() else None


def print_table(results: list[Result]) -> None:
    print(f"{'benchmark':<58} {'ratio':>7} {'target':>7}  met  note")
    for r in results:
        target = "-" if r.target is None else f"{r.target:.2f}"
        met = {True: "yes", False: "NO", None: "-"}[r.met]
        print(f"{r.name:<58} {r.ratio:>7.3f} {target:>7}  {met:<4} {r.note}")


def write_results(results: list[Result], device: str, path: Path = RESULTS) -> None:
    """Merge this run's results into results.json: a row of the same name and device is
    replaced, the others kept."""
    earlier = read_results(path)
    names = {(r.name, device) for r in results}
    kept = [r for r in (earlier.rows if earlier else ()) if (r.name, r.device) not in names]
    rows = (*kept, *(Row(**asdict(r), device=device) for r in results))
    write_result(path, "benchmarks", Benchmarks(run_metadata("python -m benchmarks"), {}, rows))
