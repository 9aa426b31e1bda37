"""Training steps of the reference decoder (forward + backward + AdamW), side by side:

- AdaRoPE vs RoPE, every parameter training (pretraining a model with either encoding);
- positional-only extension (backbone frozen, only AdaRoPE's parameters train:
  ``select_trainable(model, "positional")``) vs full fine-tuning of the same model: time and
  peak memory, at 4 x 512 tokens (2x the decoder's context) and 1 x 2048 (8x);
- AdaRoPE's rotation recomputing cos/sin in backward (``rotate_angles``) vs the stored-table
  version, positional-only at long context: peak memory and time.

Peak memory: ``common.peak_memory`` (CUDA: max_memory_allocated; CPU: the profiler's record
of every torch allocation), counting parameters and optimizer state that exist before the
step, gradients from zero.
"""

from __future__ import annotations

import copy

import torch

from ropekit.model import Decoder, DecoderConfig
from ropekit.train.extend import select_trainable

from .common import Result, compare, mib, peak_memory, tensor_bytes


def _step(model: Decoder, opt: torch.optim.Optimizer, ids: torch.Tensor):
    def step():
        opt.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        opt.step()

    return step


def _trained(model: Decoder, ids: torch.Tensor) -> tuple[torch.optim.Optimizer, object]:
    """An AdamW over what requires grad, with its state made by one step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    step = _step(model, opt, ids)
    step()
    opt.zero_grad(set_to_none=True)
    return opt, step


def _live(model: Decoder, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [*model.parameters(), *model.buffers(), *state]


def _model(encoding: str, device: str, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(DecoderConfig(encoding=encoding)).to(device)


def adarope_vs_rope(device: str, batch: int = 8, length: int = 256) -> Result:
    ids = torch.randint(0, 256, (batch, length), device=device)
    runs = {}
    for spec in ("rope", "adarope"):
        model = _model(spec, device)
        runs[spec] = _trained(model, ids)[1]
    t = compare(runs, repeats=11)
    note = (
        f"default 1.8M decoder, batch {batch} x {length}, every parameter training: "
        f"{t['adarope'] * 1e3:.0f} ms vs {t['rope'] * 1e3:.0f} ms per step"
    )
    return Result("adarope vs rope: decoder training step", t["adarope"] / t["rope"], 1.10, note)


def positional_vs_full(device: str, batch: int, length: int) -> list[Result]:
    ids = torch.randint(0, 256, (batch, length), device=device)
    base = _model("adarope", device)
    full = copy.deepcopy(base)
    positional = copy.deepcopy(base)
    counts = select_trainable(positional, "positional")
    opt_full, step_full = _trained(full, ids)
    opt_pos, step_pos = _trained(positional, ids)
    t = compare({"full": step_full, "positional": step_pos}, repeats=7)
    shape = f"{batch} x {length}"
    ratio = t["positional"] / t["full"]
    why = ""
    if ratio > 0.8:
        why = (
            "; missed: freezing the backbone skips only the weight-gradient matmuls (a third of "
            "the matmul work) and AdamW; attention's backward, norms, activations and the loss "
            "run in full in both modes (the frequencies of every layer need gradients through "
            "all layers above), and in a 192-wide model those are a large share of a step"
        )
        if length > 1024:
            why += ", the more so at this length, where causal attention grows as T^2"
    results = [
        Result(
            f"positional-only vs full fine-tuning step: time, {shape}",
            ratio,
            0.8,
            f"AdaRoPE decoder (1.8M), {counts['positional']:,} trainable parameters vs all: "
            f"{t['positional'] * 1e3:.0f} ms vs {t['full'] * 1e3:.0f} ms{why}",
        )
    ]
    mem_full = peak_memory(step_full, device, _live(full, opt_full))
    mem_pos = peak_memory(step_pos, device, _live(positional, opt_pos))
    state_full = tensor_bytes(_live(full, opt_full)) - tensor_bytes(full.parameters())
    results.append(
        Result(
            f"positional-only vs full fine-tuning step: peak memory, {shape}",
            mem_pos / mem_full,
            0.7,
            f"{mib(mem_pos)} vs {mib(mem_full)}: parameters + optimizer state ({mib(state_full)} "
            "of AdamW state in full) + peak of the step's torch allocations",
        )
    )
    return results


def recompute_vs_stored(device: str, length: int = 8192, time_length: int = 2048) -> list[Result]:
    """AdaRoPE's per-layer tables recomputed in backward vs stored, positional-only."""
    model = _model("adarope", device)
    select_trainable(model, "positional")
    ids = torch.randint(0, 256, (1, length), device=device)
    opt, step = _trained(model, ids)

    def mode(stored: bool):
        def run():
            model.encoding.stored_tables = stored
            try:
                step()
            finally:
                model.encoding.stored_tables = False

        return run

    live = _live(model, opt)
    mem_stored = peak_memory(mode(True), device, live)
    mem_new = peak_memory(mode(False), device, live)
    results = [
        Result(
            f"adarope recomputed vs stored tables: positional-only peak memory at {length}",
            mem_new / mem_stored,
            None,
            f"1.8M decoder, one {length}-token sample: {mib(mem_new)} vs {mib(mem_stored)} "
            "(stored: float64 angles + float32 cos/sin kept per layer for q and k, plus the "
            "unrotated q and k)",
        )
    ]
    short = torch.randint(0, 256, (1, time_length), device=device)
    step = _step(model, opt, short)

    def timed(stored: bool):
        def run():
            model.encoding.stored_tables = stored
            try:
                step()
            finally:
                model.encoding.stored_tables = False

        return run

    t = compare({"stored": timed(True), "recomputed": timed(False)}, repeats=5)
    results.append(
        Result(
            f"adarope recomputed vs stored tables: positional-only step time at {time_length}",
            t["recomputed"] / t["stored"],
            None,
            f"{t['recomputed'] * 1e3:.0f} ms vs {t['stored'] * 1e3:.0f} ms (recompute forms "
            "cos/sin twice more per layer, in backward)",
        )
    )
    return results


def run(device: str = "cpu") -> list[Result]:
    return [
        adarope_vs_rope(device),
        *positional_vs_full(device, batch=4, length=512),
        *positional_vs_full(device, batch=1, length=2048),
        *recompute_vs_stored(device),
    ]
