"""The vLLM plugin's decoding step for one layer against stock vLLM's decoding kernel, run in
vLLM's environment (issue 61, must 1): paired rounds of alternating order
(``common.paired``), one thread.

Shapes: SmolLM2-135M's attention (9 query heads, 3 kv heads, head dim 64, rope base 1e5,
trained length 8192), vLLM's CPU cache blocks of 128 tokens in one (P, K, b, 2 D) tensor as
vLLM allocates it, float32; one decoded token after 9216 and 16384 keys for Leaky ReRoPE,
Self-Extend and DCA (benchmarks/serving.py's specs), through 30 layers (``--layers``), each
with its own cache, as in the model: a layer's keys and values (14-25 MB) are read from
memory, not from the caches of the CPU, which the other layers' have filled since. Two steps
over the same keys and values:

- stock: vLLM's own kernel (``cpu_attention_with_kv_cache``, "vec" ISA) over every key, the
  keys written by vLLM's own cache write (``cpu_attn_reshape_and_cache``), what stock vLLM
  runs for a plain schedule;
- plugin: the plugin's step (``paged_attention.paged_banded_attention``: the remap's bands in
  torch, keys held rotated as its far band reads them, written by ``write_paged``).

Their outputs differ (stock reads every key as the far band holds it); the work is the same:
each key and value read once.

It times attention alone: what separates the engines beside it (the rotary, the cache write,
the plugin's Python per layer) is in benchmarks/serving.py's profile. A variant that hands the
far band's whole blocks to vLLM's kernel, the other keys entering its one call as rows that
stand for their softmax, was measured with this module and was slower (docs/serving/index.md).

Run: ``PYTHONPATH=src:. .venv-serving/vllm/bin/python -m benchmarks.vllm_decoding [--rounds
9] [--layers 30]``: each case's plugin / stock (median and quartiles of the rounds' ratios) and the
medians in ms.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
from collections.abc import Callable
from unittest import mock

import torch

from ropekit.encodings import build
from ropekit.serve import paged_attention, vllm_plugin

from .common import timed_rounds
from .paged_decoding import LENGTHS, SHAPE, SPECS


def steps(spec: str, length: int, layers: int = 30) -> dict[str, Callable[[], object]]:
    """The two steps (module docstring) over the same held keys, values and query, each
    through ``layers`` layers' caches."""
    from vllm import _custom_ops as ops

    H, K, D, b = SHAPE["n_heads"], SHAPE["n_kv_heads"], SHAPE["head_dim"], SHAPE["block"]
    encoding = build(spec, n_heads=H, n_kv_heads=K, head_dim=D, base=SHAPE["base"],
                     original_length=SHAPE["original_length"])  # fmt: skip
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(length)[None]
    keys = torch.randn(1, K, length, D, generator=g)
    held = paged_attention.rotate_for_cache(encoding, keys, pos, 0)[0].transpose(0, 1)
    values = torch.randn(length, K, D, generator=g)
    q = torch.randn(1, H, D, generator=g)
    n_blocks = length // b + 2
    table = torch.arange(n_blocks)[None]
    slots = pos[0]
    plugin_caches, stock_caches = [], []
    for _ in range(layers):
        plugin_caches.append(vllm_plugin._split_cache(torch.zeros(n_blocks, K, b, 2 * D)))
        paged_attention.write_paged(*plugin_caches[-1], held, values, slots)
        stock_caches.append(vllm_plugin._split_cache(torch.zeros(n_blocks, K, b, 2 * D)))
        ops.cpu_attn_reshape_and_cache(held, values, *stock_caches[-1], slots, "vec")
    plan = paged_attention.steps(torch.tensor([0, 1]), torch.tensor([length]), 1)
    positions = paged_attention.StepPositions()

    def plugin() -> None:
        for cache in plugin_caches:
            paged_attention.paged_banded_attention(
                q, *cache, table, plan, encoding, 0, D**-0.5, torch.empty(1, H, D),
                positions=positions, keys_held=True,
            )  # fmt: skip

    seq = torch.tensor([length], dtype=torch.int32)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=H, num_kv_heads=K, head_dim=D, seq_lens=seq, dtype=torch.float32,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec",
        enable_kv_split=True,
    )  # fmt: skip
    table32, stock_out = table.to(torch.int32), torch.empty(1, H, D)

    def stock() -> None:
        for keys, values in stock_caches:
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=keys, value_cache=values, output=stock_out,
                query_start_loc=starts, seq_lens=seq, scale=D**-0.5, causal=True,
                alibi_slopes=None, sliding_window=-1, block_table=table32, softcap=0.0,
                scheduler_metadata=metadata, s_aux=None,
            )  # fmt: skip

    def plugin_torch() -> None:  # the same, through the torch step
        with mock.patch.object(paged_attention, "_kernel_arrays", lambda *_: None):
            plugin()

    return {"stock": stock, "plugin": plugin, "plugin (torch step)": plugin_torch}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm_decoding", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=9, help="paired rounds (default 9)")
    parser.add_argument("--layers", type=int, default=30,
                        help="layers, each with its own cache (default 30, SmolLM2's)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds < 4:
        parser.error(f"--rounds {args.rounds}: at least 4 (quartiles of the rounds' ratios)")
    if args.layers < 1:
        parser.error(f"--layers {args.layers}: at least 1 (each with its own cache)")
    torch.set_num_threads(1)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{when}, one thread, load {os.getloadavg()[0]:.2f} (1 min) at the start")
    print(f"{args.layers} layers; ms per decoded token's attention")
    print("| remap | keys | step | stock ms | plugin ms | plugin / stock [quartiles] |")
    print("|---|---|---|---|---|---|")
    for spec in SPECS:
        for length in LENGTHS:
            times = timed_rounds(steps(spec, length, args.layers), args.rounds)
            stock = times.pop("stock")
            for name, plugin in times.items():
                ratios = [a / b for a, b in zip(plugin, stock, strict=True)]
                q1, _, q3 = statistics.quantiles(ratios, n=4)
                print(f"| {spec} | {length} | {name} | {1e3 * statistics.median(stock):.2f} | "
                      f"{1e3 * statistics.median(plugin):.2f} | {statistics.median(ratios):.2f} "
                      f"[{q1:.2f}, {q3:.2f}] |", flush=True)  # fmt: skip
    print(f"load {os.getloadavg()[0]:.2f} (1 min) at the end")


if __name__ == "__main__":
    main()
