"""Packing: fixed-length samples, next-token labels, seeded order, resume at any position."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ropekit.data import EmptyCorpusError, PackedDataset, load_documents, make_train_dataset

T = 16
# Distinct ids, so a sample's first id says which chunk of the stream it is.
STREAM = np.arange(10 * T + 5)


def test_samples_have_shape_and_shifted_labels():
    ds = make_train_dataset("shakespeare", "bytes", context=64)
    plays = load_documents("shakespeare", "train")
    n_tokens = sum(d.n_bytes for d in plays) + 2 * (len(plays) - 1)  # "\n\n" between plays
    assert len(ds) == (n_tokens - 1) // 64
    for k in (0, 1, len(ds) - 1, len(ds) + 3):
        sample = ds[k]
        assert set(sample) == {"input_ids", "labels", "loss_weight"}
        assert sample["input_ids"].shape == sample["labels"].shape == (64,)
        assert sample["input_ids"].dtype == sample["labels"].dtype == torch.int64
        assert sample["loss_weight"].dtype == torch.float32
        assert torch.equal(sample["labels"][:-1], sample["input_ids"][1:])
        assert torch.equal(sample["loss_weight"], torch.ones(64))


def test_unshuffled_samples_tile_the_stream_with_stride_context():
    ds = PackedDataset(STREAM, T, shuffle=False)
    assert len(ds) == (len(STREAM) - 1) // T
    for k in range(len(ds)):
        chunk = STREAM[k * T : k * T + T + 1]
        assert ds[k]["input_ids"].tolist() == chunk[:-1].tolist()
        assert ds[k]["labels"].tolist() == chunk[1:].tolist()


def test_each_epoch_visits_every_chunk_once_in_a_new_order():
    ds = PackedDataset(STREAM, T, seed=3)
    n = len(ds)
    epochs = [[int(ds[k]["input_ids"][0]) // T for k in range(e * n, (e + 1) * n)] for e in (0, 1)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(n))
    assert epochs[0] != epochs[1]


def test_order_is_determined_by_the_seed():
    def order(seed: int) -> list[int]:
        ds = PackedDataset(STREAM, T, seed=seed)
        return [int(ds[k]["input_ids"][0]) for k in range(len(ds))]

    assert order(0) == order(0)
    assert order(0) != order(1)


def test_resume_at_a_position_equals_continuing():
    ds = make_train_dataset("essays", "bytes", context=256, seed=7)
    batch, start, stop = 4, 8, len(ds) + 12  # the run crosses into the second epoch
    continued = list(DataLoader(ds, batch_size=batch, sampler=range(stop)))
    # A fresh dataset (a restarted process) resumed at sample `start`.
    fresh = make_train_dataset("essays", "bytes", context=256, seed=7)
    resumed = list(DataLoader(fresh, batch_size=batch, sampler=range(start, stop)))
    for a, b in zip(continued[start // batch :], resumed, strict=True):
        for key in ("input_ids", "labels", "loss_weight"):
            assert torch.equal(a[key], b[key])


def test_iterating_yields_one_epoch():
    ds = PackedDataset(STREAM, T)
    assert len(list(ds)) == len(ds)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="context=0"):
        PackedDataset(STREAM, 0)
    with pytest.raises(ValueError, match="seed=-1"):
        PackedDataset(STREAM, T, seed=-1)
    with pytest.raises(EmptyCorpusError, match=f"context={len(STREAM)} needs at least"):
        PackedDataset(STREAM, len(STREAM))
    with pytest.raises(IndexError, match="negative"):
        PackedDataset(STREAM, T)[-1]
