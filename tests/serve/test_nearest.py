"""The nearest shared schedule to a per-head AdaRoPE: the mean of its log-frequencies and the
geometric mean of its temperatures, exported on request and said so; a shared schedule is its
own nearest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ropekit.hf import ExportRefused, patch
from ropekit.serve.exporting import EXPORT_RECORD, export
from tests.tiny import perturb

from .test_exporting import SHARED


def test_nearest_exports_a_per_head_schedule_as_its_mean(tmp_path: Path, tiny_llama) -> None:
    from ropekit.serve.nearest import nearest_shared

    model = tiny_llama()
    encoding = perturb(patch(model, "adarope:init=yarn,factor=2"))
    with pytest.raises(ExportRefused):
        export(model, None, tmp_path / "refused")
    out = export(model, None, tmp_path / "near", nearest=True)
    record = json.loads((out / EXPORT_RECORD).read_text())
    assert any("nearest shared schedule" in note for note in record["notes"])
    fit = nearest_shared(encoding, length=64)
    xi = torch.stack([encoding.xi(layer).detach().expand(2, -1) for layer in range(2)])
    torch.testing.assert_close(fit.theta.log(), xi.double().mean(dim=(0, 1)), rtol=0, atol=1e-12)
    assert fit.max_log_freq_spread > 0
    low, high = fit.temperature_range
    assert low < fit.temperature < high  # a geometric mean of distinct temperatures


def test_nearest_of_a_shared_schedule_is_the_schedule(tmp_path: Path, tiny_llama) -> None:
    from ropekit.serve.nearest import nearest_shared

    model = tiny_llama()
    encoding = perturb(patch(model, SHARED), scale=False)
    fit = nearest_shared(encoding, length=64)
    torch.testing.assert_close(
        fit.theta, encoding.xi(0).detach().double()[0].exp(), rtol=1e-12, atol=0
    )
    assert fit.max_log_freq_spread == 0 and fit.temperature == pytest.approx(1.0)
