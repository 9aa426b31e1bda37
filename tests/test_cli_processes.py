"""The command line under `accelerate launch` with 2 CPU processes, end to end.

Each test runs a command once in this process and once as 2 launched processes on the same
global batch (the CLI's --batch-size is the global batch), then checks that the numbers agree,
that every file the command promises is there and complete, and, from an audit log of every
file each process wrote (tests/processes.py), that only the main process wrote them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ropekit.backbone import read_adapter
from ropekit.cli import main
from ropekit.model import Decoder, DecoderConfig, load_decoder, save_decoder
from ropekit.train import latest_checkpoint

from .processes import launch, writes

TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--context", "32"]
# One optimizer step of 4 sequences: 2 a process when launched.
PRETRAIN = [*TINY, "--steps", "4", "--batch-size", "4", "--warmup", "1"]
PRETRAIN += ["--checkpoint-interval", "2"]


@pytest.fixture(autouse=True)
def one_thread():
    """One thread in this process, as each launched process has (OMP_NUM_THREADS=1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _launch_ok(args: list[str], root: Path) -> str:
    done = launch(args, root)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _only_rng_of_rank_1(paths: set[str]) -> bool:
    """A non-main process writes just its own RNG streams into each checkpoint (the main
    process writes the rest of it)."""
    return all("/checkpoints/.tmp-step-" in p and p.endswith("/rng-1.pt") for p in paths)


def _tiny_decoder(path: Path) -> Path:
    torch.manual_seed(0)
    config = DecoderConfig(d_model=32, n_layers=1, n_heads=2, context_length=32)
    return save_decoder(Decoder(config), path)


def test_pretrain_under_two_processes_matches_one(tmp_path, capsys):
    assert main(["pretrain", "--out", str(tmp_path / "one"), *PRETRAIN]) == 0
    capsys.readouterr()
    root = tmp_path / "two"
    stdout = _launch_ok(["pretrain", "--out", str(root / "run"), *PRETRAIN], root)
    assert stdout.count("final loss") == 1  # one report, from the main process

    one = json.loads((tmp_path / "one" / "pretrain.json").read_text())
    two = json.loads((root / "run" / "pretrain.json").read_text())
    assert (one["num_processes"], two["num_processes"]) == (1, 2)
    assert two["tokens"] == one["tokens"] == 4 * 4 * 32
    # Same sequences, their losses summed in another order: equal up to float rounding.
    assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-5)
    summary = json.loads((root / "run" / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["final_loss"] == two["final_loss"]
    lines = [(tmp_path / "one" / "metrics.jsonl"), (root / "run" / "metrics.jsonl")]
    for a, b in zip(*[map(json.loads, p.read_text().splitlines()) for p in lines], strict=True):
        assert (a["step"], a["tokens"]) == (b["step"], b["tokens"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    final = latest_checkpoint(root / "run")
    assert {p.name for p in final.glob("rng-*.pt")} == {"rng-0.pt", "rng-1.pt"}
    # The saved model is complete (load_decoder checks its sha256) and trained alike.
    trained = load_decoder(root / "run" / "model").state_dict()
    for name, weight in load_decoder(tmp_path / "one" / "model").state_dict().items():
        torch.testing.assert_close(trained[name], weight, rtol=0, atol=1e-5)

    written = writes(root)
    assert {"run/pretrain.json", "run/model/model.safetensors", "run/model/config.json"} <= (
        written["0"]
    )
    assert _only_rng_of_rank_1(written["1"]), sorted(written["1"])


def test_extend_recipe_under_two_processes_matches_one(tmp_path, capsys):
    model = _tiny_decoder(tmp_path / "base")
    args = ["extend", "--model", str(model), "--method", "adarope:init=yarn,factor=2"]
    args += ["--target-length", "64", "--samples", "4", "--batch-size", "2"]
    args += ["--recipe", "adarope->lora", "--lora-rank", "2"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    root = tmp_path / "two"
    stdout = _launch_ok([*args, "--out", str(root / "run")], root)
    assert stdout.count("extended to 64") == 1

    for stage in ("stage1", "."):
        one = json.loads((tmp_path / "one" / stage / "extend.json").read_text())
        two = json.loads((root / "run" / stage / "extend.json").read_text())
        assert two["num_processes"] == 2
        assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-5)
        assert two["trainable"] == one["trainable"]
        # Complete: read_adapter checks the files against the recorded sha256.
        _, mine = read_adapter(root / "run" / stage / "adapter")
        _, theirs = read_adapter(tmp_path / "one" / stage / "adapter")
        assert mine.keys() == theirs.keys()
        for name, tensor in theirs.items():
            torch.testing.assert_close(mine[name], tensor, rtol=0, atol=1e-5)
    lora = load_file(root / "run" / "lora.safetensors")
    for name, tensor in load_file(tmp_path / "one" / "lora.safetensors").items():
        torch.testing.assert_close(lora[name], tensor, rtol=0, atol=1e-5)

    written = writes(root)
    outputs = {"extend.json", "adapter/adapter.safetensors", "adapter/adapter.json"}
    assert {f"run/stage1/{path}" for path in outputs} <= written["0"]  # positional stage
    assert {f"run/{path}" for path in outputs | {"lora.safetensors"}} <= written["0"]
    assert _only_rng_of_rank_1(written["1"]), sorted(written["1"])


def _without_run_details(result: dict) -> dict:
    """A result without what differs between any two runs: the command, output paths."""
    meta = {k: v for k, v in result["meta"].items() if k != "command"}
    return {**{k: v for k, v in result.items() if k != "paths"}, "meta": meta}


def test_eval_ppl_under_two_processes_equals_one(tmp_path, capsys):
    model = str(_tiny_decoder(tmp_path / "model"))
    args = ["eval", "ppl", "--model", model, "--lengths", "32,64", "--tokens", "128"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    root = tmp_path / "two"
    stdout = _launch_ok([*args, "--out", str(root / "ppl")], root)
    assert stdout.count("wrote") == 1

    one = json.loads((tmp_path / "one" / "ppl.json").read_text())
    two = json.loads((root / "ppl" / "ppl.json").read_text())
    # The windows' NLL, gathered in order and summed as one process sums it: equal.
    assert two["results"] == one["results"]
    assert _without_run_details(two) == _without_run_details(one)
    written = writes(root)
    assert {"ppl/ppl.json", "ppl/ppl.png"} <= written["0"]
    assert written["1"] == set()  # the other process computed, and wrote nothing


def test_eval_passkey_under_two_processes_equals_one(tmp_path, capsys):
    model = str(_tiny_decoder(tmp_path / "model"))
    args = ["eval", "passkey", "--model", model, "--lengths", "96,128", "--depths", "2"]
    args += ["--samples", "2", "--batch-size", "1", "--seed", "3"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    root = tmp_path / "two"
    stdout = _launch_ok([*args, "--out", str(root / "passkey")], root)
    assert stdout.count("wrote") == 1

    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    two = json.loads((root / "passkey" / "summary.json").read_text())
    assert _without_run_details(two) == _without_run_details(one)
    for length in (96, 128):
        for name in ("data.jsonl", "pred.jsonl"):
            stage = Path("passkey") / str(length) / name
            mine = (root / "passkey" / stage).read_bytes()
            assert mine == (tmp_path / "one" / stage).read_bytes(), stage
        stage = Path("passkey") / str(length) / "summary.json"
        mine = _without_run_details(json.loads((root / "passkey" / stage).read_text()))
        assert mine == _without_run_details(json.loads((tmp_path / "one" / stage).read_text()))
    written = writes(root)
    assert {"passkey/summary.json", "passkey/accuracy_vs_length.png"} <= written["0"]
    assert "passkey/passkey/128/pred.jsonl" in written["0"]
    assert written["1"] == set()
