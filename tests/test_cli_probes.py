"""`ropekit eval probes` and `ropekit eval ppl --single-documents` on a tiny pretrained decoder:
the options reach the configs, the files are written, what is printed says where."""

from __future__ import annotations

import json

import pytest
import torch

from ropekit.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("cli_probes") / "run"
    tiny = "--context 64 --layers 1 --d-model 32 --heads 2 --batch-size 2 --warmup 1 --steps 2"
    try:
        assert main(["pretrain", "--out", str(out), *tiny.split()]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_eval_probes(model_dir, tmp_path, capsys):
    out = tmp_path / "probes"
    command = (
        f"eval probes --model {model_dir} --lengths 300,400 --needles 3 --haystacks 2 "
        f"--task kv1_shakespeare --seed 4 --confidence 0.9 --out {out}"
    )
    assert main(command.split()) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "probes" and summary["task"]["name"] == "kv1_shakespeare"
    assert summary["config"]["needles"] == 3 and summary["config"]["seed"] == 4
    assert summary["overall"]["confidence"] == 0.9 and summary["probes_per_length"] == 6
    for e in summary["by_distance"]:
        line = (
            f"distance ({e['low_distance']:>7,}, {e['high_distance']:>7,}]: accuracy "
            f"{e['accuracy']:.2f} [{e['low']:.2f}, {e['high']:.2f}] ({e['correct']}/{e['n']} "
            "probes)"
        )
        assert line in printed
    assert sum(e["n"] for e in summary["by_distance"]) == 12
    assert f"reach: {summary['reach']['distance']:,} tokens" in printed
    assert summary["trained_length"] > 0  # the pretrained decoder's context
    assert str(out / "summary.json") in printed
    assert str(out / "accuracy_vs_distance.png") in printed


def test_a_resumed_eval_probes_prices_the_haystacks_left(model_dir, tmp_path, capsys):
    """A rerun into a folder whose answers hold some haystacks says how many are left and
    prices those (fewer prefills, so a shorter estimate); one whose answers hold all of them
    reads nothing and prints no plan; --overwrite prices them all again."""
    out = tmp_path / "probes"
    command = (
        f"eval probes --model {model_dir} --lengths 300 --needles 2 --haystacks 3 "
        f"--task kv1_shakespeare --seed 4 --out {out}"
    ).split()
    assert main(command) == 0
    first = capsys.readouterr().out
    assert "eval probes (3 prefills per length, each to its longest cut): about" in first
    assert main(command) == 0
    assert "eval probes (" not in capsys.readouterr().out  # every haystack answered
    answers = out / "300" / "probes.jsonl"
    lines = answers.read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["haystack"] == 0]
    kept += [line for line in lines if json.loads(line)["haystack"] == 1][:1]  # one needle of 2
    answers.write_text("\n".join(kept) + "\n")
    assert main(command) == 0
    plan = "eval probes (3 prefills per length, each to its longest cut; 2 left, the others "
    assert f"{plan}answered in {out}): about" in capsys.readouterr().out
    assert main([*command, "--overwrite"]) == 0
    assert "(3 prefills per length, each to its longest cut): about" in capsys.readouterr().out


def test_eval_probes_gives_the_trained_window_and_warns_where_the_model_misses_it(
    model_dir, tmp_path, capsys
):
    """The tiny decoder (two training steps, trained at 64 tokens) answers no probe: the
    probes of the bins within its 64 tokens are pooled and printed, and the warning that its
    reach cannot measure its positions goes to stderr, naming fewer needles."""
    out = tmp_path / "probes"
    command = (
        f"eval probes --model {model_dir} --lengths 256 --needles 3 --haystacks 2 --bins 8 "
        f"--task kv1_shakespeare --seed 4 --out {out}"
    )
    assert main(command.split()) == 0
    printed = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trained_length"] == 64
    inside = [e for e in summary["by_distance"] if e["high_distance"] <= 64]
    n, correct = sum(e["n"] for e in inside), sum(e["correct"] for e in inside)
    assert n > 0 and correct == 0
    assert f"inside the trained window (needles up to {inside[-1]['high_distance']} tokens " in (
        printed.out
    )
    assert f"(0/{n})" in printed.out
    assert "\nwarning: inside the trained window" in printed.err
    assert "fewer needles per haystack" in printed.err


def test_eval_probes_bad_needles_is_one_line(model_dir, tmp_path, capsys):
    command = f"eval probes --model {model_dir} --lengths 300 --needles 0 --out {tmp_path}"
    assert main(command.split()) == 2
    err = capsys.readouterr().err.strip()
    assert "needles=0 is not allowed" in err and "\n" not in err


def test_eval_ppl_single_documents(model_dir, tmp_path, capsys):
    out = tmp_path / "ppl"
    command = (
        f"eval ppl --model {model_dir} --lengths 32,64 --tokens 256 --single-documents "
        f"--data kjv --out {out}"
    )
    assert main(command.split()) == 0
    result = json.loads((out / "ppl.json").read_text())
    assert result["config"]["single_documents"] is True
    assert result["documents"] == 4 and len(result["spans"]) == 4
    assert all(s["document"].startswith("kjv/") for s in result["spans"])
    assert str(out / "ppl.json") in capsys.readouterr().out
