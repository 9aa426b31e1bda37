"""The command line with --fsdp under `accelerate launch` with 2 CPU processes, end to end.

Each test runs a command once in this process without sharding and once as 2 launched
processes sharded by FSDP2 on the same global batch, then checks that the numbers agree,
that the files are complete (written from the gathered parameters by the main process
only: the other process writes nothing but its own shards and random state), and that what
the sharded run trained loads into an unsharded model and scores like the unsharded run's.
Tolerances are those of the data-parallel CLI tests (tests/test_cli_processes.py): the same
sums in another order.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ropekit.backbone import open_backbone, read_adapter
from ropekit.cli import main
from ropekit.data import load_corpus
from ropekit.model import load_decoder

from .processes import launch, writes
from .test_cli_processes import PRETRAIN
from .tiny import llama_folder


@pytest.fixture(autouse=True)
def one_thread():
    """One thread in this process, as each launched process has (OMP_NUM_THREADS=1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("tiny-llama"))


def _launch_ok(args: list[str], root: Path) -> str:
    done = launch(args, root)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _only_own_shards(paths: set[str]) -> bool:
    """What a non-main process of a sharded run writes: its RNG streams and its shards, inside
    a checkpoint's temporary folder (DCP's writer also makes sure that folder exists)."""
    folder = re.compile(r"(.*/)?checkpoints/\.tmp-step-\d+")
    return all(
        folder.fullmatch(p)
        or (folder.fullmatch(p.rsplit("/", 1)[0]) and p.endswith(("/rng-1.pt", "/__1_0.distcp")))
        for p in paths
    )


def test_pretrain_sharded_over_two_processes_matches_one_unsharded(tmp_path, capsys):
    assert main(["pretrain", "--out", str(tmp_path / "one"), *PRETRAIN]) == 0
    capsys.readouterr()
    root = tmp_path / "two"
    stdout = _launch_ok(["pretrain", "--out", str(root / "run"), *PRETRAIN, "--fsdp"], root)
    assert stdout.count("final loss") == 1

    one = json.loads((tmp_path / "one" / "pretrain.json").read_text())
    two = json.loads((root / "run" / "pretrain.json").read_text())
    assert (one["num_processes"], two["num_processes"]) == (1, 2)
    assert two["train"]["fsdp"] is True and one["train"]["fsdp"] is False
    assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-5)
    trained = load_decoder(root / "run" / "model").state_dict()  # complete: sha256 checked
    for name, weight in load_decoder(tmp_path / "one" / "model").state_dict().items():
        torch.testing.assert_close(trained[name], weight, rtol=0, atol=1e-5)

    written = writes(root)
    assert {"run/pretrain.json", "run/model/model.safetensors"} <= written["0"]
    assert any(p.endswith("/__1_0.distcp") for p in written["1"])
    assert _only_own_shards(written["1"]), sorted(written["1"])


def _held_out(folder: Path) -> torch.Tensor:
    """Two windows of 129 tokens of text the extension did not train on."""
    tokenizer = open_backbone(folder).require_tokenizer()
    ids = tokenizer.encode(load_corpus("shakespeare")[0].text[:20000])
    return torch.tensor([ids[:129], ids[129:258]])


def test_extend_lora_recipe_sharded_over_two_processes_matches_one_unsharded(
    tmp_path, capsys, hf_folder
):
    args = ["extend", "--model", str(hf_folder), "--method", "adarope:init=yarn,factor=2"]
    args += ["--target-length", "128", "--samples", "4", "--batch-size", "2", "--data", "essays"]
    args += ["--recipe", "adarope->lora", "--lora-rank", "2"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    root = tmp_path / "two"
    stdout = _launch_ok([*args, "--out", str(root / "run"), "--fsdp"], root)
    assert stdout.count("extended to 128") == 1

    for stage in ("stage1", "."):
        one = json.loads((tmp_path / "one" / stage / "extend.json").read_text())
        two = json.loads((root / "run" / stage / "extend.json").read_text())
        assert two["num_processes"] == 2 and two["trainable"] == one["trainable"]
        assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-5)
        _, mine = read_adapter(root / "run" / stage / "adapter")  # sha256 checked
        _, theirs = read_adapter(tmp_path / "one" / stage / "adapter")
        for name, tensor in theirs.items():
            torch.testing.assert_close(mine[name], tensor, rtol=0, atol=1e-5)
    lora = load_file(root / "run" / "lora.safetensors")
    for name, tensor in load_file(tmp_path / "one" / "lora.safetensors").items():
        torch.testing.assert_close(lora[name], tensor, rtol=0, atol=1e-5)

    # What the sharded run trained, loaded into an unsharded model here, scores as the
    # unsharded run's does.
    ids = _held_out(hf_folder)
    sharded = open_backbone(hf_folder, adapter=root / "run").token_nll(ids, 128)
    unsharded = open_backbone(hf_folder, adapter=tmp_path / "one").token_nll(ids, 128)
    base = open_backbone(hf_folder).token_nll(ids, 128)
    assert (sharded - base).abs().max() > 1e-3  # the adapter and LoRA do change the scores
    torch.testing.assert_close(sharded, unsharded, rtol=1e-5, atol=1e-5)

    written = writes(root)
    outputs = {"extend.json", "adapter/adapter.safetensors", "lora.safetensors", "lora.json"}
    assert {f"run/{path}" for path in outputs} <= written["0"]
    assert _only_own_shards(written["1"]), sorted(written["1"])
