"""TrainConfig: validation names the field, the value and what is allowed; JSON round-trips."""

import json

import pytest

from ropekit.train import TrainConfig


def test_json_round_trip(tmp_path):
    config = TrainConfig(tmp_path, lr_scale={"rotary": 10.0, "norm": 0.5}, grad_clip=None)
    again = TrainConfig(**json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert again.lr_scale == (("rotary", 10.0), ("norm", 0.5))  # a mapping keeps its order


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("steps", 0, "an integer >= 1"),
        ("batch_size", 2.0, "an integer >= 1"),
        ("grad_accum", 0, "an integer >= 1"),
        ("checkpoint_interval", -5, "an integer >= 1"),
        ("keep_last", 0, "an integer >= 1"),
        ("log_interval", 0, "an integer >= 1"),
        ("warmup_steps", 2000, "an integer in [0, steps=1000]"),
        ("lr", 0.0, "a finite number > 0"),
        ("lr", float("nan"), "a finite number > 0"),
        ("weight_decay", -0.1, "a finite number >= 0"),
        ("betas", (0.9, 1.0), "two numbers in [0, 1)"),
        ("min_lr_ratio", 1.5, "a number in [0, 1]"),
        ("grad_clip", 0.0, "None (no clipping) or a finite number > 0"),
        ("seed", -1, "an integer >= 0"),
        ("lr_scale", {"rotary": 0.0}, "multipliers must be finite and > 0"),
    ],
)
def test_bad_value_names_field_value_and_allowed(tmp_path, field, value, allowed):
    with pytest.raises(ValueError, match=r"TrainConfig\." + field + "=") as err:
        TrainConfig(tmp_path, **{field: value})
    assert allowed in str(err.value)


def test_batch_size_must_split_into_micro_batches(tmp_path):
    with pytest.raises(ValueError, match=r"TrainConfig\.batch_size=10 .*multiple of grad_accum=4"):
        TrainConfig(tmp_path, batch_size=10, grad_accum=4)


def test_bad_lr_scale_regex(tmp_path):
    with pytest.raises(ValueError, match=r"lr_scale pattern '\(' .*regular expression"):
        TrainConfig(tmp_path, lr_scale={"(": 2.0})


def test_resume_and_overwrite_exclude_each_other(tmp_path):
    with pytest.raises(ValueError, match=r"TrainConfig\.overwrite=True .*resume=True"):
        TrainConfig(tmp_path, resume=True, overwrite=True)
