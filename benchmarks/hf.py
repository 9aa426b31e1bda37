"""A patched Hugging Face model's forward and peak memory vs the unpatched model, for three
families of different shapes: a Llama (every layer rotates), Gemma 3 (local layers on one
base, global layers on another, a sliding window of 1024) and GPT-OSS (attention sinks, eager
attention, local and global layers). Each is a random model built from transformers' own
config class (4 layers, hidden 256, 4 query heads of 64 over 2 key/value heads), read as one
4096-token sequence without grad and without a cache, patched with its own RoPE spec
(``spec_from_config``), so both compute the same logits.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ropekit.hf import patch, spec_from_config

from .common import Result, mib, paired, peak_memory

SHAPE = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}
FAMILIES = {
    "llama": {},
    "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"] * 2},
    "gpt_oss": {
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
}

ROUNDS = 15  # paired rounds per family (GPT-OSS's rounds spread about ±8%)


def _model(family: str, device: str) -> torch.nn.Module:
    config = AutoConfig.for_model(family, **SHAPE, **FAMILIES[family])
    for implementation in ("sdpa", "eager"):  # GPT-OSS has eager attention only
        config._attn_implementation = implementation
        torch.manual_seed(0)
        try:
            return AutoModelForCausalLM.from_config(config).to(device).eval()
        except ValueError:
            continue
    raise ValueError(f"{family}: no attention implementation builds")


def run(device: str = "cpu", length: int = 4096) -> list[Result]:
    out = []
    for family in FAMILIES:
        plain = _model(family, device)
        patched = copy.deepcopy(plain)
        spec = spec_from_config(plain.config)
        patch(patched, spec)
        ids = torch.randint(0, SHAPE["vocab_size"], (1, length), device=device)

        def forward(model, ids=ids):
            def run():
                with torch.no_grad():
                    return model(ids, use_cache=False).logits

            return run

        with torch.no_grad():
            diff = (forward(patched)() - forward(plain)()).abs().max().item()
        t = paired(forward(patched), forward(plain), repeats=ROUNDS)
        live = {name: [*m.parameters(), *m.buffers()] for name, m in (("p", patched), ("u", plain))}
        memory = {
            "patched": peak_memory(forward(patched), device, live["p"]),
            "plain": peak_memory(forward(plain), device, live["u"]),
        }
        where = (
            f"{type(plain).__name__} 4 x 256, 1 x {length}, "
            f"{plain.config._attn_implementation}, patched with {spec}"
        )
        out += [
            Result(
                f"patched HF forward vs unpatched, {family}",
                t.ratio,
                1.05,
                f"{where}: median of {ROUNDS} paired rounds (quartiles {t.quartiles[0]:.3f}-"
                f"{t.quartiles[1]:.3f}), {t.a * 1e3:.0f} ms vs {t.b * 1e3:.0f} ms; "
                f"max |logit diff| {diff:.1e}",
            ),
            Result(
                f"patched HF peak memory vs unpatched, {family}",
                memory["patched"] / memory["plain"],
                1.05,
                f"{where}: {mib(memory['patched'])} vs {mib(memory['plain'])}",
            ),
        ]
    return out
