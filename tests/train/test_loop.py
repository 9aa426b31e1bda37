"""train() end to end on a tiny Llama: learning, exact resume, frozen weights, loss weighting,
non-finite losses, output-folder safety and the metrics log across resumes."""

import errno
import json
import math
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file

from ropekit import utils
from ropekit.outdir import OutputError
from ropekit.train import (
    NonFiniteLossError,
    TrainResult,
    causal_lm_loss,
    cross_entropy_sum,
    latest_checkpoint,
    load_checkpoint,
    train,
)
from ropekit.train.loop import _open_metrics
from ropekit.train.sampling import collate, global_batch

from .tiny import CountingData, tiny_config, tiny_llama


def metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def optimizer_state(checkpoint):
    return torch.load(checkpoint / "optimizer.pt", weights_only=True)


def assert_same_tensors(a, b):
    """Equal structure and bit-identical tensors (dicts, lists, tuples, tensors, numbers)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_tensors(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tensors(x, y)
    else:
        assert a == b


def test_loss_falls_and_every_output_is_written(tmp_path):
    result = train(tiny_llama(), CountingData(), tiny_config(tmp_path, keep_last=2))

    lines = metrics(tmp_path)
    assert [m["step"] for m in lines] == list(range(1, 13))
    assert set(lines[0]) == {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed"}
    assert lines[0]["loss"] == pytest.approx(math.log(64), rel=0.05)  # untrained: near uniform
    assert lines[-1]["loss"] < 0.6 * lines[0]["loss"]
    assert lines[-1]["tokens"] == 12 * 8 * 16

    summary = json.loads(result.summary.read_text())
    assert summary["final_loss"] == result.final_loss == lines[-1]["loss"]
    assert summary["steps"] == 12 and summary["tokens"] == result.tokens == 12 * 8 * 16
    assert summary["tokens_per_s"] > 0 and summary["num_processes"] == 1
    assert summary["kind"] == "train"
    assert {"torch", "transformers", "accelerate", "ropekit"} <= set(summary["meta"]["versions"])
    assert summary["config"]["steps"] == 12
    assert isinstance(result, TrainResult)

    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step-00000008", "step-00000012"]
    assert result.checkpoint == latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / kept[-1]


class Interrupted(Exception):
    pass


def test_resume_after_interruption_is_bit_identical(tmp_path, monkeypatch):
    data = CountingData()
    reference = tiny_llama(dropout=0.1)  # dropout draws random numbers: the RNG must resume too
    train(reference, data, tiny_config(tmp_path / "reference"))

    calls = 0

    def crash_in_step_7(model, batch):
        nonlocal calls
        calls += 1
        if calls == 7:
            raise Interrupted
        return causal_lm_loss(model, batch)

    out = tmp_path / "interrupted"
    with pytest.raises(Interrupted):
        train(tiny_llama(dropout=0.1), data, tiny_config(out), loss_fn=crash_in_step_7)
    assert latest_checkpoint(out).name == "step-00000004"
    assert [m["step"] for m in metrics(out)] == list(range(1, 7))

    # Every pickle-format file is read with weights_only=True.
    real_load = torch.load
    loads = []

    def checked_load(*args, **kwargs):
        assert kwargs.get("weights_only") is True
        loads.append(args[0])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", checked_load)
    resumed = tiny_llama(dropout=0.1)
    result = train(resumed, data, tiny_config(out, resume=True))
    monkeypatch.undo()
    assert {p.name for p in loads} == {"optimizer.pt", "scheduler.pt", "rng-0.pt"}

    for (name, a), b in zip(reference.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name
    final = latest_checkpoint(tmp_path / "reference")
    assert_same_tensors(optimizer_state(final), optimizer_state(result.checkpoint))
    assert_same_tensors(
        torch.load(final / "scheduler.pt", weights_only=True),
        torch.load(result.checkpoint / "scheduler.pt", weights_only=True),
    )
    # The log is that of one run: steps 5 and 6 of the interrupted session were replaced.
    resumed_log, reference_log = metrics(out), metrics(tmp_path / "reference")
    assert [m["loss"] for m in resumed_log] == [m["loss"] for m in reference_log]
    assert result.tokens == json.loads((final / "state.json").read_text())["tokens"]


def test_frozen_weights_stay_bit_identical_and_get_no_optimizer_state(tmp_path):
    model = tiny_llama()
    model.requires_grad_(False)
    trained = model.model.layers[0].self_attn.q_proj.weight
    trained.requires_grad_(True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    result = train(model, CountingData(), tiny_config(tmp_path, steps=4))

    for name, p in model.named_parameters():
        if p is trained:
            assert not torch.equal(p, before[name])
        else:
            assert torch.equal(p, before[name]), name
            assert p.grad is None, name
    state = optimizer_state(result.checkpoint)
    assert len(state["state"]) == 1
    assert sum(len(group["params"]) for group in state["param_groups"]) == 1
    assert list(load_file(result.checkpoint / "model.safetensors")) == [
        "model.layers.0.self_attn.q_proj.weight"
    ]


def test_save_frozen_saves_every_weight(tmp_path):
    model = tiny_llama()
    model.lm_head.requires_grad_(False)
    result = train(model, CountingData(), tiny_config(tmp_path, steps=2, save_frozen=True))
    saved = load_file(result.checkpoint / "model.safetensors")
    assert set(saved) == {name for name, _ in model.named_parameters()}


def test_splitting_the_global_batch_into_micro_batches_changes_nothing_but_rounding(tmp_path):
    data = CountingData()
    whole, split = tiny_llama(), tiny_llama()
    train(whole, data, tiny_config(tmp_path / "whole", steps=6))
    train(split, data, tiny_config(tmp_path / "split", steps=6, grad_accum=4))
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for x, y in zip(metrics(tmp_path / "whole"), metrics(tmp_path / "split"), strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)


def test_logged_loss_is_the_weighted_mean_over_the_whole_global_batch(tmp_path):
    data = CountingData(loss_weight=True, position_ids=True)
    model = tiny_llama()
    config = tiny_config(tmp_path, steps=2, grad_accum=4)
    batch = collate([data[i] for i in global_batch(0, config.batch_size, len(data), config.seed)])
    with torch.no_grad():
        weighted_sum, weight = causal_lm_loss(model, batch)
        plain_sum, count = causal_lm_loss(model, {k: batch[k] for k in batch if k != "loss_weight"})
    expected, unweighted = (weighted_sum / weight).item(), (plain_sum / count).item()
    assert abs(expected - unweighted) > 1e-3  # the weights matter in this example

    train(model, data, config)
    assert metrics(tmp_path)[0]["loss"] == pytest.approx(expected, rel=1e-6)


def test_position_ids_reach_the_model(tmp_path):
    data = CountingData(position_ids=True)
    model = tiny_llama()
    batch = collate([data[i] for i in range(4)])
    with torch.no_grad():
        given = cross_entropy_sum(model(**batch).logits, batch["labels"])[0]
        default = cross_entropy_sum(model(input_ids=batch["input_ids"]).logits, batch["labels"])[0]
        loss_sum, _ = causal_lm_loss(model, batch)
    assert not torch.equal(given, default)  # restarted positions change the output
    assert torch.equal(loss_sum, given)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, bad):
    calls = 0

    def poisoned_in_step_5(model, batch):
        nonlocal calls
        calls += 1
        loss_sum, n = causal_lm_loss(model, batch)
        return (loss_sum * bad if calls == 5 else loss_sum), n

    model = tiny_llama()
    with pytest.raises(NonFiniteLossError, match="step 5") as err:
        train(
            model,
            CountingData(),
            tiny_config(tmp_path, checkpoint_interval=2),
            loss_fn=poisoned_in_step_5,
        )
    last = tmp_path / "checkpoints" / "step-00000004"
    assert err.value.step == 5 and err.value.checkpoint == last
    assert str(last) in str(err.value)
    assert latest_checkpoint(tmp_path) == last
    # The bad step was not applied: the model still holds step 4's weights, which load cleanly.
    fresh = tiny_llama(seed=1)
    state = load_checkpoint(last, fresh)
    assert state.step == 4 and state.samples_seen == 32 and math.isfinite(state.loss)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def _failing_at(step: int):
    calls = 0

    def loss_fn(model, batch):
        nonlocal calls
        calls += 1
        if calls == step:
            raise RuntimeError("out of memory (simulated)")
        return causal_lm_loss(model, batch)

    return loss_fn


def test_a_run_failing_before_its_first_checkpoint_leaves_its_folder_as_it_found_it(tmp_path):
    """Nothing of it can be resumed, so nothing of it is kept: the corrected rerun once
    needed --overwrite because of the empty metrics log the failed one left."""
    out = tmp_path / "run"
    for step in (1, 3):  # at the first step, and before the first checkpoint (step 4)
        with pytest.raises(RuntimeError, match="simulated"):
            train(tiny_llama(), CountingData(), tiny_config(out), loss_fn=_failing_at(step))
        assert not out.exists() or list(out.iterdir()) == []
    assert train(tiny_llama(), CountingData(), tiny_config(out, steps=2)).steps == 2


def test_a_run_failing_after_a_checkpoint_keeps_it_and_its_metrics(tmp_path):
    with pytest.raises(RuntimeError, match="simulated"):
        train(tiny_llama(), CountingData(), tiny_config(tmp_path), loss_fn=_failing_at(6))
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert latest_checkpoint(tmp_path).name == "step-00000004"


def test_a_folder_holding_other_files_is_refused_unless_overwrite(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=str(tmp_path)):
        train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=2))
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]  # the lock was given back

    train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=2, overwrite=True))
    assert (tmp_path / "notes.txt").read_text() == "mine"  # overwrite removes only run outputs


def test_a_previous_run_is_refused_then_replaced_with_overwrite(tmp_path):
    train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=8, keep_last=3))
    with pytest.raises(
        FileExistsError, match=r"--resume \(resume=True\) .* --overwrite \(overwrite=True\)"
    ):
        train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=2))

    train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=2, overwrite=True))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000002"]
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]


def test_resume_refuses_a_different_run(tmp_path):
    train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=4))
    with pytest.raises(ValueError, match=r"trained with lr=0\.01, not lr=0\.02"):
        train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=4, lr=2e-2, resume=True))
    with pytest.raises(ValueError, match="dataset had 32 items, this one has 16"):
        train(tiny_llama(), CountingData(n=16), tiny_config(tmp_path, steps=4, resume=True))
    # Run-control fields may change: a finished run resumes to the same result.
    result = train(
        tiny_llama(), CountingData(), tiny_config(tmp_path, steps=4, resume=True, log_interval=2)
    )
    assert result.steps == 4


def test_resume_without_a_checkpoint_starts_fresh(tmp_path):
    result = train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=2, resume=True))
    assert result.steps == 2


def test_bf16_autocast_trains_float32_weights(tmp_path, monkeypatch):
    model = tiny_llama()
    monkeypatch.setattr(utils, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(model, CountingData(), tiny_config(tmp_path, bf16=True))
    # said where this CPU only emulates bf16 matmuls (ropekit.utils.emulated_precision)
    said = [w for w in caught if "no native bfloat16 matmul" in str(w.message)]
    assert len(said) == int(utils.emulated_precision(torch.bfloat16, "cpu"))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    lines = metrics(tmp_path)
    assert math.isfinite(result.final_loss) and lines[-1]["loss"] < 0.6 * lines[0]["loss"]


def test_processes_that_do_not_see_each_other_are_stopped(tmp_path, monkeypatch):
    # What `accelerate launch --multi_gpu` without ACCELERATE_USE_CPU=1 gives on a CPU machine.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="launched as 2 processes but the Accelerator sees 1"):
        train(tiny_llama(), CountingData(), tiny_config(tmp_path))


# ----------------------------------------------------------------------------- metrics log
def _log(path, steps, torn=""):
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps]
    path.write_text("".join(lines) + torn)


def test_resume_rewinds_the_metrics_log_then_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _log(path, range(1, 7), torn='{"step": 7, "lo')  # killed in the middle of line 7
    with _open_metrics(path, 4) as log:
        assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
        log.write(json.dumps({"step": 5, "loss": 0.5}) + "\n")
        log.flush()
        inode = path.stat().st_ino
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert path.stat().st_ino == inode  # appended to, not rewritten
    with _open_metrics(path, 0):
        assert path.read_text() == ""  # resumed without a checkpoint: a fresh log


def test_the_metrics_rewind_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    _log(path, range(1, 7))
    before = path.read_bytes()

    def killed(src, dst):
        raise KeyboardInterrupt  # stands for a kill at the worst moment of the rewind

    monkeypatch.setattr("os.replace", killed)
    with pytest.raises(KeyboardInterrupt):
        _open_metrics(path, 2)
    monkeypatch.undo()
    assert path.read_bytes() == before  # every logged line is still there
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # and no temp file


def test_a_garbled_metrics_line_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _log(path, range(1, 4))
    path.write_text(path.read_text().replace('{"step": 2', '{"stop": 2'))
    with pytest.warns(UserWarning, match=r"metrics\.jsonl:2 is not a metrics record"):
        _open_metrics(path, 3).close()
    assert [m["step"] for m in metrics(tmp_path)] == [1, 3]


def test_a_linked_metrics_log_is_refused_and_its_target_untouched(tmp_path):
    out, outside = tmp_path / "run", tmp_path / "elsewhere.jsonl"
    train(tiny_llama(), CountingData(), tiny_config(out, steps=4))
    outside.write_text("not yours\n")
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to(outside)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(OutputError, match=r"metrics\.jsonl: it is a symbolic link"):
            train(tiny_llama(), CountingData(), tiny_config(out, steps=4, resume=True))
    assert not [w for w in caught if "metrics" in str(w.message)]  # not even read
    assert outside.read_text() == "not yours\n"
    assert not (out / ".ropekit.lock").exists()  # the refused run gave the lock back


def test_a_run_holds_its_folder_until_it_ends(tmp_path):
    seen = []

    def look(model, batch):
        seen.append(json.loads((tmp_path / ".ropekit.lock").read_text())["pid"])
        return causal_lm_loss(model, batch)

    train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=2), loss_fn=look)
    assert seen == [os.getpid()] * 2
    assert not (tmp_path / ".ropekit.lock").exists()


def test_a_linked_checkpoints_folder_is_refused_before_anything_is_read_or_removed(tmp_path):
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "run"
    train(tiny_llama(), CountingData(), tiny_config(elsewhere, steps=4))
    out.mkdir()
    (out / "checkpoints").symlink_to(elsewhere / "checkpoints", target_is_directory=True)
    for resume, overwrite in ((True, False), (False, True)):
        with pytest.raises(OutputError, match=r"checkpoints: it is a symbolic link"):
            config = tiny_config(out, steps=4, resume=resume, overwrite=overwrite)
            train(tiny_llama(), CountingData(), config)
    assert latest_checkpoint(elsewhere).name == "step-00000004"  # neither moved nor removed


def _files(folder):
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("step", [1, 3])  # at its first step; before its first checkpoint
def test_an_overwrite_failing_before_its_first_checkpoint_gives_the_old_run_back(tmp_path, step):
    """`overwrite` once removed the old run before the new one had taken a step: a config that
    fails at step 1 left neither. The old run is set aside until the first checkpoint."""
    train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=4))
    old = _files(tmp_path)
    with pytest.raises(RuntimeError, match="simulated"):
        train(tiny_llama(), CountingData(), tiny_config(tmp_path, overwrite=True),
              loss_fn=_failing_at(step))  # fmt: skip
    assert _files(tmp_path) == old and sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoints", "metrics.jsonl", "summary.json"
    ]  # fmt: skip
    # Past its first checkpoint, the new run is the run: the old one is gone for good.
    with pytest.raises(RuntimeError, match="simulated"):
        train(tiny_llama(), CountingData(), tiny_config(tmp_path, overwrite=True),
              loss_fn=_failing_at(6))  # fmt: skip
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "metrics.jsonl"]


def test_an_overwrite_killed_before_its_first_checkpoint_is_undone_by_the_next_run(
    tmp_path, monkeypatch
):
    """kill -9 runs no `except`: the next run into the folder finds the set-aside run and
    gives it back (here --resume then continues the old run, as if the kill never came)."""
    from ropekit.train import loop

    train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=4))
    old = _files(tmp_path)
    monkeypatch.setattr(loop, "_restore_replaced", lambda out: None)  # what a kill skips
    with pytest.raises(RuntimeError, match="simulated"):
        train(tiny_llama(), CountingData(), tiny_config(tmp_path, overwrite=True),
              loss_fn=_failing_at(2))  # fmt: skip
    assert (tmp_path / loop.REPLACED).is_dir() and not (tmp_path / "checkpoints").exists()
    monkeypatch.undo()
    result = train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=4, resume=True))
    assert result.steps == 4 and not (tmp_path / loop.REPLACED).exists()
    assert _files(tmp_path).keys() == old.keys()
    assert {k: v for k, v in _files(tmp_path).items() if "checkpoints" in k} == {
        k: v for k, v in old.items() if "checkpoints" in k
    }


def test_a_checkpoints_path_that_is_a_file_is_refused_before_the_first_step(tmp_path):
    (tmp_path / "checkpoints").write_text("mine")
    config = tiny_config(tmp_path, overwrite=True)
    with pytest.raises(OutputError, match=r"checkpoints: it is a file, not a folder"):
        # A step taken would fail with "simulated" instead.
        train(tiny_llama(), CountingData(), config, loss_fn=_failing_at(1))
    assert (tmp_path / "checkpoints").read_text() == "mine"


def test_a_batch_larger_than_the_data_is_said(tmp_path):
    with pytest.warns(UserWarning, match=r"batch_size=8 is larger than the 4 training items"):
        train(
            tiny_llama(),
            CountingData(n=4),
            tiny_config(tmp_path, steps=1, batch_size=8, warmup_steps=0),
        )


def test_a_first_checkpoint_that_cannot_be_written_leaves_the_folder_as_found(
    tmp_path, monkeypatch
):
    """A full disk at the first checkpoint once left an empty checkpoints/ that made the
    rerun ask for --resume or --overwrite, though there was nothing to resume."""
    from ropekit.train import loop

    def full(out_dir, *args, **kwargs):
        (out_dir / "checkpoints").mkdir(exist_ok=True)  # what save_checkpoint makes first
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loop, "save_checkpoint", full)
    with pytest.raises(OSError, match="No space"):
        train(tiny_llama(), CountingData(), tiny_config(tmp_path / "run", steps=2))
    assert not (tmp_path / "run").exists()
