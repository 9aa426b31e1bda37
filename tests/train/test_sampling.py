"""The global batch order: epochs, determinism, and shards that add up to the global batch."""

import pytest
import torch

from ropekit.train.sampling import collate, global_batch, local_batches


def test_each_epoch_visits_every_item_once():
    n, batch = 12, 4
    seen = [i for step in range(6) for i in global_batch(step, batch, n, seed=3)]
    assert sorted(seen[:n]) == list(range(n)) and sorted(seen[n:]) == list(range(n))
    assert seen[:n] != seen[n:]  # each epoch has its own order


def test_a_batch_may_straddle_epochs():
    n = 5
    stream = [i for step in range(5) for i in global_batch(step, 3, n, seed=0)]
    assert [sorted(stream[k : k + n]) for k in (0, 5, 10)] == [list(range(n))] * 3


def test_order_is_a_function_of_seed_and_step():
    assert global_batch(7, 4, 20, seed=1) == global_batch(7, 4, 20, seed=1)
    assert global_batch(7, 4, 20, seed=1) != global_batch(7, 4, 20, seed=2)


def test_shards_concatenate_to_the_global_batch():
    indices = global_batch(0, 8, 100, seed=0)
    one = local_batches(indices, rank=0, num_processes=1, grad_accum=4)
    two = [mb for rank in (0, 1) for mb in local_batches(indices, rank, 2, grad_accum=2)]
    assert one == two  # 1 process x 4 micro-batches sees what 2 x 2 see together
    assert [i for mb in two for i in mb] == indices


def test_indivisible_batch_is_an_error():
    with pytest.raises(ValueError, match="6 does not split into 4 processes x 1 micro-batches"):
        local_batches(list(range(6)), 0, 4, 1)


def test_collate_stacks_every_key():
    items = [{"a": torch.full((3,), i), "b": torch.zeros(2, 2) + i} for i in range(4)]
    batch = collate(items)
    assert batch["a"].shape == (4, 3) and batch["b"].shape == (4, 2, 2)
    assert torch.equal(batch["a"][:, 0], torch.arange(4))
