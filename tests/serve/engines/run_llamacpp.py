"""Prompt log-probabilities from llama.cpp (llama-cpp-python), run in its own environment.

    python run_llamacpp.py MODEL.gguf IDS.npy:OUT.npy [IDS.npy:OUT.npy ...] [--n-ctx N]

For each prompt: reads token ids (int64, (T,)), feeds them as they are (no tokenization, no
BOS added) in batches of 512 tokens, so every batch after the first reads the earlier keys
from llama.cpp's KV cache, and writes log p(ids[t+1] | ids[:t+1]) for t < T-1 as float64
(T-1,). The KV cache is float32 (llama.cpp's default f16 alone moves log-probabilities by
~1e-3) and flash attention is off, so the comparison measures the rope, not storage precision.
Prints one ``RESULT {json}`` line: the context size, timings, and any error per prompt.
"""

import argparse
import json
import sys
import time

import numpy as np


def main() -> int:
    import llama_cpp

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts", nargs="+", help="IDS.npy:OUT.npy")
    parser.add_argument("--n-ctx", type=int, default=0, help="0: the GGUF's context_length")
    args = parser.parse_args()
    started = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=args.n_ctx,
        n_batch=512,
        n_ubatch=512,
        logits_all=True,
        type_k=0,  # GGML_TYPE_F32
        type_v=0,
        flash_attn=False,
        n_threads=2,
        verbose=False,
    )
    info = {"n_ctx": llm.n_ctx(), "load_s": round(time.perf_counter() - started, 1), "runs": []}
    for pair in args.prompts:
        ids_path, out_path = pair.split(":")
        tokens = [int(t) for t in np.load(ids_path)]
        t0 = time.perf_counter()
        try:
            llm.reset()
            llm.eval(tokens)
        except Exception as e:  # reported, not raised: the test records what the engine did
            info["runs"].append({"ids": ids_path, "error": f"{type(e).__name__}: {e}"})
            continue
        got = np.empty(len(tokens) - 1, dtype=np.float64)
        for start in range(0, len(tokens) - 1, 1024):  # float64 in slices: (T, V) is GiBs
            rows = np.asarray(llm.scores[start : min(start + 1024, len(tokens) - 1)], np.float64)
            peak = rows.max(axis=-1, keepdims=True)
            logz = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=-1))
            picked = rows[np.arange(len(rows)), tokens[start + 1 : start + 1 + len(rows)]]
            got[start : start + len(rows)] = picked - logz
        np.save(out_path, got)
        info["runs"].append({"ids": ids_path, "eval_s": round(time.perf_counter() - t0, 1)})
    print("RESULT " + json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
