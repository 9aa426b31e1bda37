"""ropekit.train: the one training loop, shared by pretraining and context extension.

Public API:
    train(model, dataset, config, *, loss_fn=None, accelerator=None) -> TrainResult
        AdamW, linear warmup + cosine decay, gradient clipping and accumulation, optional bf16
        autocast, progress bar, metrics.jsonl, atomic checkpoints and exact resume, under
        Hugging Face Accelerate (`accelerate launch` / `torchrun` make it data parallel).
    TrainConfig      frozen, validated run settings (config.py).
    TrainResult      what `train` returns; also written to <out_dir>/summary.json.
    TrainDataset     what `train` needs of a dataset: len() and dict items (loop.py).
    NonFiniteLossError   a step's loss or gradient norm was NaN or infinite.
    LossFn, causal_lm_loss, cross_entropy_sum   the loss contract and the default loss (loss.py).
    load_checkpoint(path, model, optimizer=None, scheduler=None) -> CheckpointState
        put a checkpoint's weights (and optimizer, scheduler state) into existing objects.
    latest_checkpoint(out_dir) -> Path | None
    lr_factor(step, config) -> float   the learning-rate schedule (optim.py).

Modules:
    config.py      TrainConfig
    loss.py        the loss contract and next-token cross-entropy
    optim.py       parameter groups (trainable only, lr multipliers), AdamW, the lr schedule
    sampling.py    the deterministic global batch of each step and each process's share of it
    checkpoint.py  checkpoint layout, atomic save, load, RNG state
    loop.py        train() itself

Run folder (<out_dir>): checkpoints/step-XXXXXXXX/ (see checkpoint.py), metrics.jsonl (one line
per log_interval: step, loss, lr, grad_norm, tokens, tokens_per_s, elapsed) and summary.json.
"""

from ropekit.train.checkpoint import CheckpointState, latest_checkpoint, load_checkpoint
from ropekit.train.config import TrainConfig
from ropekit.train.loop import NonFiniteLossError, TrainDataset, TrainResult, train
from ropekit.train.loss import LossFn, causal_lm_loss, cross_entropy_sum
from ropekit.train.optim import lr_factor

__all__ = [
    "CheckpointState",
    "LossFn",
    "NonFiniteLossError",
    "TrainConfig",
    "TrainDataset",
    "TrainResult",
    "causal_lm_loss",
    "cross_entropy_sum",
    "latest_checkpoint",
    "load_checkpoint",
    "lr_factor",
    "train",
]
