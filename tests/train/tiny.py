"""A tiny Llama and a tiny synthetic dataset for the training-loop tests, and a script.

Holds:
    tiny_llama      the shared tiny Llama (tests/tiny.py), SMALL, vocab 64, in train mode.
    tiny_config     a TrainConfig that trains it in a dozen steps.
    CountingData    random start tokens followed by +1 counting: random, yet learnable in steps.
    main            `python tiny.py OUT_DIR [options]` trains the two above; the tests launch it
                    with `accelerate launch` or `torchrun` (several processes; `--fsdp` shards
                    them) and kill it with SIGKILL (`--pid-dir` tells them each rank's pid).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import Tensor
from transformers import LlamaForCausalLM

from ropekit.train import TrainConfig, causal_lm_loss, train

try:
    from ..tiny import tiny_model
except ImportError:  # run as a script: the process tests launch this file by its path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.tiny import tiny_model

VOCAB = 64


def tiny_llama(seed: int = 0, dropout: float = 0.0) -> LlamaForCausalLM:
    """The same weights for the same seed, in any process; `dropout` on attention weights
    makes training draw random numbers (resume tests then check the RNG state too)."""
    return tiny_model(
        "llama", seed=seed, small=True, vocab_size=VOCAB, max_position_embeddings=64,
        pad_token_id=None, eos_token_id=2, attention_dropout=dropout,
        use_cache=False,  # training: no KV cache to build and throw away
    ).train()  # fmt: skip


class CountingData:
    """`n` sequences of `length` tokens: a random start, then +1 (mod VOCAB) each position.

    The first token of each sequence is unpredictable and the rest are a function of the
    previous one, so the loss starts near ln(64) and falls quickly. Optional extras:
    `loss_weight` (random in [0, 2)) and `position_ids` (restarting at a random point).
    """

    def __init__(
        self,
        n: int = 32,
        length: int = 16,
        seed: int = 0,
        loss_weight: bool = False,
        position_ids: bool = False,
    ):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.tokens = (start + torch.arange(length)) % VOCAB  # (n, length)
        self.weights = torch.rand(n, length, generator=g) * 2 if loss_weight else None
        # Two packed documents per row: positions restart at a random split. (A constant
        # offset would change nothing in a RoPE model, which sees only relative positions.)
        split = torch.randint(1, length, (n, 1), generator=g)
        steps = torch.arange(length)
        self.positions = torch.where(steps < split, steps, steps - split) if position_ids else None

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        tokens = self.tokens[index]
        # Targets are the next tokens; the last position has none here.
        labels = torch.cat((tokens[1:], torch.full((1,), -100, dtype=tokens.dtype)))
        item = {"input_ids": tokens, "labels": labels}
        if self.weights is not None:
            item["loss_weight"] = self.weights[index]
        if self.positions is not None:
            item["position_ids"] = self.positions[index]
        return item


def tiny_config(out_dir: Path, **overrides) -> TrainConfig:
    """Settings under which CountingData's loss falls fast: 12 steps of 8 sequences."""
    settings = {
        "steps": 12,
        "batch_size": 8,
        "lr": 1e-2,
        "warmup_steps": 2,
        "checkpoint_interval": 4,
        "log_interval": 1,
    }
    return TrainConfig(out_dir, **(settings | overrides))


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--checkpoint-interval", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per micro-batch")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2")
    parser.add_argument("--spec", default=None, help="patch the Llama with this ropekit encoding")
    parser.add_argument(
        "--frozen-per-rank", action="store_true", help="each rank its own frozen embeddings"
    )
    parser.add_argument("--pid-dir", type=Path, default=None, help="write rank-<r>.pid here")
    args = parser.parse_args()
    if args.pid_dir is not None:
        rank = os.environ.get("RANK", "0")
        (args.pid_dir / f"rank-{rank}.pid").write_text(str(os.getpid()))

    def slow_loss(model, batch):
        # Gives a test time to kill the run between checkpoints; no effect on the numbers.
        time.sleep(args.sleep)
        return causal_lm_loss(model, batch)

    config = tiny_config(
        args.out_dir,
        steps=args.steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        checkpoint_interval=args.checkpoint_interval,
        resume=args.resume,
        fsdp=args.fsdp,
    )
    rank = int(os.environ.get("RANK", "0"))
    model = tiny_llama(seed=rank if args.frozen_per_rank else 0, dropout=args.dropout)
    if args.frozen_per_rank:
        model.model.embed_tokens.weight.requires_grad_(False)
    if args.spec is not None:
        from ropekit.hf import patch

        perturb(patch(model, args.spec))
    train(model, CountingData(), config, loss_fn=slow_loss)


def perturb(encoding: torch.nn.Module, seed: int = 1) -> None:
    """Move learnable encoding parameters off their init (so their gradients are not special)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in encoding.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


if __name__ == "__main__":
    main()
