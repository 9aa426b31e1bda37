"""End-to-end tests of the command line on tiny inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ropekit.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_encodings_lists_every_encoding_with_options(capsys):
    from ropekit.encodings import names

    assert main(["encodings"]) == 0
    out = capsys.readouterr().out
    for name in names():
        assert f"\n{name} " in "\n" + out
    assert "original_length" in out and "required" in out  # mixed's method
    # What a spec may omit is not called required (dca and rerope build without options):
    dca = out.split("\ndca ", 1)[1].split("\nstring ", 1)[0]
    assert "required" not in dca
    assert "from the model" in dca.split("original_length", 1)[1].split("\n", 1)[0]
    assert "N / L0 (extend, compare)" in out


def test_help_lists_the_commands_without_loading_torch():
    """`ropekit --help` and a mistyped command are answered from the command table alone (torch
    and transformers took about 5 s to load for them); the listing is the full parser's, built
    afterwards in the same process (so at the same terminal width)."""
    code = (
        "import contextlib, io, json, sys\n"
        "from ropekit.cli import build_parser, main\n"
        "shown = io.StringIO()\n"
        "with contextlib.redirect_stdout(shown):\n"
        "    codes = [main(['--help']), main(['extnd'])]\n"
        "loaded = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "full = build_parser().format_help()\n"
        "print(json.dumps({'codes': codes, 'loaded': loaded, 'shown': shown.getvalue(), "
        "'full': full}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["codes"] == [0, 2] and out["loaded"] == []
    assert "invalid choice: 'extnd'" in done.stderr
    assert out["shown"] == out["full"] and "demo" in out["full"] and "report" in out["full"]


def test_a_ropekit_decoder_is_trained_and_scored_without_loading_transformers(tmp_path):
    """transformers takes about 4 s of CPU to import, twice torch: importing ropekit's packages,
    `ropekit pretrain` and `ropekit eval ppl` on a ropekit Decoder never load it (the lazy names
    of ropekit.hf and ropekit.backbone); importing them does not load FSDP's DTensor either
    (train/sharding.py: 1.7 s, which building torch's AdamW loads anyway in a training
    process); a transformers model still gets its own backbone."""
    run, scores = str(tmp_path / "run"), str(tmp_path / "scores")
    pretrain = ["pretrain", "--out", run, "--layers", "1", "--d-model", "32", "--heads", "2",
                "--batch-size", "2", "--warmup", "1", "--context", "32",
                "--steps", "2"]  # fmt: skip
    score = ["eval", "ppl", "--model", run, "--lengths", "32", "--out", scores]
    code = (
        "import json, sys\n"
        "import ropekit.analysis, ropekit.backbone, ropekit.compare, ropekit.evals\n"
        "import ropekit.hf, ropekit.serve, ropekit.train\n"
        "from ropekit.cli import main\n"
        "imported = [m for m in ('transformers', 'torch.distributed.tensor') if m in sys.modules]\n"
        f"codes = [main({pretrain!r}), main({score!r})]\n"
        "loaded = imported + ['transformers'] * ('transformers' in sys.modules)\n"
        "from tests.tiny import tiny_model\n"
        "from ropekit.backbone import HFBackbone, as_backbone\n"
        "hf = type(as_backbone(tiny_model('llama', small=True))).__name__\n"
        "print(json.dumps({'codes': codes, 'loaded': loaded, 'hf': hf}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out == {"codes": [0, 0], "loaded": [], "hf": "HFBackbone"}, out


def test_each_command_parses_with_its_own_options_alone(capsys):
    """main builds only the named command's options: its --help shows them, opening with the
    command's summary, and the other commands' options are not built."""
    assert main(["inspect", "--help"]) == 0
    out = capsys.readouterr().out
    assert "What each serving engine does" in out and "llama.cpp" in out and "--json" in out
    parser = build_parser(["inspect"])
    commands = parser._subparsers._group_actions[0].choices
    assert [a.dest for a in commands["extend"]._actions] == ["help"]
    assert "json" in [a.dest for a in commands["inspect"]._actions]


def test_schedules_writes_png_and_json(tmp_path, capsys):
    code = main(
        [
            "schedules",
            "--methods",
            "rope,linear,ntk,yarn,llama3",
            "--head-dim",
            "64",
            "--base",
            "10000",
            "--factor",
            "8",
            "--original-length",
            "512",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    data = json.loads((tmp_path / "schedules.json").read_text())
    assert [m["method"] for m in data["methods"]] == ["rope", "linear", "ntk", "yarn", "llama3"]
    assert all(len(m["inv_freq"]) == 32 for m in data["methods"])
    assert data["meta"]["versions"]["torch"]
    png = (tmp_path / "schedules.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert str(tmp_path / "schedules.png") in capsys.readouterr().out


def test_schedules_takes_specs_with_several_options(tmp_path):
    """A spec's own options keep their commas in --methods, as compare's do (each comma was
    once a new method: 'beta_fast=16' refused as an encoding name)."""
    argv = ["schedules", "--methods", "yarn:factor=4,beta_fast=16,rope", "--out", str(tmp_path)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "schedules.json").read_text())
    assert [m["method"] for m in data["methods"]] == ["yarn:factor=4,beta_fast=16", "rope"]


def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert main(["schedules", "--methods", "yarn:factor=0.5", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "factor=0.5" in err and ">= 1" in err
    assert not (tmp_path / "schedules.json").exists()


def test_pretrain_resume_and_eval_ppl_on_tiny_settings(tmp_path, capsys):
    import torch

    torch.set_num_threads(1)
    out = tmp_path / "run"
    tiny = [
        "--context",
        "32",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--batch-size",
        "2",
        "--warmup",
        "1",
        "--steps",
        "4",
        "--checkpoint-interval",
        "2",
    ]
    assert main(["pretrain", "--out", str(out), *tiny]) == 0
    summary = json.loads((out / "pretrain.json").read_text())
    assert summary["tokens"] == 4 * 2 * 32 and summary["parameters"] > 0
    weights = (out / "model" / "model.safetensors").read_bytes()
    # Resuming a finished run trains nothing more and leaves the model as it was.
    assert main(["pretrain", "--out", str(out), "--resume", *tiny]) == 0
    assert (out / "model" / "model.safetensors").read_bytes() == weights
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "ppl",
                "--model",
                str(out),
                "--lengths",
                "32,64",
                "--tokens",
                "128",
                "--out",
                str(tmp_path / "ppl"),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "ppl" / "ppl.json").read_text())
    assert [r["length"] for r in result["results"]] == [32, 64]
    assert all(0 < r["bits_per_byte"] < 9 for r in result["results"])
    assert "ppl.png" in printed


def test_extend_with_pose_and_grad_checkpointing_on_a_tiny_decoder(tmp_path, capsys):
    import torch

    from ropekit.model import Decoder, DecoderConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = DecoderConfig(d_model=32, n_layers=2, n_heads=2, context_length=32)
    Decoder(config).save(tmp_path / "model")
    out = tmp_path / "ext"
    args = [
        "extend",
        "--model",
        str(tmp_path / "model"),
        "--method",
        "adarope:init=yarn,factor=4",
        "--target-length",
        "128",
        "--samples",
        "4",
        "--batch-size",
        "2",
        "--pose",
        "--pose-window",
        "16",
        "--grad-checkpointing",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "64 tokens, PoSE windows" in printed and str(out) in printed
    summary = json.loads((out / "extend.json").read_text())
    assert summary["tokens"] == 4 * 16 and summary["pose_window"] == 16
    assert summary["config"]["pose"] and summary["config"]["grad_checkpointing"]
    assert (out / "adapter" / "adapter.safetensors").exists()
    assert main([*args[:-2], "--pose-window", "256", "--out", str(tmp_path / "bad")]) == 2
    assert "pose_window=256" in capsys.readouterr().err
