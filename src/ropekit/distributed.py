"""Several processes of one run, launched by `accelerate launch` or `torchrun`.

Holds:
    Processes         this process's rank among `world` processes, and the few collective
                      operations the library needs (gather, broadcast, barrier); all of them are
                      no-ops for a single process.
    processes         the Processes of the current run: joins the process group when the
                      launcher started several processes.
    check_launched    refuses a launch whose processes would each run alone.
    shard             the contiguous share of a list that one rank works on.
    end_group_at_exit destroys a gloo process group when the program ends, before the
                      interpreter is torn down (why: at the function).

Why a small layer of its own: training has an `Accelerator`, but evaluation, saving a
pretrained model and writing an adapter need only "am I the main process" and "give every
process everyone's results". Every process computes its share, the shares are gathered in
rank order (so the result is the one a single process would get), and only the main process
writes files: several processes renaming over the same file would be racing, and the last one
might not be the complete one.
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass
class Processes:
    """Rank `rank` of `world` processes; `device` is where this process should compute.

    The collective methods must be called by every process, in the same order.
    """

    rank: int = 0
    world: int = 1
    device: torch.device | None = None  # None: leave models where they are (one process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    # ------------------------------------------------------------------ primitives
    def gather(self, obj: T) -> list[T]:
        """Every process's `obj` (picklable), in rank order, on every process."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """The main process's `obj` on every process (the others pass anything, e.g. None)."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        """Wait until every process gets here (e.g. the main process has written its files)."""
        if self.world > 1:
            torch.distributed.barrier()

    # ------------------------------------------------------------------ built on them
    def on_main(self, fn: Callable[[], T]) -> T:
        """`fn()` run by the main process only; its value, or the exception it raised, reaches
        every process (so an error stops them all instead of leaving them waiting)."""
        if self.world == 1:
            return fn()
        outcome: tuple[bool, Any] | None = None
        if self.is_main:
            try:
                outcome = (True, fn())
            except Exception as e:  # re-raised below, on every process
                outcome = (False, _picklable(e))
        ok, value = self.broadcast(outcome)
        if not ok:
            raise value
        return value

    def each(self, fn: Callable[[], T]) -> list[T]:
        """`fn()` run by every process; the values in rank order on every process. If any
        process raised, every process raises the lowest rank's exception."""
        if self.world == 1:
            return [fn()]
        try:
            outcome: tuple[bool, Any] = (True, fn())
        except Exception as e:
            outcome = (False, _picklable(e))
        gathered = self.gather(outcome)
        for ok, value in gathered:
            if not ok:
                raise value
        return [value for _, value in gathered]


def _picklable(error: Exception) -> Exception:
    """The exception itself when it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def check_launched(num_processes: int) -> None:
    """Raise if the launcher started more processes than the process group holds.

    That happens on a machine without GPUs when ACCELERATE_USE_CPU is not set: every process
    would then run the whole job alone and they would overwrite each other's files.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != num_processes:  # a launch the user set up: one line at the CLI, exit 2
        raise ValueError(
            f"launched as {launched} processes but the Accelerator sees {num_processes}; on a "
            "machine without GPUs set ACCELERATE_USE_CPU=1 (with `accelerate launch --multi_gpu` "
            "or `torchrun`)"
        )


def processes() -> Processes:
    """The processes of this run.

    A plain `python`/`ropekit` call is one process. Under `accelerate launch` or `torchrun`
    (WORLD_SIZE > 1), this joins the process group the way `train`'s Accelerator does (gloo
    on CPU, NCCL on GPUs; the same shared state), so training and evaluation in one program
    use one group. A group someone else initialised is used as it is.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if launched == 1 and not initialised:
        return Processes()
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # What Accelerator() does: ACCELERATE_USE_CPU=1 keeps a GPU-less launch on CPU processes.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    check_launched(state.num_processes)
    if state.num_processes == 1:
        return Processes()
    end_group_at_exit()
    return Processes(state.process_index, state.num_processes, state.device)


_ENDING = False  # end_group_at_exit has registered its handler in this process


def end_group_at_exit() -> None:
    """Destroy the default process group, if it is a gloo one, when this program ends
    normally (``atexit``), while the interpreter is still whole. Left to interpreter
    finalization, gloo's worker threads may still hold work objects whose tensors, released
    then, take the GIL of an interpreter being torn down, and the process aborts after its
    work is done ("terminate called without an active exception", SIGABRT; pytorch/pytorch
    #190489, and #179291's analysis): the launcher then reports the run failed and stops the
    other processes, which may still be writing. Seen here in 2 of 6 runs of
    tests/train/test_sharded_processes.py (one process, exit -6, after its last step); with
    this handler in 0 of 22 runs, but still once in a `make test` under its parallel load
    (that test reruns once then). One way the group outlived the handler, found after: a
    finished run's FSDP2 modules are reference cycles still holding the group, so
    ``destroy_process_group`` only unregistered it and the C++ group was left to teardown;
    the handler now collects them first. Whether that was the abort's cause is not known (it
    was not reproduced). NCCL groups are left to their own shutdown (PyTorch warns about those
    itself). Registered once; a group the program destroyed itself is left alone."""
    global _ENDING
    if not _ENDING:
        atexit.register(_end_gloo_group)
        _ENDING = True


def _end_gloo_group() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        # A finished run's FSDP2 modules are reference cycles that still hold the group
        # (FSDPMeshInfo), so destroying it would only unregister it and leave the C++ group to
        # interpreter teardown. Collected first, they let go of it, and it ends here.
        gc.collect()
        dist.destroy_process_group()


def shard(items: Sequence[T], rank: int, world: int) -> Sequence[T]:
    """Rank `rank`'s contiguous share of `items`: shares differ in size by at most one and,
    concatenated in rank order, give `items` back."""
    n = len(items)
    return items[rank * n // world : (rank + 1) * n // world]
