"""How the training loop runs on several processes: data parallel (DDP, through Accelerate) or
fully sharded (FSDP2, torch's ``fully_shard``).

Holds:
    ShardPlan        which modules FSDP2 wraps one by one (the decoder blocks) and which
                     parameters stay whole on every process (the positional ones).
    plan_for         the ShardPlan of a Backbone.
    Parallel         what the loop asks of a way of running: the module to train, the optimizer
                     preparation, gradient reduction and clipping, writing the result back.
    DataParallel     every process holds every parameter; Accelerate's DDP averages gradients.
    FullySharded     FSDP2: parameters, gradients and optimizer state split over the processes.
    parallel_for     the Parallel a TrainConfig asks for.
    clip_grad_norm   global L2 norm of gradients split into shards and whole ones, and clipping.

Why FSDP2 through torch and not Accelerate: Accelerate 1.15's FSDP switch covers GPU backends
only, so a sharded run could not be tested on the CPUs the team works on; torch's
``fully_shard`` runs on gloo CPU processes and on NCCL GPUs alike, so one code path serves
both (docs/decisions.md, "Sharded training").

What FullySharded does (``TrainConfig.fsdp``):

- It trains a *training copy* of the model: ``copy.deepcopy`` with every parameter and buffer
  aliased (new tensor objects over the same storage, so no weight is copied), then
  ``fully_shard`` on each decoder block and on the root. The caller's model is never
  touched by FSDP (its class, hooks and parameters stay plain); ``finish`` copies the trained
  values into it, gathered whole, on every process, so after ``train`` the model is what
  data-parallel training leaves: complete and equal everywhere, ready to be saved by the
  main process or trained again (the second stage of a recipe).
- Positional parameters (AdaRoPE's frequency offsets and temperatures, tuned-yarn's knobs, a
  learned table) are *replicated*: FSDP2 ignores them, every process keeps them whole and their
  gradients are averaged here, as DDP would. They are a few thousand numbers (3,420 for
  AdaRoPE on SmolLM2), so sharding saves nothing and would cost an all-gather in every
  forward; tuned-yarn's are 0-dimensional, which FSDP2 cannot split along dim 0; and every
  process needs the whole tables for its own positions, which context parallelism (each
  process holding a chunk of one sequence at its global positions) will need as well.
- Each micro-batch's backward reduce-scatters its gradients into the shards (nothing like DDP's
  ``no_sync``): keeping whole gradients across micro-batches would undo the memory sharding
  saves. Parameters stay float32 and autocast does the bf16 forward, as without sharding.

Shapes: none; this module moves whole tensors.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import Tensor, nn

from ropekit.train.config import TrainConfig

if TYPE_CHECKING:
    from ropekit.backbone import Backbone


@dataclass(frozen=True)
class ShardPlan:
    """What FSDP2 does with a model: names as in ``model.named_modules()`` and
    ``model.named_parameters()``."""

    # Modules wrapped one by one (gathered for their forward and backward, then freed): the
    # decoder blocks. Everything else (embeddings, final norm, head) is sharded with the root.
    blocks: tuple[str, ...]
    # Parameters left whole on every process; their gradients are averaged like DDP's.
    replicated: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        object.__setattr__(self, "replicated", tuple(self.replicated))
        for field in ("blocks", "replicated"):
            names = getattr(self, field)
            if len(set(names)) != len(names):
                raise ValueError(f"ShardPlan.{field}={names!r} is invalid: names must not repeat")

    def check(self, model: nn.Module) -> None:
        """ValueError naming the first block or parameter ``model`` does not have."""
        modules = dict(model.named_modules())
        params = dict(model.named_parameters())
        for name in self.blocks:
            if not name or name not in modules:
                raise ValueError(
                    f"ShardPlan.blocks names {name!r}, which {type(model).__name__} does not "
                    f"have; allowed: its submodules, e.g. {list(modules)[1:4]}"
                )
        for name in self.replicated:
            if name not in params:
                raise ValueError(
                    f"ShardPlan.replicated names {name!r}, which is not a parameter of "
                    f"{type(model).__name__}"
                )


def plan_for(backbone: Backbone) -> ShardPlan:
    """Wrap the backbone's decoder blocks; replicate its positional parameters."""
    positional = {id(p) for p in backbone.positional_parameters().values()}
    replicated = tuple(name for name, p in backbone.model.named_parameters() if id(p) in positional)
    return ShardPlan(blocks=backbone.block_names(), replicated=replicated)


class Parallel(Protocol):
    """What the training loop asks of a way of running on 1 or N processes, in call order."""

    sharded: bool  # checkpoints are sharded (torch.distributed.checkpoint), not whole files
    module: nn.Module  # what the optimizer is built on and checkpoints are taken of

    def prepare(self, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, Any]:
        """(the module the forward runs, the optimizer to step)."""

    def accumulating(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context of a micro-batch that is not the step's last."""

    def reduce_gradients(self) -> None:
        """After the step's last backward: average what the wrapper did not."""

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        """Clip to ``max_norm`` in place; returns the norm before clipping."""

    def finish(self) -> None:
        """After the last step, on every process: leave the trained values in the model."""

    def close(self) -> None:
        """Always, last: give back what was set up."""


class DataParallel:
    """Every process holds the whole model; Accelerate's DDP averages the gradients (the
    loop's behaviour before FSDP2, call for call)."""

    sharded = False

    def __init__(self, model: nn.Module, accelerator: Accelerator) -> None:
        self.module, self.accelerator = model, accelerator

    def prepare(self, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, Any]:
        return self.accelerator.prepare(self.module, optimizer)  # e.g. in DDP, on the device

    def accumulating(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return self.accelerator.no_sync(wrapped)  # DDP all-reduces after the last one only

    def reduce_gradients(self) -> None:
        pass  # DDP did it during the last backward

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        return self.accelerator.clip_grad_norm_(params, max_norm)

    def finish(self) -> None:
        pass  # the model trained in place

    def close(self) -> None:
        pass


class FullySharded:
    """FSDP2 over all processes of the run, on a training copy of ``model`` (module
    docstring). On one process it shards over a process group of one, made here: nothing is
    split, but the sharded code path and checkpoint layout run unchanged."""

    sharded = True

    def __init__(self, model: nn.Module, plan: ShardPlan, accelerator: Accelerator) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        plan.check(model)
        self.original, self.world = model, accelerator.num_processes
        self.device = accelerator.device
        self._own_group = False
        if not dist.is_initialized():
            # One process under a plain `python`: FSDP2 and torch.distributed.checkpoint need a
            # process group; a group of one in memory needs no launcher or port.
            backend = "gloo" if self.device.type == "cpu" else "nccl"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        try:
            self.module = _training_copy(model, plan.replicated)
            self.replicated = [self.module.get_parameter(n) for n in plan.replicated]
            if self.world > 1:
                _start_alike(self.module, self.device)
            with torch.no_grad():
                for p in self.replicated:  # FSDP2 moves what it manages; these it ignores
                    p.data = p.data.to(self.device)
            mesh = init_device_mesh(self.device.type, (self.world,))
            ignored = set(self.replicated)
            for name in plan.blocks:
                fully_shard(self.module.get_submodule(name), mesh=mesh, ignored_params=ignored)
            fully_shard(self.module, mesh=mesh, ignored_params=ignored)
        except BaseException:
            self.close()
            raise

    def prepare(self, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, Any]:
        return self.module, optimizer

    def accumulating(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # reduce-scatter every micro-batch (module docstring)

    def reduce_gradients(self) -> None:
        """Average the replicated parameters' gradients over the processes, as DDP does:
        g <- (sum over processes of g) / N, in one all-reduce of their concatenation."""
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if self.world == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(self.world)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        return clip_grad_norm(params, max_norm)

    def finish(self) -> None:
        """Copy every trained parameter, gathered whole (``DTensor.full_tensor``, one tensor
        at a time), into the caller's model on every process."""
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                if p.requires_grad:
                    whole = p.full_tensor() if _is_dtensor(p) else p.detach()
                    self.original.get_parameter(name).copy_(whole)

    def close(self) -> None:
        if self._own_group:
            dist.destroy_process_group()
            self._own_group = False


def _is_dtensor(tensor: Tensor) -> bool:
    # torch.distributed.tensor is not imported up front: it took 1.7 s of ropekit.train's
    # 4.6 s import (2026-12-07), paid by every process that only reads a TrainConfig (a
    # training process loads it anyway: building torch's AdamW imports torch._dynamo). Where
    # it was never imported no tensor can be a DTensor (fully_shard imports it).
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def parallel_for(
    model: nn.Module, config: TrainConfig, accelerator: Accelerator, plan: ShardPlan | None
) -> DataParallel | FullySharded:
    """FullySharded when ``config.fsdp`` (``plan`` defaults to the model's Backbone's
    ``plan_for``), else DataParallel."""
    if not config.fsdp:
        return DataParallel(model, accelerator)
    if plan is None:
        from ropekit.backbone import as_backbone

        plan = plan_for(as_backbone(model))
    return FullySharded(model, plan, accelerator)


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """Scale the gradients of ``params`` so their global L2 norm is at most ``max_norm``;
    returns the norm before (float32, the same on every process). Every process must call it.

    Some gradients are DTensor shards (each process holds rows of the tensor), some whole
    tensors equal on every process (the replicated ones), so the squared norm adds each
    shard once over the processes and each whole gradient once:

        ||g||^2 = sum_ranks sum_{p sharded} ||g_p[rank]||^2 + sum_{p whole} ||g_p||^2

    summed in float64. Clipping is torch's ``clip_grad_norm_``:
    g <- g * min(1, max_norm / (||g|| + 1e-6)).
    """
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g.to_local() for g in grads if _is_dtensor(g)]
    whole = [g for g in grads if not _is_dtensor(g)]
    device = grads[0].device if grads else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float64, device=device)
    for g in sharded:
        square += g.double().square().sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(square)
    for g in whole:
        square += g.double().square().sum()
    total = square.sqrt().float()
    coefficient = max_norm / (float(total) + 1e-6)
    if coefficient < 1:
        for g in grads:
            g.mul_(coefficient)
    return total


def _start_alike(module: nn.Module, device: torch.device) -> None:
    """Make every process start from the main process's values, as DDP does when it wraps a
    model: each shard is cut from the local copy, so ranks that differ would train a mixture
    (e.g. LoRA initialised after a first stage left each process's RNG at another point).

    What trains, and every buffer, is broadcast from rank 0 (through the device, one tensor at
    a time: NCCL moves only GPU tensors). Frozen weights are not sent (a frozen backbone can
    be most of the model, and every process read it from the same files); a float64 sum of
    each is compared instead, and a process whose sums differ stops the run.
    """
    with torch.no_grad():
        sent = [p for p in module.parameters() if p.requires_grad] + list(module.buffers())
        for tensor in sent:
            staged = tensor.detach().to(device)
            dist.broadcast(staged, src=0)
            tensor.copy_(staged)
        frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        sums = [float(p.double().sum()) for _, p in frozen]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)
    for rank, theirs in enumerate(gathered):
        pairs = zip(frozen, gathered[0], theirs, strict=True)
        differ = [name for (name, _), a, b in pairs if a != b]
        if differ:
            raise ValueError(
                f"frozen weights differ between processes 0 and {rank} (e.g. {differ[0]}): "
                "every process must load the same model before sharded training"
            )


def _training_copy(model: nn.Module, replicated: Iterable[str]) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are new tensor objects over the
    same storage (FSDP2 replaces or moves tensors of what it shards; the original's stay as
    they are), except the ``replicated`` parameters, which are copied outright (the optimizer
    updates them in place, and the caller's model takes their values only in ``finish``).
    Tokenizers are shared, not copied."""
    copies = {id(model.get_parameter(name)) for name in replicated}
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in copies:
            memo[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach()
    for tokenizer in _tokenizers(model):
        memo[id(tokenizer)] = tokenizer
    return copy.deepcopy(model, memo)


def _tokenizers(model: nn.Module) -> Iterator[Any]:
    from ropekit.backbone import as_backbone

    tokenizer = as_backbone(model).tokenizer
    if tokenizer is not None:
        yield tokenizer
