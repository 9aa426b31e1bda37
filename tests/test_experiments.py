"""Every experiment script runs end to end on tiny settings and writes its committed outputs;
every experiment's config is a frozen dataclass that refuses what it does not know.

The scripts run as users run them (``python -m experiments.<name>.run``) in a subprocess,
with a tiny config, their runs and results in tmp_path and the model cache there too, so the
committed results next to the scripts are never touched.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from experiments.common import config_dict, read_config

from ropekit.results import read_result

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
    installed Hugging Face model is reused instead of copied again). Returns results.json, an
    ``experiment`` result."""
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
    result = read_result(results / "results.json", "experiment")
    assert result["meta"]["command"].startswith(f"python -m experiments.{name}.run --config")
    assert result["provenance"]["experiment"] == name
    # The payload holds the whole config, as the config file says it.
    assert result["config"] == {"description": ""} | config
    return result


def finite(values) -> bool:
    return all(math.isfinite(v) for v in values)


# A finished experiment's runner (40 s; its results are committed): make test took 16:14 on
# 2026-12-08 with it, past its 15 minutes.
@pytest.mark.slow
def test_extend_8x_scores_every_method_on_every_seed(tmp_path):
    # Three of the committed config's six trained methods: the ablations (per-layer, no-freq,
    # no-scale) are more AdaRoPE specs down the same path, and cost 38% of the test's time
    # (78 s against 48 s, 2026-12-08 beside two probe threads); the config tests read the
    # committed config with all six.
    trained = {
        "tuned-yarn": "tuned-yarn:factor=2",
        "adarope-global": "adarope:init=yarn,factor=2,share_heads=true,share_layers=true",
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


# A finished experiment's runner (40 s; its results are committed): make test took 16:14 on
# 2026-12-08 with it, past its 15 minutes.
@pytest.mark.slow
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
        "recipes": {  # each kind of the committed config's (tuned-yarn->lora trains as adarope's)
            "yarn->lora": "yarn:factor=2",
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


# A finished experiment's runner (31 s; its results are committed): make test took 16:14 on
# 2026-12-08 with it, past its 15 minutes.
@pytest.mark.slow
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
    # Rerun on the finished jobs: the committed files regenerate byte for byte (nothing in
    # them depends on the invocation).
    files = {f: (tmp_path / "results" / f).read_bytes() for f in ("results.md", "results.json")}
    run_experiment("pretrain_encodings", config, tmp_path)
    for name, before in files.items():
        assert (tmp_path / "results" / name).read_bytes() == before, name


@pytest.mark.slow  # 100 s under load, the longest test; its parts are tested in make test
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


@pytest.mark.slow
def test_rope_vs_sinusoidal_scores_every_column(tmp_path):
    config = {
        "encodings": ["sinusoidal", "rope"],
        "seeds": [0, 1],
        "context": 64,
        "eval_lengths": [64, 128],
        "eval_tokens": 256,
        "data": "shakespeare",
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2},
        "train": {"steps": 2, "batch_size": 2, "lr": 0.003, "warmup_steps": 1},
    }
    result = run_experiment("rope_vs_sinusoidal", config, tmp_path)
    columns = result["bits_per_byte"]
    assert list(columns) == ["sinusoidal", "rope", "rope + PI"]
    for column in columns.values():
        assert all(len(c["values"]) == 2 and finite(c["values"]) for c in column.values())
    # Position interpolation at 1x is plain RoPE; at 2x it changes the numbers.
    assert columns["rope + PI"]["64"] == columns["rope"]["64"]
    assert columns["rope + PI"]["128"] != columns["rope"]["128"]
    assert sorted(p.name for p in (tmp_path / "results" / "summaries").iterdir()) == [
        "rope-s0.json", "rope-s1.json", "sinusoidal-s0.json", "sinusoidal-s1.json"
    ]  # fmt: skip


# ----------------------------------------------------------------------------- configs
EXPERIMENTS = {
    "extend_8x": "Extend8xConfig",
    "two_stage": "TwoStageConfig",
    "pretrain_encodings": "PretrainEncodingsConfig",
    "smollm2_16k": "SmolLM2Config",
    "rope_vs_sinusoidal": "RopeVsSinusoidalConfig",
}


def config_type(name: str) -> type:
    return getattr(importlib.import_module(f"experiments.{name}.run"), EXPERIMENTS[name])


def committed(name: str) -> dict:
    return json.loads((ROOT / "experiments" / name / "config.json").read_text())


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_committed_config_reads_back_as_written(name):
    cfg = read_config(config_type(name), ROOT / "experiments" / name / "config.json")
    assert dataclasses.is_dataclass(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.description = "changed"  # type: ignore[misc]
    # JSON form == the file: the results record exactly the settings that were run.
    assert json.loads(json.dumps(config_dict(cfg))) == committed(name)


def write_config(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_config_refuses_unknown_and_missing_keys(tmp_path, name):
    data = committed(name)
    with pytest.raises(ValueError, match=r"unknown key 'eval_lenghts'.*allowed: .*eval_lengths"):
        read_config(config_type(name), write_config(tmp_path, data | {"eval_lenghts": [1]}))
    del data["eval_lengths"]
    with pytest.raises(ValueError, match=r"needs key 'eval_lengths'"):
        read_config(config_type(name), write_config(tmp_path, data))


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("extend_8x", {"eval_lengths": [128, 0]}, r"Extend8xConfig\.eval_lengths=\[128, 0\]"),
        ("extend_8x", {"factor": 1}, r"Extend8xConfig\.factor=1 .*>= 2"),
        ("extend_8x", {"lr_grid": [0.01, -1]}, r"Extend8xConfig\.lr_grid=.*> 0"),
        ("extend_8x", {"seeds": [0, 0]}, r"Extend8xConfig\.seeds=\[0, 0\].*without repeats"),
        ("extend_8x", {"depths": [1.5]}, r"Extend8xConfig\.depths=\[1\.5\].*\[0, 1\]"),
        ("extend_8x", {"tasks": ["paskey"]}, r"Extend8xConfig\.tasks: task='paskey'"),
        ("extend_8x", {"trained": {"yarn": "yarn:factr=8"}}, r"trained\['yarn'\].*'factr'"),
        ("extend_8x", {"base": {"contxt": 128}}, r"Extend8xConfig\.base\.contxt=128"),
        ("extend_8x", {"untuned": {"adarope": "rope"}}, r"either untuned or trained"),
        ("two_stage", {"recipes": {"yarn->joint": "yarn:factor=8"}}, r"recipes='yarn->joint'"),
        ("two_stage", {"recipes": {"yarn->lora": "ntk:factor=8"}}, r"starts from a yarn spec"),
        ("pretrain_encodings", {"model": {"seed": 3}}, r"model\.seed=3 .*allowed"),
        ("pretrain_encodings", {"encodings": {}}, r"encodings=\{\}"),
        ("smollm2_16k", {"model": "gpt2"}, r"SmolLM2Config\.model='gpt2'.*smollm2-135m"),
        ("smollm2_16k", {"train": {"samples": 1}}, r"train: PoseTraining needs key 'pose_window'"),
        ("rope_vs_sinusoidal", {"eval_lengths": [1024, 512]}, r"must start at context=512"),
        ("rope_vs_sinusoidal", {"model": {"d_model": 192, "n_layers": 4, "n_heads": 5}},
         r"ModelShape\.n_heads=5 .*divide d_model=192"),
    ],
)  # fmt: skip
def test_config_refuses_bad_values_naming_them(tmp_path, name, change, message):
    path = write_config(tmp_path, committed(name) | change)
    with pytest.raises(ValueError, match=message):
        read_config(config_type(name), path)


@pytest.mark.slow  # about 3 minutes: every stage is a CLI process on the real model
def test_smollm2_16k_remaps_rows_run_as_a_user_runs_them_and_resume(tmp_path):
    """Experiment D's training-free rows at toy lengths: attach, perplexity and probes as CLI
    processes; a rerun runs nothing; an unfinished method is named as not run."""
    from experiments.smollm2_16k import remaps

    config = {
        "model": "smollm2-135m", "data": "shakespeare", "target_length": 16384,
        "methods": {"rope": "rope", "string": "string:shift=64,window=16"},
        "eval_lengths": [128, 256], "eval_spans": 1, "eval_seed": 0,
        "probe_lengths": [256], "tasks": ["passkey"],
        "probe_tasks": {"niah_single_2": {"needles": 2, "haystacks": 1}},
    }  # fmt: skip
    path = tmp_path / "remaps.json"
    path.write_text(json.dumps(config))
    args = ["--config", str(path), "--runs", str(tmp_path / "runs")]
    args += ["--results", str(tmp_path / "results")]
    remaps.main(args)
    data = json.loads((tmp_path / "results" / "results.json").read_text())
    rows = data["methods"]
    assert list(rows) == ["rope", "string"] and data["not_run"] == []
    for row in rows.values():
        assert set(row["perplexity"]) == {"128", "256"}
        assert row["probes"]["niah_single_2"]["256"]["n"] == 2
        assert row["probes"]["passkey"]["256"]["n"] == 1  # experiment D's own task
        assert all(s["peak_gib"] > 0.1 for s in row["stages"].values())
    # STRING shifts distances beyond its local window: not the unmodified model at 256
    assert rows["string"]["perplexity"]["256"] != rows["rope"]["perplexity"]["256"]
    before = (tmp_path / "results" / "results.json").read_bytes()
    remaps.main(args)  # every stage is recorded: nothing runs, the same results
    assert (tmp_path / "results" / "results.json").read_bytes() == before
    # A method scored in an earlier session whose run folder is gone (runs/ is not
    # committed) stays in the results: the next session's collect does not drop it.
    shutil.rmtree(tmp_path / "runs" / "remaps" / "rope")
    remaps.main([*args, "--collect"])
    again = json.loads((tmp_path / "results" / "results.json").read_text())
    assert again["methods"] == data["methods"] and again["not_run"] == []
    config["methods"]["dca"] = "dca"
    path.write_text(json.dumps(config))
    remaps.main([*args, "--collect"])
    assert json.loads((tmp_path / "results" / "results.json").read_text())["not_run"] == ["dca"]


def test_smollm2_32k_retrieval_contrasts_pool_the_lengths_with_newcombes_interval(tmp_path):
    """Experiment E's retrieval from its committed probes: each finished method's accuracy per
    length as its summary says, and a pair's difference pooled over the lengths, with
    Newcombe's interval of the pooled counts; a method whose probes are unfinished (no
    summary.json yet) is left out."""
    from experiments.smollm2_32k import contrasts

    from ropekit.evals import difference_interval

    final = ROOT / "experiments" / "smollm2_32k" / "final"

    def correct(method):
        data = json.loads((final / "eval" / method / "s0/probes/summary.json").read_text())
        return sum(e["correct"] for e in data["by_length"]), sum(e["n"] for e in data["by_length"])

    probed = contrasts.retrieval(final)
    assert {"rope", "yarn-x4", "leaky-rerope", "tuned-yarn"} <= set(probed)
    assert [e.length for e in probed["yarn-x4"]] == [16384, 32768]
    rows = {(a, b): row for a, b, *row in contrasts.retrieval_contrasts(final, 32768)}
    (k_a, n), (k_b, _) = correct("tuned-yarn"), correct("yarn-x4")
    assert rows[("tuned-yarn", "yarn-x4")] == [k_a, k_b, n, difference_interval(k_a, n, k_b, n)]
    # a copy without YaRN x4's summary (its probes unfinished): no pair with it
    partial = tmp_path / "final"
    for method in probed:
        source = final / "eval" / method / "s0" / "probes" / "summary.json"
        if method != "yarn-x4":
            (partial / "eval" / method / "s0" / "probes").mkdir(parents=True)
            shutil.copy(source, partial / "eval" / method / "s0" / "probes")
    assert set(contrasts.retrieval(partial)) == set(probed) - {"yarn-x4"}


def test_smollm2_32k_contrasts_pair_every_scored_window_and_average_the_seeds(tmp_path):
    """The contrasts of experiment E from its committed ppl.json files, against the same files
    read by hand: a minus b over every domain's windows at 32k, a trained method's windows
    averaged over its seeds, and its seeds' spread in the error; a seed not yet scored on
    every domain is left out, and two trained methods meet at the seeds both have."""
    from experiments.smollm2_32k import contrasts

    final = ROOT / "experiments" / "smollm2_32k" / "final"

    def windows(method, seed, domain):
        data = json.loads((final / "eval" / method / f"s{seed}" / domain / "ppl.json").read_text())
        row = next(r for r in data["results"] if r["length"] == 32768)
        return np.array(row["last_quarter_nll_windows"])

    seeds = contrasts.scored_seeds(final)
    assert seeds["tuned-yarn"] == [0, 1, 2] and seeds["yarn-x4"] == [0]
    found = {(a, b): d for a, b, d in contrasts.contrasts(final, 32768)}
    # the best free method: the lowest mean over domains of the last-quarter NLL at 32k
    free = {m: np.mean([windows(m, 0, d).mean() for d in contrasts.DOMAINS])
            for m in ("yarn-x4", "leaky-rerope")}  # fmt: skip
    assert contrasts.best_free(final, seeds, 32768) == min(free, key=free.get)
    assert (min(free, key=free.get), "yarn-x4") in found
    # each method's score and cost are the verdict's own (compare.json, as far as it has got)
    verdict = json.loads((final / "compare.json").read_text())["verdict"]
    rows = {m: (n, score, cost) for m, n, score, cost in contrasts.standing(final, seeds, 32768)}
    assert set(verdict["scores"]) <= set(rows) and rows["tuned-yarn"][0] == 3
    for method, score in verdict["scores"].items():
        assert rows[method][1] == pytest.approx(score, rel=1e-12)
        assert rows[method][2] == pytest.approx(verdict["costs"][method], rel=1e-12, abs=1e-15)
    assert [r[1] for r in rows.values()] == sorted(r[1] for r in rows.values())  # best first
    per_seed = np.array([
        np.concatenate([windows("tuned-yarn", s, d) - windows("yarn-x4", 0, d)
                        for d in contrasts.DOMAINS])
        for s in range(3)
    ])  # fmt: skip
    by_hand = per_seed.mean(axis=0)  # per window, seeds averaged
    d = found[("tuned-yarn", "yarn-x4")]
    assert d.n == len(by_hand) >= 6 and d.mean == pytest.approx(by_hand.mean(), rel=1e-12)
    assert d.seeds == 3
    assert d.se_seeds == pytest.approx(per_seed.mean(axis=1).std(ddof=1) / 3**0.5, rel=1e-9)
    # A seed scored on two of three domains is not one of the method's seeds yet; a trained
    # method is compared with another at their common seeds.
    partial = tmp_path / "final"
    for method, seed, domains in [
        ("yarn-x4", 0, contrasts.DOMAINS),
        ("tuned-yarn", 0, contrasts.DOMAINS),
        ("tuned-yarn", 1, contrasts.DOMAINS[:2]),
        ("tuned-yarn", 2, contrasts.DOMAINS),
        ("adarope-global", 0, contrasts.DOMAINS),
    ]:
        for domain in domains:
            target = partial / "eval" / method / f"s{seed}" / domain
            target.mkdir(parents=True)
            shutil.copy(final / "eval" / method / f"s{seed}" / domain / "ppl.json", target)
    for method, trained in [("yarn-x4", False), ("tuned-yarn", True), ("adarope-global", True)]:
        (partial / "methods" / method / ("lr-0.02" if trained else "") / "s0").mkdir(parents=True)
    seeds = contrasts.scored_seeds(partial)
    assert seeds == {"adarope-global": [0], "tuned-yarn": [0, 2], "yarn-x4": [0]}
    found = {(a, b): d for a, b, d in contrasts.contrasts(partial, 32768)}
    # yarn-x4 is the only free method, so the best: no method against itself, none twice
    assert contrasts.best_free(partial, seeds, 32768) == "yarn-x4"
    assert [(a, b) for a, b, _ in contrasts.contrasts(partial, 32768)] == [
        ("adarope-global", "yarn-x4"), ("tuned-yarn", "yarn-x4")
    ]  # fmt: skip
    assert found[("tuned-yarn", "yarn-x4")].seeds == 2
    table = contrasts.pair_table(partial, seeds, "adarope-global", "tuned-yarn")
    assert len(table["tuned-yarn"]["kjv"][32768].ppl) == 1  # seed 0, which both have
    pairs = (*contrasts.PAIRS, ("adarope-global", "tuned-yarn"))
    both = {(a, b): d for a, b, d in contrasts.contrasts(partial, 32768, pairs)}
    assert both[("adarope-global", "tuned-yarn")].seeds == 1
    assert both[("adarope-global", "tuned-yarn")].se_seeds is None
    # As a user runs it: the table; a length not scored, or a folder that is not a
    # comparison's, is refused in one line, exit 2.
    command = [sys.executable, "-m", "experiments.smollm2_32k.contrasts", "--final", str(partial)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "| tuned-yarn | yarn-x4 | 6 | 2 |" in done.stdout
    lines = done.stdout.splitlines()
    one = next(line for line in lines if line.startswith("| adarope-global | yarn-x4 | 6 | 1 |"))
    two = next(line for line in lines if line.startswith("| tuned-yarn | yarn-x4 | 6 | 2 |"))
    assert "(one seed) |" in one and "seed)" not in two
    # the last column: each seed's paired difference, read by hand (seeds 0 and 2 here)
    each = [
        np.concatenate([windows("tuned-yarn", s, d) - windows("yarn-x4", 0, d)
                        for d in contrasts.DOMAINS]).mean()
        for s in (0, 2)
    ]  # fmt: skip
    assert two.endswith(" | " + ", ".join(f"{x:+.4f}" for x in each) + " |")
    # Every run seed by seed, a domain not finished left out: the cells read by hand.
    runs = {(m, s): cells for m, s, cells in contrasts.per_seed(partial, 32768)}
    assert set(runs) == {
        ("yarn-x4", 0),
        ("adarope-global", 0),
        *(("tuned-yarn", s) for s in range(3)),
    }
    assert set(runs[("tuned-yarn", 1)]) == set(contrasts.DOMAINS[:2])
    data = json.loads((final / "eval" / "tuned-yarn" / "s2" / "sotu" / "ppl.json").read_text())
    near = next(r for r in data["results"] if r["length"] == 8192)["perplexity"]
    far = np.exp(windows("tuned-yarn", 2, "sotu").mean())
    assert runs[("tuned-yarn", 2)]["sotu"] == pytest.approx((far, near), rel=1e-12)
    assert f"| tuned-yarn | 1 | {runs[('tuned-yarn', 1)]['shakespeare'][0]:.2f} |" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("| tuned-yarn | 1 |"))
    assert row.strip("| ").split(" | ").count("-") == 2  # no sotu yet, at either length
    # The figure's right panel: each method's score seed by seed, read by hand.
    scores = contrasts.seed_scores(partial, seeds, 32768)
    assert set(scores) == set(seeds)
    for s, score in zip(seeds["tuned-yarn"], scores["tuned-yarn"], strict=True):
        by_hand = np.mean([windows("tuned-yarn", s, d).mean() for d in contrasts.DOMAINS])
        assert score == pytest.approx(by_hand, rel=1e-12)
    png = tmp_path / "contrasts.png"
    done = subprocess.run([*command, "--figure", str(png)], cwd=ROOT, capture_output=True)
    assert done.returncode == 0 and png.read_bytes().startswith(b"\x89PNG"), done.stderr
    for bad, message in [(["--length", "1000"], "--length 1000 is not scored there; the "
                          "lengths are [8192, 16384, 32768]"),
                         (["--final", str(tmp_path)], "has no eval/")]:  # fmt: skip
        done = subprocess.run(command + bad, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_smollm2_32k_neighbours_contrasts_pair_its_own_methods(tmp_path, capsys):
    """Issue 58's contrasts name only methods of its comparison, and are read from the folder
    they are given with E's reader: on a folder of Leaky ReRoPE, YaRN x4 and `cope` holding a
    copy of YaRN x4's scored runs, cope's pair with YaRN x4 is the one contrast, a difference
    of exactly 0 (E's pairs would give Leaky ReRoPE's, the best free method, instead)."""
    from experiments.smollm2_32k import contrasts as e
    from experiments.smollm2_32k_neighbours import contrasts

    here = ROOT / "experiments" / "smollm2_32k_neighbours"
    methods = json.loads((here / "compare.json").read_text())["methods"]
    assert {m for pair in contrasts.PAIRS for m in pair} <= set(methods)
    final = ROOT / "experiments" / "smollm2_32k" / "final"
    partial = tmp_path / "final"
    copies = [("yarn-x4", "yarn-x4"), ("cope", "yarn-x4"), ("leaky-rerope", "leaky-rerope")]
    for method, source in copies:
        shutil.copytree(final / "eval" / source / "s0", partial / "eval" / method / "s0",
                        ignore=shutil.ignore_patterns("probes"))  # fmt: skip
        (partial / "methods" / method / "s0").mkdir(parents=True)
    (found,) = e.contrasts(partial, 32768, contrasts.PAIRS)
    assert found[:2] == ("cope", "yarn-x4") and found[2].mean == 0.0
    contrasts.main(["--final", str(partial)])
    out = capsys.readouterr().out
    assert "| cope | yarn-x4 | " in out and "| logn |" not in out


def test_smollm2_32k_contrasts_also_read_a_second_folders_methods(tmp_path):
    """--also reads stage 2's methods before the merge: a method only it holds is scored
    with the others; one both folders hold is read from --final; a folder that is not a
    comparison's is refused in one line, exit 2."""
    from experiments.smollm2_32k import contrasts

    final = ROOT / "experiments" / "smollm2_32k" / "final"
    stage2 = tmp_path / "stage2"
    # a method final/ will never hold (its own methods fill in as E runs)
    for method, source in [("stage2-only", "yarn-x4"), ("rope", "tuned-yarn")]:
        for domain in contrasts.DOMAINS:
            target = stage2 / "eval" / method / "s0" / domain
            target.mkdir(parents=True)
            shutil.copy(final / "eval" / source / "s0" / domain / "ppl.json", target)
    seeds = contrasts.scored_seeds(final)
    merged = contrasts.union([final, stage2], tmp_path / "view")
    assert contrasts.scored_seeds(merged) == seeds | {"stage2-only": [0]}
    rows = {m: score for m, _, score, _ in contrasts.standing(merged, seeds | {"stage2-only": [0]},
                                                                32768)}  # fmt: skip
    alone = {m: score for m, _, score, _ in contrasts.standing(final, seeds, 32768)}
    assert rows["stage2-only"] == alone["yarn-x4"] and rows["rope"] == alone["rope"]
    command = [sys.executable, "-m", "experiments.smollm2_32k.contrasts", "--also", str(stage2)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "| stage2-only | 0 |" in done.stdout and "stage2-only (seeds [0])" in done.stdout
    done = subprocess.run([*command, "--also", str(tmp_path / "nothing")], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "--also" in done.stderr and "has no eval/" in done.stderr


def test_smollm2_32k_merge_copies_finished_jobs_with_their_times_and_replaces_nothing(tmp_path):
    """Stage 2's finished jobs go to the same place in final/ with their wall times; caches,
    checkpoints and unfinished jobs stay; a file final/ holds with other bytes refuses the
    whole merge (nothing copied), and a running comparison's lock refuses it too."""
    from experiments.smollm2_32k import merge

    from ropekit.results import read_records, write_records
    from tests.processes import locked_elsewhere

    stage2, final = tmp_path / "stage2", tmp_path / "final"

    def put(root, rel, text="x"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)

    for rel in ("eval/rope/s0/kjv/ppl.json", "methods/rope/s0/extend.json"):
        put(stage2, rel, "rope")  # copied in from final/ to start stage 2: the same bytes
        put(final, rel, "rope")
    put(stage2, "eval/dca/s0/kjv/ppl.json", "dca kjv")
    put(stage2, "eval/dca/s0/kjv/ppl.png", "figure")
    put(stage2, "eval/dca/s0/kjv/windows/8192-0.npz", "cache")
    put(stage2, "eval/dca/s0/sotu/windows/8192-0.npz", "unfinished")
    put(stage2, "methods/dca/s0/extend.json", "extend")
    put(stage2, "methods/dca/s0/adapter/adapter.json", "adapter")
    put(stage2, "methods/dca/s0/train/checkpoint", "checkpoint")
    put(stage2, "eval/dca/s0/probes/16384/probes.jsonl", "answers so far")  # no summary yet
    write_records(stage2 / "times.jsonl", [
        {"job": "train methods/rope/s0", "seconds": 0.4},  # reused there: final's time stays
        {"job": "train methods/dca/s0", "seconds": 0.5},
        {"job": "eval eval/dca/s0/kjv", "seconds": 3000.0},
    ])  # fmt: skip
    write_records(final / "times.jsonl", [{"job": "train methods/rope/s0", "seconds": 30.0}])
    assert merge.finished_jobs(stage2) == [
        Path("eval/dca/s0/kjv"), Path("eval/rope/s0/kjv"), Path("methods/dca/s0"),
        Path("methods/rope/s0"),
    ]  # fmt: skip
    assert merge.merge(stage2, final, log=lambda _: None) == 4
    copied = sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file())
    assert copied == [
        "eval/dca/s0/kjv/ppl.json", "eval/dca/s0/kjv/ppl.png", "eval/rope/s0/kjv/ppl.json",
        "methods/dca/s0/adapter/adapter.json", "methods/dca/s0/extend.json",
        "methods/rope/s0/extend.json", "times.jsonl",
    ]  # fmt: skip
    assert read_records(final / "times.jsonl") == [
        {"job": "train methods/rope/s0", "seconds": 30.0},
        {"job": "train methods/dca/s0", "seconds": 0.5},
        {"job": "eval eval/dca/s0/kjv", "seconds": 3000.0},
    ]
    assert merge.merge(stage2, final, log=lambda _: None) == 0  # a rerun adds nothing
    (final / "eval/dca/s0/kjv/ppl.png").unlink()  # a file lost: copied again, its time kept once
    assert merge.merge(stage2, final, log=lambda _: None) == 1
    assert len(read_records(final / "times.jsonl")) == 3
    # The probes finish: their whole tree goes, with the job's time.
    put(stage2, "eval/dca/s0/probes/summary.json", "summary")
    write_records(stage2 / "times.jsonl", [
        *read_records(stage2 / "times.jsonl"), {"job": "probes eval/dca/s0/probes", "seconds": 9.0}
    ])  # fmt: skip
    assert merge.merge(stage2, final, log=lambda _: None) == 2
    assert (final / "eval/dca/s0/probes/16384/probes.jsonl").read_text() == "answers so far"
    assert read_records(final / "times.jsonl")[-1]["job"] == "probes eval/dca/s0/probes"
    # Another result where a copy would go: refused in one line, exit 2, nothing copied.
    put(stage2, "eval/string/s0/kjv/ppl.json", "string")
    put(stage2, "eval/dca/s0/sotu/ppl.json", "dca sotu")
    # stopped after its ppl.json, before its time: only the attempt's record, never merged
    write_records(stage2 / "times.jsonl", [
        *read_records(stage2 / "times.jsonl"),
        {"job": "eval eval/dca/s0/sotu", "started": 1.7e9, "earlier": 0.0},
    ])  # fmt: skip
    put(final, "eval/string/s0/kjv/ppl.json", "another string")
    before = sorted(final.rglob("*"))
    command = [sys.executable, "-m", "experiments.smollm2_32k.merge",
               "--stage2", str(stage2), "--final", str(final)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "holds another result than" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and sorted(final.rglob("*")) == before
    # While the comparison in final/ runs (its lock held), the merge refuses.
    (final / "eval/string/s0/kjv/ppl.json").unlink()
    with locked_elsewhere(final):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 2 and "in use by another run" in done.stderr, done.stderr
        assert not (final / "eval/dca/s0/sotu/ppl.json").exists()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and (final / "eval/dca/s0/sotu/ppl.json").is_file(), done.stderr
    assert all("seconds" in r for r in read_records(final / "times.jsonl"))


def test_issue_58_config_builds_every_method_at_smollm2s_shape():
    """The neighbours' comparison (experiments/smollm2_32k_neighbours, not run yet) names
    methods that build for SmolLM2-135M (9 query heads over 3 key/value heads, head dim 64,
    30 layers, base 1e5, L0 8192), and only AdaRoPE and AdaRoPE in Leaky ReRoPE's bands train:
    the fixed controls have no parameters, so they are scored once, as E's training-free
    methods were."""
    from ropekit.compare import from_file
    from ropekit.encodings import build

    config = from_file(ROOT / "experiments/smollm2_32k_neighbours/compare.json")
    shape = {"n_heads": 9, "n_kv_heads": 3, "head_dim": 64, "n_layers": 30}
    trained = {}
    for name, spec in zip(config.names, config.methods, strict=True):
        encoding = build(spec, **shape, base=1e5, original_length=8192)
        trained[name] = sum(p.numel() for p in encoding.positional_parameters().values())
    assert {n for n, count in trained.items() if count} == {
        "adarope",
        "adarope-global",
        "adarope-leaky-rerope",
    }
    assert trained["adarope-leaky-rerope"] == trained["adarope"] == 30 * 3 * 32 + 30 * 9 * 2


def _probe_answers(folder: Path, method: str, correct: list[bool], distances: list[int]) -> None:
    """A method's probes.jsonl as retrieval/run.sh leaves it: haystack i, one needle, its own
    key and value (the same for every method), answered right or not."""
    from ropekit.results import write_records

    stage = folder / method / "32768"
    stage.mkdir(parents=True, exist_ok=True)
    records = [
        {"haystack": i, "needle": 0, "key": f"key{i}", "value": str(7000000 + i),
         "needle_position": 500, "cut": d + 700, "distance": d + 200, "correct": c,
         "contains": c, "haystack_seconds": float(i)}
        for i, (c, d) in enumerate(zip(correct, distances, strict=True))
    ]  # fmt: skip
    write_records(stage / "probes.jsonl", records)


def test_smollm2_32k_retrieval_by_distance_tabulates_only_when_every_method_has_answered(
    tmp_path,
):
    """E's retrieval redo (by_distance.py and its README tables): the progress counts each
    method's answers; the tables stay a line until all seven methods answered all 56 probes;
    then a method's bins and reach are what ``summarize_records`` gives its answers, its
    probes past 8,192 are pooled once each, and each pair is joined probe by probe with
    Newcombe's paired interval. The methods are run.sh's, the probes probes.sh's."""
    from docs import tables
    from experiments.smollm2_32k import by_distance as d

    from ropekit.evals import paired_difference_interval

    here = ROOT / "experiments" / "smollm2_32k" / "retrieval"
    labels = [line.split()[0].strip('"') for line in (here / "run.sh").read_text().splitlines()
              if line.startswith('  "')]  # fmt: skip
    assert tuple(labels) == d.METHODS and {m for p in d.PAIRS for m in p} <= set(d.METHODS)
    probes = (here / "probes.sh").read_text()
    assert "--lengths 32768 --needles 1 --haystacks 56 " in probes and "--bins 8 --seed 0" in probes

    folder = tmp_path / "experiments" / "smollm2_32k" / "retrieval"
    rng = np.random.default_rng(0)
    distances = [int(x) for x in rng.integers(1000, 32000, d.HAYSTACKS)]
    chances = (0.9, 0.5, 0.6, 0.4, 0.3, 0.3, 0.1)
    right = {m: [bool(x) for x in rng.random(d.HAYSTACKS) < p]
             for m, p in zip(d.METHODS, chances, strict=True)}  # fmt: skip
    for m in d.METHODS:
        _probe_answers(folder, m, right[m][:-1], distances[:-1])  # one haystack short each
    assert [p.answered for p in d.progress(folder)] == [d.HAYSTACKS - 1] * len(d.METHODS)
    assert not d.complete(folder)
    line = "Fills in once every method has answered all its probes (0 of 7 have"
    assert tables.e_retrieval_by_distance(tmp_path).startswith(line)
    assert tables.e_retrieval_distance_contrasts(tmp_path).startswith(line)
    assert tables.e_retrieval_contrasts_by_bin(tmp_path).startswith(line)

    for m in d.METHODS:
        _probe_answers(folder, m, right[m], distances)
    assert d.complete(folder)
    far = [i for i, x in enumerate(distances) if x + 200 > 8192]
    first, *_ = d.progress(folder)
    method = first.method
    assert (first.answered, first.past) == (56, len(far))
    assert first.mean_cut == pytest.approx(np.mean(distances) + 700)
    assert (first.median_seconds, first.total_seconds) == (np.median(range(56)), sum(range(56)))
    found = d.by_method(folder)
    bins = {}  # by hand: (low, high] of 4,096 tokens each -> [correct, n]
    for x, c in zip(distances, right[method], strict=True):
        low = (x + 200 - 1) // 4096 * 4096
        bins.setdefault((low, low + 4096), [0, 0])
        bins[low, low + 4096][0] += c
        bins[low, low + 4096][1] += 1
    got = {(b.low_distance, b.high_distance): [b.correct, b.n] for b in found[method].by_distance}
    assert got == bins
    for accuracy, found_reach in zip((0.8, 0.5), found[method].reaches, strict=True):
        reached = 0
        for low in range(0, 32768, 4096):
            k, n = bins.get((low, low + 4096), (0, 0))
            if n == 0 or k < accuracy * n:
                break
            reached = low + 4096
        assert (found_reach.distance, found_reach.accuracy) == (reached, accuracy)
    assert (found[method].past.correct, found[method].past.n) == (
        sum(right[method][i] for i in far), len(far))  # fmt: skip
    for a, b, pairs in d.contrasts(folder):
        both = sum(right[a][i] and right[b][i] for i in far)
        only_a = sum(right[a][i] and not right[b][i] for i in far)
        only_b = sum(right[b][i] and not right[a][i] for i in far)
        counts = (both, only_a, only_b, len(far) - both - only_a - only_b)
        assert (pairs.both, pairs.only_a, pairs.only_b, pairs.neither) == counts
        assert pairs.interval() == paired_difference_interval(*counts)
    for a, b, per_bin in d.contrasts_by_bin(folder):
        assert sum(p.n for p in per_bin.values()) == 56
        for (low, high), pairs in per_bin.items():
            inside = [i for i, x in enumerate(distances) if low < x + 200 <= high]
            assert pairs.n == len(inside)
            assert pairs.correct_a == sum(right[a][i] for i in inside)
            assert pairs.correct_b == sum(right[b][i] for i in inside)
            assert pairs.both == sum(right[a][i] and right[b][i] for i in inside)
    assert tables.e_retrieval_contrasts_by_bin(tmp_path).count("\n") == 2 + len(d.PAIRS)
    text = tables.e_retrieval_by_distance(tmp_path)
    assert text.count("\n") == 2 + len(d.METHODS) and "| rope (the floor) |" in text
    assert tables.e_retrieval_distance_contrasts(tmp_path).count("\n") == 2 + len(d.PAIRS)
    assert d.figure(folder, tmp_path / "f.png").stat().st_size > 0


def test_issue_58_retrieval_tabulates_a_pair_once_both_its_methods_have_answered(tmp_path, capsys):
    """Issue 58's retrieval (its by_distance.py): its methods are retrieval.sh's, in its order,
    each asked against one of E's redo's; a pair is tabulated, probe by probe with E's
    reader, only once both methods have answered all 56 probes, and a method not finished is
    only counted."""
    from experiments.smollm2_32k import by_distance as e
    from experiments.smollm2_32k.contrasts import linked
    from experiments.smollm2_32k_neighbours import by_distance as n

    script = (ROOT / "experiments" / "smollm2_32k_neighbours" / "retrieval.sh").read_text()
    labels = re.search(r"^LABELS=\(([^)]*)\)", script, re.MULTILINE).group(1).split()
    assert tuple(labels) == n.METHODS == tuple(a for a, _ in n.PAIRS)
    assert {b for _, b in n.PAIRS} <= set(e.METHODS)
    rng = np.random.default_rng(1)
    distances = [int(x) for x in rng.integers(1000, 32000, e.HAYSTACKS)]
    right = {m: [bool(x) for x in rng.random(e.HAYSTACKS) < 0.5]
             for m in ("cope", "yarn-x4", "logn", "adarope")}  # fmt: skip
    mine, theirs, empty = tmp_path / "mine", tmp_path / "theirs", tmp_path / "empty"
    _probe_answers(mine, "cope", right["cope"], distances)
    _probe_answers(mine, "logn", right["logn"][:10], distances[:10])  # not finished
    empty.mkdir()
    n.main(["--retrieval", str(mine), "--e-retrieval", str(empty)])
    assert "No new method and the method it is asked against" in capsys.readouterr().out
    for method in ("yarn-x4", "adarope"):
        _probe_answers(theirs, method, right[method], distances)
    png = tmp_path / "f.png"
    n.main(["--retrieval", str(mine), "--e-retrieval", str(theirs), "--figure", str(png)])
    out = capsys.readouterr().out
    assert "cope: 56 of 56 answered" in out and "logn: 10 of 56 answered" in out
    ((_, _, pairs),) = e.contrasts(linked([mine, theirs], tmp_path / "both"), n.PAIRS[1:2])
    low, high = pairs.interval()
    assert f"cope - yarn-x4 past 8192: {pairs.difference:+.3f} [{low:+.3f}, {high:+.3f}]" in out
    assert "logn - adarope" not in out and "\nadarope: " not in out
    assert png.read_bytes().startswith(b"\x89PNG")


def test_the_retrieval_hours_left_price_each_haystack_by_what_it_took_the_others():
    """A method's remaining haystacks cost what they took the other methods (their median),
    scaled by its pace on the haystacks both answered; unpriced ones take its own median."""
    from experiments.smollm2_32k import by_distance as d

    def row(method: str, seconds: dict[int, float]) -> d.Progress:
        return d.Progress(method, len(seconds), 0, None, seconds)

    rows = [row("fast", {0: 10.0, 1: 100.0}), row("slow", {0: 20.0}), row("new", {})]
    left = d.seconds_left(rows)
    rest = d.HAYSTACKS - 2  # haystacks 2.. that no one has answered
    assert left["fast"] == pytest.approx(rest * 55.0)  # its own median, 55 s
    assert left["slow"] == pytest.approx(2 * 100.0 + rest * 20.0)  # twice as slow as "fast"
    assert left["new"] is None  # haystacks no one priced and no median of its own


def test_the_probe_queue_gives_each_start_the_first_method_neither_finished_nor_held(tmp_path):
    """Two probing threads split one experiment's methods: each takes the first method in
    order that has no summary.json and whose folder no live process holds; a lock left by a
    dead process does not hold it. As the scripts call it: the label on stdout (nothing when
    none is left), and ``--held`` exits 0 only for a folder a live process holds."""
    import socket

    from experiments import probe_queue

    from ropekit.outdir import LOCK_FILE, hold_lock

    out = tmp_path / "retrieval"
    for label in ("done", "busy", "stale", "fresh"):
        (out / label).mkdir(parents=True)
    (out / "done" / "summary.json").write_text("{}")
    lock = hold_lock(out / "busy" / LOCK_FILE, command="eval probes")  # this process: alive
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    record = {"pid": int(dead.stdout), "host": socket.gethostname(), "command": "x", "since": "t"}
    (out / "stale" / LOCK_FILE).write_text(json.dumps(record))
    labels = ["done", "busy", "stale", "fresh"]
    try:
        assert probe_queue.held(out / "busy") and not probe_queue.held(out / "stale")
        assert probe_queue.next_label(out, labels) == "stale"
        (out / "stale" / "summary.json").write_text("{}")
        assert probe_queue.next_label(out, labels) == "fresh"
        command = [sys.executable, "-m", "experiments.probe_queue"]
        done = subprocess.run([*command, str(out), *labels], cwd=ROOT, capture_output=True,
                              text=True)  # fmt: skip
        assert (done.returncode, done.stdout) == (0, "fresh\n"), done.stderr
        held = [subprocess.run([*command, "--held", str(out / m)], cwd=ROOT).returncode
                for m in ("busy", "fresh")]  # fmt: skip
        assert held == [0, 1]
        (out / "fresh" / "summary.json").write_text("{}")
        assert probe_queue.next_label(out, labels) is None  # busy is another start's
        done = subprocess.run([*command, str(out), *labels], cwd=ROOT, capture_output=True)
        assert (done.returncode, done.stdout) == (0, b"")
        assert subprocess.run([*command, str(out)], cwd=ROOT, capture_output=True).returncode == 2
    finally:
        lock.release()
    assert probe_queue.next_label(out, labels) == "busy"  # released: free for the next start


def test_resume_runs_each_long_experiments_script_in_issue_order():
    """experiments/resume.sh (what a session starts once per core) parses, and every stage it
    names is an executable script here, in the order of the issues (56's redo, 56's search,
    58's comparison, 58's retrieval), each resumable and splitting its work between starts."""
    script = ROOT / "experiments" / "resume.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    stages = ["$E/retrieval/run.sh", "$E/search/run.sh", "$N/run.sh", "$N/retrieval.sh"]
    assert [text.index(f'stage "{s}"') for s in stages] == sorted(
        text.index(f'stage "{s}"') for s in stages
    )
    where = {"$E": "experiments/smollm2_32k", "$N": "experiments/smollm2_32k_neighbours"}
    for s in stages:
        path = ROOT / s.replace(s[:2], where[s[:2]], 1)
        assert path.is_file() and os.access(path, os.X_OK), path
    for s in ("retrieval/run.sh", "../smollm2_32k_neighbours/retrieval.sh"):
        assert "experiments.probe_queue" in (ROOT / "experiments/smollm2_32k" / s).read_text()
