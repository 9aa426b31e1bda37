"""patch/unpatch: properties of the patched model, then parity with transformers' own RoPE.

Every model here is a tiny random fp32 model (tests/tiny.py); tolerances are fp32 noise:
ropekit forms angles in float64, transformers in float32, which at positions < 64 differs by
about 1e-6 in cos/sin and by a few 1e-6 in logits of magnitude ~3.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ropekit.encodings import build
from ropekit.hf import (
    build_for_model,
    encoding_of,
    is_patched,
    model_dims,
    patch,
    spec_from_config,
    unpatch,
)

from ..tiny import ARCH_NAMES, L0, VOCAB, perturb, tiny_model

ATOL = 1e-5  # fp32 logits, see the module docstring


def _ids(batch: int = 2, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model, ids, **kwargs) -> torch.Tensor:
    return model(ids, use_cache=False, **kwargs).logits


# --------------------------------------------------------------------------- properties
def test_patch_attaches_encoding_as_submodule_and_unpatch_restores() -> None:
    model = tiny_model("llama")
    ids = _ids()
    before = _logits(model, ids)
    encoding = patch(model, "adarope")
    assert is_patched(model) and encoding_of(model) is encoding
    assert model.model.ropekit_encoding is encoding
    names = {n for n, _ in model.named_parameters()}
    assert {f"model.ropekit_encoding.{n}" for n, _ in encoding.named_parameters()} <= names
    assert any(k.startswith("model.ropekit_encoding.") for k in model.state_dict())
    assert unpatch(model) is encoding
    assert not is_patched(model) and not hasattr(model.model, "ropekit_encoding")
    assert not any("ropekit" in n for n, _ in model.named_parameters())
    assert "forward" not in model.model.layers[0].self_attn.__dict__
    assert torch.equal(_logits(model, ids), before)
    assert unpatch(model) is None


def test_context_fills_what_the_spec_omits() -> None:
    model = tiny_model("qwen2", {"rope_type": "default", "rope_theta": 5e5})
    encoding = patch(model, "yarn:factor=4")
    assert encoding.config.base == 5e5 and encoding.config.original_length == L0
    assert patch(model, "yarn:factor=4", base=1e4).config.base == 1e4
    # AdaRoPE extending a pretrained model measures AdaScale against its training length.
    assert patch(model, "adarope").config.l_ref == L0
    assert patch(model, "adarope:l_ref=64").config.l_ref == 64


def test_repatch_replaces_the_encoding() -> None:
    model = tiny_model("llama")
    ids = _ids()
    patch(model, "yarn:factor=4")
    yarn = _logits(model, ids)
    patch(model, "linear:factor=2")
    patch(model, "yarn:factor=4")
    assert torch.equal(_logits(model, ids), yarn)
    assert sum("ropekit" in n for n, _ in model.named_modules()) == 1


def test_refuses_what_it_cannot_wire() -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="rotary encodings"):
        patch(model, "alibi")
    other = build("rope", n_heads=4, n_kv_heads=4, head_dim=16, n_layers=2)
    with pytest.raises(ValueError, match="n_kv_heads=4; this model's full_attention layers have 2"):
        patch(model, other)
    with pytest.raises(ValueError, match="factor"):
        patch(model, "yarn:factor=0.5")
    assert not is_patched(model)


def test_positional_parameters_stay_in_their_dtype_when_the_model_is_cast() -> None:
    model = tiny_model("llama")
    encoding = perturb(patch(model, "adarope"))
    dtypes = {n: p.dtype for n, p in encoding.named_parameters()}
    model.to(torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert {n: p.dtype for n, p in encoding.named_parameters()} == dtypes
    unpatch(model)
    encoding.to(torch.bfloat16)  # once unpatched, the guard is gone
    assert all(p.dtype == torch.bfloat16 for p in encoding.parameters())


def test_deepcopy_of_a_patched_model_is_independent() -> None:
    model = tiny_model("llama")
    perturb(patch(model, "adarope"))
    ids = _ids()
    twin = copy.deepcopy(model)
    assert torch.equal(_logits(twin, ids), _logits(model, ids))
    with torch.no_grad():
        encoding_of(twin).log_tau.add_(0.5)
    assert not torch.allclose(_logits(twin, ids), _logits(model, ids))
    assert encoding_of(twin) is twin.model.ropekit_encoding


def test_positional_only_training_reaches_only_the_encoding() -> None:
    """With the backbone frozen no layer input requires grad; activation checkpointing must
    still carry gradients to the encoding (transformers 5.24 checkpoints non-reentrantly)."""
    model = tiny_model("llama")
    encoding = perturb(patch(model, "adarope:init=yarn,factor=2"))
    model.requires_grad_(False)
    encoding.requires_grad_(True)
    ids = _ids(length=48)
    model(ids, labels=ids, use_cache=False).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert reference and all(n.startswith("model.ropekit_encoding.") for n in reference)
    assert all(g.abs().sum() > 0 for g in reference.values())
    model.zero_grad(set_to_none=True)
    model.activation_checkpointing_enable()
    model.train()  # transformers checkpoints only in training mode
    model(ids, labels=ids, use_cache=False).loss.backward()
    params = dict(model.named_parameters())
    for name, grad in reference.items():
        torch.testing.assert_close(params[name].grad, grad)


# --------------------------------------------------------------------------- parity
@pytest.mark.parametrize(
    ("arch", "attn"), [*((a, "sdpa") for a in ARCH_NAMES), ("llama", "eager"), ("qwen3", "eager")]
)
def test_own_spec_leaves_logits_and_input_gradients_unchanged(arch: str, attn: str) -> None:
    model = tiny_model(arch, attn_implementation=attn)
    embeds = model.get_input_embeddings()(_ids(length=48)).detach()

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        x = embeds.clone().requires_grad_(True)
        logits = model(inputs_embeds=x, use_cache=False).logits
        weights = torch.linspace(-1, 1, logits.shape[-1])
        (logits * weights).sum().backward()
        return logits.detach(), x.grad

    ref_logits, ref_grad = run()
    patch(model, spec_from_config(model.config))
    logits, grad = run()
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    # The gradient sums 2 x 48 x 97 weighted logits (entries up to ~300); the same 1e-5,
    # taken relative to its largest entry. In float64 the two differ by ~1e-7 of it: all of
    # that is transformers' float32 angles (position * inv_freq formed in float32).
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(grad, ref_grad, atol=ATOL * scale, rtol=0)


# Each: transformers rope_parameters, and the lengths to test (below and above L0 = 32).
ROPE_KINDS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0},
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": L0,
        "attention_factor": 1.3,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": L0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "truncate": False,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 4.0,
        "original_max_position_embeddings": L0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    "longrope": {
        "rope_type": "longrope",
        "factor": 4.0,
        "original_max_position_embeddings": L0,
        "short_factor": [1.0, 1.0, 1.1, 1.2, 1.4, 1.8, 2.0, 2.5],
        "long_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
    },
}


@pytest.mark.parametrize("kind", list(ROPE_KINDS))
@pytest.mark.parametrize("length", [24, 56])
def test_ropekit_schedule_equals_transformers_rope_type(kind: str, length: int) -> None:
    """Each transformers rope type vs ropekit's schedule of that kind on the same weights.

    A fresh transformers model per forward: its "dynamic" frequencies depend on the longest
    sequence it has seen (dynamic_rope_update), ropekit's only on the current one."""
    plain = tiny_model("llama")
    params = {"rope_theta": 10000.0, **ROPE_KINDS[kind]}
    reference = tiny_model("llama", params, like=plain)
    ids = _ids(length=length)
    expected = _logits(reference, ids)

    spec = spec_from_config(reference.config)
    assert spec.name == {"dynamic": "dynamic-ntk"}.get(params["rope_type"], params["rope_type"])
    patch(plain, spec)
    torch.testing.assert_close(_logits(plain, ids), expected, atol=ATOL, rtol=0)


def test_spec_strings_with_defaults_equal_transformers() -> None:
    """A hand-written spec (the user's path) equals transformers' yarn on a Qwen3 model."""
    plain = tiny_model("qwen3", {"rope_type": "default", "rope_theta": 1e6})
    params = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}
    reference = tiny_model("qwen3", params, like=plain)  # original length: max_position
    ids = _ids(length=60)
    patch(plain, "yarn:factor=2")
    torch.testing.assert_close(_logits(plain, ids), _logits(reference, ids), atol=ATOL, rtol=0)


def test_build_for_model_uses_the_model_shape() -> None:
    model = tiny_model("mistral")
    encoding = build_for_model(model.config, "adarope:init=linear,factor=2")
    dims = model_dims(model.config)
    assert (encoding.n_heads, encoding.n_kv_heads, encoding.head_dim, encoding.n_layers) == (
        dims.n_heads,
        dims.n_kv_heads,
        dims.head_dim,
        dims.n_layers,
    )


def test_lora_on_a_patched_model_trains_both_and_saves_the_adapter(tmp_path) -> None:
    from peft import LoraConfig, get_peft_model

    from ropekit.backbone import load_adapter, save_adapter

    model = tiny_model("llama")
    encoding = perturb(patch(model, "adarope:init=linear,factor=2"))
    ids = _ids()
    before = _logits(model, ids)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert encoding_of(lora) is encoding
    torch.testing.assert_close(_logits(lora, ids), before, atol=0, rtol=0)  # LoRA B starts at 0
    encoding.requires_grad_(True)  # PEFT froze everything but LoRA; "joint" trains both
    lora(ids, labels=ids, use_cache=False).loss.backward()
    trained = {n for n, p in lora.named_parameters() if p.grad is not None}
    assert any("lora_" in n for n in trained) and any("ropekit_encoding" in n for n in trained)
    fresh = tiny_model("llama")
    load_adapter(fresh, save_adapter(lora, tmp_path))
    assert torch.equal(_logits(fresh, ids), before)
