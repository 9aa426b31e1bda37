"""PoSE samples (Zhu et al. 2024): layouts are strictly increasing windows inside the target
that cover every relative distance; the dataset gives a window's tokens at their true
positions, fresh positions each epoch; what cannot be cut is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ropekit.data import PoseDataset, PoseLayout, draw_layout


# ----------------------------------------------------------------------------- layout laws
@pytest.mark.parametrize("window, target", [(2, 2), (2, 9), (8, 64), (33, 128), (64, 64)])
def test_layouts_are_strictly_increasing_windows_inside_the_target(window, target):
    rng = np.random.default_rng(0)
    for _ in range(300):
        layout = draw_layout(window, target, rng)
        pos = layout.positions()
        assert pos.dtype == torch.long and pos.shape == (window,)
        assert bool((pos[1:] > pos[:-1]).all()) and pos[0] >= 0 and pos[-1] < target
        # Chunk 0 is contiguous and at most half the window (the authors' sampling); the
        # second chunk follows after exactly `skip` extra positions.
        assert 1 <= layout.split <= (window + 1) // 2
        gaps = pos[1:] - pos[:-1]
        assert gaps[layout.split - 1] == layout.skip + 1
        assert bool((torch.cat((gaps[: layout.split - 1], gaps[layout.split :])) == 1).all())
        assert pos[-1] - pos[0] == layout.skip + window - 1  # the largest distance trained


def test_window_equal_to_target_is_the_plain_window():
    layout = draw_layout(16, 16, np.random.default_rng(3))
    assert torch.equal(layout.positions(), torch.arange(16))


def test_every_relative_distance_of_the_target_is_covered_and_the_largest_is_uniform():
    window, target, n = 8, 64, 4000
    rng = np.random.default_rng(1)
    pos = torch.stack([draw_layout(window, target, rng).positions() for _ in range(n)])
    distances = pos[:, :, None] - pos[:, None, :]  # (n, window, window)
    assert distances[distances > 0].unique().tolist() == list(range(1, target))
    largest = (pos[:, -1] - pos[:, 0]).numpy()
    # The largest distance is skip + window - 1 with skip ~ U{0..target-window}: uniform over
    # window-1..target-1 (57 values, ~70 draws each; a skewed sampler leaves the top empty).
    counts = np.bincount(largest, minlength=target)[window - 1 :]
    assert counts.min() > 35 and counts.max() < 110


def test_bad_layouts_are_refused_with_the_field():
    with pytest.raises(ValueError, match="window=1"):
        draw_layout(1, 8, np.random.default_rng(0))
    with pytest.raises(ValueError, match="window=9"):
        draw_layout(9, 8, np.random.default_rng(0))
    with pytest.raises(ValueError, match="exceeds target=8"):
        PoseLayout(window=4, target=8, split=2, start=3, skip=2)
    with pytest.raises(ValueError, match="split=4"):
        PoseLayout(window=4, target=8, split=4, start=0, skip=0)


# ----------------------------------------------------------------------------- dataset
class _Windows:
    """Full-length samples: input_ids, labels (next tokens) and a loss weight per token."""

    def __init__(self, n: int, target: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 256, (n, target + 1), generator=g)
        self.weights = torch.rand(n, target, generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.tokens[i]
        return {"input_ids": row[:-1], "labels": row[1:], "loss_weight": self.weights[i]}


def test_pose_items_are_the_window_tokens_at_their_true_positions():
    base = _Windows(3, 40)
    data = PoseDataset(base, 10, 40, seed=5, repeats=2)
    assert len(data) == 6
    for i in range(len(data)):
        item = data[i]
        full = base[i % 3]
        pos = item["position_ids"]
        assert set(item) == {"input_ids", "labels", "loss_weight", "position_ids"}
        assert torch.equal(pos, data.layout(i).positions())
        for key in ("input_ids", "labels", "loss_weight"):
            assert torch.equal(item[key], full[key][pos]), key
        # Labels stay the true next tokens of the text, also across the jump.
        assert torch.equal(item["labels"], base.tokens[i % 3][pos + 1])
        assert all(torch.equal(a, b) for a, b in zip(item.values(), data[i].values(), strict=True))
    # A window seen again (next epoch) gets fresh positions; another seed, other positions.
    assert not torch.equal(data[0]["position_ids"], data[3]["position_ids"])
    other = PoseDataset(base, 10, 40, seed=6)
    assert any(not torch.equal(data[i]["position_ids"], other[i]["position_ids"]) for i in range(3))


def test_pose_dataset_refuses_what_it_cannot_cut():
    with pytest.raises(ValueError, match="pose window=41"):
        PoseDataset(_Windows(2, 40), 41, 40)
    with pytest.raises(ValueError, match="target=32 tokens"):
        PoseDataset(_Windows(2, 40), 8, 32)[0]
    with pytest.raises(IndexError):
        PoseDataset(_Windows(2, 40), 8, 40)[2]
