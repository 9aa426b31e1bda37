"""Next-token cross-entropy: targets, ignore index, weights, dtype, and what reaches the model."""

import math
from types import SimpleNamespace

import pytest
import torch

from ropekit.train import causal_lm_loss, cross_entropy_sum


def test_weighted_loss_by_hand():
    # Three positions, vocabulary 3. Logits log(1, 2, 1) give probabilities (1/4, 1/2, 1/4).
    row = torch.tensor([1.0, 2.0, 1.0]).log()
    logits = row.expand(1, 3, 3)  # (B=1, T=3, V=3)
    labels = torch.tensor([[2, 1, -100]])  # position t is scored against labels[t]
    weight = torch.tensor([[7.0, 0.5, 2.0]])  # the ignored label's weight counts for nothing
    loss_sum, n = cross_entropy_sum(logits, labels, weight)
    # -log p(2) = ln 4 with weight 7; -log p(1) = ln 2 with weight 0.5.
    assert n.item() == pytest.approx(7.5)
    assert loss_sum.item() == pytest.approx(7 * math.log(4) + 0.5 * math.log(2))
    assert (loss_sum / n).item() == pytest.approx((7 * math.log(4) + 0.5 * math.log(2)) / 7.5)


def test_ignored_labels_count_for_nothing_whatever_their_weight():
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    weight = torch.rand(2, 5) + 0.5
    masked = labels.clone()
    masked[0, 3] = -100
    full_sum, full_n = cross_entropy_sum(logits, labels, weight)
    part_sum, part_n = cross_entropy_sum(logits, masked, weight)
    nll = -torch.log_softmax(logits[0, 3], -1)[labels[0, 3]]
    assert part_n.item() == pytest.approx(full_n.item() - weight[0, 3].item())
    assert part_sum.item() == pytest.approx(full_sum.item() - weight[0, 3].item() * nll.item())


def test_unit_weights_equal_no_weights_and_scale_cancels_in_the_mean():
    logits = torch.randn(3, 6, 11)
    labels = torch.randint(0, 11, (3, 6))
    plain = cross_entropy_sum(logits, labels)
    ones = cross_entropy_sum(logits, labels, torch.ones(3, 6))
    assert torch.equal(plain[0], ones[0]) and torch.equal(plain[1], ones[1])
    assert plain[1].item() == 3 * 6  # every label is scored
    weight = torch.rand(3, 6)
    one = cross_entropy_sum(logits, labels, weight)
    three = cross_entropy_sum(logits, labels, 3 * weight)
    torch.testing.assert_close(one[0] / one[1], three[0] / three[1])


def test_bf16_logits_give_float32_loss():
    logits = torch.randn(2, 4, 9)
    labels = torch.randint(0, 9, (2, 4))
    loss_sum, n = cross_entropy_sum(logits.bfloat16(), labels)
    assert loss_sum.dtype == n.dtype == torch.float32
    # Upcasting happens before log-softmax, so the only error is bf16 rounding of the logits.
    reference = cross_entropy_sum(logits.bfloat16().float(), labels)[0]
    assert torch.equal(loss_sum, reference)


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match=r"logits \(2, 4, 9\), labels \(2, 5\)"):
        cross_entropy_sum(torch.randn(2, 4, 9), torch.zeros(2, 5, dtype=torch.long))


@pytest.mark.parametrize("with_positions", [False, True])
def test_causal_lm_loss_passes_position_ids_only_when_present(with_positions):
    seen = {}

    def model(**kwargs):
        seen.update(kwargs)
        return SimpleNamespace(logits=torch.zeros(1, 4, 5))

    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.ones(1, 4).long()}
    if with_positions:
        batch["position_ids"] = torch.arange(10, 14)[None]
    loss_sum, n = causal_lm_loss(model, batch)
    assert set(seen) == ({"input_ids", "position_ids"} if with_positions else {"input_ids"})
    assert n.item() == 4 and loss_sum.item() == pytest.approx(4 * math.log(5))
