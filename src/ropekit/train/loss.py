"""Losses the training loop can call.

Holds:
    LossFn               the contract: `loss_fn(model, batch) -> (loss_sum, n_tokens)`.
    cross_entropy_sum    next-token cross-entropy of logits against labels, summed, in float32.
    causal_lm_loss       the default LossFn: run the model, then `cross_entropy_sum`.
    backbone_loss        the LossFn of a Backbone: its training forward (which knows what each
                         model kind needs, e.g. a mask for PoSE positions), then the same sum.

Why a sum and a count rather than a mean: the loop adds both over micro-batches and
processes and divides once, so every token weighs the same as in one big batch however the
global batch is split (a mean of micro-batch means would not).

Shapes: B batch · T sequence length · V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from ropekit.backbone import Backbone

IGNORE_INDEX = -100  # label value that carries no loss (Hugging Face and PyTorch convention)

LossFn = Callable[[nn.Module, dict[str, Tensor]], tuple[Tensor, Tensor]]
"""`loss_fn(model, batch) -> (loss_sum, n_tokens)`: summed token loss and what it sums over.

`batch` maps each key of the dataset items to a stacked (B, ...) tensor on the training
device. `n_tokens` is the number of scored tokens, or the sum of their weights for a weighted
loss. Both are scalar tensors; `loss_sum` must carry the gradient.
"""


def cross_entropy_sum(
    logits: Tensor, labels: Tensor, loss_weight: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Summed next-token cross-entropy and the total weight it sums over.

    Labels are the targets, already shifted: the logits at position t are scored against
    `labels[:, t]`, the token that follows input t (ropekit.data's packed samples are cut this
    way from T + 1 tokens, so every position is trained). `loss_weight[:, t]` weighs that
    prediction. Tokens labelled IGNORE_INDEX count for nothing whatever their weight.

    logits (B, T, V) any float dtype; labels (B, T) long; loss_weight (B, T) float or None.
    Returns (sum_t w_t * nll_t, sum_t w_t), float32 scalars; the weighted mean is their ratio.
    """
    if logits.shape[:2] != labels.shape or (
        loss_weight is not None and loss_weight.shape != labels.shape
    ):
        shapes = f"logits {tuple(logits.shape)}, labels {tuple(labels.shape)}"
        if loss_weight is not None:
            shapes += f", loss_weight {tuple(loss_weight.shape)}"
        raise ValueError(f"expected logits (B, T, V) and labels, loss_weight (B, T); got {shapes}")
    # float32 whatever the autocast dtype: log-softmax over a large vocabulary in bf16 loses
    # most of the precision that tells a good prediction from a slightly better one.
    logits = logits.float()  # (B, T, V)
    nll = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),  # (B*T, V)
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view_as(labels)  # (B, T)
    weight = (labels != IGNORE_INDEX).float()
    if loss_weight is not None:
        weight = weight * loss_weight.float()
    return (nll * weight).sum(), weight.sum()


def causal_lm_loss(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The default LossFn: `model(input_ids=..., position_ids=...)` then `cross_entropy_sum`.

    `position_ids` is passed only when the batch has it (packed or offset sequences); the
    model must return an object with `.logits` (B, T, V), as Hugging Face causal LMs and
    ropekit's decoder do. `loss_weight`, when present, weighs each label token.
    """
    inputs = {"input_ids": batch["input_ids"]}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
    logits = model(**inputs).logits
    return cross_entropy_sum(logits, batch["labels"], batch.get("loss_weight"))


def backbone_loss(backbone: Backbone) -> LossFn:
    """`cross_entropy_sum` of `backbone.training_logits`: the module the loop passes (the
    backbone's model, or its data-parallel wrapper) runs the forward its kind needs."""

    def loss(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        logits = backbone.training_logits(model, batch)  # (B, T, V)
        return cross_entropy_sum(logits, batch["labels"], batch.get("loss_weight"))

    return loss
