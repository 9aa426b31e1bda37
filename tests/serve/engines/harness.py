"""The serving tests' machinery: one real text, the ropekit-patched references, the exports and
the engines run in their own environments.

Holds:
    LENGTHS           the prompt lengths: inside SmolLM2's 8192-token window and beyond it.
    Method            one exportable (or plugin-served) method: how to patch, how to export.
    METHODS           linear, dynamic, yarn, llama3, a learned shared schedule and the
                      searched factors of experiment D (both longrope), and
                      per-head AdaRoPE: hand-set (vLLM plugin; nearest shared schedule)
                      and trained (experiment D's seed-0 adapter; nearest shared schedule).
    prompt_ids        the first n tokens of the held-out Shakespeare plays (SmolLM2 tokenizer).
    token_logprobs    log p(ids[t+1] | ids[:t+1]) of a model, float64 (T-1,).
    SELF_EXTEND       Self-Extend in llama.cpp's blocks, served by the recipe (RECIPE_FILE).
    run_engine        one engine subprocess; returns its RESULT record (run_recipe: the
                      Self-Extend recipe's; run_script: any file in an engine's Python).
    Diff, diff        max and mean |a - b| of two log-probability rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ropekit.encodings import Spec

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
# 1024: inside the 8192-token window; 9216: beyond it. A 9216-token fp32 forward of SmolLM2
# takes about 2 minutes on 2 busy cores (12288: 3.4), and the target needs about 15 of them.
LENGTHS = tuple(int(n) for n in os.environ.get("ROPEKIT_SERVING_LENGTHS", "1024,9216").split(","))
MODEL = "smollm2-135m"  # trained at 8192 tokens; every method below extends it 2x to 16384
SHARED = "adarope:init=yarn,factor=2,share_heads=true,share_layers=true"
# The factors `ropekit search` found for SmolLM2 at 16k (experiment D's committed search).
SEARCHED = json.loads((ROOT / "experiments/smollm2_16k/search/search.json").read_text())["spec"]


# vLLM's longrope takes the long factors at every length once max_model_len > L0 (inspect's
# rule, ropekit.serve.engines); transformers the short ones while the sequence fits in L0. What
# vLLM serves inside the window is therefore the same schedule with short := long.
def _long_factors_only(spec: str) -> str:
    parsed = Spec.parse(spec)
    return str(parsed.with_options(short_factor=parsed.given["long_factor"]))


SEARCHED_LONG_ONLY = _long_factors_only(SEARCHED)
L0 = 8192  # SmolLM2's max_position_embeddings
PER_HEAD = "adarope:init=yarn,factor=2"
# The per-head adapter experiment D's training made (seed 0: 16 PoSE samples of Shakespeare's
# training plays, lr 0.02; `ropekit compare --config experiments/smollm2_16k/ood.json`):
# the nearest shared schedule's perplexity cost is measured on a trained adapter, not only on
# hand-set parameters.
TRAINED = ROOT / "experiments/smollm2_16k/ood/adapters/adarope-s0"
# Self-Extend as llama.cpp groups its KV cache (G 4, W 512: 18 blocks at 9216 tokens, every
# distance below 2700), served by the recipe a user copies; it needs no ropekit at run time.
SELF_EXTEND = "self-extend:mode=llama.cpp,group=4,window=512"
RECIPE_FILE = ROOT / "src/ropekit/serve/llamacpp_self_extend.py"


def engine_python(engine: str) -> str:
    var = {"vllm": "ROPEKIT_VLLM_PYTHON", "llamacpp": "ROPEKIT_LLAMACPP_PYTHON"}[engine]
    default = ROOT / ".venv-serving" / engine / "bin" / "python"
    return os.environ.get(var) or str(default)


def set_shared(encoding: Any) -> None:
    """Hand-set parameters of the shared AdaRoPE: every pair's log-frequency moved by a smooth
    +-8% wave and one constant temperature (gamma = 0, so it folds exactly into the attention
    factor): a learned shared schedule that is not YaRN's."""
    with torch.no_grad():
        f = torch.arange(encoding.dxi.shape[-1], dtype=torch.float64)
        encoding.dxi.copy_((0.08 * torch.sin(f / 3)).expand_as(encoding.dxi))
        encoding.log_tau.fill_(-0.05)
        encoding.gamma.zero_()


def set_per_head(encoding: Any) -> None:
    """Hand-set per-(layer, kv head) frequencies and per-head AdaScale with gamma > 0 (the
    temperature grows with the query position): what no rope_parameters can express."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        encoding.dxi.copy_(0.05 * torch.randn(encoding.dxi.shape, generator=g))
        encoding.log_tau.copy_(0.1 * torch.randn(encoding.log_tau.shape, generator=g))
        encoding.gamma.copy_(0.3 * torch.rand(encoding.gamma.shape, generator=g))


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    spec: str
    setter: Callable[[Any], None] | None = None  # hand-set learned parameters
    formats: tuple[str, ...] = ("hf", "gguf")  # what ropekit export is asked to write
    engines: tuple[str, ...] = ("transformers", "vllm", "llamacpp")  # those that must serve it
    nearest: bool = False
    adapter: Path | None = None  # a trained adapter folder instead of a setter (spec: its own)
    # What vLLM computes inside the window when it differs from transformers by its rule.
    vllm_inside: str | None = None

    @property
    def vllm_format(self) -> str:
        return "vllm" if "vllm" in self.formats else "hf"


METHODS = (
    Method("linear", "linear:factor=2"),
    Method("dynamic", "dynamic-ntk:factor=2", engines=("transformers", "vllm")),
    Method("yarn", "yarn:factor=2"),
    Method("llama3", "llama3:factor=2,low_freq_factor=1,high_freq_factor=4"),
    Method("longrope (learned shared)", SHARED, set_shared),
    # llama.cpp has one rope_freqs tensor for every length: export --format gguf refuses.
    Method(
        "longrope (searched)",
        SEARCHED,
        engines=("transformers", "vllm"),
        vllm_inside=SEARCHED_LONG_ONLY,
    ),
    Method("adarope per head (plugin)", PER_HEAD, set_per_head, ("vllm", "hf", "gguf"), ("vllm",)),
    Method("adarope per head -> nearest", PER_HEAD, set_per_head, nearest=True),
    Method(
        "trained adarope per head -> nearest",
        json.loads((TRAINED / "adapter.json").read_text())["spec"],
        adapter=TRAINED,
        nearest=True,
    ),
)


def prompt_ids(tokenizer: Any, n: int) -> torch.Tensor:
    """(1, n) token ids of the held-out Shakespeare plays (one real text, one tokenization)."""
    from ropekit.data.corpora import load_corpus

    text = "\n\n".join(d.text for d in load_corpus("shakespeare", "validation"))
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.shape[1] >= n, f"the held-out plays hold only {ids.shape[1]} tokens"
    return ids[:, :n]


@torch.no_grad()
def token_logprobs(model: Any, ids: torch.Tensor, **kwargs: Any) -> np.ndarray:
    """log p(ids[t+1] | ids[:t+1]) for t < T-1, float64 (T-1,), from one uncached forward."""
    logits = model(ids, use_cache=False, **kwargs).logits[0, :-1]  # (T-1, V)
    out = torch.empty(logits.shape[0], dtype=torch.float64)
    for start in range(0, logits.shape[0], 2048):  # log-softmax in slices: 12k x 49k floats
        rows = logits[start : start + 2048].double().log_softmax(-1)
        out[start : start + 2048] = rows.gather(
            -1, ids[0, start + 1 : start + 1 + len(rows), None]
        )[:, 0]
    return out.numpy()


@dataclasses.dataclass(frozen=True)
class Diff:
    max: float
    mean: float

    def row(self) -> dict[str, float]:
        return {"max": self.max, "mean": self.mean}


def diff(a: np.ndarray, b: np.ndarray) -> Diff:
    if a.shape != b.shape:
        raise ValueError(f"log-probability rows differ in length: {a.shape} vs {b.shape}")
    d = np.abs(a - b)
    return Diff(float(d.max()), float(d.mean()))


def run_engine(engine: str, folder: Path, pairs: list[tuple[Path, Path]], *extra: str) -> dict:
    """Run tests/serve/engines/run_<engine>.py in that engine's environment; its RESULT record
    (with ``error`` when the engine refused), plus the log file. The runner prints RESULT only
    after every prompt's file is written, so a crash after it (vLLM 0.32's teardown aborts now
    and then: "terminate called without an active exception", exit -6) loses nothing: the
    record keeps the exit code and the numbers are still checked."""
    script = HERE / f"run_{engine}.py"
    log = folder.parent / f"{folder.name}.{engine}.log"
    args = [str(script), str(folder), *(f"{i}:{o}" for i, o in pairs), *extra]
    return run_script(engine, args, log)


def run_recipe(gguf: Path, pairs: list[tuple[Path, Path]], *extra: str, log: Path) -> dict:
    """Score prompts with the llama.cpp Self-Extend recipe, run as a user runs it: the file
    itself in llama-cpp-python's environment, where ropekit is not installed."""
    args = [str(RECIPE_FILE), str(gguf), *extra, "--score", *(f"{i}:{o}" for i, o in pairs)]
    return run_script("llamacpp", args, log)


def run_script(engine: str, args: list[str], log: Path) -> dict:
    """``args`` run by that engine's Python, output to ``log``; its RESULT record."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        proc = subprocess.run(
            [engine_python(engine), *args], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    lines = [line for line in log.read_text().splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise AssertionError(f"{engine} exited {proc.returncode}; last lines of {log}:\n{tail}")
    record = json.loads(lines[-1].removeprefix("RESULT "))
    record["log"] = str(log)
    if proc.returncode != 0:
        record["exit_code_after_result"] = proc.returncode
    return record


def python_version_of(engine: str, module: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({module!r}))"
    return subprocess.run(
        [engine_python(engine), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def driver_versions() -> dict[str, str]:
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
