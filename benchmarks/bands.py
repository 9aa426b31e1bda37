"""Distance remaps against plain RoPE on a small reference decoder (d_model 64, 4 heads of 16,
2 layers), side by side in one run: a 16,384-token forward (no grad), one decoding step after a
16,384-token prefill, a training step (forward + backward, every weight training) at 4,096
tokens, and the forward's peak memory; each at three extension ratios, the trained length
being 1/2, 1/4 and 1/8 of the sequence, so that the methods' defaults (ReRoPE w = 512, leaky
k = 16; Self-Extend G = 8, W = 1024; DCA chunk 3/4 L0, local L0/16; STRING S = 0.33 L0,
W = 128) cross more band boundaries as the ratio grows (DCA: 3, 7 and 15 chunks at 16k).

The remaps attend in bands on the fused kernel (``ropekit.encodings.bands_fused`` on CPU,
``bands_flex`` on CUDA); plain RoPE through PyTorch's causal attention is the reference. A
small model is the hard case: its
attention is most of its time, and fixed per-call costs weigh most. Each forward row's note
splits the remap's time into rotation (queries per band, keys per distinct positions), the
fused kernel calls, the merge and the planning, measured in one instrumented forward; the
reference kernel's time (the eager block-by-block path, no longer used where the fused one
runs) is measured at 4x for comparison. On CUDA the run adds each remap's forward on random
weights in SmolLM2-135M's shape.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ropekit.encodings import bands, bands_flex, bands_fused
from ropekit.model import Decoder, DecoderConfig, KVCache

from .common import Result, compare, mib, peak_memory, sync

LENGTH = 16384
TRAIN_LENGTH = 4096
RATIOS = (2, 4, 8)
METHODS = ("rerope", "rerope:leaky=16", "self-extend", "dca", "string")
TARGETS = {"forward": 1.5, "decode": 1.5, "train": 2.0, "memory": 1.3}
DCA_FORWARD = 1.3  # DCA's bands are chunk-aligned: nearly one causal attention
# SmolLM2-135M's shape with random weights (CUDA only: there a small decoder's time is kernel
# launches, and this shape shows the cost where the arithmetic weighs; the real model's CPU
# rows are benchmarks/smollm2.py's).
SMOLLM2_SHAPE = {"d_model": 576, "n_heads": 9, "n_kv_heads": 3, "n_layers": 30,
                 "ffn_hidden": 1536, "vocab_size": 49152}  # fmt: skip


def _model(spec: str, context: int, device: str) -> Decoder:
    torch.manual_seed(0)
    config = DecoderConfig(encoding=spec, d_model=64, n_heads=4, n_layers=2, context_length=context)
    return Decoder(config).to(device)


# The parts of each fused kernel, timed in a forward's split.
_PARTS = {
    "pieces": {
        (bands_fused, "_kernel"): "kernel",
        (bands_fused, "_merge"): "merge",
        (bands_fused, "index_bounds"): "plan",
        (bands_fused, "_blocks"): "plan",
        (bands, "_rotate_keys"): "rotation",
    },
    "flex": {
        (bands_flex, "_attend"): "kernel",
        (bands_flex, "_merge"): "merge",
        (bands_fused, "index_bounds"): "plan",
        (bands_flex, "tiles"): "plan",
        (bands_flex, "_block_mask"): "plan",
        (bands, "_rotate_keys"): "rotation",
    },
}


def _kernel(device: str) -> str:
    """Which fused kernel runs on the device: FlexAttention on CUDA where it compiled (a
    failure is recorded by the first forward), else the pieces."""
    return "flex" if device == "cuda" and not bands_flex._failure else "pieces"


def _where(device: str) -> str:
    """How the device's fused kernel splits the work, for the rows' notes."""
    if _kernel(device) == "flex":
        return f"FlexAttention tiles of {bands_flex.TILE}"
    return f"blocks of {bands_fused.BLOCK_ROWS} rows"


@contextlib.contextmanager
def _timing(spent: collections.Counter, device: str) -> Iterator[None]:
    """Add the seconds spent in the fused kernel's parts to ``spent`` while inside."""
    wrapped = _PARTS[_kernel(device)]
    originals = {key: getattr(*key) for key in wrapped}

    def timed(fn: Callable, label: str) -> Callable:
        def run(*args, **kwargs):
            sync()  # CUDA launches kernels without waiting: time each part to its end
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                spent[label] += time.perf_counter() - start
                spent[label + " calls"] += 1

        return run

    for (module, name), label in wrapped.items():
        setattr(module, name, timed(originals[(module, name)], label))
    try:
        yield
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


def _split(fn: Callable[[], None], device: str, unit: str = "s", scale: float = 1.0) -> str:
    """Where one call of ``fn`` spends its time (queries are rotated inside the fused call:
    the rest of the time is their rotation, the model's other layers and bookkeeping)."""
    spent: collections.Counter = collections.Counter()
    with torch.no_grad(), _timing(spent, device):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        total = time.perf_counter() - start
    t = {k: v * scale for k, v in spent.items() if not k.endswith("calls")}
    return (
        f"split of {total * scale:.2f} {unit}: kernel {t['kernel']:.2f} {unit} "
        f"({spent['kernel calls']} calls), key rotation {t['rotation']:.2f} {unit}, merge "
        f"{t['merge']:.2f} {unit}, planning {t['plan']:.3f} {unit}"
    )


def _forward(model: Decoder, ids: torch.Tensor) -> Callable[[], None]:
    def fn() -> None:
        with torch.no_grad():
            model(ids)

    return fn


def _decode(model: Decoder, ids: torch.Tensor) -> Callable[[], None]:
    """One token after a prefill of ids; the cache is cropped back after each step."""
    cache = KVCache()
    with torch.no_grad():
        model(ids[:, :-1], cache=cache)
    prefix = len(cache)

    def fn() -> None:
        with torch.no_grad():
            model(ids[:, -1:], cache=cache)
        cache.crop(prefix)

    return fn


def _train(model: Decoder, ids: torch.Tensor) -> Callable[[], None]:
    def fn() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    return fn


def _label(spec: str) -> str:
    """A method's name in the rows: the remap, and "leaky" for Leaky ReRoPE."""
    return f"{spec.split(':')[0]}{' leaky' if 'leaky' in spec else ''}"


def run(device: str = "cpu", length: int = LENGTH) -> list[Result]:
    ids = torch.randint(0, 256, (1, length), device=device)
    step_ids = torch.randint(0, 256, (1, length + 1), device=device)
    train_ids = torch.randint(0, 256, (1, TRAIN_LENGTH), device=device)
    results = _rows(device, length, ids, step_ids, train_ids)
    if device == "cuda":  # launches weigh most in the small decoder there: add a larger shape
        results += [*_shaped_rows(device, ids), _floor_row(device, length)]
    return results


def _floor_row(device: str, length: int) -> Result:
    """One band that covers every key (plain causal attention as a remap) through the fused
    kernel, against PyTorch's causal attention, in SmolLM2-135M's attention shape: what the
    banded path costs before any band boundary (its planning, kernel and merge on one band)."""
    g = torch.Generator(device).manual_seed(0)
    q = torch.randn(1, 9, length, 64, device=device, generator=g)
    k, v = (torch.randn(1, 3, length, 64, device=device, generator=g) for _ in range(2))
    positions = torch.arange(length, device=device)[None]
    band = bands.Band(positions, positions)

    def banded() -> None:
        with torch.no_grad():
            bands.banded_attention(q, k, v, [band], positions, lambda x, p, query: x,
                                   causal_offset=0)  # fmt: skip

    def plain() -> None:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1),
                                           v.repeat_interleave(3, 1), is_causal=True)  # fmt: skip

    times = compare({"banded": banded, "plain": plain}, repeats=5)
    return Result(
        f"time one band vs causal attention at {length}, SmolLM2-135M's attention shape",
        times["banded"] / times["plain"],
        None,
        f"1 x {length}, 9 heads and 3 kv heads of 64, no grad, no rotation, {_where(device)}: "
        f"{times['banded'] * 1e3:.1f} ms vs {times['plain'] * 1e3:.1f} ms (SDPA, kv heads "
        "repeated): the kernel's own cost against plain attention's",
    )


def _shaped_rows(device: str, ids: torch.Tensor) -> list[Result]:
    """Each remap's forward at 2x against RoPE's on SmolLM2-135M's shape."""
    length, ratio = ids.shape[1], 2
    models = {}
    for spec in ("rope", *METHODS):
        torch.manual_seed(0)
        config = DecoderConfig(encoding=spec, context_length=length // ratio, **SMOLLM2_SHAPE)
        models[spec] = Decoder(config).to(device).eval()
    forward = compare({s: _forward(m, ids) for s, m in models.items()}, repeats=3)
    return [
        Result(
            f"time forward {_label(spec)} vs rope at {length}, {ratio}x, SmolLM2-135M's shape",
            forward[spec] / forward["rope"],
            DCA_FORWARD if spec == "dca" else TARGETS["forward"],
            f"random weights in SmolLM2-135M's shape (d576, 9 heads and 3 kv heads of 64, 30 "
            f"layers), trained length {length // ratio}, 1 x {length}, no grad, "
            f"{_where(device)}: {forward[spec] * 1e3:.1f} ms vs "
            f"{forward['rope'] * 1e3:.1f} ms",
        )
        for spec in METHODS
    ]


def _rows(
    device: str, length: int, ids: torch.Tensor, step_ids: torch.Tensor, train_ids: torch.Tensor
) -> list[Result]:
    """Every remap's forward, memory, decode and train rows at each ratio (module docstring)."""
    results = []
    for ratio in RATIOS:
        context = length // ratio
        models = {spec: _model(spec, context, device).eval() for spec in ("rope", *METHODS)}
        live = {s: [*m.parameters(), *m.buffers()] for s, m in models.items()}
        peaks = {s: peak_memory(_forward(m, ids), device, live[s]) for s, m in models.items()}
        forward = compare({s: _forward(m, ids) for s, m in models.items()}, repeats=3)
        decode = compare({s: _decode(m, step_ids) for s, m in models.items()}, repeats=15)
        trains = {s: _model(s, TRAIN_LENGTH // ratio, device).train() for s in models}
        train = compare({s: _train(m, train_ids) for s, m in trains.items()}, repeats=3)
        for spec in METHODS:
            name = _label(spec)
            enc = models[spec].encoding.spec
            where = f"decoder d64 x2, {ratio}x (trained length {context}), {_where(device)}"
            split = _split(_forward(models[spec], ids), device)
            step_split = _split(_decode(models[spec], step_ids), device, "ms", 1e3)
            forward_target = DCA_FORWARD if spec == "dca" else TARGETS["forward"]
            results += [
                Result(
                    f"time forward {name} vs rope at {length}, {ratio}x",
                    forward[spec] / forward["rope"],
                    forward_target,
                    f"{where}, 1 x {length}, no grad, {enc}: {forward[spec]:.2f} s vs "
                    f"{forward['rope']:.2f} s; {split}",
                ),
                Result(
                    f"peak memory forward {name} vs rope at {length}, {ratio}x",
                    peaks[spec] / peaks["rope"],
                    TARGETS["memory"],
                    f"{where}: {mib(peaks[spec])} vs {mib(peaks['rope'])}",
                ),
                Result(
                    f"time decode step {name} vs rope, {length} cached, {ratio}x",
                    decode[spec] / decode["rope"],
                    TARGETS["decode"],
                    f"{where}, one token after {length} (rotated keys kept by the cache): "
                    f"{decode[spec] * 1e3:.2f} ms vs {decode['rope'] * 1e3:.2f} ms; "
                    f"{step_split}",
                ),
                Result(
                    f"time train step {name} vs rope at {TRAIN_LENGTH}, {ratio}x",
                    train[spec] / train["rope"],
                    TARGETS["train"],
                    f"decoder d64 x2, trained length {TRAIN_LENGTH // ratio}, 1 x "
                    f"{TRAIN_LENGTH}, forward + backward, every weight: {train[spec]:.2f} s vs "
                    f"{train['rope']:.2f} s",
                ),
            ]
        if ratio == 4:
            results += _reference_rows(models, ids, forward, length)
    return results


def _reference_rows(models: dict[str, Decoder], ids: torch.Tensor, forward: dict, length: int):
    """The reference kernel's forward at 4x, for comparison (one timed run each)."""

    def reference(model: Decoder) -> Callable[[], None]:
        def fn() -> None:
            original = bands_fused.supported
            bands_fused.supported = lambda q, key_positions: "benchmark: the reference kernel"
            bands._FALLBACKS.add("benchmark: the reference kernel")  # no warning for this
            try:
                with torch.no_grad():
                    model(ids)
            finally:
                bands_fused.supported = original

        return fn

    times = compare({s: reference(models[s]) for s in METHODS}, repeats=1, warmup=0)
    return [
        Result(
            f"time forward {_label(spec)} reference kernel vs rope at {length}, 4x",
            times[spec] / forward["rope"],
            None,
            f"the eager block-by-block kernel (the oracle): {times[spec]:.2f} s vs rope "
            f"{forward['rope']:.2f} s (rope timed in the forward rows' rounds)",
        )
        for spec in METHODS
    ]
