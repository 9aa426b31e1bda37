"""The vLLM plugin's decoding step for one layer: the compiled pass
(``paged_attention._decoding_step``, ``serve.paged_kernels``) against the torch
step (``_torch_decoding_step``, what runs where numba does not), without vLLM (issue 61, must
1): paired rounds of alternating order (``common.paired``), one thread.

Shapes: SmolLM2-135M's attention (9 query heads, 3 kv heads, head dim 64, rope base 1e5,
trained length 8192), vLLM's CPU cache blocks of 128 tokens, float32; one decoded token after
9216 and 16384 keys held rotated (``rotate_for_cache``) in consecutive blocks, as vLLM hands
out a lone request's blocks, for Leaky ReRoPE, Self-Extend and DCA (benchmarks/serving.py's
specs). One warm layer: the keys and values come from the CPU's caches where they fit
(``benchmarks/vllm_decoding.py`` reads 30 layers' caches from memory, as the model does, and
times both against vLLM's own kernel).

A third formulation was measured with this module on 2026-12-06 and dropped: each band piece
as one call of PyTorch's CPU flash-attention op, merged by log-sum-exp, took 1.11-1.17x the
torch step (its kernel runs the same small products per block and kv head).

Run: ``PYTHONPATH=src python -m benchmarks.paged_decoding [--rounds 21]``: each case's
paired ratio (compiled / torch, median and quartiles of the rounds' ratios) and both medians.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
from collections.abc import Callable

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


def case(
    spec: str, length: int, dtype: torch.dtype = torch.float32, shape: dict | None = None
) -> dict[str, Callable[[], Tensor]]:
    """One layer's decoding step after ``length`` keys (module docstring): each step (compiled,
    torch) as a function of nothing that returns its output (1, H, 1, D)."""
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
    common = (q, key_cache, value_cache, blocks, length, bands, k_pos, held)
    if paged_attention._kernel_arrays(q, key_cache, value_cache, blocks, encoding) is None:
        raise RuntimeError("the compiled step does not run here (is numba installed?)")
    return {
        "compiled": lambda: paged_attention._decoding_step(*common, encoding, 0, D**-0.5),
        "torch": lambda: paged_attention._torch_decoding_step(*common, rotate, D**-0.5),
    }


def run(rounds: int) -> list[dict]:
    """Each case's paired ratio, compiled / torch (module docstring)."""
    rows = []
    for spec in SPECS:
        for length in LENGTHS:
            steps = case(spec, length)
            result = paired(steps["compiled"], steps["torch"], repeats=rounds)
            rows.append({"spec": spec, "keys": length, "ratio": result.ratio,
                         "quartiles": result.quartiles, "compiled_ms": 1e3 * result.a,
                         "torch_ms": 1e3 * result.b})  # fmt: skip
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
    print("| remap | keys | compiled / torch [quartiles] | compiled ms | torch ms |")
    print("|---|---|---|---|---|")
    for r in run(args.rounds):
        q1, q3 = r["quartiles"]
        print(f"| {r['spec']} | {r['keys']} | {r['ratio']:.3f} [{q1:.3f}, {q3:.3f}] | "
              f"{r['compiled_ms']:.2f} | {r['torch_ms']:.2f} |")  # fmt: skip
    print(f"load {os.getloadavg()[0]:.2f} (1 min) at the end")


if __name__ == "__main__":
    main()
