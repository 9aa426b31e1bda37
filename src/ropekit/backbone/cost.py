"""What long work will cost on this machine, said before it starts, and work that will not
finish refused.

Holds:
    forward_seconds   a cost model of one forward over T tokens, timed on this machine.
    Work              the forwards a command will run: how many of each length, and whether
                      each also runs a backward (training).
    check_work        print the estimate; refuse work past `LONG_WORK_S` on a model read far
                      past its reach unless the user says yes.
    LONG_WORK_S, FAR_PAST   the stated bound and what "far past" means.

A forward of T tokens costs 2 FLOPs per weight per token plus causal attention's
2 x heads x head_dim x T^2 per layer. The rates come from one timed forward of
``TIMED_TOKENS`` tokens and one timed attention call of ``TIMED_ATTENTION`` tokens on this
machine now (attention runs slower per FLOP than the weights' matmuls here), so the estimate
follows the machine's real pace, load included; a training step (forward and backward) is
three forwards (Kaplan et al. 2020's 6N against 2N).

Why refuse: `eval probes --lengths 10000000` on a model trained at 32 tokens fit in memory,
built its haystacks for 32 s and then sat in one prefill with no estimate; such a run answers
nothing a shorter one would not (a model read 300,000 times past its length). Work that is
long but meant (a 4x extension measured at 4x) is only announced; work far past the model's
reach and past the bound needs ``--yes``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .base import Backbone

# The forward timed before long work, and the length of the attention call timed beside it
# (long enough that its T^2 term dominates).
TIMED_TOKENS, TIMED_ATTENTION = 1024, 4096
# Work estimated above this on a model read past FAR_PAST x its reach is refused without --yes.
LONG_WORK_S = 3600.0
FAR_PAST = 16  # x the model's reach: its training length x its encoding's stretch factor


def forward_seconds(backbone: Backbone) -> Callable[[int], float]:
    """A rough cost model of one forward over T tokens on this machine: 2 FLOPs per weight per
    token at the rate of one timed forward of ``TIMED_TOKENS`` tokens (at most L0), plus
    causal attention's 2 x heads x head_dim x T^2 per layer at the rate of one timed causal
    attention call of ``TIMED_ATTENTION`` tokens (attention runs slower per FLOP here)."""
    shape = backbone.fingerprint()
    weights = sum(p.numel() for p in backbone.backbone_parameters().values())
    heads, dim = shape.get("n_heads", 1), shape.get("head_dim", 1)
    attention = shape.get("n_layers", 0) * 2 * heads * dim  # x T^2

    def timed(fn: Callable[[], Any]) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            fn()
            return max(time.perf_counter() - start, 1e-9)

    g = torch.Generator().manual_seed(0)
    dtype = next(iter(backbone.backbone_parameters().values())).dtype
    q, k = (torch.randn(1, h, TIMED_ATTENTION, dim, generator=g).to(dtype) for h in (heads, 1))
    attention_rate = (
        2
        * heads
        * dim
        * TIMED_ATTENTION**2
        / timed(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
    )
    n = min(TIMED_TOKENS, backbone.training_length)
    ids = torch.randint(0, backbone.vocab_size, (1, n), generator=g)
    timed(lambda: backbone.forward_logits(ids[:, :16]))  # compiled kernels warm up untimed
    whole = timed(lambda: backbone.forward_logits(ids))
    rest = max(whole - attention * n**2 / attention_rate, whole / 10)  # the weights' share
    weight_rate = 2.0 * weights * n / rest
    return lambda tokens: (
        2.0 * weights * tokens / weight_rate + attention * tokens**2 / attention_rate
    )


@dataclass(frozen=True)
class Work:
    """The forwards a command will run: ``forwards[T]`` forwards of T tokens each (a prefill
    read in chunks through the cache costs what one forward of its length costs), each also
    with a backward when ``training``."""

    what: str  # the command's work in words, e.g. "eval probes: 2 prefills of 10,000,000 tokens"
    forwards: Mapping[int, int]
    training: bool = False
    # the longest input it reads when its forwards are expected lengths below it (a probe's
    # haystack is read to a cut point: its forwards are the cuts expected, this its length)
    reads_to: int | None = None

    @property
    def longest(self) -> int:
        return self.reads_to or max(self.forwards, default=0)


def reach(backbone: Backbone) -> int:
    """The longest context the model is meant to read: its training length times its
    encoding's stretch factor (an extension to 8x reaches 8 L0)."""
    encoding = backbone.encoding
    factor = getattr(encoding, "factor", None) if encoding is not None else None
    return round(backbone.training_length * max(1.0, float(factor or 1.0)))


def estimate_seconds(work: Work, seconds: Callable[[int], float]) -> float:
    per_step = 3.0 if work.training else 1.0  # forward + backward: 6N against 2N
    return per_step * sum(count * seconds(length) for length, count in work.forwards.items())


def check_work(
    backbone: Backbone,
    work: Work,
    *,
    yes: bool = False,
    log: Callable[[str], None] = print,
    seconds: Callable[[int], float] | None = None,
) -> float:
    """Say what ``work`` will take on this machine (``seconds``: a cost model, default
    `forward_seconds` timed now) and return the estimate. Raise ValueError, naming the
    estimate and ``--yes``, when it is above `LONG_WORK_S` and the longest forward reads the
    model past `FAR_PAST` x its `reach`, unless ``yes``."""
    if not work.forwards:
        return 0.0
    estimate = estimate_seconds(work, seconds or forward_seconds(backbone))
    log(f"{work.what}: about {duration(estimate)} on this machine (estimated from a timed forward)")
    far = reach(backbone) * FAR_PAST
    if estimate > LONG_WORK_S and work.longest > far and not yes:
        raise ValueError(
            f"{work.what} is estimated at {duration(estimate)} on this machine, reading a model "
            f"whose reach is {reach(backbone):,} tokens at {work.longest:,} "
            f"({work.longest / reach(backbone):,.0f}x); refused above {duration(LONG_WORK_S)} "
            f"past {FAR_PAST}x its reach: shorter lengths, or --yes to run it anyway"
        )
    return estimate


def duration(seconds: float) -> str:
    """``42 s``, ``17 min``, ``3.2 h``, ``12 days``: the unit a reader takes in at once."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:,.0f} days"
