"""Prompt log-probabilities from vLLM (the CPU build), run in its own environment.

    python run_vllm.py MODEL_DIR IDS.npy OUT.npy [--max-model-len N] [--kv-cache]

Feeds the token ids as they are (``TokensPrompt``), asks for ``prompt_logprobs=0`` (the
log-probability of each prompt token only) and writes log p(ids[t+1] | ids[:t+1]) for
t < T-1 as float64 (T-1,). ``--max-model-len`` 0 (default) lets vLLM derive the longest length
from the folder's config, as a user who passes no flag gets. With ``--kv-cache`` the first half
of the prompt is run first with prefix caching on, so the second request reads those keys from
vLLM's KV cache (the prefix-cache hit count is printed). Start-up runs under the ``__main__``
guard: vLLM starts worker processes. Eager mode unless ``--compile`` (compiling SmolLM2 adds
about a minute to each start here and changes no number the test checks).
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
    parser.add_argument("ids")
    parser.add_argument("out")
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--kv-cache", action="store_true")
    parser.add_argument(
        "--compile", action="store_true", help="vLLM's torch.compile (default: eager, faster start)"
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = [int(t) for t in np.load(args.ids)]
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=args.max_model_len or None,
        enable_prefix_caching=args.kv_cache,
        seed=0,
        enforce_eager=not args.compile,
    )
    loaded = time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    if args.kv_cache:
        # A block-aligned prefix is cached by the first request and reused by the second.
        half = (len(ids) // 2) // 16 * 16
        llm.generate([TokensPrompt(prompt_token_ids=ids[:half])], params, use_tqdm=False)
    (result,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    got = np.array(
        [
            step[token].logprob
            for step, token in zip(result.prompt_logprobs[1:], ids[1:], strict=True)
        ],
        dtype=np.float64,
    )
    np.save(args.out, got)
    info = {
        "max_model_len": llm.llm_engine.model_config.max_model_len,
        "num_cached_tokens": getattr(result, "num_cached_tokens", None),
        "load_s": round(loaded - started, 1),
        "eval_s": round(time.perf_counter() - loaded, 1),
    }
    print("RESULT " + json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
