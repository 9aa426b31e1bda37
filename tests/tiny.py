"""The one factory of tiny randomly initialised Hugging Face models every test builds from:
Llama (and Mistral, Qwen2, Qwen3, the other architectures ropekit.hf patches).

Holds:
    ARCH_NAMES      the four architectures ropekit.hf patches.
    VOCAB, L0       the default vocabulary and original length (max_position_embeddings).
    SMALL           the overrides of the smaller shape (hidden 32, head dim 8, init std 0.02)
                    that the training, evaluation and CLI tests use.
    tiny_config     a small config (4 query heads over 2 kv heads, head dim 16, L0 = 32);
                    ``small=True`` applies SMALL; keyword overrides set any config field.
    tiny_model      a model from that config, the same weights for the same seed; ``like=``
                    copies another model's weights (same shapes, other RoPE settings).
    perturb         moves learnable encodings away from init (trained-looking parameters).
    bpe_tokenizer_folder  a byte-level BPE trained on the essays, saved as a folder.
    llama_folder    a saved tiny Llama with a trained byte-level BPE tokenizer, for the CLI.
    family_model    a tiny random model of any family ropekit.hf supports, built by transformers'
                    auto classes from its own config class (4 layers; local and global layers
                    alternate with a window of 8 where the family has layer types).

The ``tiny_llama`` fixture (tests/conftest.py) is ``tiny_model`` with ``arch="llama"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from ropekit.encodings import PositionEncoding

VOCAB = 97
L0 = 32  # max_position_embeddings: the "original length" of every tiny model
ARCHS: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
ARCH_NAMES = tuple(ARCHS)
# The smaller shape: 4 query heads over 2 kv heads of dim 8, init std transformers' default.
SMALL: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "head_dim": 8,
    "initializer_range": 0.02,
}


def tiny_config(
    arch: str = "llama",
    rope_parameters: dict[str, Any] | None = None,
    *,
    small: bool = False,
    **overrides: Any,
):
    """The config of ``arch``: the default shape, or SMALL's; ``overrides`` win over both."""
    config_cls, _ = ARCHS[arch]
    options: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # grouped-query attention: 2 query heads per kv head
        "head_dim": 16,
        "max_position_embeddings": L0,
        # Larger than the default 0.02 so attention is peaked and rotation errors show.
        "initializer_range": 0.08,
        "rope_parameters": rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": None,  # generation runs its full length (the references do too)
        "tie_word_embeddings": False,
    }
    if arch == "mistral":
        options["sliding_window"] = None
    if arch == "qwen2":
        options["attention_bias"] = True
    if small:
        options.update(SMALL)
    options.update(overrides)
    return config_cls(**options)


def tiny_model(
    arch: str = "llama",
    rope_parameters: dict[str, Any] | None = None,
    *,
    seed: int = 0,
    like: nn.Module | None = None,
    attn_implementation: str = "sdpa",
    small: bool = False,
    **overrides: Any,
) -> nn.Module:
    """A float32 model in eval mode; with ``like``, a copy of that model's weights."""
    _, model_cls = ARCHS[arch]
    config = tiny_config(arch, rope_parameters, small=small, **overrides)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if like is not None:
        model.load_state_dict(like.state_dict(), strict=True)
    return model


def perturb(encoding: PositionEncoding, *, seed: int = 0, scale: bool = True) -> PositionEncoding:
    """Move learnable parameters off their initial values. ``scale=False`` leaves AdaScale's
    log_tau and gamma at init (the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in encoding.named_parameters():
            if not scale and name in ("log_tau", "gamma"):
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            p.add_(0.5 * noise.abs() if name == "gamma" else 0.2 * noise)
    return encoding


def bpe_tokenizer_folder(folder: Path, *, vocab_size: int, essays: int) -> Path:
    """A byte-level BPE (GPT-2 style, EOS ``<|endoftext|>``) of ``vocab_size`` ids trained on
    the first ``essays`` essays, saved as a Hugging Face tokenizer folder; the same files for
    the same call (no test downloads a tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ropekit.data import load_corpus

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator([d.text for d in load_corpus("essays")[:essays]], trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(
        folder
    )
    return folder


def llama_folder(
    folder: Path, *, layers: int = 2, max_positions: int = 64, essays: int = 2
) -> Path:
    """A Hugging Face folder for CLI tests: a tiny random Llama (SMALL, ``layers`` layers,
    L0 = ``max_positions``) and a byte-level BPE tokenizer of 300 ids
    trained here on ``essays`` essays; the same files for the same call."""
    bpe_tokenizer_folder(folder, vocab_size=300, essays=essays)
    model = tiny_model(
        "llama", small=True, vocab_size=300, num_hidden_layers=layers,
        max_position_embeddings=max_positions, pad_token_id=None, eos_token_id=0,
    )  # fmt: skip
    model.save_pretrained(folder)
    return folder


# What a family's tiny config sets beyond the common shape (the rest is its config's default).
FAMILY_LAYER_TYPES: dict[str, list[str] | None] = {
    "qwen3_5_text": None,  # its default: linear attention, and full attention in layer 4
    "llama4_text": None,  # its default: chunked attention, NoPE in layer 4
}

# Sizes the common shape does not reach, where the family's default would build a large model
# (Gemma 4's per-layer input embeddings, 262144 x 256 a layer: 270M parameters, 6 s to build;
# Qwen3-MoE's 128 experts of 768: 76M). None of them touches the attention or its rotation.
FAMILY_SIZES: dict[str, dict[str, Any]] = {
    "gemma4_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16},
    "qwen3_moe": {"num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_5_text": {
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    },
}  # fmt: skip


def family_config(model_type: str, **overrides: Any):
    """The tiny config of ``model_type`` (``family_model``'s); transformers' own class refuses
    settings the family does not take (Phi-3's rope type must be longrope)."""
    from transformers import AutoConfig

    options: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": L0, "initializer_range": 0.08,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None,
        "tie_word_embeddings": False,
    }  # fmt: skip
    probe = AutoConfig.for_model(model_type)
    if getattr(probe, "layer_types", None) and model_type not in FAMILY_LAYER_TYPES:
        options.update(
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=8,
            use_sliding_window=True,  # Qwen2, Qwen3: the window applies only when this is set
        )
    options.update(FAMILY_SIZES.get(model_type, {}))
    options.update(overrides)
    return AutoConfig.for_model(model_type, **options)


def family_model(
    model_type: str, *, seed: int = 0, attn_implementation: str | None = None, **overrides: Any
) -> nn.Module:
    """A float32 model of ``model_type`` in eval mode: sdpa where the family supports it,
    else eager (Gemma 2, GPT-OSS), unless ``attn_implementation`` says."""
    from transformers import AutoModelForCausalLM

    config = family_config(model_type, **overrides)
    for implementation in (attn_implementation,) if attn_implementation else ("sdpa", "eager"):
        config._attn_implementation = implementation
        torch.manual_seed(seed)
        try:
            return AutoModelForCausalLM.from_config(config).eval()
        except ValueError:  # "does not support ... scaled_dot_product_attention yet"
            if attn_implementation:
                raise
    raise AssertionError("unreachable")
