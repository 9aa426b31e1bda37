"""Self-Extend served by llama.cpp's own group attention, driven through llama-cpp-python: a
recipe that needs only ``llama_cpp`` and ``numpy`` at run time (copy this file anywhere).

What it computes is ropekit's ``self-extend:mode=llama.cpp,group=G,window=W`` on the model
of a GGUF file (``ropekit export --spec ... --format gguf`` writes the file of the base
schedule): the KV cache is grouped in whole blocks of W tokens as it grows. Query i (block
b = floor(i / W)) sees the keys of its own block at their true distances and every older key
j at distance (b W / G + i mod W) - floor(j / G) (``ropekit.encodings.remap.SelfExtend``).
llama.cpp holds this as positions in its KV cache: while block b is decoded, its tokens sit at
b W / G + (i mod W); before block b + 1 starts, block b's keys move to floor(j / G), and the
K-shift (``src/llama-kv-cache.cpp: build_rope_shift``) re-rotates each moved key by the change
of its position. This is the bookkeeping of llama.cpp's ``--grp-attn-n G --grp-attn-w W``
(``tools/completion/completion.cpp``, the ``ga_i``/``ga_n``/``ga_w`` loop, and
``examples/passkey/passkey.cpp``), with the blocks aligned to W exactly: completion.cpp groups
only between batches, so its prompt batches must be multiples of W for the same result.

One departure, and why: llama.cpp moves a block with ``llama_memory_seq_add`` (shift the
block back to its true positions) and ``llama_memory_seq_div`` (divide them by G). In the
llama.cpp that llama-cpp-python 0.3.36 vendors, ``seq_div`` records the K-shift with the wrong
sign: ``src/llama-kv-cells.h: pos_div`` does ``shift[i] += p_old - pos[i]`` where ``pos_add``
does ``shift[i] += d`` (new minus old), and ``set_input_k_shift`` hands that shift to the rope
unchanged. A divided key therefore ends up rotated at 2 p_old - p_new instead of p_new: its
cached position (and so the causal mask) is right, its rotation is not. llama.cpp before the
KV-cells refactor (``llama_kv_cache_seq_div`` in ``llama.cpp``) recorded
``delta += pos - p_old``, the right sign. Measured on SmolLM2-135M (docs/serving/serving.md):
through ``seq_div`` the prompt's log-probabilities past the first block are nats away from
Self-Extend's; this recipe moves every key with ``llama_memory_seq_add`` alone, one call per
position of the block (seq_add(p, p + 1, floor(j / G) - p)), which records the shift with its
right sign and gives the same positions. ``seq_div=True`` keeps llama.cpp's own calls, to
measure the difference.

The KV cache must be float32 (``type_k=0, type_v=0``): K-shift on a quantized or f16 cache
rounds every moved key again. The base schedule must not scale cos/sin (YaRN's attention
factor): ``build_rope_shift`` passes the context's ``yarn_attn_factor`` to the rope, which
multiplies a shifted key by it once more (``ggml/src/ggml-cpu/ops.cpp: rope_yarn``).

Use (greedy continuation of a text file, or scoring token ids as the serving tests do)::

    python llamacpp_self_extend.py model.gguf --group 4 --window 512 --prompt-file doc.txt
    python llamacpp_self_extend.py model.gguf --group 4 --window 512 --score ids.npy:out.npy

Holds: block_position, group_calls, decode_steps, SelfExtendSession, prompt_logprobs, generate,
open_model, main.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

# One memory call: ("add", p0, p1, delta) is llama_memory_seq_add(mem, seq, p0, p1, delta);
# ("div", p0, p1, d) is llama_memory_seq_div(mem, seq, p0, p1, d). Ranges are [p0, p1).
Call = tuple[str, int, int, int]


def block_position(i: int, group: int, window: int) -> int:
    """The position llama.cpp holds for true position ``i`` while i's block is decoded:
    b W / G + (i mod W) with b = floor(i / W) (completion.cpp's n_past after b groupings)."""
    return (i // window) * (window // group) + i % window


def group_calls(block: int, group: int, window: int, seq_div: bool = False) -> list[Call]:
    """The memory calls that group completed block ``block`` (true positions b W .. b W + W - 1,
    cached at b W / G + m) so that its keys sit at floor(j / G) = b W / G + floor(m / G).

    ``seq_div=False``: one seq_add per position, ascending, each moving one cell by
    floor(m / G) - m. A moved cell lands at or below its old position, so no later range
    [p, p + 1) holds it again. ``seq_div=True``: llama.cpp's two calls (completion.cpp with
    ga_i = b W / G, n_past = ga_i + W, ib = b, bd = (W / G)(G - 1)): shift the block back to
    its true positions, then divide them by G (the K-shift's sign is wrong: module docstring).
    """
    if window % group:
        raise ValueError(f"window={window} must be a multiple of group={group} (as --grp-attn-w)")
    base = block * (window // group)
    if seq_div:
        back = block * (window // group) * (group - 1)  # ib * bd
        calls: list[Call] = []
        if back:
            calls.append(("add", base, base + window, back))
        calls.append(("div", block * window, block * window + window, group))
        return calls
    return [
        ("add", base + m, base + m + 1, m // group - m) for m in range(window) if m // group != m
    ]


def decode_steps(
    start: int, count: int, n_batch: int, group: int, window: int, seq_div: bool = False
) -> Iterator[tuple[list[Call], list[int]]]:
    """For ``count`` tokens fed after ``start`` already cached: per ``llama_decode``, the memory
    calls to make first and the positions of its tokens. A decode never crosses a block
    boundary (the next block needs this one grouped first) nor holds more than ``n_batch``
    tokens; a block is grouped just before the first token of the next one."""
    i, end = start, start + count
    while i < end:
        calls = (
            group_calls(i // window - 1, group, window, seq_div) if i and i % window == 0 else []
        )
        n = min(end - i, n_batch, window - i % window)
        yield calls, [block_position(i + k, group, window) for k in range(n)]
        i += n


class SelfExtendSession:
    """One sequence decoded with Self-Extend on a ``llama_cpp.Llama`` (its context and model;
    nothing of its own token bookkeeping is used). ``feed`` takes tokens in any chunks:
    prompts and generated tokens alike; blocks are grouped exactly at multiples of W."""

    def __init__(self, llm: Any, group: int, window: int, seq_div: bool = False) -> None:
        import llama_cpp

        if window % group:
            raise ValueError(f"window={window} must be a multiple of group={group}")
        self.lib, self.llm = llama_cpp, llm
        self.group, self.window, self.seq_div = group, window, seq_div
        self.ctx = llm.ctx
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
        self.n_batch = int(llm.n_batch)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.n_tokens = 0  # true positions fed so far
        self.calls: list[Call] = []  # every memory call made, for checking
        llama_cpp.llama_memory_clear(self.mem, True)

    def close(self) -> None:
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None

    def __enter__(self) -> SelfExtendSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cached_range(self) -> tuple[int, int]:
        """The smallest and largest position llama.cpp holds for the sequence now."""
        mem = self.mem
        return self.lib.llama_memory_seq_pos_min(mem, 0), self.lib.llama_memory_seq_pos_max(mem, 0)

    def feed(self, tokens: list[int], logits: bool = True) -> np.ndarray | None:
        """Decode ``tokens`` after those already fed; (len, V) float32 logits when ``logits``
        (else only the last row's are computed, and None is returned)."""
        out = np.empty((len(tokens), self.n_vocab), np.float32) if logits else None
        done = 0
        steps = decode_steps(
            self.n_tokens, len(tokens), self.n_batch, self.group, self.window, self.seq_div
        )
        for calls, positions in steps:
            for kind, p0, p1, value in calls:
                if kind == "add":
                    self.lib.llama_memory_seq_add(self.mem, 0, p0, p1, value)
                else:
                    self.lib.llama_memory_seq_div(self.mem, 0, p0, p1, value)
                self.calls.append((kind, p0, p1, value))
            n, b = len(positions), self.batch
            b.n_tokens = n
            for k, pos in enumerate(positions):
                b.token[k] = tokens[done + k]
                b.pos[k] = pos
                b.n_seq_id[k] = 1
                b.seq_id[k][0] = 0
                b.logits[k] = logits or done + k == len(tokens) - 1
            rc = self.lib.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} at true position {self.n_tokens}")
            if out is not None:
                ptr = ctypes.cast(
                    self.lib.llama_get_logits(self.ctx), ctypes.POINTER(ctypes.c_float)
                )
                out[done : done + n] = np.ctypeslib.as_array(ptr, shape=(n, self.n_vocab))
            self.n_tokens += n
            done += n
        return out

    def last_logits(self) -> np.ndarray:
        """(V,) float32 logits of the last token fed."""
        ptr = self.lib.llama_get_logits_ith(self.ctx, -1)
        row = np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,)
        )
        return row.copy()


def _floats(ptr: Any) -> Any:
    """llama_get_logits' float* as a ctypes pointer numpy can view (no copy)."""
    return ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))


def prompt_logprobs(
    session: SelfExtendSession, tokens: list[int], chunk: int = 512, tail: int = 0
) -> np.ndarray:
    """log p(tokens[t + 1] | tokens[:t + 1]) for t < T - 1, float64 (T - 1,), the prompt fed
    in chunks of ``chunk`` tokens (the (T, V) logits are never held at once) and its last
    ``tail`` tokens one per decode, as generation feeds them."""
    got = np.empty(len(tokens) - 1, np.float64)
    head = len(tokens) - tail
    starts = [*range(0, head, chunk), *range(head, len(tokens))]
    for start, stop in zip(starts, [*starts[1:], len(tokens)], strict=True):
        rows = session.feed(tokens[start:stop]).astype(np.float64)
        nxt = tokens[start + 1 : start + 1 + len(rows)]
        rows = rows[: len(nxt)]
        peak = rows.max(axis=-1, keepdims=True)
        logz = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=-1))
        got[start : start + len(rows)] = rows[np.arange(len(rows)), nxt] - logz
    return got


def generate(session: SelfExtendSession, prompt: list[int], n_predict: int) -> list[int]:
    """Greedy continuation of ``prompt`` by ``n_predict`` tokens (stops at end of generation)."""
    lib = session.lib
    vocab = lib.llama_model_get_vocab(session.llm.model)
    session.feed(prompt, logits=False)
    out: list[int] = []
    for _ in range(n_predict):
        token = int(np.argmax(session.last_logits()))
        if lib.llama_vocab_is_eog(vocab, token):
            break
        out.append(token)
        session.feed([token], logits=False)
    return out


def open_model(path: str, n_ctx: int = 0, n_batch: int = 512, threads: int = 1) -> Any:
    """``llama_cpp.Llama`` as the recipe needs it: float32 KV cache, flash attention off (the
    serving tests' settings), ``n_ctx`` cells (0: the GGUF's context_length)."""
    import llama_cpp

    return llama_cpp.Llama(
        model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, logits_all=True,
        type_k=0, type_v=0,  # GGML_TYPE_F32: the K-shift rotates keys in place
        flash_attn=False, n_threads=threads, verbose=False,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file (ropekit export --format gguf)")
    parser.add_argument("--group", type=int, required=True, help="G (--grp-attn-n)")
    parser.add_argument("--window", type=int, required=True, help="W (--grp-attn-w)")
    parser.add_argument("--n-ctx", type=int, default=0, help="KV cells; 0: the GGUF's length")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seq-div", action="store_true", help="llama.cpp's own seq_div calls")
    parser.add_argument("--prompt-file", help="continue this text greedily")
    parser.add_argument("--n-predict", type=int, default=64)
    parser.add_argument("--score", nargs="*", default=[], help="IDS.npy:OUT.npy log-probs")
    parser.add_argument("--tail", type=int, default=0, help="score: last N tokens one by one")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    llm = open_model(args.model, args.n_ctx, threads=args.threads)
    info: dict[str, Any] = {"n_ctx": llm.n_ctx(), "load_s": round(time.perf_counter() - started, 1)}
    info["runs"] = []
    for pair in args.score:
        ids_path, out_path = pair.split(":")
        tokens = [int(t) for t in np.load(ids_path)]
        t0 = time.perf_counter()
        with SelfExtendSession(llm, args.group, args.window, args.seq_div) as session:
            np.save(out_path, prompt_logprobs(session, tokens, tail=args.tail))
            calls = len(session.calls)
        info["runs"].append(
            {"ids": ids_path, "eval_s": round(time.perf_counter() - t0, 1), "memory_calls": calls}
        )
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
        prompt = llm.tokenize(text.encode("utf-8"), add_bos=True)
        with SelfExtendSession(llm, args.group, args.window, args.seq_div) as session:
            new = generate(session, prompt, args.n_predict)
        print(llm.detokenize(new).decode("utf-8", errors="replace"))
    if args.score:
        print("RESULT " + json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
