"""Sharded training (TrainConfig.fsdp, FSDP2) in this process: over a process group of one the
sharded code path runs whole (fully_shard per block, replicated positional parameters, the
gradient norm over shards and whole tensors, torch.distributed.checkpoint), so its numbers,
checkpoints, resume and refusals are checked here without launching processes
(tests/train/test_sharded_processes.py runs 2 processes).

Tolerances: a sharded run adds its gradients and norms in another order than an unsharded
one, so parameters agree to float rounding, not bit for bit. The yardstick is measured in
each test: the same unsharded run with its global batch cut into micro-batches differently
(grad_accum 1 vs 2: the same numbers summed in another order). Sharded runs must stay within
`NOISE_FACTOR` times that (measured: 0.3-0.8x of it for 12 steps; a wrong gradient, e.g.
replicated gradients not averaged, is over 1000x).
"""

from __future__ import annotations

import json
import os
import pickle
import re

import pytest
import torch
from torch import nn

from ropekit.backbone import as_backbone
from ropekit.train import causal_lm_loss, latest_checkpoint, load_checkpoint, train
from ropekit.train.checkpoint import CheckpointError, CheckpointWarning, verify_checkpoint
from ropekit.train.sharding import ShardPlan, clip_grad_norm, plan_for

from ..model.tiny import tiny_model as tiny_decoder
from ..tiny import ARCH_NAMES
from ..tiny import tiny_model as tiny_hf
from .tiny import CountingData, perturb, tiny_config, tiny_llama

NOISE_FACTOR = 4


def decoder(spec: str = "adarope:l_ref=4") -> nn.Module:
    return tiny_decoder(spec)  # byte-level: CountingData's ids (< 64) are bytes too


def llama_with_adarope(dropout: float = 0.0) -> nn.Module:
    from ropekit.hf import patch

    model = tiny_llama(dropout=dropout)
    perturb(patch(model, "adarope"))
    return model


MODELS = {
    "decoder-adarope": decoder,
    "decoder-tuned-yarn": lambda: decoder("tuned-yarn:factor=4"),  # 0-dim knobs, replicated
    "llama-adarope": llama_with_adarope,
}


def max_difference(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.named_parameters(), b.named_parameters(), strict=True)
    return max((x - y).abs().max().item() for (_, x), (_, y) in pairs)


def losses(out_dir) -> list[float]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def reorder_noise(make, tmp_path, **settings) -> tuple[float, float]:
    """(largest parameter difference, largest relative loss difference) between two unsharded
    runs that differ only in how the global batch is cut into micro-batches."""
    a, b = make(), make()
    train(a, CountingData(), tiny_config(tmp_path / "accum1", grad_accum=1, **settings))
    train(b, CountingData(), tiny_config(tmp_path / "accum2", grad_accum=2, **settings))
    la, lb = losses(tmp_path / "accum1"), losses(tmp_path / "accum2")
    return max_difference(a, b), max(abs(x - y) / x for x, y in zip(la, lb, strict=True))


def assert_plain(model: nn.Module, cls: type) -> None:
    """No trace of FSDP: the class, the parameters and the hooks are the model's own (and the
    patch's: ropekit.hf reads each step's cache and positions with pre-hooks)."""
    from torch.distributed.tensor import DTensor

    assert type(model) is cls
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    hooks = [
        hook
        for m in model.modules()
        for hook in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
    ]
    assert all(getattr(hook, "__module__", "").startswith("ropekit.hf") for hook in hooks)


@pytest.mark.parametrize("name", MODELS)
def test_sharded_training_equals_unsharded_within_reordering_noise(tmp_path, name):
    make = MODELS[name]
    noise, loss_noise = reorder_noise(make, tmp_path / "noise")
    plain, sharded = make(), make()
    train(plain, CountingData(), tiny_config(tmp_path / "plain"))
    result = train(sharded, CountingData(), tiny_config(tmp_path / "sharded", fsdp=True))

    assert max_difference(plain, sharded) <= NOISE_FACTOR * noise
    for a, b in zip(losses(tmp_path / "plain"), losses(tmp_path / "sharded"), strict=True):
        assert abs(a - b) <= NOISE_FACTOR * loss_noise * a
    assert_plain(sharded, type(plain))
    # The checkpoint is DCP's, in the manifest, and verifies.
    names = {p.name for p in result.checkpoint.iterdir()}
    assert {".metadata", "__0_0.distcp", "optimizer-groups.pt", "scheduler.pt"} <= names
    assert "model.safetensors" not in names
    manifest = json.loads((result.checkpoint / "manifest.json").read_text())
    assert manifest["layout"] == "sharded" and set(manifest["files"]) == names - {"manifest.json"}
    verify_checkpoint(result.checkpoint)


def test_activation_checkpointing_under_sharding_changes_no_number(tmp_path):
    """FSDP2 gathers a block again when checkpointing recomputes it in the backward."""
    plain, sharded = decoder(), decoder()
    for model in (plain, sharded):
        model.gradient_checkpointing_enable()
    train(plain, CountingData(), tiny_config(tmp_path / "plain", steps=4))
    train(sharded, CountingData(), tiny_config(tmp_path / "sharded", steps=4, fsdp=True))
    noise, _ = reorder_noise(decoder, tmp_path / "noise", steps=4)
    assert max_difference(plain, sharded) <= NOISE_FACTOR * noise


def _wrapping_of(make):
    """(model, what its training module looked like (filled by the loss), its plan, a loss
    that looks)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    model = make()
    plan = plan_for(as_backbone(model))
    seen = {}

    def look(module, batch):
        if not seen:
            seen["root"] = isinstance(module, FSDPModule)
            seen["blocks"] = [isinstance(module.get_submodule(n), FSDPModule) for n in plan.blocks]
            params = dict(module.named_parameters())
            seen["replicated"] = [not isinstance(params[n], DTensor) for n in plan.replicated]
            others = [p for n, p in params.items() if n not in plan.replicated]
            seen["others sharded"] = all(isinstance(p, DTensor) for p in others)
        return as_backbone(model).training_logits(module, batch), batch

    def loss(module, batch):
        logits, batch = look(module, batch)
        from ropekit.train import cross_entropy_sum

        return cross_entropy_sum(logits, batch["labels"])

    return model, seen, plan, loss


@pytest.mark.parametrize("arch", ["decoder", *ARCH_NAMES])
def test_every_decoder_block_is_wrapped_and_positional_parameters_stay_whole(tmp_path, arch):
    def make():
        if arch == "decoder":
            return decoder()
        model = tiny_hf(arch)
        as_backbone(model).set_encoding("adarope")
        return model

    model, seen, plan, loss = _wrapping_of(make)
    assert len(plan.blocks) == 2 and plan.replicated  # 2 layers; AdaRoPE's tables
    expected = "blocks.{}" if arch == "decoder" else "model.layers.{}"
    assert plan.blocks == tuple(expected.format(i) for i in range(2))
    data = CountingData()
    train(model, data, tiny_config(tmp_path, steps=2, fsdp=True), loss_fn=loss)
    assert seen == {
        "root": True,
        "blocks": [True, True],
        "replicated": [True] * len(plan.replicated),
        "others sharded": True,
    }
    assert_plain(model, type(make()))


class Interrupted(Exception):
    pass


def _crash_in_call(n):
    calls = 0

    def loss(model, batch):
        nonlocal calls
        calls += 1
        if calls == n:
            raise Interrupted
        return causal_lm_loss(model, batch)

    return loss


def test_sharded_resume_after_interruption_is_bit_identical(tmp_path, monkeypatch):
    data = CountingData()
    reference = llama_with_adarope(dropout=0.1)  # dropout: the RNG streams must resume too
    train(reference, data, tiny_config(tmp_path / "reference", fsdp=True))

    out = tmp_path / "interrupted"
    stopped = llama_with_adarope(dropout=0.1)
    before = {n: p.detach().clone() for n, p in stopped.named_parameters()}
    with pytest.raises(Interrupted):
        train(stopped, data, tiny_config(out, fsdp=True), loss_fn=_crash_in_call(7))
    assert latest_checkpoint(out).name == "step-00000004"
    # The caller's model takes trained values only when training ends.
    assert all(torch.equal(p, before[n]) for n, p in stopped.named_parameters())
    assert not torch.distributed.is_initialized()  # the group of one is given back

    real_load = torch.load
    loads = []

    def checked_load(*args, **kwargs):
        assert kwargs.get("weights_only") is True  # nothing unpickled but tensors and numbers
        loads.append(args[0])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", checked_load)
    resumed = llama_with_adarope(dropout=0.1)
    result = train(resumed, data, tiny_config(out, fsdp=True, resume=True))
    monkeypatch.undo()
    named = {p.name for p in loads if hasattr(p, "name")}
    assert named == {"optimizer-groups.pt", "scheduler.pt", "rng-0.pt"}
    assert len(loads) > len(named)  # DCP's tensors, through the same weights_only load

    for (name, a), b in zip(reference.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert losses(out) == losses(tmp_path / "reference")
    assert result.steps == 12


def test_a_sharded_checkpoint_loads_into_an_unsharded_model_and_optimizer(tmp_path):
    from ropekit.train.optim import build_optimizer

    model = llama_with_adarope()
    config = tiny_config(tmp_path, fsdp=True)
    result = train(model, CountingData(), config)
    assert not torch.distributed.is_initialized()

    fresh = llama_with_adarope()
    optimizer, scheduler = build_optimizer(fresh, config)
    state = load_checkpoint(result.checkpoint, fresh, optimizer, scheduler)
    assert state.step == 12
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert scheduler.last_epoch == 12
    steps = {float(s["step"]) for s in optimizer.state_dict()["state"].values()}
    assert steps == {12.0}  # AdamW's state came back for every parameter, at step 12


def test_resume_across_the_fsdp_switch_is_refused_naming_it(tmp_path):
    for fsdp in (False, True):
        out = tmp_path / str(fsdp)
        train(tiny_llama(), CountingData(), tiny_config(out, steps=2, fsdp=fsdp))
        other = tiny_config(out, steps=2, fsdp=not fsdp, resume=True)
        with pytest.raises(ValueError, match=rf"trained with fsdp={fsdp}, not fsdp={not fsdp}$"):
            train(tiny_llama(), CountingData(), other)


def test_a_checkpoint_written_before_the_fsdp_field_existed_still_resumes(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(Interrupted):
        train(tiny_llama(), CountingData(), tiny_config(out), loss_fn=_crash_in_call(7))
    checkpoint = latest_checkpoint(out)
    config = json.loads((checkpoint / "config.json").read_text())
    del config["fsdp"]  # what an older ropekit wrote
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2))
    _rewrite_manifest(checkpoint)
    result = train(tiny_llama(), CountingData(), tiny_config(out, resume=True))
    assert result.steps == 12


def _rewrite_manifest(checkpoint):
    """What someone who also forges the manifest would do (so only the content check is left)."""
    from ropekit.train.checkpoint import _write_manifest

    layout = json.loads((checkpoint / "manifest.json").read_text()).get("layout", "full")
    (checkpoint / "manifest.json").unlink()
    _write_manifest(checkpoint, layout)


def _sharded_stopped_after_8_steps(out_dir):
    with pytest.raises(Interrupted):
        train(
            llama_with_adarope(), CountingData(), tiny_config(out_dir, fsdp=True),
            loss_fn=_crash_in_call(9),
        )  # fmt: skip


def _flip_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


SHARDED_DAMAGE = {
    "truncated shards": (
        lambda c: (c / "__0_0.distcp").write_bytes((c / "__0_0.distcp").read_bytes()[:100]),
        r"__0_0\.distcp is 100 bytes, manifest\.json says \d+",
    ),
    "flipped bit in the index": (
        lambda c: _flip_bit(c / ".metadata"),
        r"\.metadata does not match its sha256",
    ),
    "missing shards": (lambda c: (c / "__0_0.distcp").unlink(), r"__0_0\.distcp missing"),
}


@pytest.mark.parametrize("damage", SHARDED_DAMAGE)
def test_a_damaged_sharded_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, damage):
    reference = llama_with_adarope()
    train(reference, CountingData(), tiny_config(tmp_path / "reference", fsdp=True))
    out = tmp_path / "run"
    _sharded_stopped_after_8_steps(out)
    harm, problem = SHARDED_DAMAGE[damage]
    harm(out / "checkpoints" / "step-00000008")

    with pytest.raises(CheckpointError, match=problem):
        load_checkpoint(out / "checkpoints" / "step-00000008", llama_with_adarope())
    resumed = llama_with_adarope()
    with pytest.warns(CheckpointWarning, match=rf"step-00000008 is damaged \({problem}"):
        train(resumed, CountingData(), tiny_config(out, fsdp=True, resume=True))
    assert (out / "checkpoints" / "damaged-step-00000008").is_dir()
    for (name, a), b in zip(reference.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


class _Sentinel:
    """A pickle that would create a file when unpickled (``os.system`` stands for any code)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_checkpoint_index_that_would_run_code_is_refused_before_it_runs(tmp_path):
    out = tmp_path / "run"
    _sharded_stopped_after_8_steps(out)
    checkpoint = out / "checkpoints" / "step-00000008"
    ran = tmp_path / "it-ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Sentinel(ran)))
    _rewrite_manifest(checkpoint)  # the manifest agrees: only the unpickler stands in the way
    verify_checkpoint(checkpoint)

    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(checkpoint, llama_with_adarope())
    message = str(caught.value)
    assert "\n" not in message and re.search(r"\.metadata cannot be read.*posix\.system", message)
    assert not ran.exists()


def test_a_checkpoint_index_listing_a_non_tensor_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    out = tmp_path / "run"
    _sharded_stopped_after_8_steps(out)
    checkpoint = out / "checkpoints" / "step-00000008"
    with (checkpoint / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    metadata.state_dict_metadata["model.extra"] = BytesStorageMetadata()
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(checkpoint)
    with pytest.raises(CheckpointError, match=r"model\.extra is not a tensor"):
        load_checkpoint(checkpoint, llama_with_adarope())


def test_a_sharded_checkpoint_of_another_model_is_one_line(tmp_path):
    result = train(tiny_llama(), CountingData(), tiny_config(tmp_path, steps=2, fsdp=True))
    with pytest.raises(ValueError, match=r"weights the model does not have") as caught:
        load_checkpoint(result.checkpoint, decoder())
    assert "\n" not in str(caught.value)


def test_bad_plans_are_refused_naming_the_name(tmp_path):
    model = decoder()
    good = plan_for(as_backbone(model))
    with pytest.raises(ValueError, match=r"ShardPlan\.blocks names 'blocks\.7'"):
        ShardPlan(blocks=("blocks.7",)).check(model)
    with pytest.raises(ValueError, match=r"ShardPlan\.replicated names 'encoding\.nothing'"):
        ShardPlan(blocks=good.blocks, replicated=("encoding.nothing",)).check(model)
    with pytest.raises(ValueError, match=r"ShardPlan\.blocks=.* must not repeat"):
        ShardPlan(blocks=("blocks.0", "blocks.0"))
    with pytest.raises(ValueError, match=r"ShardPlan\.blocks names 'blocks\.7'"):
        bad = ShardPlan(blocks=("blocks.7",))
        train(model, CountingData(), tiny_config(tmp_path, steps=2, fsdp=True), plan=bad)
    assert not torch.distributed.is_initialized()
    assert not (tmp_path / "checkpoints").exists()


def test_clip_grad_norm_equals_torch_on_whole_tensors():
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(3)]
    params.append(nn.Parameter(torch.randn((), generator=g)))  # a 0-dim knob, as tuned-yarn's
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    expected = [p.grad.clone() for p in params]
    for max_norm in (0.5, 1e9):
        for p, e in zip(params, expected, strict=True):
            p.grad = e.clone()
        mine = clip_grad_norm(params, max_norm)
        theirs_grads = [e.clone() for e in expected]
        twins = [nn.Parameter(p.detach().clone()) for p in params]
        for t, e in zip(twins, theirs_grads, strict=True):
            t.grad = e
        theirs = torch.nn.utils.clip_grad_norm_(twins, max_norm)
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=0)
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p.grad, t.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("recipe", ["adarope->lora", "adarope->joint"])
def test_sharded_extension_recipe_equals_unsharded(tmp_path, recipe):
    """extend's two-stage recipes (stage 2: LoRA alone, or LoRA and the encoding) on one
    process, sharded and not: the adapter and LoRA weights agree to rounding, and the sharded
    run's files load back into an unsharded model that scores exactly like the model extend
    returned."""
    from safetensors.torch import load_file

    from ropekit.backbone import load_adapter, read_adapter
    from ropekit.model import save_decoder
    from ropekit.train.extend import ExtendConfig, run_extension

    torch.manual_seed(0)
    base = save_decoder(decoder("rope"), tmp_path / "base")
    from ropekit.backbone import open_backbone

    config = ExtendConfig(
        "adarope:init=yarn,factor=2", target_length=16, samples=4, batch_size=2, lora_rank=2,
        data="shakespeare",
    )  # fmt: skip
    models = {}
    for fsdp in (False, True):
        backbone = open_backbone(base)
        run_extension(
            backbone, config, tmp_path / str(fsdp), recipe=recipe, fsdp=fsdp,
            log=lambda *_: None,
        )  # fmt: skip
        models[fsdp] = backbone
    for stage in ("stage1/adapter", "adapter"):
        _, plain = read_adapter(tmp_path / "False" / stage)
        _, sharded = read_adapter(tmp_path / "True" / stage)
        for name in plain:
            torch.testing.assert_close(sharded[name], plain[name], rtol=0, atol=1e-5)
    plain, sharded = (load_file(tmp_path / f"{f}" / "lora.safetensors") for f in (False, True))
    for name in plain:
        torch.testing.assert_close(sharded[name], plain[name], rtol=0, atol=1e-5)

    reloaded = open_backbone(base)
    load_adapter(reloaded, tmp_path / "True")
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    assert torch.equal(reloaded.token_nll(ids, 16), models[True].token_nll(ids, 16))
    assert_plain(models[True].model, type(reloaded.model))


@pytest.mark.parametrize("kind", ["FSDP", "DEEPSPEED"])
def test_accelerates_own_sharding_is_refused_naming_the_way_that_works(tmp_path, kind):
    """Accelerate's FSDP or DeepSpeed would shard the model in prepare() and the main process
    would save its shards as if they were the model."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    launched = SimpleNamespace(num_processes=1, distributed_type=DistributedType[kind])
    with pytest.raises(ValueError, match=rf"Accelerate's {kind} .* allowed: .*--fsdp"):
        train(tiny_llama(), CountingData(), tiny_config(tmp_path), accelerator=launched)
    assert not tmp_path.joinpath("checkpoints").exists()
