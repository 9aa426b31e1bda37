"""A patched Hugging Face model's forward vs the unpatched model: a tiny random Llama built in
code (2 layers, hidden 256, 4 heads of 64, one 1024-token sequence, no grad), patched with its
own RoPE spec (``spec_from_config``), so both compute the same logits.
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ropekit.hf import patch, spec_from_config

from .common import Result, compare


def run(device: str = "cpu", length: int = 1024) -> list[Result]:
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config).to(device).eval()
    patched = copy.deepcopy(plain)
    spec = spec_from_config(config)
    patch(patched, spec)
    ids = torch.randint(0, config.vocab_size, (1, length), device=device)

    def forward(model):
        def run():
            with torch.no_grad():
                return model(ids).logits

        return run

    with torch.no_grad():
        diff = (forward(patched)() - forward(plain)()).abs().max().item()
    t = compare({"patched": forward(patched), "plain": forward(plain)}, repeats=15)
    note = (
        f"LlamaForCausalLM 2 x 256, 1 x {length}, sdpa, patched with {spec!r}: "
        f"{t['patched'] * 1e3:.1f} ms vs {t['plain'] * 1e3:.1f} ms; max |logit diff| {diff:.1e}"
    )
    return [Result("patched HF forward vs unpatched", t["patched"] / t["plain"], 1.05, note)]
