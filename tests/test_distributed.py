"""ropekit.distributed: shares, the one-process case, and errors reaching every process (ranks
as threads, see tests/processes.py)."""

from __future__ import annotations

import pytest

from ropekit.distributed import Processes, check_launched, processes, shard

from .processes import run_ranks


@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("n", [0, 1, 5, 12])
def test_shards_are_contiguous_balanced_and_cover_everything(n, world):
    items = list(range(n))
    shares = [shard(items, r, world) for r in range(world)]
    assert [x for share in shares for x in share] == items
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_one_process_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    one = processes()
    assert (one.rank, one.world, one.is_main, one.distributed) == (0, 1, True, False)
    assert one.device is None  # models stay where the caller put them
    assert one.gather("x") == ["x"] and one.broadcast("x") == "x"
    assert one.on_main(lambda: 3) == 3 and one.each(lambda: 4) == [4]
    one.barrier()


def test_a_launch_the_process_group_does_not_match_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"launched as 2 processes.*ACCELERATE_USE_CPU=1"):
        check_launched(1)
    check_launched(2)


def test_values_and_errors_reach_every_process():
    def gathered(p: Processes):
        return p.each(lambda: p.rank * 10), p.on_main(lambda: f"from {p.rank}")

    assert run_ranks(3, gathered) == [([0, 10, 20], "from 0")] * 3

    def failing_on(rank):
        def fn(p: Processes):
            def work():
                if p.rank == rank:
                    raise ValueError(f"rank {p.rank} failed")
                return p.rank

            return p.each(work)

        return fn

    # Every rank raises the failing rank's error instead of waiting for it forever.
    for result in run_ranks(3, failing_on(1)):
        assert isinstance(result, ValueError) and str(result) == "rank 1 failed"

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no pickling")

    def main_fails(p: Processes):
        def work():
            raise Unpicklable("lost")

        return p.on_main(work)

    for result in run_ranks(2, main_fails):
        assert isinstance(result, RuntimeError) and "Unpicklable: lost" in str(result)


@pytest.mark.parametrize("registered", [True, False])
def test_a_gloo_group_is_destroyed_at_exit_while_the_interpreter_is_whole(registered):
    """end_group_at_exit's handler runs before every handler registered earlier (atexit is
    last in, first out), so a check registered first sees the group gone; without it the
    group is still alive when the interpreter starts tearing down (where gloo can abort).
    Registering twice adds one handler."""
    import subprocess
    import sys

    program = f"""
import atexit
import torch.distributed as dist
from ropekit.distributed import end_group_at_exit
atexit.register(lambda: print("alive at exit:", dist.is_initialized()))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
before = atexit._ncallbacks()
if {registered}:
    end_group_at_exit()
    end_group_at_exit()
print("handlers added:", atexit._ncallbacks() - before)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"handlers added: {int(registered)}" in done.stdout
    assert f"alive at exit: {not registered}" in done.stdout


def test_the_group_ends_at_exit_even_while_a_finished_fsdp_model_awaits_collection():
    """A sharded run's FSDP2 modules are reference cycles that hold the group (FSDPMeshInfo)
    after the run returns; the exit handler collects them before destroying the group, so no
    reference to the group is left for interpreter teardown to drop."""
    import subprocess
    import sys

    program = """
import gc, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from ropekit.distributed import _end_gloo_group
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

def run():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.randn(2, 8)).sum().backward()

run()
group = dist.distributed_c10d._get_default_group()
held = sorted({type(r).__name__ for r in gc.get_referrers(group)})
print("held before:", held)
_end_gloo_group()
print("held after:", sorted({type(r).__name__ for r in gc.get_referrers(group)}))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert "FSDPMeshInfo" in lines["held before"]  # the cycle holds the group
    assert lines["held after"] == "['dict']"  # only this program's own name for it
