"""Every `ropekit ...` command that README.md and docs/ show runs (issue 29: the README's own
compare example once failed).

The commands are read from the documents themselves: inline code spans and lines of code
blocks that start with `ropekit ` (`a\\|b` alternatives expanded, `[...]` optional parts
dropped). Each must appear in `STAND_INS`, which runs it on tiny stand-ins, because the real
ones take minutes to hours here; the substitutions, stated once:

- `M`, `smollm2-135m` -> a 1-layer Llama of 32 dims with a BPE tokenizer (L0 = 64 tokens;
  1,024 for experiment D's config, whose DCA has a local size of 512);
- `N` -> 256 (4 x L0) where the command extends, `A` -> an AdaRoPE adapter of that model,
  `runs/...` and `DIR` -> folders under the test's temporary directory;
- lengths in the thousands -> tens or hundreds, `--budget 24` as written, one sample and two
  depths per retrieval length;
- a decoder pretrained from scratch gets the tiny size flags (1 layer, 32 dims, 2 steps);
- a config file of a committed experiment -> the same command with its model, lengths and
  sample counts overridden to the stand-ins (the config's methods and protocol kept);
- a command named without options (`ropekit search`) -> its `--help`.

A command added to the documents without a stand-in fails `test_every_documented_command_
has_a_stand_in`, naming it.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from ropekit.cli import main

from .test_cli_bad_inputs import _hf_folder

ROOT = Path(__file__).resolve().parents[1]
# docs/cli.md is generated from the parser (tests/test_cli_reference.py holds it to it).
DOCUMENTS = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").rglob("*.md")))]
DOCUMENTS = [p for p in DOCUMENTS if p.name != "cli.md"]

TINY = "--layers 1 --d-model 32 --heads 2 --batch-size 2 --warmup 1 --steps 2"

# documented command -> the stand-in run (placeholders: {hf} model, {ada} and {shared}
# adapters, {yarn_hf} the model exported with yarn:factor=2, {yarn_gguf} the same as GGUF,
# {ada_vllm} {ada} exported for the vLLM plugin, {se_gguf} Self-Extend (llama.cpp's mode) as
# GGUF, {ood} a copy of experiment D's comparison, {out} a fresh folder)
STAND_INS: dict[str, str] = {
    "ropekit analyze": "analyze --help",
    "ropekit compare --executor ray": "compare --help",  # ray is an extra: make test-ray
    "ropekit compare --config c.json --out DIR --executor ray --job-cpus 2": "compare --help",
    "ropekit analyze --model M --adapter A --lengths 512,2048 --out DIR":
        "analyze --model {hf} --adapter {ada} --lengths 16,64 --out {out}",
    "ropekit compare --config experiments/smollm2_16k/ood.json":
        "compare --config experiments/smollm2_16k/ood.json --model {hf1k} --target-length 2048 "
        "--lengths 256,1024,2048 --samples 2 --seeds 0 --pose-window 64 --out {out}",
    "ropekit compare --model M --target-length N --methods rope,dynamic-ntk,yarn,string,adarope "
    "--eval-data shakespeare,kjv --out DIR":
        "compare --model {hf} --target-length 256 --methods rope,dynamic-ntk,yarn,string,adarope "
        "--eval-data shakespeare,kjv --samples 2 --seeds 0 --lrs 0.01 --lengths 64,256 "
        "--probe-lengths '' --out {out}",
    # run with --quick (at its test size, --tiny) by tests/test_demo.py
    "ropekit demo --quick": "demo --help",
    "ropekit encodings": "encodings",
    "ropekit eval ppl --model M --lengths 512,1024,2048 --out DIR":
        "eval ppl --model {hf} --lengths 16,32,64 --out {out}",
    "ropekit eval needle --model M --lengths 512,1024,2048 --out DIR":
        "eval needle --model {hf} --lengths 512,1024 --samples 1 --depths 2 --out {out}",
    "ropekit eval passkey --model M --lengths 512,1024,2048 --out DIR":
        "eval passkey --model {hf} --lengths 512,1024 --samples 1 --depths 2 --out {out}",
    "ropekit eval ruler --model M --lengths 512,1024,2048 --out DIR":
        "eval ruler --model {hf} --lengths 1024 --samples 1 --out {out}",
    "ropekit eval probes --model M --lengths 32768 --needles 1 --haystacks 8 --out DIR":
        "eval probes --model {hf} --lengths 512,1024 --needles 1 --haystacks 4 --out {out}",
    "ropekit export": "export --help",
    "ropekit export --model M --adapter A --format hf --out DIR":
        "export --model {hf} --adapter {shared} --format hf --out {out}",
    "ropekit export --model M --adapter A --format gguf --out DIR":
        "export --model {hf} --adapter {shared} --format gguf --out {out}",
    "ropekit export --format gguf":
        "export --model {hf} --spec yarn:factor=2 --format gguf --out {out}",
    "ropekit export --model M --adapter A --format vllm --out DIR":
        "export --model {hf} --adapter {ada} --format vllm --out {out}",
    "ropekit export --model smollm2-135m --adapter runs/ada-shared/adapter --format gguf "
    "--out runs/a":
        "export --model {hf} --adapter {shared} --format gguf --out {out}",
    "ropekit export --model smollm2-135m --adapter runs/ada/adapter --format vllm "
    "--out runs/ada-vllm":
        "export --model {hf} --adapter {ada} --format vllm --out {out}da-vllm",
    "ropekit export --model smollm2-135m --adapter runs/ada/adapter --nearest "
    "--out runs/ada-near":
        "export --model {hf} --adapter {ada} --nearest --out {out}da-near",
    "ropekit export --model smollm2-135m --spec self-extend:mode=llama.cpp,group=4,window=512 "
    "--format gguf --out runs/se-gguf":
        "export --model {hf1k} --spec self-extend:mode=llama.cpp,group=4,window=512 --format gguf "
        "--out {out}",
    "ropekit export --model smollm2-135m --spec yarn:factor=2 --format gguf --out runs/yarn-gguf":
        "export --model {hf} --spec yarn:factor=2 --format gguf --out {out}",
    "ropekit export --model smollm2-135m --spec yarn:factor=2 --out runs/yarn-hf":
        "export --model {hf} --spec yarn:factor=2 --out {out}",
    "ropekit extend --model M --method 'adarope:init=yarn,factor=8' --target-length N --out DIR":
        "extend --model {hf} --method 'adarope:init=yarn,factor=8' --target-length 512 "
        "--samples 2 --out {out}",
    "ropekit extend --pose --pose-window N --grad-checkpointing":
        "extend --model {hf} --method adarope:init=yarn --target-length 256 --samples 2 --pose "
        "--pose-window 32 --grad-checkpointing --out {out}",
    "ropekit inspect": "inspect --help",
    "ropekit inspect DIR": "inspect {yarn_hf}",
    "ropekit inspect runs/yarn-hf": "inspect {yarn_hf}",
    "ropekit inspect runs/ada-vllm": "inspect {ada_vllm}",
    "ropekit inspect runs/yarn-gguf": "inspect {yarn_gguf}",
    "ropekit inspect runs/se-gguf": "inspect {se_gguf}",
    "ropekit models install smollm2-135m": "models install --help",
    "ropekit pretrain --encoding alibi --context 512 --out DIR":
        f"pretrain --encoding alibi --context 32 {TINY} --out {{out}}",
    "ropekit schedules --methods rope,linear,ntk,yarn,llama3 --head-dim 64 --base 10000 "
    "--factor 8 --original-length 512 --out runs/schedules":
        "schedules --methods rope,linear,ntk,yarn,llama3 --head-dim 64 --base 10000 --factor 8 "
        "--original-length 512 --out {out}",
    "ropekit schedules --methods rope,linear,ntk,yarn,llama3 --out DIR":
        "schedules --methods rope,linear,ntk,yarn,llama3 --out {out}",
    "ropekit search": "search --help",
    "ropekit search --model M --target-length N --budget 24 --out DIR":
        "search --model {hf} --target-length 256 --budget 24 --samples 1 --out {out}",
    "ropekit compare": "compare --help",
    "ropekit report DIR": "report {ood}",
    "ropekit eval probes": "eval probes --help",
    "ropekit schedules": "schedules --help",
}  # fmt: skip
ORDER = sorted(STAND_INS)


def _expanded(command: str) -> list[str]:
    """`a\\|b` alternatives as separate commands, `[...]` optional parts dropped to their
    content, runs of spaces made one."""
    command = re.sub(r"\[([^\]]*)\]", r"\1", command)
    commands = [command]
    while any("\\|" in c for c in commands):
        c = next(c for c in commands if "\\|" in c)
        word = next(w for w in c.split() if "\\|" in w)
        commands.remove(c)
        commands += [c.replace(word, alt, 1) for alt in word.split("\\|")]
    return [" ".join(c.split()) for c in commands]


def documented() -> set[str]:
    found: set[str] = set()
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for span in re.findall(r"`(ropekit [^`]+)`", text):
            found.update(_expanded(span))
        block, line_so_far = False, ""
        for line in text.splitlines():
            if line.strip().startswith("```"):
                block = not block
                continue
            code = "" if line.strip().startswith("#") else line.split(" #", 1)[0].strip()
            if not block or not (line_so_far or code.startswith("ropekit ")):
                continue
            line_so_far = f"{line_so_far} {code}".strip()
            if line_so_far.endswith("\\"):
                line_so_far = line_so_far[:-1]
                continue
            found.update(_expanded(line_so_far))
            line_so_far = ""
    found.discard("ropekit <command>")  # the generic form
    return found


def test_every_documented_command_has_a_stand_in():
    missing = sorted(documented() - set(STAND_INS))
    assert not missing, f"documented commands without a stand-in in STAND_INS: {missing}"
    stale = sorted(set(STAND_INS) - documented())
    assert not stale, f"STAND_INS entries no document shows any more: {stale}"


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, Path]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("documented")
    hf = _hf_folder(root / "hf")
    made = {"hf": hf, "ada": root / "ada", "shared": root / "ada-shared"}
    made["hf1k"] = _hf_folder(root / "hf1k", max_positions=1024)  # DCA's local size 512 fits
    try:
        for name, spec in (
            ("ada", "adarope:init=yarn,factor=4"),
            ("shared", "adarope:init=yarn,factor=4,share_heads=true,share_layers=true,scale=false"),
        ):
            argv = ["extend", "--model", str(hf), "--method", spec, "--target-length", "256",
                    "--samples", "2", "--out", str(made[name])]  # fmt: skip
            assert main(argv) == 0
        made["yarn_hf"] = root / "yarn-hf"
        assert main(["export", "--model", str(hf), "--spec", "yarn:factor=2", "--out",
                     str(made["yarn_hf"])]) == 0  # fmt: skip
        made["yarn_gguf"] = root / "yarn-gguf"
        assert main(["export", "--model", str(hf), "--spec", "yarn:factor=2", "--format", "gguf",
                     "--out", str(made["yarn_gguf"])]) == 0  # fmt: skip
        made["se_gguf"] = root / "se-gguf"
        assert main(["export", "--model", str(made["hf1k"]), "--spec",
                     "self-extend:mode=llama.cpp,group=4,window=512", "--format", "gguf",
                     "--out", str(made["se_gguf"])]) == 0  # fmt: skip
        made["ada_vllm"] = root / "ada-vllm"
        assert main(["export", "--model", str(hf), "--adapter", str(made["ada"] / "adapter"),
                     "--format", "vllm", "--out", str(made["ada_vllm"])]) == 0  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    made["ada"], made["shared"] = made["ada"] / "adapter", made["shared"] / "adapter"
    made["ood"] = root / "ood"  # experiment D's committed comparison, re-rendered in a copy
    shutil.copytree(ROOT / "experiments" / "smollm2_16k" / "ood", made["ood"])
    return made


@pytest.mark.parametrize("command", ORDER, ids=lambda c: c if len(c) < 100 else c[:96] + "...")
def test_the_documented_command_runs(command, stand_ins, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # documented paths (experiments/...) are relative to the repo
    text = STAND_INS[command].format(out=tmp_path / "out", **stand_ins)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(shlex.split(text))
    finally:
        torch.set_num_threads(threads)
    assert code == 0, f"{command!r} (run as {text!r}) exited {code}"
    if command in CHECKS:
        CHECKS[command](tmp_path / "out")


def _compare_names_what_each_engine_serves(out: Path) -> None:
    """The README's compare on a Hugging Face model: each engine's answer per method, and
    per engine the best eligible method it serves exactly."""
    data = json.loads((out / "compare.json").read_text())
    served = data["served"]
    assert all(e["exact"] for e in served["yarn"].values())
    assert not any(e["exact"] for e in served["dynamic-ntk"].values())  # transformers' cache
    assert served["adarope"]["vllm+ropekit"]["exact"]  # per-head: the plugin only
    assert not served["adarope"]["llama.cpp"]["exact"] and served["adarope"]["llama.cpp"]["why"]
    serving = data["verdict"]["serving"]
    eligible = data["verdict"]["eligible"]
    for engine, entry in serving.items():
        assert entry["method"] is None or served[entry["method"]][engine]["exact"]
        better = eligible[: eligible.index(entry["method"])] if entry["method"] else eligible
        assert not any(served[m][engine]["exact"] for m in better), (engine, entry)
    assert "| engine | best it serves |" in (out / "report.md").read_text()
    # A comparison written before the per-engine verdict gets the same answers from
    # `ropekit report`, from its specs alone (a trained method off its initialization).
    path = out / "compare.json"
    old = json.loads(path.read_text())
    del old["served"], old["verdict"]["serving"]
    old["format_version"] = 2  # the untyped layout, which left out what was not yet asked
    path.write_text(json.dumps(old))
    (out / "report.md").unlink()
    assert main(["report", str(out)]) == 0
    again = json.loads(path.read_text())
    assert {m: {e: s["exact"] for e, s in row.items()} for m, row in again["served"].items()} == {
        m: {e: s["exact"] for e, s in row.items()} for m, row in served.items()
    }
    assert again["verdict"]["serving"] == serving and again["meta"]["amended"]
    assert again["table"] == data["table"] and "| engine |" in (out / "report.md").read_text()


# documented command -> what its output must show beyond exiting 0
CHECKS = {
    "ropekit compare --model M --target-length N --methods rope,dynamic-ntk,yarn,string,adarope "
    "--eval-data shakespeare,kjv --out DIR": _compare_names_what_each_engine_serves,
}
