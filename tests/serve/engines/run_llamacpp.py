"""Prompt log-probabilities from llama.cpp (llama-cpp-python), run in its own environment.

    python run_llamacpp.py MODEL.gguf IDS.npy OUT.npy [--n-ctx N] [--kv-cache]

Reads token ids (int64, (T,)), feeds them as they are (no tokenization, no BOS added) and
writes log p(ids[t+1] | ids[:t+1]) for t < T-1 as float64 (T-1,). The KV cache is float32
(llama.cpp's default is f16, whose rounding alone moves log-probabilities by ~1e-3) and flash
attention is off, so the comparison measures the rope, not storage precision. With
``--kv-cache`` the prompt is fed in two halves, so the second half reads the first half's keys
from the cache.
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
    parser.add_argument("ids")
    parser.add_argument("out")
    parser.add_argument("--n-ctx", type=int, default=0, help="0: the GGUF's context_length")
    parser.add_argument("--kv-cache", action="store_true")
    args = parser.parse_args()
    ids = np.load(args.ids).astype(np.int64)
    started = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=args.n_ctx or 0,
        n_batch=512,
        n_ubatch=512,
        logits_all=True,
        type_k=0,  # GGML_TYPE_F32
        type_v=0,
        flash_attn=False,
        n_threads=2,
        verbose=False,
    )
    loaded = time.perf_counter()
    tokens = [int(t) for t in ids]
    if args.kv_cache:
        half = len(tokens) // 2
        llm.eval(tokens[:half])
        llm.eval(tokens[half:])
    else:
        llm.eval(tokens)
    scores = np.asarray(llm.scores[: len(tokens) - 1], dtype=np.float64)  # (T-1, V)
    peak = scores.max(axis=-1, keepdims=True)
    logz = peak[:, 0] + np.log(np.exp(scores - peak).sum(axis=-1))
    got = scores[np.arange(len(tokens) - 1), ids[1:]] - logz
    np.save(args.out, got)
    info = {
        "n_ctx": llm.n_ctx(),
        "n_ctx_train": llm.n_ctx_train() if hasattr(llm, "n_ctx_train") else None,
        "load_s": round(loaded - started, 1),
        "eval_s": round(time.perf_counter() - loaded, 1),
    }
    print("RESULT " + json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
