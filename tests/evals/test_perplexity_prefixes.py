"""Windows that start together are read once: every window a longer one starts with is
scored in the longer one's reading (``Backbone.prefix_nll``), and each row is the row its own
forward gives, bit for bit, for static schedules, attention-level methods and length-following
encodings (which are read alone), on a ropekit Decoder and a tiny Llama, two layers deep and
past the original length, in float64 so that a difference is a difference in the reading."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ropekit.data import heldout_stream
from ropekit.evals import PerplexityConfig, as_language_model, evaluate_perplexity
from ropekit.evals.adapters import BackboneLM
from ropekit.evals.perplexity import WindowStore, _prefix_groups, windows_read
from ropekit.hf import patch

from ..model.tiny import tiny_model as sharp_decoder
from ..tiny import tiny_model as sharp_llama

CHUNK = 32
# 20 fits in one chunk (read alone), 40 ends in a partial chunk, 64 in a whole one; 160 is
# the longest. lcm = 320 targets: every length tiles them from the same start.
LENGTHS = (20, 40, 64, 160)
# batch_tokens = the shortest length: every window is read alone (batch 1).
CONFIG = PerplexityConfig(LENGTHS, n_tokens=320, batch_tokens=20, seed=5)


@pytest.fixture(scope="module")
def stream(byte_tok):
    return heldout_stream("shakespeare", byte_tok)


class ReadTokens:
    """Counts the tokens ``Backbone.run`` feeds (wraps the backbone's method)."""

    def __init__(self, lm):
        self.tokens = 0
        inner = lm.backbone.run

        def run(ids, *args, **kwargs):
            self.tokens += ids.shape[1]
            return inner(ids, *args, **kwargs)

        lm.backbone.run = run


def _saved(lengths, n_tokens, chunk):
    """Tokens a shared reading does not read again, by brute force over the windows: for each
    start where windows of several lengths begin, each shorter one of more than one chunk
    shares its whole chunks with the longest."""
    starts: dict[int, list[int]] = {}
    for length in lengths:
        for start in range(0, n_tokens, length):
            starts.setdefault(start, []).append(length)
    return sum(n // chunk * chunk for g in starts.values() for n in g if chunk < n < max(g))


def _rows(folder):
    return {p.name: dict(np.load(p)) for p in sorted(folder.glob("*.npz"))}


def _model(encoding, hf):
    if hf:
        model = sharp_llama("llama", vocab_size=256).double()  # original length 32
        if encoding is not None:
            patch(model, encoding)
        return model
    return sharp_decoder(encoding, n_layers=2).double().eval()  # original length 8


@pytest.mark.parametrize(
    ("encoding", "hf", "dynamic"),
    [
        ("rope", False, False),
        ("yarn:factor=4", False, False),
        ("alibi", False, False),
        ("rerope:window=8,leaky=4", False, False),
        ("self-extend:group=2,window=4", False, False),
        ("dynamic-ntk:factor=2", False, True),
        (None, True, False),
        ("rerope:window=8,leaky=4", True, False),
        ("self-extend:group=2,window=4", True, False),
        ("dynamic-ntk:factor=2", True, True),
        ("dca", True, True),
    ],
)
def test_windows_read_in_a_longer_window_are_their_own_forwards(
    tmp_path, stream, byte_tok, monkeypatch, encoding, hf, dynamic
):
    lm = as_language_model(_model(encoding, hf), byte_tok, chunk_size=CHUNK)
    counter = ReadTokens(lm)
    shared = evaluate_perplexity(
        lm, stream, CONFIG, False, store=WindowStore(tmp_path / "shared", "k")
    )
    shared_tokens, counter.tokens = counter.tokens, 0
    with monkeypatch.context() as m:
        m.delattr(BackboneLM, "prefix_nll")  # every window read by its own forward
        alone = evaluate_perplexity(
            lm, stream, CONFIG, False, store=WindowStore(tmp_path / "alone", "k")
        )
    shared_rows, alone_rows = _rows(tmp_path / "shared"), _rows(tmp_path / "alone")
    assert len(shared_rows) == 8 + 16 + 5 + 2  # every window of every length
    assert shared_rows.keys() == alone_rows.keys()
    for name, rows in alone_rows.items():
        assert np.array_equal(shared_rows[name]["r0"], rows["r0"]), name
    assert [r.nll for r in shared.results] == [r.nll for r in alone.results]
    # Static readings share their chunks (a length-following encoding reads in one forward,
    # not through run's cache, and shares nothing).
    expected = 0 if dynamic else _saved(LENGTHS, 320, CHUNK)
    assert counter.tokens - shared_tokens == expected
    if not dynamic:
        assert expected == 128  # 32 + 64 at the first start, 32 at 160


def test_a_resumed_group_reads_only_its_missing_windows(tmp_path, stream, byte_tok):
    """Windows a store holds are read back; the rest of their group is read in the longest
    missing one's reading, with the same rows."""
    lm = as_language_model(_model("rope", False), byte_tok, chunk_size=CHUNK)
    full = tmp_path / "full"
    evaluate_perplexity(lm, stream, CONFIG, False, store=WindowStore(full, "k"))
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / WindowStore.KEY).write_text("k\n")
    start = min(int(p.stem.split("-")[1]) for p in full.glob("160-*.npz")) - 160
    for length in (160, 64):  # the first start's two longest are stored
        name = f"{length}-{start + length}.npz"
        (partial / name).write_bytes((full / name).read_bytes())
    counter = ReadTokens(lm)
    evaluate_perplexity(lm, stream, CONFIG, False, store=WindowStore(partial, "k"))
    assert _rows(partial).keys() == _rows(full).keys()
    for name, rows in _rows(full).items():
        assert np.array_equal(_rows(partial)[name]["r0"], rows["r0"]), name
    # Everything but the two stored windows is read, less the 40-window at 160 read in the
    # 160-window there, and the 40-window at 0 now read alone (its group's longest missing
    # window, with the 20 read alone beside it).
    every = sum(320 for _ in LENGTHS)
    assert counter.tokens == every - 160 - 64 - 32


@pytest.mark.parametrize("hf", [False, True])
def test_prefix_nll_equals_token_nll_of_each_prefix(byte_tok, hf):
    lm = as_language_model(_model("rope", hf), byte_tok, chunk_size=CHUNK)
    ids = torch.tensor(list(range(200)), dtype=torch.long) % 251
    lengths = [150, 5, 32, 33, 64, 96, 97, 199]
    rows = lm.prefix_nll(ids, lengths)
    for n, row in zip(lengths, rows, strict=True):
        assert torch.equal(row, lm.token_nll(ids[None, : n + 1])[0]), n
    with pytest.raises(ValueError, match=r"lengths in 1..T, here 1\.\.199"):
        lm.prefix_nll(ids, [200])
    with pytest.raises(ValueError, match=r"input_ids \(T\+1,\)"):
        lm.prefix_nll(ids[None], [5])


def test_only_whole_windows_read_one_at_a_time_are_grouped():
    """A batch is read in its own chunk length (the logits budget is shared by its rows) and
    a sliding window scores only its end: neither is a prefix of another window's reading."""
    plan = {20: [(20, 20), (40, 20)], 40: [(40, 40)], 80: [(80, 80)]}
    config = PerplexityConfig((20, 40, 80), n_tokens=80, batch_tokens=40)  # 20: batches of 2
    assert _prefix_groups(plan, config) == [[(40, 40), (80, 80)]]
    assert _prefix_groups(plan, dataclasses.replace(config, batch_tokens=20)) == [
        [(20, 20), (40, 40), (80, 80)]
    ]
    assert _prefix_groups(plan, dataclasses.replace(config, stride=10)) == []


def test_windows_read_counts_what_a_shared_reading_leaves_to_read():
    # Experiment E: 8k, 16k and 32k over 2 single-document spans of 32k. In each span the 8k
    # windows at 0 and 16k and the 16k window at 0 are read in longer ones' readings.
    e = PerplexityConfig((8192, 16384, 32768), n_tokens=65536, single_documents=True)
    assert windows_read(e, shared=False) == {8192: 8, 16384: 4, 32768: 2}
    assert windows_read(e) == {8192: 4, 16384: 2, 32768: 2}
    # One joined span: the 2k windows at 0, 4k, 8k and 12k (in 4k windows) and the 4k window
    # at 0 (in the 16k window) share.
    joined = PerplexityConfig((2048, 4096, 16384), n_tokens=16384, batch_tokens=2048)
    assert windows_read(joined) == {2048: 4, 4096: 3, 16384: 1}
    # Batched lengths (the default batch_tokens reads 2k windows 4 at a time) and sliding
    # windows read everything themselves.
    assert windows_read(dataclasses.replace(joined, batch_tokens=8192)) == {
        2048: 8,
        4096: 4,
        16384: 1,
    }
    sliding = PerplexityConfig((2048, 4096), n_tokens=8192, stride=1024, batch_tokens=2048)
    assert windows_read(sliding) == windows_read(sliding, shared=False) == {2048: 7, 4096: 5}
