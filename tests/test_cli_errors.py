"""Bad input through the command line: one line on stderr naming what is wrong and what is
allowed, exit code 2, nothing overwritten."""

from __future__ import annotations

import pytest
import torch

from ropekit.cli import main

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--batch-size", "2", "--warmup", "1"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run") / "base"
    assert main(["pretrain", "--context", "32", "--steps", "2", "--out", str(out), *TINY]) == 0
    return out


def _fails(argv: list[str], capsys, *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    for word in words:
        assert word in err, (word, err)
    return err


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("rope:base", ["key=value"]),
        ("ropey", ["unknown encoding", "known:"]),
        ("linear:factor=0.5", ["factor=0.5", ">= 1"]),
        ("linear:factor=-1", ["factor=-1", ">= 1"]),
        ("rope:fraction=1.5", ["fraction", "(0, 1]"]),
    ],
)
def test_bad_specs(spec, words, tmp_path, capsys):
    out = tmp_path / "out"
    _fails(
        ["pretrain", "--encoding", spec, "--steps", "1", "--out", str(out), *TINY], capsys, *words
    )
    assert not out.exists()


def test_odd_head_dim(tmp_path, capsys):
    argv = [
        "pretrain",
        "--out",
        str(tmp_path / "o"),
        "--steps",
        "1",
        "--layers",
        "1",
        "--d-model",
        "30",
        "--heads",
        "2",
    ]
    _fails(argv, capsys, "head_dim=15", "even")


def test_non_utf8_and_empty_corpora(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine text \xff\xfe then garbage")
    _fails(
        ["pretrain", "--data", str(bad), "--out", str(tmp_path / "a"), "--steps", "1", *TINY],
        capsys,
        "bad.txt",
        "UTF-8",
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _fails(
        ["pretrain", "--data", str(empty), "--out", str(tmp_path / "b"), "--steps", "1", *TINY],
        capsys,
        "empty",
    )


def test_target_length_below_training_length(tiny_run, tmp_path, capsys):
    argv = [
        "extend",
        "--model",
        str(tiny_run),
        "--method",
        "yarn:factor=2",
        "--target-length",
        "16",
        "--out",
        str(tmp_path / "e"),
    ]
    _fails(argv, capsys, "target_length=16", "training length 32")


def test_output_folder_holding_another_run_is_refused(tiny_run, tmp_path, capsys):
    before = sorted(p.name for p in tiny_run.iterdir())
    _fails(
        ["pretrain", "--context", "32", "--steps", "2", "--out", str(tiny_run), *TINY],
        capsys,
        str(tiny_run),
        "overwrite",
    )
    assert sorted(p.name for p in tiny_run.iterdir()) == before


def test_adapter_for_another_model_and_corrupted_files(tiny_run, tmp_path, capsys):
    ext = tmp_path / "ext"
    assert (
        main(
            [
                "extend",
                "--model",
                str(tiny_run),
                "--method",
                "adarope",
                "--target-length",
                "64",
                "--samples",
                "2",
                "--out",
                str(ext),
            ]
        )
        == 0
    )
    capsys.readouterr()
    other = tmp_path / "other"
    assert (
        main(
            [
                "pretrain",
                "--context",
                "32",
                "--steps",
                "1",
                "--out",
                str(other),
                "--layers",
                "2",
                "--d-model",
                "32",
                "--heads",
                "2",
                "--batch-size",
                "2",
                "--warmup",
                "1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    evaluate = ["eval", "ppl", "--lengths", "32", "--tokens", "64", "--out", str(tmp_path / "p")]
    _fails(
        [*evaluate, "--model", str(other), "--adapter", str(ext)],
        capsys,
        "different model",
        "n_layers: expected 1, got 2",
    )
    weights = ext / "adapter" / "adapter.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])
    _fails([*evaluate, "--model", str(tiny_run), "--adapter", str(ext)], capsys, "corrupted")
    model_file = tiny_run / "model" / "model.safetensors"
    good = model_file.read_bytes()
    try:
        model_file.write_bytes(good[: len(good) // 2])
        _fails([*evaluate, "--model", str(tiny_run)], capsys, "model.safetensors")
    finally:
        model_file.write_bytes(good)
