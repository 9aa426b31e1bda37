"""End to end: a tiny decoder memorises a short byte string (the whole model trains)."""

from __future__ import annotations

import pytest
import torch

from ropekit.model import Decoder, DecoderConfig

TEXT = b"To be, or not to be, that is the question."


@pytest.mark.parametrize("spec", ["rope", "alibi"])
def test_tiny_model_overfits_a_byte_string(spec):
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, encoding=spec))
    ids = torch.tensor([list(TEXT)])  # (1, 42) bytes
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(100):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 5.0  # about ln 256 = 5.5 at init
    assert losses[-1] < 0.1  # memorised: every next byte predicted
    # Memorised means greedy decoding from the first bytes reproduces the rest.
    continuation = model.generate(ids[:, :8], max_new_tokens=ids.shape[1] - 8)
    assert bytes(continuation[0].tolist()) == TEXT[8:]
