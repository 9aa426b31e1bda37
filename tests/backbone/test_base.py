"""What the Backbone base class does for every kind of model. token_nll: chunked scoring
through the KV cache equals one forward for static encodings; a length-following one (dynamic
NTK, DCA's scale, STRING's shift) is read in one forward per window, so its early chunks do not
see a shorter length. parameter_digest: equal exactly for bit-identical weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ropekit.backbone import as_backbone
from ropekit.backbone.base import parameter_digest
from ropekit.hf import patch

from ..model.tiny import tiny_model as tiny_decoder
from ..tiny import L0, VOCAB
from ..tiny import tiny_model as tiny_hf


def _full_nll(backbone, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = backbone.forward_logits(ids[:, :-1]).float()  # one forward, no cache
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(
        ids.shape[0], -1
    )


def _chunked_through_cache(backbone, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    cache, parts = backbone.new_cache(), []
    with torch.no_grad():
        for start in range(0, ids.shape[1] - 1, chunk):
            part = ids[:, start : min(ids.shape[1] - 1, start + chunk)]
            parts.append(backbone.run(part, cache, None, None, last_only=False).float())
    logits = torch.cat(parts, dim=1)
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(
        ids.shape[0], -1
    )


def _hf(spec: str):
    model = tiny_hf("llama")
    patch(model, spec)
    return as_backbone(model)


@pytest.mark.parametrize(
    ("make", "static", "following"),
    [
        (lambda s: _hf(s), "yarn:factor=2", "dynamic-ntk:factor=2"),
        (
            lambda s: _hf(s),
            "dca:chunk_size=12,local_size=4,scale=none",
            "dca:chunk_size=12,local_size=4",
        ),
        (lambda s: _hf(s), "string:shift=10,window=3", "string:window=3"),
        (lambda s: as_backbone(tiny_decoder(s).eval()), "rope", "dynamic-ntk:factor=2"),
    ],
)
def test_a_length_following_encoding_is_scored_in_one_forward(make, static, following):
    ids = torch.randint(2, VOCAB, (2, 3 * L0 + 1), generator=torch.Generator().manual_seed(0))
    for spec in (static, following):
        backbone = make(spec)
        got = backbone.token_nll(ids, 16)
        torch.testing.assert_close(got, _full_nll(backbone, ids), atol=1e-5, rtol=1e-5)
        assert backbone.scores_in_one_forward == (spec == following)
    # Through the cache in chunks, the following encoding's early chunks saw shorter lengths.
    drift = (_chunked_through_cache(backbone, ids, 16) - got).abs().max()
    assert drift > 1e-3, (following, drift)


def test_parameter_digest_names_bit_identical_weights_whatever_their_order():
    a = {"x": torch.arange(4.0), "y": torch.ones(2, 2, dtype=torch.float64)}
    same = {"y": a["y"].clone(), "x": a["x"].clone()}
    assert parameter_digest(a) == parameter_digest(same)
    moved = {"x": a["x"].clone(), "y": a["y"].clone()}
    moved["x"][2] = torch.nextafter(moved["x"][2], torch.tensor(10.0))  # one ulp
    assert parameter_digest(moved) != parameter_digest(a)
    assert parameter_digest({"x": a["x"], "y": a["y"].float()}) != parameter_digest(a)  # dtype
    assert parameter_digest({"z": a["x"], "y": a["y"]}) != parameter_digest(a)  # name
    assert parameter_digest({"x": a["x"].reshape(2, 2), "y": a["y"]}) != parameter_digest(a)
