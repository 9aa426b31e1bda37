"""Prompt log-probabilities from vLLM (the CPU build), run in its own environment.

    python run_vllm.py MODEL_DIR IDS.npy:OUT.npy [IDS.npy:OUT.npy ...] [--max-model-len N]
                       [--kv-cache] [--compile]

For each prompt: feeds the token ids as they are (``TokensPrompt``), asks for
``prompt_logprobs=0`` (the log-probability of each prompt token only) and writes
log p(ids[t+1] | ids[:t+1]) for t < T-1 as float64 (T-1,). ``--max-model-len`` 0 (default)
lets vLLM derive the longest length from the folder's config, as a user who passes no flag
gets. vLLM prefills long prompts in chunks (chunked prefill), so later chunks read earlier
keys from its paged KV cache; with ``--kv-cache`` prefix caching is on and the first half of
each prompt is sent first, so the full prompt starts from cached blocks (the cached-token
count is reported). Eager mode unless ``--compile`` (compiling SmolLM2 adds about a minute to
each start here). Start-up runs under the ``__main__`` guard: vLLM starts worker processes.
Prints one ``RESULT {json}`` line; an engine that refuses the folder reports its error there.
"""

import argparse
import json
import os
import sys
import time

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts", nargs="+", help="IDS.npy:OUT.npy")
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--kv-cache", action="store_true")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    try:
        llm = LLM(
            model=args.model,
            dtype="float32",
            max_model_len=args.max_model_len or None,
            enable_prefix_caching=args.kv_cache,
            enforce_eager=not args.compile,
            seed=0,
        )
    except Exception as e:  # reported, not raised: the test records what the engine did
        print("RESULT " + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 0
    config = llm.llm_engine.model_config
    info = {
        "max_model_len": config.max_model_len,
        "load_s": round(time.perf_counter() - started, 1),
        "runs": [],
    }
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    for pair in args.prompts:
        ids_path, out_path = pair.split(":")
        ids = [int(t) for t in np.load(ids_path)]
        t0 = time.perf_counter()
        try:
            if args.kv_cache:
                half = (len(ids) // 2) // 16 * 16  # whole blocks of 16 tokens get cached
                llm.generate([TokensPrompt(prompt_token_ids=ids[:half])], params, use_tqdm=False)
            (result,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        except Exception as e:
            info["runs"].append({"ids": ids_path, "error": f"{type(e).__name__}: {e}"})
            continue
        steps = zip(result.prompt_logprobs[1:], ids[1:], strict=True)
        got = np.array([step[token].logprob for step, token in steps], dtype=np.float64)
        np.save(out_path, got)
        info["runs"].append(
            {
                "ids": ids_path,
                "eval_s": round(time.perf_counter() - t0, 1),
                "cached_tokens": getattr(result, "num_cached_tokens", None),
            }
        )
    print("RESULT " + json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
