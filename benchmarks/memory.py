"""Peak memory of a forward pass vs sequence length for rope, alibi and adarope: the default
1.8M reference decoder, one sequence, no autograd (evaluation / prefill).

Attention itself needs O(T) memory here (PyTorch's fused CPU/CUDA kernels with a causal
flag); what this shows is whether an encoding adds a length x length buffer. ALiBi's bias runs
in blocks of query rows (``Attention._attend_in_row_blocks``), each no larger than q.
"""

from __future__ import annotations

import torch

from ropekit.model import Decoder, DecoderConfig

from .common import Result, mib, peak_memory

ENCODINGS = ("rope", "alibi", "adarope")


def run(device: str = "cpu", lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)) -> list[Result]:
    models = {}
    for spec in ENCODINGS:
        torch.manual_seed(0)
        models[spec] = Decoder(DecoderConfig(encoding=spec)).to(device).eval()
    results = []
    for T in lengths:
        ids = torch.randint(0, 256, (1, T), device=device)
        peaks = {}
        for spec, model in models.items():

            def forward(model=model, ids=ids):
                with torch.no_grad():
                    model(ids)

            peaks[spec] = peak_memory(forward, device, [*model.parameters(), *model.buffers()])
        note = ", ".join(f"{s} {mib(peaks[s])}" for s in ENCODINGS)
        for spec in ("alibi", "adarope"):
            target = 1.2 if spec == "alibi" and T == 8192 else None
            results.append(
                Result(
                    f"peak memory forward {spec} vs rope at {T}",
                    peaks[spec] / peaks["rope"],
                    target,
                    f"1.8M decoder, 1 x {T}, no grad: {note}",
                )
            )
    return results
