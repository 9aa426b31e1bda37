"""The vLLM plugin's decoding step for one layer (``paged_attention._decoding_step``) against
a fused formulation of it (issue 61, must 1), without vLLM: paired rounds of alternating order
(``common.paired``), one thread.

Shapes: SmolLM2-135M's attention (9 query heads, 3 kv heads, head dim 64, rope base 1e5,
trained length 8192), vLLM's CPU cache blocks of 128 tokens, float32; one decoded token after
9216 and 16384 keys held rotated (``rotate_for_cache``) in consecutive blocks, as vLLM hands
out a lone request's blocks, for Leaky ReRoPE, Self-Extend and DCA (benchmarks/serving.py's
specs).

The fused candidate (``fused_decoding_step``): the same bands, pieces and rotations, but each
band piece is one call of PyTorch's CPU flash-attention op
(``_scaled_dot_product_flash_attention_for_cpu``) with the cache's blocks as its batch (the
band's query expanded over them, stride 0: the g query heads of a kv head as g query rows,
which share its keys; keys and values as views of the cache, no copy), and the pieces merged
exactly by their log-sum-exp: out = sum_p exp(lse_p - LSE) out_p, LSE = logsumexp_p(lse_p)
(FlashAttention's merge, Dao et al. 2022, sec. 3.1). It reads each key and value once, as the
shipped step does, and takes a strided, stride-0 query and views of the cache without copying,
but was not faster: 1.11-1.17x the shipped step's time (2026-12-06 17:24 UTC, load 2.7), its
kernel running the same small products per (block, kv head) tile (3 query rows over 128 keys)
as the shipped step's batched products, one tile at a time, and those products are 72-83% of
the shipped step (``split``). So the shipped step stays; this module keeps the candidate to
re-check on another CPU.

Run: ``PYTHONPATH=src python -m benchmarks.paged_decoding [--rounds 21]``: prints each case's
paired ratio (fused / shipped, median and quartiles of the rounds' ratios), both medians, and
where the shipped step's time goes (``split``: shares of the profiled op time; the profiler
adds a few microseconds to every op, so the small ones' share reads high).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ropekit.encodings import build
from ropekit.serve import paged_attention
from ropekit.serve.paged_attention import held_band, rotate_for_cache, write_paged

from .common import paired

SPECS = ("rerope:leaky=2.1", "self-extend", "dca")  # benchmarks/serving.py's remaps
LENGTHS = (9216, 16384)
# SmolLM2-135M's attention and vLLM's CPU cache block.
SHAPE = {"n_heads": 9, "n_kv_heads": 3, "head_dim": 64, "block": 128, "base": 1e5,
         "original_length": 8192}  # fmt: skip
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def fused_decoding_step(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    blocks: Tensor,
    length: int,
    bands: Sequence[Any],
    k_pos: Tensor,
    held: Tensor,
    rotate: Any,
    scale: float,
) -> Tensor:
    """``_decoding_step`` (same arguments, same result (1, H, 1, D)) with each band piece on
    the flash-attention op and the pieces merged by log-sum-exp (module docstring)."""
    _, K, b, D = key_cache.shape
    H = q.shape[1]
    g = H // K
    layout = paged_attention._decoding_layout(bands, k_pos, held, b, scale)
    ids = paged_attention._block_ids(blocks, -(-length // b))
    keys = paged_attention._blocks(key_cache, ids)  # (n', K, b, D)
    values = paged_attention._blocks(value_cache, ids)
    queries = rotate(q.expand(len(bands), H, 1, D) * layout.q_factors.to(q.dtype),
                     layout.q_positions, True)  # (n_bands, H, 1, D)  # fmt: skip
    outs, lses = [], []
    for query, part in zip(queries.view(-1, K, g, D), layout.keys, strict=True):
        if part is None:
            continue
        source = keys[part.lo : part.hi]  # (m, K, b, D): views of the cache
        if part.turn is not None:
            source = rotate(source, part.turn, False)
        for lo, hi, r0, r1 in part.pieces:
            # (m, K, g, D) over (m, K, r, D): the blocks as the batch, each kv head's g rows
            out, lse = _flash(
                query.expand(hi - lo, K, g, D), source[lo - part.lo : hi - part.lo, :, r0:r1],
                values[lo:hi, :, r0:r1], scale=1.0,
            )  # fmt: skip
            outs.append(out)  # (m, K, g, D)
            lses.append(lse)  # (m, K, g)
    lse = torch.cat(lses)
    weights = (lse - lse.logsumexp(0)).exp_()  # each piece's share of the row's softmax
    out = (torch.cat(outs) * weights[..., None].to(q.dtype)).sum(0)  # (K, g, D)
    return out.reshape(1, H, 1, D)


def case(
    spec: str, length: int, dtype: torch.dtype = torch.float32, shape: dict | None = None
) -> Callable[[Callable[..., Tensor]], Tensor]:
    """One layer's decoding step after ``length`` keys (module docstring): a function that
    runs a step function (``_decoding_step``'s arguments) on it and returns its output."""
    shape = shape or SHAPE
    H, K, D, b = shape["n_heads"], shape["n_kv_heads"], shape["head_dim"], shape["block"]
    encoding = build(spec, n_heads=H, n_kv_heads=K, head_dim=D, base=shape["base"],
                     original_length=shape["original_length"])  # fmt: skip
    g = torch.Generator().manual_seed(0)
    n_blocks = -(-length // b) + 1
    key_cache = torch.randn(n_blocks, K, b, D, generator=g, dtype=dtype)
    value_cache = torch.randn(n_blocks, K, b, D, generator=g, dtype=dtype)
    k_pos = torch.arange(length)[None]  # (1, S)
    keys = torch.randn(1, K, length, D, generator=g, dtype=dtype)
    held_keys = rotate_for_cache(encoding, keys, k_pos, 0)[0].transpose(0, 1)  # (S, K, D)
    values = torch.randn(length, K, D, generator=g, dtype=dtype)
    write_paged(key_cache, value_cache, held_keys, values, k_pos[0])  # slots 0 .. S - 1
    q = torch.randn(1, H, 1, D, generator=g, dtype=dtype)
    bands = encoding.bands(k_pos[:, -1:], k_pos, 0)
    held = bands[held_band(bands)].k_positions
    rotate = functools.partial(encoding.rotate_band, layer=0)
    blocks = torch.arange(n_blocks)
    args = (q, key_cache, value_cache, blocks, length, bands, k_pos, held, rotate, D**-0.5)
    return lambda step: step(*args)


# Where the shipped step's time goes: torch's profiler's self CPU time of each op, in groups.
_PARTS = {
    "products": ("aten::bmm",),  # the batched products of queries and keys, weights and values
    "rotation": ("_Rotate", "aten::mul", "aten::addcmul_"),  # every band's query, turned keys
    "softmax": ("aten::amax", "aten::sub_", "aten::exp_", "aten::sum", "aten::fill_"),
}


def split(on: Callable[[Callable[..., Tensor]], Tensor], steps: int = 20) -> dict[str, float]:
    """Each part's share of the shipped step's profiled op time (``_PARTS``; "rest": every
    other op: views, copies, the tail block, the division)."""
    from torch.profiler import ProfilerActivity, profile

    on(paged_attention._decoding_step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            on(paged_attention._decoding_step)
    times = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(times.values())
    shares = {part: sum(times.get(op, 0.0) for op in ops) / total for part, ops in _PARTS.items()}
    return {**shares, "rest": 1 - sum(shares.values())}


def run(rounds: int) -> list[dict]:
    """Each case's paired ratio, fused / shipped (module docstring), and the shipped step's
    split (``split``)."""
    rows = []
    for spec in SPECS:
        for length in LENGTHS:
            on = case(spec, length)
            result = paired(
                lambda on=on: on(fused_decoding_step),
                lambda on=on: on(paged_attention._decoding_step),
                repeats=rounds,
            )  # fmt: skip
            rows.append({"spec": spec, "keys": length, "ratio": result.ratio,
                         "quartiles": result.quartiles, "fused_ms": 1e3 * result.a,
                         "shipped_ms": 1e3 * result.b, "split": split(on)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.paged_decoding", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=21, help="paired rounds (default 21)")
    args = parser.parse_args(argv)
    if args.rounds < 4:
        parser.error(f"--rounds {args.rounds}: at least 4 (quartiles of the rounds' ratios)")
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{when}, one thread, load {load:.2f} (1 min) at the start")
    parts = [*_PARTS, "rest"]
    print("| remap | keys | fused / shipped [quartiles] | fused ms | shipped ms | "
          + " | ".join(f"shipped: {p}" for p in parts) + " |")  # fmt: skip
    print("|---" * (5 + len(parts)) + "|")
    for r in run(args.rounds):
        q1, q3 = r["quartiles"]
        shares = " | ".join(f"{r['split'][p]:.0%}" for p in parts)
        print(f"| {r['spec']} | {r['keys']} | {r['ratio']:.3f} [{q1:.3f}, {q3:.3f}] | "
              f"{r['fused_ms']:.2f} | {r['shipped_ms']:.2f} | {shares} |")  # fmt: skip
    print(f"load {os.getloadavg()[0]:.2f} (1 min) at the end")


if __name__ == "__main__":
    main()
