"""`ropekit search` (LongRoPE's factor search) on a tiny pretrained decoder: the seeds are the
rules users have, the best is never worse than them, the constraints hold, the result is a
longrope adapter that scores what the search recorded, and a rerun makes no forward."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ropekit.backbone import as_backbone, load_adapter, read_adapter
from ropekit.encodings import schedules
from ropekit.model import Decoder, DecoderConfig
from ropekit.train import TrainConfig
from ropekit.train.pretrain import pretrain
from ropekit.train.search import SearchConfig, initial_factors, search

CONTEXT, TARGET = 32, 128


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("base")
    model = DecoderConfig(d_model=32, n_layers=2, n_heads=2, context_length=CONTEXT)
    config = TrainConfig(out_dir=out, steps=120, batch_size=16, lr=3e-3, warmup_steps=10)
    pretrain(out, model=model, train_config=config)
    return out / "model"


class ForwardCounter:
    """Counts passes through the decoder stack (its final norm runs once per forward, whether
    scoring calls ``forward`` or reads ``final_hidden`` and takes the logits apart)."""

    def __init__(self, model):
        self.calls = 0
        model.norm.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.calls += 1


def test_the_seeds_are_pi_ntk_and_yarn_as_factors_against_rope():
    seeds = initial_factors(16, 10000.0, 4.0, 32)
    assert np.allclose(seeds["pi"], 4.0)
    rope = schedules.rope(16, 10000.0)[0].numpy()
    ntk = schedules.ntk(16, 10000.0, 4.0)[0].numpy()
    assert np.allclose(seeds["ntk"], rope / ntk) and seeds["ntk"][0] == pytest.approx(1.0)
    for factors in seeds.values():  # lambda >= 1 and non-decreasing towards slow pairs
        assert (factors >= 1).all() and (np.diff(factors) >= 0).all()


def test_search_beats_its_seeds_and_writes_a_longrope_adapter(base_dir, tmp_path):
    model = Decoder.load(base_dir).eval()
    counter = ForwardCounter(model)
    config = SearchConfig(TARGET, samples=2, budget=24, population=4, parents=2, chunk=64)
    result = search(model, config, tmp_path / "s", progress=False, log=lambda _: None)
    assert result.forwards <= config.budget and counter.calls > 0
    assert result.nll <= min(result.baselines.values())
    lines = (tmp_path / "s" / "candidates.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert len(records) == result.forwards // config.samples
    for r in records:
        f = np.array(r["factors"])
        assert (f >= 1).all() and (np.diff(f) >= 0).all() and (f <= 16).all()
    meta, _ = read_adapter(tmp_path / "s" / "adapter")
    assert meta["spec"].startswith("longrope:") and "short_factor=[1]" in meta["spec"]
    # The adapter loads into a fresh model; beyond the window it uses the searched factors.
    fresh = Decoder.load(base_dir).eval()
    load_adapter(fresh, tmp_path / "s")
    assert as_backbone(fresh).encoding.spec == result.spec
    # A rerun of the finished search scores nothing again.
    again = Decoder.load(base_dir).eval()
    rerun = ForwardCounter(again)
    same = search(again, config, tmp_path / "s", progress=False, log=lambda _: None)
    assert rerun.calls == 0 and same.spec == result.spec and same.nll == result.nll


def test_an_interrupted_search_scores_only_what_is_missing(base_dir, tmp_path):
    config = SearchConfig(TARGET, samples=1, budget=10, population=4, parents=2, chunk=64)
    whole = search(Decoder.load(base_dir).eval(), config, tmp_path / "whole", progress=False)
    out = tmp_path / "cut"
    search(Decoder.load(base_dir).eval(), config, out, progress=False)
    lines = (out / "candidates.jsonl").read_text().splitlines()
    (out / "candidates.jsonl").write_text("\n".join(lines[:5]) + "\n")  # 5 of 10 kept
    (out / "search.json").unlink()
    model = Decoder.load(base_dir).eval()
    counter = ForwardCounter(model)
    resumed = search(model, config, out, progress=False)
    # The 5 missing candidates, one sample each, one forward each: a longrope schedule follows
    # the length attended, so it is scored in one forward per window, not in chunks.
    assert counter.calls == 5
    assert resumed.spec == whole.spec and resumed.nll == whole.nll


def test_bad_settings_are_refused(base_dir, tmp_path):
    with pytest.raises(ValueError, match="parents"):
        SearchConfig(TARGET, population=2, parents=3)
    with pytest.raises(ValueError, match="three seeds"):
        SearchConfig(TARGET, samples=2, budget=4)
    with pytest.raises(ValueError, match="longer target"):
        search(Decoder.load(base_dir), SearchConfig(CONTEXT), tmp_path / "x", progress=False)


def test_a_model_without_rotary_positions_and_an_absurd_budget_are_one_line_errors(tmp_path):
    alibi = Decoder(DecoderConfig(d_model=32, n_layers=1, n_heads=2, context_length=CONTEXT,
                                  encoding="alibi"))  # fmt: skip
    with pytest.raises(ValueError, match="'alibi', not rotary: a factor search rescales RoPE"):
        search(alibi, SearchConfig(TARGET), tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match=r"128,000,000,000 tokens to score; the limit is"):
        SearchConfig(TARGET, budget=10**9)


class _Distance:
    """A scorer whose fitness is known: the squared log-distance to a target, so what the
    evolution does (not only the final minimum) is what the test sees."""

    def __init__(self, target: np.ndarray) -> None:
        self.target, self.forwards, self.records = target, 0, []

    def known(self, factors: np.ndarray) -> float | None:
        return None

    def __call__(self, factors: np.ndarray, origin: str) -> float:
        self.forwards += 1
        self.records.append(origin)
        return float(np.sum((np.log(factors) - np.log(self.target)) ** 2))


def test_the_evolution_breeds_from_its_best_and_crosses_them():
    """The target takes NTK's factors for the fast half of the pairs and PI's for the slow
    half, which no seed is: breeding from the best candidates gets within 5% of the seeds'
    best distance in 120 forwards (from the worst it never improves on the seeds), and the
    generations cross their parents (LongRoPE's evolution), not only mutate them. Both
    mutants (worst parents, no crossover) once passed every test here, since the final pick is
    the minimum over every scored candidate whatever the evolution did."""
    from tqdm.auto import tqdm

    from ropekit.train.search import MAX_FACTOR_TIMES_S, _evolve

    factor = TARGET / CONTEXT
    seeds = initial_factors(16, 10000.0, factor, CONTEXT)
    half = len(seeds["pi"]) // 2
    target = np.concatenate([seeds["ntk"][:half], seeds["pi"][half:]])
    scorer = _Distance(target)
    start = min(scorer(f, name) for name, f in seeds.items())
    config = SearchConfig(TARGET, samples=1, budget=120, population=8, parents=4)
    evolved = _Distance(target)
    best = _evolve(evolved, config, seeds, MAX_FACTOR_TIMES_S * factor, tqdm(disable=True))
    assert best["nll"] < 0.05 * start, (best["nll"], start)
    crossed = [o for o in evolved.records if o.endswith("crossover")]
    assert len(crossed) >= len(evolved.records) // 4, evolved.records
