"""lm-evaluation-harness on ropekit-extended models (``--model ropekit``), offline.

1. A tiny local task (a JSONL file of held-out Shakespeare passages, rolling log-likelihood)
   run by ``ropekit-lm-eval``: each document's log-likelihood equals the patched model's own
   sum of token log-probabilities (lm-eval's HFLM runs the same model).
2. lm-eval's own RULER ``niah_single_1`` (its "repeat" haystack is built in, no download) next
   to ropekit's ``niah_single_1`` on SmolLM2 at 4096 tokens, same number of samples: both
   scores are recorded in runs/serving/ruler.json and printed; the prompts differ (see
   README), so the test asserts that both ran and scored in [0, 1], and reports the gap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ropekit.hf import load_model, load_tokenizer, model_dir, patch

from .harness import MODEL, ROOT, prompt_ids, token_logprobs

SPEC = "yarn:factor=2"
RULER_LENGTH = 4096
RULER_SAMPLES = int(os.environ.get("ROPEKIT_SERVING_RULER_SAMPLES", "8"))
# lm-eval's niah_single_1 generates 128 tokens with no stop string; its scorer only checks that
# the 7-digit value appears, which it does within the first tokens, and 128 steps at 4k cost
# about a minute a sample on 2 cores: 32 keeps the comparison and a quarter of the time.
RULER_GEN_TOKENS = 32


def _script(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _lm_eval(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [_script("ropekit-lm-eval"), *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def _samples(out: Path, task: str) -> list[dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    assert files, f"no samples file for {task} under {out}"
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]


def _first_float(value) -> float:
    while isinstance(value, (list, tuple)):
        value = value[0]
    return float(value)


def test_a_local_task_scores_what_the_patched_model_computes(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(MODEL)
    ids = prompt_ids(tokenizer, 1200)[0]
    docs = [tokenizer.decode(ids[:500]), tokenizer.decode(ids[600:1100])]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "ropekit_local.yaml").write_text(
        "task: ropekit_local\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
        "metadata:\n  version: 1.0\n"
    )
    out = tmp_path / "out"
    proc = _lm_eval(
        [
            "run",
            "--model",
            "ropekit",
            "--model_args",
            f"pretrained={MODEL},method={SPEC}",
            "--tasks",
            "ropekit_local",
            "--include_path",
            str(tasks),
            "--batch_size",
            "1",
            "--output_path",
            str(out),
            "--log_samples",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = sorted(_samples(out, "ropekit_local"), key=lambda s: s["doc_id"])
    model = load_model(MODEL, dtype=torch.float32)
    patch(model, SPEC)
    prefix = tokenizer.bos_token_id  # HFLM's prefix token for rolling windows (no BOS added)
    for sample, doc in zip(samples, docs, strict=True):
        tokens = tokenizer(doc, add_special_tokens=False).input_ids
        ours = token_logprobs(model, torch.tensor([[prefix, *tokens]])).sum()
        theirs = _first_float(sample["resps"])
        print(f"\nlm-eval {theirs:.4f} vs patched model {ours:.4f} ({len(tokens)} tokens)")
        assert abs(theirs - ours) < 1e-3 * len(tokens) ** 0.5, (theirs, ours)


def test_ruler_niah_single_1_next_to_ropekit(tmp_path: Path) -> None:
    started = time.perf_counter()
    out = tmp_path / "lm_eval"
    metadata = json.dumps({"max_seq_lengths": [RULER_LENGTH], "tokenizer": str(model_dir(MODEL))})
    proc = _lm_eval(
        [
            "run",
            "--model",
            "ropekit",
            "--model_args",
            f"pretrained={MODEL}",
            "--tasks",
            "niah_single_1",
            "--metadata",
            metadata,
            "--limit",
            str(RULER_SAMPLES),
            "--gen_kwargs",
            f"max_gen_toks={RULER_GEN_TOKENS}",
            "--batch_size",
            "1",
            "--output_path",
            str(out),
            "--log_samples",
        ],
        tmp_path,
    )
    record: dict = {"length": RULER_LENGTH, "samples": RULER_SAMPLES}
    if proc.returncode != 0:
        record["lm_eval_error"] = (proc.stdout + proc.stderr)[-4000:]
    else:
        results = json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())["results"]
        row = results["niah_single_1"]
        score = next(v for k, v in row.items() if k.startswith(str(RULER_LENGTH)))
        record["lm_eval"] = float(score)
        record["lm_eval_example"] = _samples(out, "niah_single_1")[0]["arguments"]
    lm_eval_s = time.perf_counter() - started
    ours_dir = tmp_path / "ropekit"
    ours = subprocess.run(
        [
            _script("ropekit"),
            "eval",
            "ruler",
            "--model",
            MODEL,
            "--tasks",
            "niah_single_1",
            "--lengths",
            str(RULER_LENGTH),
            "--samples",
            str(RULER_SAMPLES),
            "--out",
            str(ours_dir),
        ],
        capture_output=True,
        text=True,
    )
    assert ours.returncode == 0, ours.stderr[-3000:]
    summary = json.loads((ours_dir / "summary.json").read_text())
    (row,) = [r for r in summary["average"] if r["length"] == RULER_LENGTH]
    record["ropekit"] = float(row["score"])
    record["ropekit_example"] = (
        next(ours_dir.rglob("data.jsonl")).read_text().splitlines()[0][:3000]
    )
    record["ropekit_stdout"] = ours.stdout[-2000:]
    if "lm_eval" in record:
        # Two binomial estimates from n samples each: their difference's standard error.
        n = RULER_SAMPLES
        a, b = record["lm_eval"], record["ropekit"]
        record["difference"] = a - b
        record["standard_error"] = ((a * (1 - a) + b * (1 - b)) / n) ** 0.5
    record["seconds"] = {
        "lm_eval": round(lm_eval_s, 1),
        "total": round(time.perf_counter() - started, 1),
    }
    (ROOT / "runs" / "serving").mkdir(parents=True, exist_ok=True)
    (ROOT / "runs" / "serving" / "ruler.json").write_text(json.dumps(record, indent=2, default=str))
    print("\n" + ours.stdout[-1500:])
    print(
        json.dumps({k: v for k, v in record.items() if k != "lm_eval_example"}, default=str)[:3000]
    )
    assert 0.0 <= record["ropekit"] <= 1.0
    if "lm_eval_error" in record:
        pytest.fail("lm-eval's RULER did not run offline:\n" + record["lm_eval_error"][-2000:])
    assert 0.0 <= record["lm_eval"] <= 1.0
