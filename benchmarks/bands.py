"""Distance remaps at 16k: peak memory and time of one forward against plain RoPE's, side by
side in one run, on a small reference decoder (d_model 64, 4 heads of 16, 2 layers, trained
length 4096 so every method's defaults apply: ReRoPE w = 512 (leaky k = 16), Self-Extend
G = 8, W = 1024, DCA chunk_size 3072 / local_size 256, STRING S = 1351, W = 128), one
sequence, no autograd (evaluation / prefill).

The remaps attend in bands (``ropekit.encodings.bands``): blocks of query rows whose logits
never exceed the larger of ``BLOCK_ENTRIES`` and the queries' own entries, keys rotated once
per distinct band positions, so the target is memory within 1.3x of plain RoPE's forward
(whose attention is PyTorch's fused kernel). The mixed window is a schedule (one band),
measured for completeness. A small model is the hard case for the memory ratio: the block
buffers shrink more slowly than everything else.
"""

from __future__ import annotations

import torch

from ropekit.model import Decoder, DecoderConfig

from .common import Result, compare, mib, peak_memory

LENGTH = 16384
METHODS = (
    "rerope:leaky=16",
    "self-extend",
    "dca",
    "string",
    "mixed:method=yarn,factor=4",
)


def _model(spec: str, device: str) -> Decoder:
    torch.manual_seed(0)
    config = DecoderConfig(encoding=spec, d_model=64, n_heads=4, n_layers=2, context_length=4096)
    return Decoder(config).to(device).eval()


def run(device: str = "cpu", length: int = LENGTH) -> list[Result]:
    ids = torch.randint(0, 256, (1, length), device=device)
    models = {spec: _model(spec, device) for spec in ("rope", *METHODS)}

    def forward(model: Decoder):
        def fn():
            with torch.no_grad():
                model(ids)

        return fn

    peaks = {
        spec: peak_memory(forward(model), device, [*model.parameters(), *model.buffers()])
        for spec, model in models.items()
    }
    times = compare({spec: forward(model) for spec, model in models.items()}, repeats=3)
    results = []
    for spec in METHODS:
        note = (
            f"decoder d64 x2 layers, 1 x {length}, no grad: {models[spec].encoding.spec} "
            f"{mib(peaks[spec])}, rope {mib(peaks['rope'])}; {times[spec]:.1f} s vs "
            f"{times['rope']:.1f} s"
        )
        name = spec.split(":")[0]
        results.append(
            Result(
                f"peak memory forward {name} vs rope at {length}",
                peaks[spec] / peaks["rope"],
                1.3,
                note,
            )
        )
        results.append(
            Result(
                f"time forward {name} vs rope at {length}", times[spec] / times["rope"], None, note
            )
        )
    return results
