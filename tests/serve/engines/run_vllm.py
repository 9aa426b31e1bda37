"""Prompt log-probabilities from vLLM (the CPU build), run in its own environment.

    python run_vllm.py MODEL_DIR IDS.npy:OUT.npy [IDS.npy:OUT.npy ...] [--max-model-len N]
                       [--decode N] [--compile] [--max-num-batched-tokens N] [--bench N]
                       [--bench-only] [--profile N] [--whole-prompts]

For each prompt: feeds the token ids as they are (``TokensPrompt``), asks for
``prompt_logprobs=0`` (the log-probability of each prompt token only) and writes
log p(ids[t+1] | ids[:t+1]) for t < T-1 as float64 (T-1,). ``--max-model-len`` 0 (default)
lets vLLM derive the longest length from the folder's config, as a user who passes no flag
gets. vLLM prefills long prompts in chunks of ``max_num_batched_tokens`` (4096 on CPU), so
later chunks read earlier keys from its paged KV cache. Requests that ask for prompt
log-probabilities never read vLLM's prefix cache (``Request.get_skip_reading_prefix_cache``),
so with ``--decode N`` prefix caching is on and a second request for the same prompt
generates N greedy tokens with their log-probabilities: its prompt comes from the cached
blocks (the cached-token count is reported) and every decoding step reads the cache. Those
go to OUT.decode.npz (``tokens``, ``logprobs``). Eager mode unless ``--compile`` (compiling
SmolLM2 adds about a minute to each start here). ``--max-num-batched-tokens`` sets vLLM's
token budget per step, so a prompt's chunks are known. ``--bench N`` (with ``--decode``) times,
after the rest, each prompt served as one request of 1 + N greedy tokens stepped through
vLLM's engine (prefix cache emptied first, no log-probabilities): its prefill (until its first
token) and each of its N decoding steps, reported as tokens per second (decoding: the median
step), in CPU seconds of this process and in wall seconds. The engine then runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its CPU time is this process's: on a machine
other jobs share, wall time follows their load and CPU time much less (the engines of a
comparison run with one thread each and the same binding). ``--bench-only`` skips the
log-probabilities and decoded tokens (speed only). ``--profile N`` (with ``--bench``): the
first prompt's request then makes N more tokens, its decoding steps under torch's profiler,
which reports each op's self CPU time per step (where the time goes). ``--whole-prompts``
turns chunked prefill and prefix caching off (each prompt in one step; give
``--max-num-batched-tokens`` >= the longest prompt): how the plugin serves a remap that
follows the attended length, and decoding then re-reads the prompt. Start-up runs under the
``__main__`` guard: vLLM starts worker processes. Prints one ``RESULT {json}`` line; an engine
that refuses the folder reports its error there.
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
    parser.add_argument("--decode", type=int, default=0)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=0)
    parser.add_argument("--bench", type=int, default=0)
    parser.add_argument("--bench-only", action="store_true")
    parser.add_argument("--profile", type=int, default=0)
    parser.add_argument("--whole-prompts", action="store_true")
    args = parser.parse_args()
    if args.bench and not args.decode:
        parser.error("--bench decodes from the prefix cache: give --decode too")
    if args.profile and not args.bench:
        parser.error("--profile profiles the benchmark's decoding: give --bench too")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
    if args.bench:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    try:
        llm = LLM(
            model=args.model,
            dtype="float32",
            max_model_len=args.max_model_len or None,
            enable_prefix_caching=args.decode > 0 and not args.whole_prompts,
            **({"enable_chunked_prefill": False} if args.whole_prompts else {}),
            enforce_eager=not args.compile,
            seed=0,
            **(
                {"max_num_batched_tokens": args.max_num_batched_tokens}
                if args.max_num_batched_tokens
                else {}
            ),
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
    for pair in [] if args.bench_only else args.prompts:
        ids_path, out_path = pair.split(":")
        ids = [int(t) for t in np.load(ids_path)]
        t0 = time.perf_counter()
        prompt = TokensPrompt(prompt_token_ids=ids)
        try:
            (result,) = llm.generate([prompt], params, use_tqdm=False)
        except Exception as e:
            info["runs"].append({"ids": ids_path, "error": f"{type(e).__name__}: {e}"})
            continue
        steps = zip(result.prompt_logprobs[1:], ids[1:], strict=True)
        got = np.array([step[token].logprob for step, token in steps], dtype=np.float64)
        np.save(out_path, got)
        run = {"ids": ids_path, "eval_s": round(time.perf_counter() - t0, 1)}
        if args.decode:
            greedy = SamplingParams(max_tokens=args.decode, temperature=0.0, logprobs=0)
            (decoded,) = llm.generate([prompt], greedy, use_tqdm=False)
            tokens = list(decoded.outputs[0].token_ids)
            logprobs = [
                step[t].logprob for step, t in zip(decoded.outputs[0].logprobs, tokens, strict=True)
            ]
            np.savez(
                out_path.removesuffix(".npy") + ".decode.npz",
                tokens=np.array(tokens, dtype=np.int64),
                logprobs=np.array(logprobs, dtype=np.float64),
            )
            run["cached_tokens"] = decoded.num_cached_tokens
        info["runs"].append(run)
    if args.bench:
        info["bench"] = [
            _bench(llm, pair.split(":")[0], args.bench, args.profile * (i == 0))
            for i, pair in enumerate(args.prompts)
        ]
    print("RESULT " + json.dumps(info), flush=True)
    return 0


def _stepped(llm, ids: list[int], n: int, between=None) -> tuple[np.ndarray, np.ndarray]:
    """One request of 1 + n greedy tokens stepped through the engine: (its prefill, until its
    first token; its n decoding steps (n, 2)), each as (CPU seconds of this process, wall
    seconds). ``between(i)`` runs before decoding step i (the profiler's hooks)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=1 + n, min_tokens=1 + n, temperature=0.0)
    engine.add_request("bench", TokensPrompt(prompt_token_ids=ids), params)
    made, marks = 0, [(time.process_time(), time.perf_counter())]
    while engine.has_unfinished_requests():
        if between is not None and made >= 1:
            between(made - 1)
        outputs = engine.step()
        now = (time.process_time(), time.perf_counter())
        produced = max((len(o.outputs[0].token_ids) for o in outputs), default=made)
        if produced > made:  # a step may make no token (a chunk of a chunked prefill)
            marks.append(now)
            made = produced
    if made != 1 + n:
        raise RuntimeError(f"the request made {made} tokens, not {1 + n}")
    times = np.diff(np.array(marks), axis=0)  # (1 + n, 2)
    return times[0], times[1:]


def _bench(llm, ids_path: str, n: int, profiled: int = 0) -> dict:
    """Prefill and decoding speed of one prompt (module docstring), tokens per second of CPU
    time, and the wall seconds; ``profiled`` more decoding steps under torch's profiler: each
    op's self CPU ms per step, the 15 largest."""
    from torch.profiler import ProfilerActivity, profile

    ids = [int(t) for t in np.load(ids_path)]
    llm.reset_prefix_cache()
    prof = profile(activities=[ProfilerActivity.CPU])

    def between(i: int) -> None:
        if i == n:
            prof.start()

    prefill, steps = _stepped(llm, ids, n + profiled, between if profiled else None)
    decode = steps[:n]
    median = np.median(decode, axis=0)  # (cpu, wall)
    out = {
        "ids": ids_path,
        "tokens": len(ids),
        "prefill_cpu_s": round(float(prefill[0]), 3),
        "prefill_wall_s": round(float(prefill[1]), 3),
        "prefill_tok_s": len(ids) / float(prefill[0]),
        "decode_cpu_s": [round(float(t), 4) for t in decode[:, 0]],
        "decode_wall_s": [round(float(t), 4) for t in decode[:, 1]],
        "decode_s": round(float(median[0]), 4),  # the median step's CPU seconds
        "decode_tok_s": 1 / float(median[0]),
        "decode_wall_median_s": round(float(median[1]), 4),
    }
    if profiled:
        prof.stop()
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        out["profile"] = {
            "steps": profiled,
            "context": len(ids) + n,
            "step_cpu_ms": round(1e3 * float(np.median(steps[n:, 0])), 1),
            "self_ms_per_step": {
                e.key: round(e.self_cpu_time_total / 1e3 / profiled, 2) for e in ops[:15]
            },
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
