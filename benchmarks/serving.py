"""The vLLM plugin's speed against stock vLLM, side by side (issue 61, must 1).

One run: stock vLLM serving SmolLM2-135M's YaRN x2 export (what a user serves without
ropekit's plugin) and ropekit's plugin serving Leaky ReRoPE, Self-Extend and DCA
(``export --format vllm``), each in vLLM's environment (``tests/serve/engines/run_vllm.py
--bench``) with one thread and the same binding (``VLLM_CPU_OMP_THREADS_BIND``, default
``nobind``: the scheduler places each on either core), one engine after another (``--at-once
1``, the default: no engine shares the machine with another, whose memory traffic would slow
the one that reads more) or several at once, on the held-out plays' first 9216 and 16367
tokens (16367 + 1 + 16 tokens fill the 16384-token context every export accepts). Each prompt
is one request stepped through vLLM's engine with its prefix cache emptied: its prefill (until
its first token) and the median of its 16 decoding steps, timed in CPU seconds of the engine's
process (the engine runs in it) and in wall seconds; the 9216-token request then makes 4 more
tokens under torch's profiler, each op's self time per step (where the time goes: stock's
attention op against the plugin's batched products ``bmm``, rotation ``_Rotate``, copies and
its Python ``unified_attention_with_output``). The machine is shared with other jobs: wall
time follows their load, CPU time much less; ratios are of CPU time within one run. float32,
eager mode, vLLM's CPU backend with chunks of 4096 tokens and prefix caching, as stock serves;
DCA (its scale follows the attended length) with each prompt in one step, as the plugin
requires (``vllm_plugin.check_scheduling``).

Run (after ``make serving-setup``; about 40 minutes one engine at a time beside one busy core):

    .venv-serving/driver/bin/python -m benchmarks.serving [--at-once 1] [--out ...]

Writes the ``speed`` record of the remap record (its parity rows, from ``make test-serving``,
are kept) and prints the table; ``python -m docs.tables`` renders it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16  # decoding steps timed per prompt (their median is the decoding speed)
PROFILED = 4  # decoding steps under the profiler
CONTEXT = 16384  # 2 x SmolLM2's 8192: the length every export accepts
LENGTHS = (9216, CONTEXT - 1 - STEPS)
CHUNK = 4096  # vLLM's CPU default token budget per step
STOCK = ("stock vLLM, yarn x2", "yarn:factor=2")
REMAPS = (  # issue 61's three; names as in the record's parity rows
    ("leaky rerope (w 512, k 2.1)", "rerope:leaky=2.1"),
    ("self-extend (G 8, W 1024)", "self-extend"),
    ("dca (chunkllama scale)", "dca"),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs/serving/vllm_remaps.json")
    parser.add_argument(
        "--cpu", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND (default nobind)"
    )
    parser.add_argument("--work", type=Path, default=None, help="folder for the exports")
    parser.add_argument(
        "--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths (a quick check)"
    )
    parser.add_argument(
        "--at-once", type=int, default=1, choices=range(1, 5), metavar="{1..4}",
        help="engines running at the same time (default 1: one after another, none sharing "
        "the machine with another engine; 4: all side by side, each under the others' load)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if not lengths or max(lengths) + 1 + STEPS > CONTEXT:
        parser.error(f"--lengths {args.lengths}: each at most {CONTEXT - 1 - STEPS}")
    if not args.out.is_file():
        parser.error(f"--out {args.out}: no remap record there (make test-serving writes one)")
    record = json.loads(args.out.read_text())
    work = args.work or Path(tempfile.mkdtemp(prefix="ropekit-serving-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    # One thread per engine, the same binding, 2 GiB of KV cache each (46k tokens of SmolLM2:
    # both prompts in blocks never used before, which vLLM hands out in order, so the
    # plugin reads them in place); four engines at once fit the machine's memory.
    os.environ.update(
        VLLM_CPU_OMP_THREADS_BIND=args.cpu, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="2"
    )
    speed = run(work, args.cpu, lengths, args.at_once)
    record["speed"] = speed
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(args.out)  # whole or not at all
    for line in table(speed):
        print(line)


def run(work: Path, cpu: str, lengths: list[int], at_once: int = 1) -> dict:
    """Every engine's speed and profile (module docstring), stock first, ``at_once`` engines
    at a time."""
    from tests.serve.engines.harness import MODEL, prompt_ids, python_version_of, run_engine

    from ropekit.hf import load_model, load_tokenizer, patch, unpatch
    from ropekit.serve.exporting import export

    tokenizer = load_tokenizer(MODEL)
    model = load_model(MODEL, dtype=torch.float32)
    full = prompt_ids(tokenizer, max(lengths))
    ids = []
    for n in lengths:
        ids.append(work / f"ids{n}.npy")
        np.save(ids[-1], full[0, :n].numpy())
    bench = ["--decode", "1", "--bench", str(STEPS), "--bench-only", "--profile", str(PROFILED)]
    engines = {}
    for name, spec in (STOCK, *REMAPS):
        encoding = patch(model, spec)
        try:
            plugin = encoding.remaps_distance
            kind = {"format": "vllm", "max_length": CONTEXT} if plugin else {}
            folder = export(
                model, None, work / spec.replace(":", "_"), tokenizer=tokenizer, overwrite=True,
                **kind,
            )  # fmt: skip
        finally:
            unpatch(model)
        whole = plugin and encoding.dynamic  # the plugin serves each prompt in one step
        budget = ["--max-num-batched-tokens", str(CONTEXT if whole else CHUNK)]
        flags = [*bench, *budget, *(["--whole-prompts"] * whole)]
        engines[name] = (spec, plugin, whole, folder, flags)

    def serve(name: str) -> dict:
        spec, plugin, whole, folder, flags = engines[name]
        got = run_engine("vllm", folder, [(p, work / f"{name[:5]}.{p.stem}.npy") for p in ids],
                         *flags)  # fmt: skip
        if "error" in got:
            raise RuntimeError(f"{name}: vLLM refused {folder}: {got['error']}")
        row = {
            "spec": spec,
            "plugin": plugin,
            "prompt_in_one_step": whole,
            "lengths": {str(b["tokens"]): _timing(b) for b in got["bench"]},
            "profile": got["bench"][0]["profile"],
            "load_1m": round(os.getloadavg()[0], 2),
        }
        print(f"{name}: {json.dumps(row['lengths'])}", flush=True)
        return row

    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        rows = dict(zip(engines, pool.map(serve, engines), strict=True))
    stock = rows[STOCK[0]]["lengths"]
    for row in rows.values():
        for n, timing in row["lengths"].items():
            timing["prefill_ratio"] = round(timing["prefill_tok_s"] / stock[n]["prefill_tok_s"], 3)
            timing["decode_ratio"] = round(timing["decode_tok_s"] / stock[n]["decode_tok_s"], 3)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs",
        "threads": 1,
        "binding": f"VLLM_CPU_OMP_THREADS_BIND={cpu}, OMP_NUM_THREADS=1 (every engine)",
        "timing": "CPU seconds of each engine's process; "
        + ("the engines one after another" if at_once == 1 else f"{at_once} engines at once"),
        "model": "SmolLM2-135M, float32, eager, prefix cache emptied per prompt",
        "decode_steps": STEPS,
        "chunk": CHUNK,
        "baseline": STOCK[0],
        "vllm-cpu": python_version_of("vllm", "vllm-cpu"),
        "rows": rows,
    }


def _timing(bench: dict) -> dict:
    return {
        "prefill_cpu_s": bench["prefill_cpu_s"],
        "prefill_wall_s": bench["prefill_wall_s"],
        "prefill_tok_s": round(bench["prefill_tok_s"], 1),
        "decode_median_cpu_s": bench["decode_s"],
        "decode_median_wall_s": bench["decode_wall_median_s"],
        "decode_tok_s": round(bench["decode_tok_s"], 2),
    }


def table(speed: dict) -> list[str]:
    """The speed rows as markdown: tokens/s and the ratio to stock per length."""
    lengths = list(next(iter(speed["rows"].values()))["lengths"])
    head = " | ".join(f"prefill / decode @{n}" for n in lengths)
    lines = [f"| engine | {head} | load |", "|---|" + "---|" * len(lengths) + "---|"]
    for name, row in speed["rows"].items():
        cells = []
        for n in lengths:
            t = row["lengths"][n]
            cells.append(
                f"{t['prefill_tok_s']:.0f} / {t['decode_tok_s']:.2f} tok/s "
                f"({t['prefill_ratio']:.2f}x / {t['decode_ratio']:.2f}x)"
            )
        lines.append(f"| {name} | {' | '.join(cells)} | {row['load_1m']:.1f} |")
    return lines


if __name__ == "__main__":
    main()
