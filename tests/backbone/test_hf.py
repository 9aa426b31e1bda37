"""HFBackbone: the fingerprint and training length read from the config; the end-of-sequence
ids gathered from the generation config, the config and the tokenizer; any prompts share one
batch (left padding); left-padded prompts give each prompt's own logits. (Cropping its cache:
test_crop.py; patching: tests/hf.)"""

from __future__ import annotations

import torch

from ropekit.backbone import as_backbone

from ..tiny import L0, VOCAB


def test_the_fingerprint_and_training_length_come_from_the_config(tiny_llama):
    backbone = as_backbone(tiny_llama({"rope_type": "default", "rope_theta": 5e5}))
    assert backbone.fingerprint() == {
        "architecture": "llama", "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
        "base": 5e5, "original_length": L0,
    }  # fmt: skip
    assert backbone.training_length == L0 and backbone.vocab_size == VOCAB


def test_eos_ids_gather_the_generation_config_and_the_config(tiny_llama):
    model = tiny_llama(eos_token_id=[5, 6])
    model.generation_config.eos_token_id = 7
    assert as_backbone(model).eos_ids == frozenset({5, 6, 7})


def test_left_padded_prompts_share_a_batch_and_give_each_prompts_own_logits(tiny_llama):
    backbone = as_backbone(tiny_llama())
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    assert backbone.group_prompts(prompts) == [[0, 1]]
    ids = torch.tensor([prompts[0], [0, 0, *prompts[1]]])  # pad id 0 on the left
    mask = (torch.arange(5) >= torch.tensor([[0], [2]])).long()  # (B, S)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # counted from each row's first real token
    with torch.no_grad():
        batched = backbone.run(ids, None, mask, positions, last_only=True)  # (B, 1, V)
        for row, prompt in enumerate(prompts):
            alone = backbone.run(torch.tensor([prompt]), None, None, None, last_only=True)
            torch.testing.assert_close(batched[row], alone[0], atol=1e-5, rtol=1e-5)
