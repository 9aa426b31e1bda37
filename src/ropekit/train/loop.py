"""The training loop shared by pretraining and context extension.

Holds:
    train                run (or resume) a training run and return its TrainResult.
    TrainResult          final loss, steps, tokens, time and where the outputs are.
    NonFiniteLossError   raised when a step's loss or gradient norm is NaN or infinite.

One optimizer step: every process takes its share of the global batch (see sampling.py), runs
forward and backward on its micro-batches, and the loss sums and token counts are added over
all of them. The gradient is then divided by the global token count, which makes it the
gradient of the token-weighted mean loss of the whole global batch on 1 or N processes.

How the processes share the model is a ``Parallel`` (sharding.py): data parallel (DDP through
Accelerate, every process holds every parameter), or, with ``TrainConfig.fsdp``, fully
sharded (FSDP2: parameters, gradients and optimizer state split over the processes, sharded
checkpoints). The steps and their numbers are the same either way, up to float rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch import Tensor, nn
from tqdm.auto import tqdm

from ropekit.distributed import Processes, check_launched, end_group_at_exit
from ropekit.outdir import (
    LOCK_FILE,
    OutDirLock,
    OutputError,
    check_target,
    has_outputs,
    lock_out_dir,
    writing,
)
from ropekit.results import check_provenance, run_metadata, write_result
from ropekit.train.checkpoint import (
    CHECKPOINTS,
    CheckpointState,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_state,
    restore_rng,
    resume_checkpoint,
    save_checkpoint,
)
from ropekit.train.config import RUN_CONTROL, TrainConfig
from ropekit.train.loss import LossFn, causal_lm_loss
from ropekit.train.optim import build_optimizer, lr_factor
from ropekit.train.sampling import collate, global_batch, local_batches
from ropekit.train.sharding import Parallel, ShardPlan, parallel_for
from ropekit.utils import atomic_write_text, warn_if_emulated

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
# Where `overwrite` keeps the run it replaces until the new run's first checkpoint: a new
# config that fails at its first step (a learned table too short, a loss that is NaN) gives
# the old run back instead of leaving neither.
REPLACED = ".replaced"
_RUN_FILES = (CHECKPOINTS, METRICS, SUMMARY)  # what a run writes into out_dir (and replaces)
# Every field's default, in to_dict() form (resume fills fields older checkpoints lack).
_DEFAULTS = TrainConfig(out_dir=Path(".")).to_dict()


class TrainDataset(Protocol):
    """What `train` needs from a dataset: a length and items by index.

    `dataset[i]` must return the same dict of tensors every time it is asked (resuming and
    multi-process runs rely on it): `input_ids` (T,) long, `labels` (T,) long (-100 = no loss),
    optionally `loss_weight` (T,) float and `position_ids` (T,) long, all items one length T.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, Tensor]: ...


class NonFiniteLossError(RuntimeError, ValueError):
    """A step's loss or gradient norm was NaN or infinite; its update was not applied. A
    ValueError too: it comes from settings (a learning rate too high, data that scores no
    token), so the CLI reports it as one line."""

    def __init__(self, step: int, loss: float, grad_norm: float, checkpoint: Path | None):
        self.step, self.loss, self.grad_norm, self.checkpoint = step, loss, grad_norm, checkpoint
        kept = f"last good checkpoint: {checkpoint}" if checkpoint else "no checkpoint yet"
        super().__init__(
            f"training stopped at step {step}: loss={loss}, grad_norm={grad_norm} "
            f"(must be finite); the step was not applied; {kept}"
        )


@dataclass(frozen=True)
class TrainResult:
    """The outcome of `train`; the same numbers are in `summary`."""

    final_loss: float  # loss of the last step
    steps: int  # optimizer steps completed
    tokens: int  # input tokens trained on, all processes and sessions together
    elapsed_s: float  # wall-clock seconds of training, all sessions together
    tokens_per_s: float  # tokens / elapsed_s
    checkpoint: Path  # the final checkpoint
    summary: Path  # the run summary JSON


def train(
    model: nn.Module,
    dataset: TrainDataset,
    config: TrainConfig,
    *,
    loss_fn: LossFn | None = None,
    accelerator: Accelerator | None = None,
    provenance: Mapping[str, Any] | None = None,
    plan: ShardPlan | None = None,
    command: str = "",
) -> TrainResult:
    """Train `model` in place on `dataset`; checkpoints, metrics and summary go to out_dir.

    Only parameters with requires_grad=True are trained or saved (unless save_frozen). The
    loss defaults to `causal_lm_loss`; pass `loss_fn` for another (e.g. chunked) loss.
    Launched by `accelerate launch` or `torchrun`, every process calls `train` alike and the
    run is data parallel; `accelerator` defaults to `Accelerator()` (one you pass must leave
    gradient accumulation to `config.grad_accum`). With `config.fsdp` the parameters are
    sharded by FSDP2 as `plan` says (default: `plan_for` the model's Backbone: its decoder
    blocks wrapped one by one, its positional parameters replicated); on return the model
    holds the trained values, complete, on every process. With `config.resume`,
    a run continues from its latest checkpoint exactly as if it had never stopped; a
    checkpoint whose recorded `provenance` (what the run trains: model, encoding, data,
    tokenizer; ropekit.results) differs from the one passed is refused, naming the field.
    `command` is what the summary records as the command that made the run (empty: the
    process's own command line, which for a run launched by code names that code's entry,
    e.g. `ropekit compare ... --join` or pytest, not the run).

    Raises NonFiniteLossError when a loss or gradient norm is not finite, FileExistsError
    when out_dir already holds files and neither resume nor overwrite is set, and
    ropekit.outdir.OutDirLocked (a ValueError) when another live run is using out_dir.
    """
    accelerator = accelerator or Accelerator()
    if accelerator.num_processes > 1:
        end_group_at_exit()  # the group the Accelerator joined (ropekit.distributed)
    loss_fn = loss_fn or causal_lm_loss
    _check_setup(dataset, config, accelerator)
    if config.bf16:
        warn_if_emulated(torch.bfloat16, accelerator.device, "training's bf16 autocast")
    lock, checkpoint = _claim_out_dir(config, accelerator)
    try:
        parallel = parallel_for(model, config, accelerator, plan)
        try:
            return _train(
                parallel, dataset, config, loss_fn, accelerator, checkpoint, provenance, command
            )
        finally:
            parallel.close()
    except BaseException:
        if accelerator.is_main_process:  # no checkpoint of this run yet: the old run is back
            _restore_replaced(config.out_dir)
        raise
    finally:
        lock.release()


def _train(
    parallel: Parallel,
    dataset: TrainDataset,
    config: TrainConfig,
    loss_fn: LossFn,
    accelerator: Accelerator,
    checkpoint: Path | None,
    provenance: Mapping[str, Any] | None,
    command: str,
) -> TrainResult:
    """`train` in an out_dir this run holds, resuming from `checkpoint` if there is one."""
    rank, world = accelerator.process_index, accelerator.num_processes
    main = accelerator.is_main_process
    set_seed(config.seed + rank)  # own streams per process, e.g. for dropout
    model = parallel.module  # the model itself, or its sharded training copy
    optimizer, scheduler = build_optimizer(model, config)
    state = _start_state(
        model, optimizer, scheduler, dataset, config, world, checkpoint, provenance
    )
    wrapped, optimizer = parallel.prepare(optimizer)
    if checkpoint is not None:
        restore_rng(checkpoint, rank)
    trainable = [p for p in model.parameters() if p.requires_grad]

    step, tokens, elapsed_before = state.step, state.tokens, state.elapsed_s
    start = time.perf_counter()
    logged = (start, tokens)  # time and tokens at the last log line, for tokens/s
    metrics = _open_metrics(config.out_dir / METRICS, step) if main else None
    bar = tqdm(total=config.steps, initial=step, desc="train", unit="step", disable=not main)
    wrapped.train()
    fresh = checkpoint is None
    try:
        while step < config.steps:
            loss, grad_norm, n_tokens = _optimizer_step(
                wrapped, dataset, config, loss_fn, accelerator, parallel, trainable, step,
                checkpoint,
            )  # fmt: skip
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step, tokens = step + 1, tokens + n_tokens
            bar.update()
            now = time.perf_counter()
            elapsed = elapsed_before + now - start
            if step % config.log_interval == 0 or step == config.steps:
                tokens_per_s = (tokens - logged[1]) / (now - logged[0])
                logged = (now, tokens)
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
                if metrics is not None:
                    _log_line(metrics, config, step, loss, grad_norm, tokens, tokens_per_s, elapsed)
            if step % config.checkpoint_interval == 0 or step == config.steps:
                state = dataclasses.replace(
                    state, step=step, samples_seen=step * config.batch_size, tokens=tokens,
                    loss=loss, elapsed_s=elapsed, num_processes=world,
                    config=config.to_dict(),  # run-control fields may have changed on resume
                )  # fmt: skip
                checkpoint = save_checkpoint(
                    config.out_dir, state, model=model, optimizer=optimizer,
                    scheduler=scheduler, accelerator=accelerator,
                    save_frozen=config.save_frozen, keep_last=config.keep_last,
                    sharded=parallel.sharded,
                )  # fmt: skip
                if main:  # this run can be resumed now: the one it replaces is gone for good
                    shutil.rmtree(config.out_dir / REPLACED, ignore_errors=True)
    except BaseException:
        if metrics is not None and fresh and checkpoint is None:
            # Nothing of this run can be resumed (no checkpoint yet): leave the folder as it
            # was found, so the corrected rerun needs neither --resume nor --overwrite (and
            # `train` gives back the run an --overwrite set aside).
            metrics.close()
            (config.out_dir / METRICS).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # a first checkpoint that failed (a full disk)
                (config.out_dir / CHECKPOINTS).rmdir()  # left it empty: it is not a run either
        raise
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
    parallel.finish()  # sharded: the trained values, whole, into the caller's model
    return _finish(state, checkpoint, config, accelerator, command)


def _log_line(
    metrics: IO[str],
    config: TrainConfig,
    step: int,
    loss: float,
    grad_norm: float,
    tokens: int,
    tokens_per_s: float,
    elapsed: float,
) -> None:
    """One line of metrics.jsonl, flushed so a killed run keeps every line it logged."""
    record = {
        "step": step,
        "loss": loss,
        "lr": config.lr * lr_factor(step - 1, config),  # times any lr_scale
        "grad_norm": grad_norm,  # before clipping
        "tokens": tokens,
        "tokens_per_s": tokens_per_s,  # since the previous line
        "elapsed": elapsed,
    }
    metrics.write(json.dumps(record) + "\n")
    metrics.flush()


def _start_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    dataset: TrainDataset,
    config: TrainConfig,
    world: int,
    checkpoint: Path | None,
    provenance: Mapping[str, Any] | None,
) -> CheckpointState:
    """A fresh run's state, or the checkpoint's (loaded into the objects) when resuming."""
    state = CheckpointState(
        step=0,
        samples_seen=0,
        tokens=0,
        loss=math.nan,
        elapsed_s=0.0,
        num_processes=world,
        dataset_len=len(dataset),
        config=config.to_dict(),
        provenance=dict(provenance or {}),
    )
    if checkpoint is None:
        return state
    saved = read_checkpoint_state(checkpoint)
    _check_resumable(checkpoint, saved, config, len(dataset), state.provenance)
    # The main process verified every file of it against its manifest when choosing it.
    return load_checkpoint(checkpoint, model, optimizer, scheduler, verify=False)


def _optimizer_step(
    wrapped: nn.Module,
    dataset: TrainDataset,
    config: TrainConfig,
    loss_fn: LossFn,
    accelerator: Accelerator,
    parallel: Parallel,
    trainable: list[nn.Parameter],
    step: int,
    checkpoint: Path | None,
) -> tuple[float, float, int]:
    """Gradients of step ``step``'s global batch, scaled and clipped: (loss, grad norm before
    clipping, input tokens). The update itself is the caller's."""
    rank, world = accelerator.process_index, accelerator.num_processes
    indices = global_batch(step, config.batch_size, len(dataset), config.seed)
    batches = local_batches(indices, rank, world, config.grad_accum)
    totals = _forward_backward(
        wrapped, dataset, batches, loss_fn, accelerator, parallel, config.bf16
    )
    parallel.reduce_gradients()
    # A global batch with no scored token gives 0/0 = NaN here, caught below.
    loss = float(totals[0] / totals[1])
    # DDP (or FSDP2) averaged the summed-loss gradients over processes; this makes them the
    # gradient of the mean over every scored token of the global batch.
    scale = float(world / totals[1])
    for p in trainable:
        if p.grad is not None:
            p.grad.mul_(scale)
    grad_norm = float(parallel.clip_grad_norm(trainable, config.grad_clip or math.inf))
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteLossError(step + 1, loss, grad_norm, checkpoint)
    return loss, grad_norm, int(totals[2])


def _finish(
    state: CheckpointState,
    checkpoint: Path,
    config: TrainConfig,
    accelerator: Accelerator,
    command: str,
) -> TrainResult:
    result = TrainResult(
        final_loss=state.loss,
        steps=state.step,
        tokens=state.tokens,
        elapsed_s=state.elapsed_s,
        tokens_per_s=state.tokens / state.elapsed_s,
        checkpoint=checkpoint,
        summary=config.out_dir / SUMMARY,
    )
    if accelerator.is_main_process:
        _write_summary(result, config, accelerator.num_processes, state.provenance, command)
    accelerator.wait_for_everyone()
    return result


def _forward_backward(
    model: nn.Module,
    dataset: TrainDataset,
    batches: list[list[int]],
    loss_fn: LossFn,
    accelerator: Accelerator,
    parallel: Parallel,
    bf16: bool,
) -> Tensor:
    """Accumulate gradients of this process's micro-batches.

    Returns float64 [loss sum, scored tokens, input tokens] summed over all processes.
    """
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)
    for i, indices in enumerate(batches):
        batch = collate([dataset[j] for j in indices])
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        # DDP all-reduces gradients once per step, after the last micro-batch.
        last = i == len(batches) - 1
        with nullcontext() if last else parallel.accumulating(model):
            with torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss_sum, n_scored = loss_fn(model, batch)
            accelerator.backward(loss_sum)
        totals[0] += loss_sum.detach().double()
        totals[1] += n_scored
        totals[2] += batch["input_ids"].numel()
    return accelerator.reduce(totals, reduction="sum")


def _check_setup(dataset: TrainDataset, config: TrainConfig, accelerator: Accelerator) -> None:
    # Each process would train alone and they would overwrite each other's checkpoints.
    check_launched(accelerator.num_processes)
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        # Its prepare() would shard the model, and checkpoints, the final model and adapters
        # would be saved from the main process's shards: incomplete.
        raise ValueError(
            f"Accelerate's {accelerator.distributed_type.value} (accelerate launch --use_fsdp "
            "or --use_deepspeed) is not allowed; allowed: data parallel (no launcher option) "
            "or ropekit's FSDP2 (TrainConfig.fsdp, --fsdp on the command line)"
        )
    share = accelerator.num_processes * config.grad_accum
    if config.batch_size % share:
        raise ValueError(
            f"TrainConfig.batch_size={config.batch_size} is invalid for "
            f"{accelerator.num_processes} processes: a multiple of processes x "
            f"grad_accum={config.grad_accum} = {share} is allowed (it is the global batch, "
            "split over the processes: --batch-size on the command line)"
        )
    if len(dataset) == 0:
        raise ValueError("the training dataset is empty")
    if config.batch_size > len(dataset):
        # Legitimate (epochs are drawn one after another, sampling.global_batch), but a step
        # then reads some items twice: say so rather than let a tiny corpus pass unnoticed.
        warnings.warn(
            f"batch_size={config.batch_size} is larger than the {len(dataset)} training items: "
            "every step repeats some of them; add data or lower the batch size",
            stacklevel=3,
        )


def _claim_out_dir(config: TrainConfig, accelerator: Accelerator) -> tuple[OutDirLock, Path | None]:
    """Lock out_dir and make it ready; returns the lock and the checkpoint to resume from.

    The main process does it all (the others would only repeat its reads) and its outcome,
    or its error, reaches every process.
    """
    out = config.out_dir
    lock = OutDirLock(out / LOCK_FILE, held=False)  # what the other processes hold

    def claim() -> Path | None:
        nonlocal lock
        lock = lock_out_dir(out, main=True, command=f"train (steps={config.steps})")
        try:
            _settle_replaced(out)
            occupied = has_outputs(out)
            if occupied and not (config.resume or config.overwrite):
                raise FileExistsError(
                    f"{out} already holds files (another run?); pass --resume (resume=True) to "
                    "continue the run in it or --overwrite (overwrite=True) to replace its "
                    "checkpoints, metrics and summary"
                )
            check_target(out / CHECKPOINTS, out)  # neither read nor removed through a link
            if (out / CHECKPOINTS).exists() and not (out / CHECKPOINTS).is_dir():
                raise OutputError(
                    f"cannot write {out / CHECKPOINTS}: it is a file, not a folder; the run "
                    "keeps its checkpoints there: move the file away or choose another --out",
                    path=out / CHECKPOINTS,
                )
            checkpoint = resume_checkpoint(out) if config.resume else None
            if occupied and config.overwrite:
                # Only what a run writes: out_dir may also hold files the user put there. Set
                # aside, not deleted, until this run's first checkpoint (REPLACED).
                _set_aside_run(out)
            return checkpoint
        except BaseException:
            lock.release()
            raise

    checkpoint = Processes(accelerator.process_index, accelerator.num_processes).on_main(claim)
    return lock, checkpoint  # the lock claim() took on the main process


def _set_aside_run(out: Path) -> None:
    """Move the run in `out` into `out/REPLACED`, where `_restore_replaced` finds it."""
    aside = out / REPLACED
    with writing(aside):
        aside.mkdir(exist_ok=True)
        for name in _RUN_FILES:
            if (out / name).exists():
                os.replace(out / name, aside / name)


def _restore_replaced(out: Path) -> None:
    """Put back the run an --overwrite run set aside (it failed, or was killed, before its
    first checkpoint), replacing what that run left; nothing to do without one."""
    aside = out / REPLACED
    if not aside.is_dir():
        return
    with writing(out):
        for name in _RUN_FILES:
            if (aside / name).exists():
                if (out / name).is_dir():
                    shutil.rmtree(out / name)
                os.replace(aside / name, out / name)
        shutil.rmtree(aside)


def _settle_replaced(out: Path) -> None:
    """A run set aside by an --overwrite run that was killed (so neither kept nor restored):
    gone for good if that run reached a checkpoint, else given back."""
    if not (out / REPLACED).is_dir():
        return
    if latest_checkpoint(out) is not None:
        shutil.rmtree(out / REPLACED)
    else:
        _restore_replaced(out)


def _check_resumable(
    checkpoint: Path,
    state: CheckpointState,
    config: TrainConfig,
    dataset_len: int,
    provenance: Mapping[str, Any],
) -> None:
    """Before any weight is loaded: the checkpoint must belong to this run."""
    check_provenance(state.provenance, provenance, f"cannot resume {checkpoint}: it")
    now = config.to_dict()
    # A field the checkpoint's ropekit did not have yet (e.g. fsdp) had its default then.
    saved = {**_DEFAULTS, **state.config}
    changed = sorted(k for k in now.keys() - RUN_CONTROL if now[k] != saved.get(k))
    if changed:
        was = ", ".join(f"{k}={saved.get(k)!r}" for k in changed)
        new = ", ".join(f"{k}={now[k]!r}" for k in changed)
        raise ValueError(f"cannot resume {checkpoint}: it was trained with {was}, not {new}")
    if state.dataset_len != dataset_len:
        raise ValueError(
            f"cannot resume {checkpoint}: its dataset had {state.dataset_len} items, this one "
            f"has {dataset_len}, and the data order depends on it"
        )


def _open_metrics(path: Path, step: int) -> IO[str]:
    """Open the metrics log for appending, after rewinding it to the lines up to `step` (those
    a resumed run does not redo).

    The rewind is a new file renamed over the old one, so a kill at any moment leaves either
    the whole old log or the rewound one, never a truncated one; the run then appends, so
    every line written before a later kill stays. A last line without its newline (a kill
    mid-write) is dropped; a garbled line elsewhere is dropped with a warning.
    """
    kept = []
    check_target(path)  # never read or write through a link
    if path.is_file():
        with writing(path):
            lines = path.read_bytes().split(b"\n")
        for number, line in enumerate(lines[:-1], start=1):  # lines[-1]: "" or a torn line
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line.decode() + "\n")
            except (ValueError, TypeError, KeyError):
                warnings.warn(f"{path}:{number} is not a metrics record; dropped", stacklevel=2)
    atomic_write_text(path, "".join(kept))
    flags = os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    with writing(path):
        return os.fdopen(os.open(path, flags), "a", encoding="utf-8")


def _write_summary(
    result: TrainResult,
    config: TrainConfig,
    num_processes: int,
    provenance: dict[str, Any],
    command: str,
) -> None:
    summary: dict[str, Any] = {
        "final_loss": result.final_loss,
        "steps": result.steps,
        "tokens": result.tokens,
        "elapsed_s": result.elapsed_s,
        "tokens_per_s": result.tokens_per_s,
        "checkpoint": str(result.checkpoint),
        "num_processes": num_processes,
        "config": config.to_dict(),
    }
    meta = run_metadata(command, seed=config.seed)
    write_result(result.summary, "train", summary, meta=meta, provenance=provenance)
