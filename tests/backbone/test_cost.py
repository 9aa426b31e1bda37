"""The estimate said before long work, and the refusal of work that will not finish
(ropekit.backbone.cost): announced always, refused only above the bound on a model read far
past its reach, and then only without --yes."""

from __future__ import annotations

import pytest

from ropekit.backbone import as_backbone
from ropekit.backbone.cost import (
    FAR_PAST,
    LONG_WORK_S,
    Work,
    check_work,
    duration,
    forward_seconds,
    reach,
)

from ..model.tiny import CONTEXT, tiny_model


def _one_second_per_token(tokens: int) -> float:
    return float(tokens)


def test_the_estimate_is_the_sum_of_the_forwards_and_a_step_is_three():
    backbone = as_backbone(tiny_model())
    lines = []
    work = Work("eval", {64: 3, 128: 2})
    seconds = check_work(backbone, work, log=lines.append, seconds=_one_second_per_token)
    assert seconds == 3 * 64 + 2 * 128 and lines == ["eval: about 7 min on this machine "
                                                    "(estimated from a timed forward)"]  # fmt: skip
    training = Work("extend", {64: 3, 128: 2}, training=True)
    assert check_work(backbone, training, log=lines.append, seconds=_one_second_per_token) == (
        3 * seconds
    )


def test_work_far_past_the_reach_and_past_the_bound_is_refused_unless_yes():
    backbone = as_backbone(tiny_model())
    far = CONTEXT * FAR_PAST + 1
    work = Work("eval probes", {far: 1})
    slow = lambda tokens: 2 * LONG_WORK_S  # noqa: E731 - a cost model: every forward 2 h
    with pytest.raises(ValueError) as refused:
        check_work(backbone, work, log=lambda _: None, seconds=slow)
    message = str(refused.value)
    assert "estimated at 2.0 h" in message and "--yes" in message
    assert f"reach is {CONTEXT} tokens at {far:,}" in message and "\n" not in message
    assert check_work(backbone, work, yes=True, log=lambda _: None, seconds=slow) == 7200


@pytest.mark.parametrize(
    ("longest", "seconds"),
    [
        (CONTEXT * FAR_PAST, 2 * LONG_WORK_S),  # long, but at the edge of the reach: meant
        (CONTEXT * FAR_PAST * 10, LONG_WORK_S / 2),  # far past, but it will finish
    ],
)
def test_long_work_that_is_meant_or_that_will_finish_is_only_announced(longest, seconds):
    backbone = as_backbone(tiny_model())
    lines = []
    check_work(backbone, Work("w", {longest: 1}), log=lines.append, seconds=lambda t: seconds)
    assert len(lines) == 1 and lines[0].startswith("w: about ")


def test_the_reach_of_an_extended_model_is_its_factor_times_its_training_length():
    assert reach(as_backbone(tiny_model())) == CONTEXT
    assert reach(as_backbone(tiny_model("yarn:factor=8"))) == 8 * CONTEXT


def test_the_cost_model_is_linear_in_the_weights_and_quadratic_in_attention():
    seconds = forward_seconds(as_backbone(tiny_model()))
    a, b, c = seconds(1000), seconds(2000), seconds(4000)
    assert 0 < a < b < c
    # f(T) = w T + q T^2: f(4000) - 2 f(2000) = 8e6 q = 4 (f(2000) - 2 f(1000)).
    assert (c - 2 * b) == pytest.approx(4 * (b - 2 * a), rel=1e-9)


@pytest.mark.parametrize(
    ("seconds", "words"),
    [(42, "42 s"), (17 * 60, "17 min"), (3.2 * 3600, "3.2 h"), (12 * 86400, "12 days")],
)
def test_durations_read_at_a_glance(seconds, words):
    assert duration(seconds) == words
