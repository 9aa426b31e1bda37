"""The base-model recipe: its cache key follows the settings that shape the base model and only
those; its two stages; where the model is cached; bad settings refused."""

from __future__ import annotations

import dataclasses

import pytest

from ropekit.demo import PRESETS, DemoConfig
from ropekit.train.recipe import BaseRecipe, base_model_dir


def test_base_key_follows_the_base_settings_only():
    config = PRESETS["full"]
    key = config.base.key()
    assert key == DemoConfig(preset="full").base.key()
    # The key of the recipe as it was before it moved out of demo.py: cached models stay valid.
    assert key == "L128-d192x4-1200steps-fb3695ae4c18"
    # Extension and evaluation settings do not touch the base model: same cache entry.
    for change in ({"extend_samples": 5}, {"task_samples": 3}, {"factor": 4}):
        assert dataclasses.replace(config, **change).base.key() == key
    for change in ({"base_steps": 7}, {"recall_steps": 0}, {"lr": 2e-3}, {"seed": 1}):
        assert dataclasses.replace(config.base, **change).key() != key


def test_two_stages_recall_then_mixture_and_one_warmup():
    recipe = BaseRecipe(recall_steps=40, base_steps=60, warmup=50)
    recall, mixture = recipe.stages()
    assert (recall["name"], recall["retrieval_ratio"], recall["context"]) == ("recall", 1.0, 96)
    assert (recall["warmup_steps"], recall["min_lr_ratio"]) == (40, 1.0)  # constant after
    assert (mixture["name"], mixture["context"], mixture["warmup_steps"]) == ("mixture", 128, 0)
    (only,) = BaseRecipe(recall_steps=0, base_steps=60).stages()
    assert only["name"] == "mixture" and only["warmup_steps"] == 50  # the warmup moves here


def test_the_base_model_is_cached_under_its_key(monkeypatch, tmp_path):
    monkeypatch.setenv("ROPEKIT_CACHE", str(tmp_path))
    recipe = BaseRecipe(base_steps=7)
    assert base_model_dir(recipe) == tmp_path / "demo" / recipe.key()
    assert recipe.key().startswith("L128-d192x4-607steps-")


@pytest.mark.parametrize(
    "change",
    [{"context": 0}, {"recall_steps": -1}, {"batch_size": True}, {"n_heads": 5},
     {"encoding": "nonsense"}, {"retrieval_ratio": 2.0}],
)  # fmt: skip
def test_bad_settings_are_refused(change):
    with pytest.raises(ValueError):
        BaseRecipe(**change)
