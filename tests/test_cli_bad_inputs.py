"""Every error a user can cause through the command line, as a table: each bad input must end
with exit code 2, one line on stderr naming what is wrong, and no file changed (nothing
written, nothing replaced, nothing removed) in the folders the command was pointed at.

The folders are real runs made once for the module by the CLI itself: a tiny pretrained
decoder, an AdaRoPE extension of it, a perplexity and a passkey evaluation of it, and a tiny
Hugging Face folder with a BPE tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ropekit.cli import main

from .tiny import llama_folder

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--batch-size", "2", "--warmup", "1"]
ROOT = Path(__file__).resolve().parents[1]


def _hf_folder(folder: Path, max_positions: int = 64) -> Path:
    """tests/tiny.py's Hugging Face folder with one layer and a tokenizer of one essay."""
    return llama_folder(folder, layers=1, max_positions=max_positions, essays=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("runs")
    base, ext = root / "base", root / "ext"
    ok = [
        ["pretrain", "--context", "32", "--steps", "2", "--out", str(base), *TINY],
        ["extend", "--model", str(base), "--method", "adarope:init=yarn,factor=2",
         "--target-length", "64", "--samples", "2", "--out", str(ext)],
        ["eval", "ppl", "--model", str(base), "--lengths", "32", "--tokens", "64",
         "--out", str(root / "ppl")],
        ["eval", "passkey", "--model", str(base), "--lengths", "96", "--depths", "1",
         "--samples", "1", "--out", str(root / "passkey")],
        ["schedules", "--out", str(root / "schedules")],
    ]  # fmt: skip
    try:
        for argv in ok:
            assert main(argv) == 0, argv
        # Another model of the same shape: its results must never be taken for base's.
        other = root / "other"
        assert main(["pretrain", "--context", "32", "--steps", "2", "--seed", "1",
                     "--out", str(other), *TINY]) == 0  # fmt: skip
        _hf_folder(root / "hf")
    finally:
        torch.set_num_threads(threads)
    (root / "a_file.txt").write_text("not a folder\n")
    return {
        "root": root, "base": base, "ext": ext, "ppl": root / "ppl",
        "passkey": root / "passkey", "other": other, "hf": root / "hf",
        "schedules": root / "schedules",
        "file": root / "a_file.txt",
    }  # fmt: skip


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` with a digest of its content."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if "__pycache__" in path.parts:
            continue
        key = path.relative_to(folder).as_posix()
        out[key] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this should never run",))


def _damaged(runs: dict[str, Path], tmp: Path, what: str) -> Path:
    """A copy of a run with one file damaged (made per case, in the case's own folder)."""
    if what == "hf-config":
        folder = shutil.copytree(runs["hf"], tmp / "hf-bad-config")
        (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    elif what == "hf-pickle":  # weights that would run code when unpickled
        folder = shutil.copytree(runs["hf"], tmp / "hf-pickle")
        (folder / "model.safetensors").unlink()
        torch.save({"x": _RunsCode()}, folder / "pytorch_model.bin")
    elif what == "hf-weights":
        folder = shutil.copytree(runs["hf"], tmp / "hf-bad-weights")
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif what == "decoder-weights":
        folder = shutil.copytree(runs["base"] / "model", tmp / "bad-model")
        data = bytearray((folder / "model.safetensors").read_bytes())
        data[-9] ^= 0xFF  # one flipped bit pattern in the last weight
        (folder / "model.safetensors").write_bytes(bytes(data))
    elif what == "adapter":
        folder = shutil.copytree(runs["ext"] / "adapter", tmp / "bad-adapter")
        data = bytearray((folder / "adapter.safetensors").read_bytes())
        data[-5] ^= 0x01
        (folder / "adapter.safetensors").write_bytes(bytes(data))
    elif what == "lora-rank":
        folder = shutil.copytree(runs["ext"], tmp / "lora-run")
        meta = json.loads((folder / "adapter" / "adapter.json").read_text())
        assert meta["spec"]  # a run folder, positional adapter intact
        (folder / "lora.json").write_text(json.dumps({"format": "ropekit-lora"}))
        (folder / "lora.safetensors").write_bytes(b"\x08" + b"\x00" * 15)
    elif what == "comparison":  # a compare folder whose compare.json was cut short
        folder = tmp / "bad-compare"
        folder.mkdir()
        (folder / "compare.json").write_text('{"kind": "compare", "format_version": 2, "verd')
    elif what == "parquet":  # not parquet at all: pyarrow's message names no file
        folder = tmp / "bad.parquet"
        folder.write_bytes(b"PAR1 but not really\n")
    elif what == "fifo":  # exists, so "no such file" would mislead
        folder = tmp / "fifo.txt"
        os.mkfifo(folder)
    elif what == "checkpoints":  # a run folder whose checkpoints path is a file
        folder = tmp / "run"
        folder.mkdir()
        (folder / "checkpoints").write_text("not a folder\n")
    else:  # pragma: no cover - a typo in the table
        raise AssertionError(what)
    return folder


# (id, argv with {placeholders}, words the message must hold)
CASES: list[tuple[str, str, tuple[str, ...]]] = [
    # Specs and schedules.
    ("spec-overflow", "schedules --methods ntk:factor=1e308 --out {tmp}/s", ("factor",)),
    ("factor-overflow", "schedules --factor 1e308 --out {tmp}/s", ("factor",)),
    ("factor-nan", "schedules --factor nan --out {tmp}/s", ("--factor", "finite")),
    ("factor-below-1", "schedules --factor 0.5 --out {tmp}/s", ("factor",)),
    ("unknown-method", "schedules --methods banana --out {tmp}/s", ("unknown encoding",)),
    ("odd-head-dim", "schedules --head-dim 7 --out {tmp}/s", ("head_dim",)),
    ("methods-repeat", "schedules --methods rope,yarn,rope --out {tmp}/s", ("repeat", "'rope'")),
    (
        "method-in-list",
        "schedules --methods rope,bogus --out {tmp}/s",
        ("unknown encoding 'bogus'",),
    ),
    (
        "method-bracket",
        "schedules --methods longrope:long_factor=[1,2 --out {tmp}/s",
        ("--methods", "unmatched '['"),
    ),
    (
        "passkey-lengths-too-short",
        "eval passkey --model {base} --lengths 16,32 --out {tmp}/pk",
        ("no task fits any of the lengths", "length >= "),
    ),
    (
        "probe-needles-past-the-length",
        "eval probes --model {base} --lengths 128 --needles 100000 --out {tmp}/pr",
        ("needles=100000", "at most 21"),
    ),
    (
        "probe-haystacks-absurd",
        "eval probes --model {base} --lengths 128 --haystacks 1000000000 --out {tmp}/pr",
        ("prompt tokens", "limit"),
    ),
    (
        "search-budget-absurd",
        "search --model {base} --target-length 128 --budget 1000000000 --out {tmp}/sr",
        ("tokens to score", "the limit is"),
    ),
    ("head-dim-text", "schedules --head-dim x --out {tmp}/s", ("--head-dim", "integer")),
    ("negative-base", "schedules --base -1 --out {tmp}/s", ("base",)),
    ("zero-original-length", "schedules --original-length 0 --out {tmp}/s", ("original_length",)),
    (
        "schedules-other-settings",
        "schedules --factor 4 --out {schedules}",
        ("other settings", "factor"),
    ),
    # pretrain: encoding, numbers, data, folders, resume identity.
    ("pretrain-spec-overflow", "pretrain --encoding ntk:factor=1e308 --out {tmp}/p", ("factor",)),
    ("pretrain-malformed-spec", "pretrain --encoding rope:base= --out {tmp}/p", ("key=value",)),
    ("pretrain-unknown-spec", "pretrain --encoding banana --out {tmp}/p", ("unknown encoding",)),
    ("lr-huge", "pretrain --lr 1e30 --out {tmp}/p", ("lr=",)),
    ("lr-nan", "pretrain --lr nan --out {tmp}/p", ("--lr", "finite")),
    ("lr-negative", "pretrain --lr -1 --out {tmp}/p", ("lr=",)),
    ("steps-zero", "pretrain --steps 0 --out {tmp}/p", ("steps=",)),
    ("steps-fraction", "pretrain --steps 1.5 --out {tmp}/p", ("--steps", "integer")),
    ("batch-zero", "pretrain --batch-size 0 --out {tmp}/p", ("batch_size=",)),
    ("answer-weight-nan", "pretrain --answer-weight nan --out {tmp}/p", ("--answer-weight",)),
    ("answer-weight-negative", "pretrain --answer-weight -1 --out {tmp}/p", ("answer_weight",)),
    ("retrieval-ratio-negative", "pretrain --retrieval-ratio -1 --out {tmp}/p", ("ratio",)),
    ("retrieval-ratio-above-1", "pretrain --retrieval-ratio 2 --out {tmp}/p", ("ratio",)),
    ("retrieval-kind", "pretrain --retrieval-kinds banana --out {tmp}/p", ("kinds",)),
    ("warmup-above-steps", "pretrain --steps 10 --warmup 20 --out {tmp}/p", ("warmup_steps",)),
    ("context-zero", "pretrain --context 0 --out {tmp}/p", ("context_length",)),
    ("heads-do-not-divide", "pretrain --d-model 30 --heads 4 --out {tmp}/p", ("d_model",)),
    ("kv-heads-do-not-divide", "pretrain --heads 4 --kv-heads 3 --out {tmp}/p", ("kv_heads",)),
    ("missing-data-file", "pretrain --data {tmp}/none.txt --out {tmp}/p", ("none.txt",)),
    ("unknown-corpus", "pretrain --data banana --out {tmp}/p", ("banana",)),
    ("out-is-a-file", "pretrain --steps 1 --out {file}", ("a_file.txt",)),
    ("out-under-a-file", "pretrain --steps 1 --out {file}/run", ("a_file.txt",)),
    ("out-name-too-long", "pretrain --steps 1 --out {tmp}/" + "x" * 300, ("300 bytes", "255")),
    ("out-not-writable", "pretrain --steps 1 --out /proc/ropekit-run", ("/proc/ropekit-run",)),
    ("out-holds-a-run", "pretrain --steps 2 --out {base}", ("resume", "overwrite")),
    ("resume-and-overwrite", "pretrain --steps 2 --resume --overwrite --out {tmp}/p", ("resume",)),
    (
        "resume-other-encoding",
        "pretrain {tiny} --steps 4 --resume --encoding alibi --out {base}",
        ("other settings", "encoding"),
    ),
    (
        "resume-other-spec-option",
        "pretrain {tiny} --steps 4 --resume --encoding rope:base=500000 --out {base}",
        ("other settings", "rope:base=500000"),
    ),
    (
        "resume-other-data",
        "pretrain {tiny} --steps 4 --resume --data kjv --out {base}",
        ("other settings", "data."),
    ),
    # extend.
    (
        "factor-too-small",
        "extend --model {base} --method yarn:factor=2 --target-length 128 --out {tmp}/e",
        ("factor=2", "factor >= 4"),
    ),
    (
        "target-below-training",
        "extend --model {base} --method yarn:factor=2 --target-length 16 --out {tmp}/e",
        ("training length",),
    ),
    (
        "extend-unknown-spec",
        "extend --model {base} --method banana --target-length 64 --out {tmp}/e",
        ("unknown encoding",),
    ),
    (
        "extend-lr-huge",
        "extend --model {base} --method adarope --target-length 64 --lr 1e30 --out {tmp}/e",
        ("lr=",),
    ),
    (
        "extend-lr-inf",
        "extend --model {base} --method adarope --target-length 64 --lr inf --out {tmp}/e",
        ("--lr", "finite"),
    ),
    (
        "extend-samples-zero",
        "extend --model {base} --method adarope --target-length 64 --samples 0 --out {tmp}/e",
        ("samples=",),
    ),
    (
        "pose-window-one",
        "extend --model {base} --method adarope --target-length 64 --pose "
        "--pose-window 1 --out {tmp}/e",
        ("pose_window",),
    ),
    (
        "pose-window-without-pose",
        "extend --model {base} --method adarope --target-length 64 --pose-window 8 --out {tmp}/e",
        ("pose_window", "--pose"),
    ),
    (
        "pose-with-retrieval",
        "extend --model {base} --method adarope --target-length 64 --pose "
        "--retrieval-ratio 0.5 --out {tmp}/e",
        ("retrieval_ratio",),
    ),
    (
        "retrieval-ratio-nan",
        "extend --model {base} --method adarope --target-length 64 "
        "--retrieval-ratio nan --out {tmp}/e",
        ("--retrieval-ratio",),
    ),
    (
        "unknown-mode",
        "extend --model {base} --method adarope --target-length 64 --mode full --out {tmp}/e",
        ("--mode",),
    ),
    (
        "recipe-family",
        "extend --model {base} --method yarn:factor=2 --target-length 64 "
        "--recipe adarope->lora --out {tmp}/e",
        ("recipe",),
    ),
    (
        "adapter-replaced",
        "extend --model {base} --adapter {ext} --method yarn:factor=2 "
        "--target-length 64 --out {tmp}/e",
        ("adapter", "--method"),
    ),
    (
        "missing-model",
        "extend --model {tmp}/nothing --method adarope --target-length 64 --out {tmp}/e",
        ("nothing",),
    ),
    (
        "extend-out-holds-a-run",
        "extend --model {base} --method adarope --target-length 64 --out {ext}",
        ("already holds an extension run",),
    ),
    (
        "extend-resume-and-overwrite",
        "extend --model {base} --method adarope --target-length 64 "
        "--resume --overwrite --out {tmp}/e",
        ("overwrite",),
    ),
    (
        "samples-beyond-data",
        "extend --model {base} --method adarope --target-length 64 --samples 100000 --out {tmp}/e",
        ("samples=100000",),
    ),
    (
        "extend-resume-other-model",
        "extend --model {other} --method adarope:init=yarn,factor=2 "
        "--target-length 64 --samples 2 --resume --out {ext}",
        ("other settings", "model"),
    ),
    # eval.
    ("ppl-length-zero", "eval ppl --model {base} --lengths 0 --out {tmp}/q", ("lengths=",)),
    ("ppl-length-text", "eval ppl --model {base} --lengths a,b --out {tmp}/q", ("--lengths",)),
    (
        "ppl-tokens-not-multiple",
        "eval ppl --model {base} --lengths 32 --tokens 7 --out {tmp}/q",
        ("n_tokens",),
    ),
    (
        "ppl-stride-zero",
        "eval ppl --model {base} --lengths 32 --stride 0 --out {tmp}/q",
        ("stride",),
    ),
    (
        "ppl-other-model",
        "eval ppl --model {other} --lengths 32 --tokens 64 --out {ppl}",
        ("other settings", "model"),
    ),
    (
        "ppl-other-data",
        "eval ppl --model {base} --lengths 32 --tokens 64 --data kjv --out {ppl}",
        ("other settings", "data"),
    ),
    (
        "ppl-corrupt-adapter",
        "eval ppl --model {base} --adapter {bad:adapter} --lengths 32 --out {tmp}/q",
        ("sha256",),
    ),
    (
        "ppl-missing-adapter",
        "eval ppl --model {base} --adapter {tmp}/none --lengths 32 --out {tmp}/q",
        ("none",),
    ),
    (
        "ppl-bad-lora",
        "eval ppl --model {base} --adapter {bad:lora-rank} --lengths 32 --out {tmp}/q",
        ("lora",),
    ),
    (
        "ppl-corrupt-model",
        "eval ppl --model {bad:decoder-weights} --lengths 32 --out {tmp}/q",
        ("model.safetensors",),
    ),
    (
        "hf-pickled-code",
        "eval ppl --model {bad:hf-pickle} --lengths 32 --out {tmp}/q",
        ("pickled weights", "refused", "posix.system"),
    ),
    (
        "hf-corrupt-config",
        "eval ppl --model {bad:hf-config} --lengths 32 --out {tmp}/q",
        ("config.json",),
    ),
    (
        "hf-corrupt-weights",
        "eval ppl --model {bad:hf-weights} --lengths 32 --out {tmp}/q",
        ("hf-bad-weights",),
    ),
    (
        "passkey-into-a-pretrain-run",
        "eval passkey --model {base} --lengths 96 --depths 1 --samples 1 --out {base}",
        ("summary.json",),
    ),
    (
        "passkey-other-model",
        "eval passkey --model {other} --lengths 96 --depths 1 --samples 1 --out {passkey}",
        ("other settings", "model"),
    ),
    (
        "passkey-other-adapter",
        "eval passkey --model {base} --adapter {ext} --lengths 96 "
        "--depths 1 --samples 1 --out {passkey}",
        ("other settings",),
    ),
    (
        "passkey-depths-zero",
        "eval passkey --model {base} --lengths 96 --depths 0 --out {tmp}/k",
        ("--depths",),
    ),
    (
        "passkey-samples-zero",
        "eval passkey --model {base} --lengths 96 --samples 0 --out {tmp}/k",
        ("samples=",),
    ),
    (
        "threshold-above-1",
        "eval passkey --model {base} --lengths 96 --threshold 2 --out {tmp}/k",
        ("threshold=",),
    ),
    (
        "ruler-unknown-task",
        "eval ruler --model {base} --lengths 96 --tasks banana --out {tmp}/k",
        ("banana",),
    ),
    # analyze, models, export, report.
    ("analyze-length-one", "analyze --model {base} --lengths 1 --out {tmp}/a", ("lengths",)),
    (
        "analyze-beta-nan",
        "analyze --model {base} --lengths 32 --betas nan --out {tmp}/a",
        ("--betas",),
    ),
    (
        "analyze-windows-zero",
        "analyze --model {base} --lengths 32 --windows 0 --out {tmp}/a",
        ("n_windows",),
    ),
    (
        "analyze-capture",
        "analyze --model {base} --lengths 32 --capture banana --out {tmp}/a",
        ("capture",),
    ),
    (
        "analyze-influence-windows",
        "analyze --model {base} --lengths 32 --windows 1 --influence-windows 5 --out {tmp}/a",
        ("influence_windows",),
    ),
    ("install-unknown-model", "models install banana", ("banana",)),
    ("export-missing-adapter", "export --model {hf} --adapter {tmp}/none --out {tmp}/x", ("none",)),
    ("report-empty-folder", "report {tmp}/empty", ("no result",)),
    ("report-missing-folder", "report {tmp}/nowhere", ("nowhere",)),
    ("report-cut-comparison", "report {bad:comparison}", ("compare.json", "not valid JSON")),
    # Round three (issue 57): each once exit 0, a traceback, a lost run or a useless line.
    ("methods-empty", "schedules --methods= --out {tmp}/s", ("--methods", "names no method")),
    ("methods-only-commas", "schedules --methods=, --out {tmp}/s", ("--methods", "no method")),
    (
        "compare-methods-empty",
        "compare --model {base} --target-length 64 --methods=, --out {tmp}/c",
        ("--methods", "names no method"),
    ),
    (
        "spec-value-100k-digits",
        "pretrain --encoding rope:base=" + "9" * 100_000 + " --out {tmp}/p",
        ("rope:base=999", "(100,013 characters)", "base=inf", "finite"),
    ),
    (
        "schedules-base-past-float32",
        "schedules --base 1e300 --out {tmp}/s",
        ("base=1e+300", "wavelength", "float32"),
    ),
    ("alibi-option", "pretrain --encoding alibi:base=2 --out {tmp}/p", ("'base'", "no options")),
    (
        "parquet-damaged",
        "pretrain --data {bad:parquet} --out {tmp}/p",
        ("bad.parquet", "not a readable parquet file"),
    ),
    ("data-fifo", "pretrain --data {bad:fifo} --out {tmp}/p", ("fifo.txt", "not a regular file")),
    (
        "export-decoder-run",
        "export --model {base} --spec yarn:factor=2 --out {tmp}/x",
        ("ropekit decoder run", "cannot be exported", "Hugging Face folder"),
    ),
    (
        "export-out-under-a-file",
        "export --model {hf} --spec yarn:factor=2 --out {file}/x",
        ("a_file.txt is a file, not a folder",),
    ),
    (
        "export-out-is-a-file",
        "export --model {hf} --spec yarn:factor=2 --out {file}",
        ("a_file.txt: it is a file, not a folder",),
    ),
    (
        "inspect-json-under-a-file",
        "inspect {hf} --json {file}/report.json",
        ("a_file.txt is a file, not a folder",),
    ),
    (
        "checkpoints-is-a-file",
        "pretrain {tiny} --steps 12 --checkpoint-interval 10 --overwrite --out {bad:checkpoints}",
        ("checkpoints: it is a file, not a folder",),
    ),
    (
        "probes-far-past-the-reach",  # once accepted: it fit in memory, then ran for days
        "eval probes --model {base} --lengths 10000000 --out {tmp}/pr",
        ("estimated at", "days", "(312,500x)", "--yes"),
    ),
    (
        "search-far-past-the-reach",
        "search --model {base} --target-length 1000000 --budget 400 --out {tmp}/sr",
        ("estimated at", "(31,250x)", "--yes"),
    ),
    (
        "extend-batch-above-samples",
        "extend --model {base} --method adarope --target-length 64 --samples 2 --batch-size 4 "
        "--out {tmp}/e",
        ("batch_size=4", "samples=2"),
    ),
]


def _argv(template: str, runs: dict[str, Path], tmp: Path) -> list[str]:
    argv = []
    template = template.replace("{tiny}", "--context 32 " + " ".join(TINY))
    for word in template.split():
        for key in ("tmp", *runs):
            word = word.replace("{" + key + "}", str(tmp if key == "tmp" else runs[key]))
        if word.startswith("{bad:"):
            word = str(_damaged(runs, tmp, word[5:-1]))
        argv.append(word)
    return argv


def test_the_table_has_at_least_sixty_inputs():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("case", "template", "words"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, template, words, runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ROPEKIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    argv = _argv(template, runs, tmp_path)
    before = {"runs": _snapshot(runs["root"]), "tmp": _snapshot(tmp_path)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(argv)
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip()
    assert code == 2, (case, code, err)
    assert err.count("\n") == 0 and err, (case, err)
    assert len(err) < 1000, (case, len(err))  # a value echoed whole is cut (options.one_line)
    for word in words:
        assert word in err, (case, word, err)
    assert _snapshot(runs["root"]) == before["runs"], case
    assert _snapshot(tmp_path) == before["tmp"], case


def _subprocess(args: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1", **env}
    command = [sys.executable, "-m", "ropekit.cli", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, **kwargs)


def test_a_bad_environment_value_is_one_line(runs, tmp_path):
    before = _snapshot(runs["root"])
    done = _subprocess(
        ["eval", "ppl", "--model", str(runs["base"]), "--lengths", "32", "--tokens", "64",
         "--out", str(tmp_path / "q")],
        {"ROPEKIT_COMPILE": "banana"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "ROPEKIT_COMPILE" in done.stderr
    assert _snapshot(runs["root"]) == before and not (tmp_path / "q").exists()


def test_a_closed_pipe_ends_quietly():
    """`ropekit encodings | true`: the reader is gone before the first line is written."""
    reader = subprocess.Popen(["true"], stdin=subprocess.PIPE)
    reader.wait()
    writer = subprocess.run(
        [sys.executable, "-m", "ropekit.cli", "encodings"],
        cwd=ROOT,
        stdout=reader.stdin,
        stderr=subprocess.PIPE,
        text=True,
    )
    reader.stdin.close()
    assert writer.returncode == 0 and writer.stderr == "", writer.stderr


def test_resume_refuses_other_files_of_the_same_size(tmp_path, capsys):
    """The data fingerprint is a digest of every token, not the files' names or sizes."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    for i in range(12):  # whole documents go to one split or the other, by a hash of the text
        text = "".join(f"line {j} of document {i:02d}.\n" for j in range(200))
        (tmp_path / "a" / f"doc{i}.txt").write_text(text)
        (tmp_path / "b" / f"doc{i}.txt").write_text(text.replace("line", "LINE"))
    out = tmp_path / "run"
    args = ["pretrain", "--context", "32", "--steps", "2", *TINY, "--out", str(out)]
    assert main([*args, "--data", str(tmp_path / "a" / "*.txt")]) == 0
    capsys.readouterr()
    before = _snapshot(out)
    resumed = [*args, "--steps", "4", "--resume", "--data", str(tmp_path / "b" / "*.txt")]
    assert main(resumed) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "data.tokens" in err, err
    assert _snapshot(out) == before


def test_an_overwrite_that_fails_at_its_first_step_leaves_the_old_run(runs, capsys):
    """`--overwrite` with a config that fails at step 1 (a learned table too short for the
    context) once removed the finished run's checkpoints, metrics and summary first, leaving
    neither run; the run it replaces is set aside until the new one's first checkpoint."""
    before = _snapshot(runs["root"])
    argv = ["pretrain", "--context", "32", *TINY, "--steps", "2", "--overwrite",
            "--encoding", "learned:max_length=8", "--out", str(runs["base"])]  # fmt: skip
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("ropekit pretrain: error: position 31 is past the learned table"), last
    assert _snapshot(runs["root"]) == before


def test_the_command_line_never_reaches_a_network(monkeypatch, capsys):
    """Models and data come from installed packages: every command runs offline."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    assert main(["encodings"]) == 0
    capsys.readouterr()
    assert [os.environ.get(v) for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")] == ["1", "1"]
