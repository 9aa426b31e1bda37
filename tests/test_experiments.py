"""Every experiment script runs end to end on tiny settings and writes its committed outputs.

The scripts run as users run them (``python -m experiments.<name>.run``) in a subprocess,
with a tiny config, their runs and results in tmp_path and the model cache there too, so the
committed results next to the scripts are never touched.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_BASE = {
    "context": 96,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 2,
    "recall_steps": 2,
    "recall_batch_size": 2,
    "base_steps": 2,
    "batch_size": 2,
    "warmup": 1,
}
TINY_EVAL = {
    "eval_lengths": [96, 192],
    "eval_windows": 1,
    "tasks": ["passkey_shakespeare"],
    "task_lengths": [96],
    "depths": [0.5],
    "samples_per_depth": 1,
}


def run_experiment(name: str, config: dict, tmp_path: Path, own_cache: bool = True) -> dict:
    """``own_cache``: models go to a cache in tmp_path (False: the user cache, where an
    installed Hugging Face model is reused instead of copied again)."""
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(config))
    results = tmp_path / "results"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    if own_cache:
        env["ROPEKIT_CACHE"] = str(tmp_path / "cache")
    command = [
        sys.executable, "-m", f"experiments.{name}.run", "--config", str(cfg_path),
        "--runs", str(tmp_path / "runs"), "--results", str(results), "--threads", "1",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (results / "results.md").is_file()
    return json.loads((results / "results.json").read_text())


def finite(values) -> bool:
    return all(math.isfinite(v) for v in values)


def test_extend_8x_scores_every_method_on_every_seed(tmp_path):
    trained = {
        "tuned-yarn": "tuned-yarn:factor=2",
        "adarope-global": "adarope:init=yarn,factor=2,share_heads=true,share_layers=true",
        "adarope-per-layer": "adarope:init=yarn,factor=2,share_heads=true",
        "adarope-no-freq": "adarope:init=yarn,factor=2,freq=false",
        "adarope-no-scale": "adarope:init=yarn,factor=2,scale=false",
        "adarope": "adarope:init=yarn,factor=2",
    }
    config = {
        "base": TINY_BASE,
        "data": "shakespeare",
        "factor": 2,
        "samples": 2,
        "lr_grid": [0.01, 0.03],
        "selection_samples": 1,
        "seeds": [0, 1],
        "untuned": {"rope": "rope", "yarn": "yarn:factor=2"},
        "trained": trained,
        **TINY_EVAL,
    }
    result = run_experiment("extend_8x", config, tmp_path)
    assert list(result["methods"]) == ["rope", "yarn", *trained]
    for name, method in result["methods"].items():
        assert set(method["bpb"]) == {"96", "192"}
        assert method["runs"] == (2 if name in trained else 1)
        assert finite(v for stat in method["bpb"].values() for v in stat["values"])
    assert (
        result["methods"]["adarope"]["trainable"] > result["methods"]["adarope-global"]["trainable"]
    )
    # The search tried every rate and kept the one with the lowest selection loss.
    search = result["methods"]["adarope"]["lr_search"]
    assert len(search) == 2
    assert result["methods"]["adarope"]["lr"] == float(min(search, key=search.get))
    assert "adarope - adarope-global" in result["paired_bpb_differences"]
    for figure in ("bpb_vs_length.png", "nll_vs_position.png", "heatmap_passkey_shakespeare.png"):
        assert (tmp_path / "results" / figure).stat().st_size > 0


def test_two_stage_runs_every_recipe(tmp_path):
    config = {
        "base": TINY_BASE,
        "data": "shakespeare",
        "factor": 2,
        "samples": 2,
        "positional_lr": 0.01,
        "lora_lr_grid": [0.003],
        "selection_samples": 1,
        "seeds": [0, 1],
        "recipes": {
            "yarn->lora": "yarn:factor=2",
            "tuned-yarn->lora": "tuned-yarn:factor=2",
            "adarope->lora": "adarope:init=yarn,factor=2",
            "adarope->joint": "adarope:init=yarn,factor=2",
        },
        **TINY_EVAL,
    }
    result = run_experiment("two_stage", config, tmp_path)
    recipes = result["recipes"]
    assert recipes["yarn->lora"]["stage1_trainable"] == 0
    assert recipes["adarope->lora"]["stage1_trainable"] > 0
    # ->joint keeps training the encoding beside LoRA; ->lora trains LoRA alone.
    joint, lora = recipes["adarope->joint"], recipes["adarope->lora"]
    assert joint["stage2_trainable"] == lora["stage2_trainable"] + lora["stage1_trainable"]
    assert finite(v for r in recipes.values() for s in r["bpb"].values() for v in s["values"])


@pytest.mark.parametrize("encodings", [{"rope": "rope", "alibi": "alibi"}])
def test_pretrain_encodings_scores_every_encoding(tmp_path, encodings):
    config = {
        "encodings": encodings,
        "seeds": [0, 1],
        "model": TINY_BASE,
        "data": "shakespeare",
        **TINY_EVAL,
        "eval_lengths": [96, 192],
    }
    result = run_experiment("pretrain_encodings", config, tmp_path)
    assert list(result["encodings"]) == list(encodings)
    for entry in result["encodings"].values():
        assert entry["bpb"]["96"]["n"] == 2
        assert finite(entry["bpb"]["96"]["values"])


def test_smollm2_16k_scores_every_method(tmp_path):
    """The real model at toy lengths: PoSE windows of 32 tokens whose positions span 16k,
    perplexity at 32/64 tokens, the tasks at 192."""
    config = {
        "model": "smollm2-135m",
        "data": "shakespeare",
        "target_length": 16384,
        "train": {"samples": 2, "pose_window": 32, "lr": 0.02, "seeds": [0, 1],
                  "grad_checkpointing": True},
        "untuned": {"rope": "rope", "dynamic-ntk": "dynamic-ntk:factor=2",
                    "yarn-x2": "yarn:factor=2"},
        "trained": {"tuned-yarn": "tuned-yarn:factor=2",
                    "adarope-global": "adarope:init=yarn,factor=2,share_heads=true,"
                                      "share_layers=true"},
        "eval_lengths": [32, 64],
        "eval_spans": 1,
        "eval_seed": 0,
        "tasks": ["passkey"],
        "task_lengths": [192],
        "depths": [0.5],
        "samples_per_depth": 1,
    }  # fmt: skip
    result = run_experiment("smollm2_16k", config, tmp_path, own_cache=False)
    methods = result["methods"]
    assert list(methods) == ["rope", "dynamic-ntk", "yarn-x2", "tuned-yarn", "adarope-global"]
    for name, m in methods.items():
        for n in ("32", "64"):
            stats = m["perplexity"][n]
            assert finite(stats[k]["mean"] for k in ("perplexity", "last_quarter_perplexity"))
            assert stats["perplexity"]["n"] == (2 if m["trained"] else 1), name
        assert 0.0 <= m["tasks"]["192"]["passkey"]["score"] <= 1.0
    # Dynamic NTK leaves the original window alone; YaRN changes it.
    for n in ("32", "64"):
        rope = methods["rope"]["perplexity"][n]["perplexity"]["mean"]
        assert methods["dynamic-ntk"]["perplexity"][n]["perplexity"]["mean"] == pytest.approx(rope)
        assert methods["yarn-x2"]["perplexity"][n]["perplexity"]["mean"] != pytest.approx(rope)
    assert methods["tuned-yarn"]["trainable"] == 4
    assert methods["adarope-global"]["trainable"] == 32 + 2  # one schedule, one temperature
    for name in ("tuned-yarn", "adarope-global"):
        runs = methods[name]["runs"]
        assert [r["seed"] for r in runs] == [0, 1]
        assert all(r["extend_s"] > 0 and len(r["losses"]) == 2 for r in runs)
        # Seeds draw different samples and positions: the runs differ.
        assert runs[0]["losses"] != runs[1]["losses"]
    paired = result["paired_perplexity_differences"]["adarope-global - tuned-yarn"]
    assert paired["64"]["n"] == 2
