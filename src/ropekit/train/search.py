"""``ropekit search``: LongRoPE's evolutionary search of per-pair rescale factors, no training.

LongRoPE (Ding et al. 2024, arXiv:2402.13753, sec. 3.2 and Algorithm 1) extends a model by
dividing each rotary pair's frequency by its own factor, theta_f / lambda_f, and finds the
factors by an evolutionary search scored by perplexity on a few long samples. Only this search
part of LongRoPE is public; here it is, on any model ropekit can give an encoding to:

1. The initial population holds the rules users already have, as per-pair factors against
   plain RoPE: PI (lambda_f = s), NTK-aware (b -> b s^(d/(d-2))) and YaRN (NTK-by-parts), the
   paper's seeds, plus mutations of them up to ``population``.
2. Every candidate is scored by the mean NLL (nats per token; of the answer tokens only under
   ``needle-ppl``, below) of the same ``samples`` samples
   of ``target_length`` tokens from the *training* split of ``data`` (never the held-out text
   results are measured on), each written as the spec step 4 writes. The samples are longer
   than the original window and a ``longrope`` encoding follows the length, so each is read
   in one forward (``Backbone.token_nll``) with exactly the long factors the spec applies at
   the target length; its short factors never enter a score.
3. The ``parents`` best breed the next generation: mutation (each factor times
   exp(N(0, mutation)) with probability 1/2) and crossover (each pair from one of two
   parents). The paper's constraints hold for every candidate: lambda_f >= 1 (no pair is sped
   up) and lambda_f non-decreasing from the fastest pair to the slowest (a slower pair never
   interpolates less), enforced by a running maximum; factors are capped at 4 s.
4. The search stops when its ``budget`` of forwards (candidates x samples) is spent. The best
   candidate becomes a ``longrope`` spec whose short factors are 1, so inputs inside the
   original window keep the original frequencies and longer ones switch to the searched
   factors (the LongRoPE2 rule, Shang et al. 2025, as transformers applies ``longrope`` by
   sequence length), written as an adapter that ``ropekit export`` serves. The attention
   factor sqrt(1 + ln s / ln L0) applies at every length, short inputs included, as in
   transformers and Phi-3: on SmolLM2 at 2x it costs 2.3% perplexity at 2k (46.51 against
   45.46, experiment D); ``mixed:method=longrope,...`` keeps the original RoPE whole inside
   the window, but no engine's config expresses it.

The default score is perplexity, which can keep factors that do not retrieve: on SmolLM2 at
32k (experiment E) the search kept NTK-aware's factors, which answered 0 of 5 passkeys at 32k
(needles about 16k back) and 5 of 5 at 16k (8k back). ``objective="needle-ppl"`` scores
LongRoPE2's needle-driven perplexity instead (Shang et al. 2025, arXiv:2502.20082, sec. 3.2):
each scoring sample becomes a needle document, its own passkey woven into the text more than
the trained length before its end (uniform over those depths) and asked there
(``data.retrieval``, as the retrieval mixture trains them), and the fitness is the mean NLL
of the answer's tokens only, so a candidate that cannot reach the needle scores high
whatever its text perplexity. NTK-aware's factors turn 11
slow pairs past every angle they saw in training at 32k and none at 16k
(``schedules.unseen_rotations``); the search names such pairs in a warning and in its result
(``unseen_pairs``). Check a result with ``ropekit eval probes`` or ``ropekit compare``.

Resumable: every scored candidate is a record of ``candidates.jsonl`` carrying the digest of
the search's provenance (model, data, config); a rerun scores only what is missing and a
finished search makes no forward. What LongRoPE also searches and ropekit does not: the number
of initial *tokens* kept unscaled (n-hat): positions below it would need their own rotation,
which a frequency schedule cannot express.

Holds: SearchConfig, VERSION, SearchRecord (search.json, the ``search`` kind), SearchResult,
initial_factors, search.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ropekit.backbone import Backbone, as_backbone, write_adapter
from ropekit.data import make_train_dataset
from ropekit.data.retrieval import RetrievalConfig, draw_records, weave
from ropekit.encodings import PositionEncoding, schedules
from ropekit.results import (
    check_replaceable,
    digest,
    read_record,
    read_records,
    register,
    run_metadata,
    to_json,
    write_records,
    write_result,
)

SEARCH_JSON = "search.json"
CANDIDATES = "candidates.jsonl"
MAX_FACTOR_TIMES_S = 4.0  # factors are capped at this multiple of s
OBJECTIVES = ("ppl", "needle-ppl")
# Tokens a search may score in all (budget x target_length): past it the run would take
# months (SmolLM2-135M on one CPU core here scores 8,192 tokens in about a minute).
MAX_SEARCH_TOKENS = 10**9
# The least mutation step: a candidate is recognised by its factors to 6 decimals (the records'
# keys) and one recognised costs no forward, so with much smaller steps every child reads as
# its parent and the search never spends its budget (at 1e-9 it never ended).
MIN_MUTATION = 1e-4


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """One factor search. Lengths in the model's tokens."""

    target_length: int  # context the searched factors must serve (tokens)
    samples: int = 2  # training-split samples of target_length that score every candidate
    budget: int = 48  # forwards the search may spend: candidates x samples (paper: thousands)
    population: int = 8  # candidates per generation (paper: 64)
    parents: int = 4  # best candidates that breed the next generation
    mutation: float = 0.1  # a mutated factor is multiplied by exp(N(0, mutation)); 1e-4 to 1
    data: str | tuple[str, ...] = "shakespeare"  # text the candidates are scored on (train split)
    seed: int = 0  # picks the samples, the mutations and the crossovers
    chunk: int = 2048  # tokens per forward while scoring (memory only; the numbers are exact)
    # the fitness: "ppl", the mean NLL of every token of the samples; "needle-ppl", LongRoPE2's
    # needle-driven perplexity: the mean NLL of the answer tokens only, each sample a needle
    # document (its own passkey woven into it more than the trained length before its end,
    # asked there)
    objective: str = "ppl"

    def __post_init__(self) -> None:
        if not isinstance(self.data, str):
            object.__setattr__(self, "data", tuple(self.data))
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"objective={self.objective!r} is not allowed; allowed: {', '.join(OBJECTIVES)}"
            )
        for name in ("target_length", "samples", "budget", "population", "parents", "chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 1")
        if self.parents > self.population:
            raise ValueError(
                f"parents={self.parents} is not allowed; it must be <= population={self.population}"
            )
        if self.budget < 3 * self.samples:
            raise ValueError(
                f"budget={self.budget} is not allowed: it must cover the three seeds (PI, NTK, "
                f"YaRN), samples={self.samples} forwards each, so >= {3 * self.samples}"
            )
        if self.budget * self.target_length > MAX_SEARCH_TOKENS:
            raise ValueError(
                f"budget={self.budget} forwards of target_length={self.target_length} is "
                f"{self.budget * self.target_length:,} tokens to score; the limit is "
                f"{MAX_SEARCH_TOKENS:,} (budget <= {MAX_SEARCH_TOKENS // self.target_length:,} "
                "at this length)"
            )
        if not (math.isfinite(self.mutation) and MIN_MUTATION <= self.mutation <= 1):
            raise ValueError(
                f"mutation={self.mutation!r} is not allowed; it must lie in [{MIN_MUTATION:g}, 1]: "
                "candidates are recognised by their factors to 6 decimals, and much smaller steps "
                "breed children that read as candidates already scored, which cost no forward, "
                "so the search may never spend its budget"
            )
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} is not allowed; it must be an integer >= 0")

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values (the provenance of a search). The objective is left out
        at its default, perplexity, which every search made before it could be chosen scored:
        their folders stay resumable."""
        out = dataclasses.asdict(self)
        out["data"] = list(self.data) if isinstance(self.data, tuple) else self.data
        if out["objective"] == "ppl":
            del out["objective"]
        return out


VERSION = 3  # 3: typed (2: the untyped layout, the same fields; the objective added since
# reads as its default, perplexity, which every search before it scored)


@register("search", VERSION, {2: lambda data: data})
@dataclasses.dataclass(frozen=True)
class SearchRecord:
    """search.json: the best candidate, the seeds' fitness and what the search spent."""

    meta: dict[str, Any]  # run_metadata
    provenance: dict[str, Any]  # model and config: what a rerun must match to reuse it
    spec: str  # the searched longrope spec (what the adapter holds)
    nll: float  # its fitness: mean NLL (nats/token) on the scoring samples (config.objective)
    origin: str  # where the best candidate came from ("yarn", "generation 3 crossover", ...)
    baselines: dict[str, float]  # the seeds' fitness: pi, ntk, yarn
    forwards: int  # forwards spent (this run and earlier ones together)
    candidates: int  # candidates scored
    factor: float  # target_length / trained_at
    trained_at: int  # the model's training length (L0)
    config: SearchConfig
    elapsed_s: float
    adapter: str  # the folder the best spec was written to


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What ``search`` returns."""

    out_dir: Path
    spec: str  # the searched longrope spec (what the adapter holds)
    nll: float  # its fitness: mean NLL (nats/token) on the scoring samples
    baselines: dict[str, float]  # the seeds' fitness: pi, ntk, yarn
    forwards: int  # forwards spent (this run and earlier ones together)
    elapsed_s: float
    # Rotary pairs the spec turns past every angle they saw in training at the target length
    # (``schedules.unseen_rotations``), which a perplexity score does not see.
    unseen_pairs: tuple[int, ...] = ()


def _monotone(factors: np.ndarray, cap: float) -> np.ndarray:
    """The paper's constraints: lambda >= 1, non-decreasing from fast to slow pairs, <= cap."""
    return np.minimum(np.maximum.accumulate(np.maximum(factors, 1.0)), cap)


def initial_factors(dim: int, base: float, factor: float, original_length: int) -> dict:
    """The seeds of the search as per-pair factors against plain RoPE: PI, NTK and YaRN."""
    rope, _ = schedules.rope(dim, base)
    rules = {
        "pi": schedules.linear(dim, base, factor)[0],
        "ntk": schedules.ntk(dim, base, factor)[0],
        "yarn": schedules.yarn(dim, base, factor, original_length)[0],
    }
    cap = MAX_FACTOR_TIMES_S * factor
    return {name: _monotone((rope / inv).numpy(), cap) for name, inv in rules.items()}


def _mutate(parent: np.ndarray, rng: np.random.Generator, step: float, cap: float) -> np.ndarray:
    change = np.where(rng.random(parent.shape) < 0.5, rng.normal(0.0, step, parent.shape), 0.0)
    return _monotone(parent * np.exp(change), cap)


def _crossover(a: np.ndarray, b: np.ndarray, rng: np.random.Generator, cap: float) -> np.ndarray:
    return _monotone(np.where(rng.random(a.shape) < 0.5, a, b), cap)


def _spec(factors: np.ndarray, factor: float, original_length: int) -> str:
    """A longrope spec: ``factors`` beyond the original window, short factors 1 inside it."""
    values = "[" + ",".join(f"{v:.6g}" for v in factors) + "]"
    return (
        f"longrope:short_factor=[1],long_factor={values},factor={factor:g},"
        f"original_length={original_length}"
    )


class _Scorer:
    """A candidate's fitness: the mean over the scoring samples of their mean NLL, of every
    token ("ppl") or of the answer tokens of a needle document ("needle-ppl"); records every
    scored candidate."""

    def __init__(
        self, backbone: Backbone, config: SearchConfig, path: Path, stage: str, context: dict
    ) -> None:
        packed = make_train_dataset(
            config.data if isinstance(config.data, str) else list(config.data),
            backbone.require_tokenizer(), config.target_length, seed=config.seed,
        )  # fmt: skip
        if len(packed) < config.samples:
            raise ValueError(
                f"samples={config.samples} is not allowed: the training text holds only "
                f"{len(packed)} samples of {config.target_length} tokens"
            )
        first = [packed.sample(k)[0] for k in range(config.samples)]  # (T+1,) tokens each
        self.samples = [torch.as_tensor(tokens)[None] for tokens in first]  # (1, T+1) each
        # (T,) the label positions each sample's fitness averages: all, or its answer's
        self.scored = [torch.ones(ids.shape[1] - 1, dtype=torch.bool) for ids in self.samples]
        if config.objective == "needle-ppl":
            self.samples, self.scored = _needle_documents(
                first, backbone, config.seed, context["original_length"]
            )
        self.backbone, self.config, self.path, self.stage = backbone, config, path, stage
        self.context = context
        self.records = [r for r in read_records(path) if r.get("stage") == stage]
        self.forwards = len(self.records) * config.samples

    def known(self, factors: np.ndarray) -> float | None:
        key = [round(float(v), 6) for v in factors]
        for record in self.records:
            if record["factors"] == key:
                return record["nll"]
        return None

    def __call__(self, factors: np.ndarray, origin: str) -> float:
        found = self.known(factors)
        if found is not None:
            return found
        c = self.context
        spec = _spec(factors, c["factor"], c["original_length"])
        self.backbone.set_encoding(spec)
        total = sum(
            float(self.backbone.token_nll(ids, self.config.chunk)[0][scored].double().mean())
            for ids, scored in zip(self.samples, self.scored, strict=True)
        )
        nll = total / len(self.samples)
        key = [round(float(v), 6) for v in factors]
        self.records.append({"stage": self.stage, "origin": origin, "factors": key, "nll": nll})
        write_records(self.path, self.records)
        self.forwards += self.config.samples
        return nll


def _needle_documents(
    samples: list[np.ndarray], backbone: Backbone, seed: int, trained: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """LongRoPE2's needle documents (Shang et al. 2025, sec. 3.2, "needle-driven
    perplexity"): each training sample (T+1,) with its own passkey woven in and asked at its
    end ("What is the pass key? The pass key is 48213."), as ``data.retrieval`` builds them
    for training; returns the documents (1, T+1) and, per document, the label positions (T,)
    of its answer's tokens. Every document draws its own passkey (seed, document index), so
    the scores are over independent probes.

    Every needle sits more than ``trained`` (L0) tokens before its question, at a uniform
    depth of what is left: what the search must find is factors that reach past the window
    the model was trained on. At uniform depths of the whole document, about L0 / T of the
    needles lie inside that window, where the model's own RoPE already reads them: E's 32k
    rerun drew 6 documents whose needles sat 6.1k-31.1k back, one of them past the 16.4k at
    which NTK-aware's factors had failed E's probes."""
    tokenizer = backbone.require_tokenizer()
    config = RetrievalConfig(ratio=1.0, kinds=("passkey",))
    documents, answers = [], []
    for k, tokens in enumerate(samples):
        rng = np.random.default_rng([seed, k, 0x6E656564])  # "need"
        woven, _, where = weave(
            np.asarray(tokens), draw_records(rng, config), tokenizer, rng, at_least_back=trained
        )
        answer = torch.zeros(len(woven) - 1, dtype=torch.bool)
        for start, stop in where.answer_spans:
            answer[start:stop] = True
        documents.append(torch.as_tensor(woven)[None])
        answers.append(answer)
    return documents, answers


def _evolve(scorer: _Scorer, config: SearchConfig, seeds: dict, cap: float, bar: tqdm) -> dict:
    """The generations; returns {"factors", "nll", "origin"} of the best candidate."""
    rng = np.random.default_rng([config.seed, 7])
    scored: list[tuple[float, np.ndarray, str]] = []

    def score(factors: np.ndarray, origin: str) -> bool:
        if scorer.forwards + config.samples > config.budget and scorer.known(factors) is None:
            return False  # the budget is spent
        before = scorer.forwards
        scored.append((scorer(factors, origin), factors, origin))
        bar.update(scorer.forwards - before)
        return True

    population = [(f, name) for name, f in seeds.items()]
    while len(population) < config.population:
        name, f = list(seeds.items())[len(population) % len(seeds)]
        population.append((_mutate(f, rng, config.mutation, cap), f"mutation of {name}"))
    generation = 0
    while all(score(f, origin) for f, origin in population):
        generation += 1
        best = sorted(scored, key=lambda s: s[0])[: config.parents]
        population = []
        for i in range(config.population):
            a = best[i % len(best)][1]
            if i % 2 and len(best) > 1:
                b = best[(i + 1) % len(best)][1]
                child = _mutate(_crossover(a, b, rng, cap), rng, config.mutation / 2, cap)
                population.append((child, f"generation {generation} crossover"))
            else:
                population.append(
                    (_mutate(a, rng, config.mutation, cap), f"generation {generation}")
                )
    nll, factors, origin = min(scored, key=lambda s: s[0])
    return {"factors": factors, "nll": nll, "origin": origin}


def _unseen_pairs(
    backbone: Backbone, encoding: PositionEncoding, target_length: int, log: Any
) -> tuple[int, ...]:
    """The pairs of the kept spec past their trained angles at the target length, named in
    one warning line: perplexity can keep such factors (module docstring). They are one run of
    pairs: the slow pairs are the last ones, and the factors never decrease towards them."""
    trained, _ = backbone.build_encoding("rope").inv_freq(length=target_length)
    searched, _ = encoding.inv_freq(length=target_length)  # (1, F): one schedule for all heads
    mask = schedules.unseen_rotations(
        searched[0], trained[0], target_length, backbone.training_length
    )
    pairs = tuple(int(f) for f in mask.nonzero().flatten())
    if pairs:
        log(
            f"warning: the kept factors turn {len(pairs)} of {mask.numel()} rotary pairs "
            f"({pairs[0]}-{pairs[-1]}) past every angle they saw in training at "
            f"{target_length} tokens; a perplexity score does not see it, retrieval can fail "
            "there: check it with ropekit eval probes"
        )
    return pairs


def _finished(backbone: Backbone, config: SearchConfig, out: Path, log: Any) -> SearchResult:
    """A finished search of this model, data and config: its result, its spec attached."""
    found = read_record(out / SEARCH_JSON, SearchRecord)
    encoding = backbone.set_encoding(found.spec)
    log(f"{out} holds this search, finished: {found.spec}")
    unseen = _unseen_pairs(backbone, encoding, config.target_length, log)
    return SearchResult(
        out, found.spec, found.nll, found.baselines, found.forwards, found.elapsed_s, unseen
    )


def search(
    model: Backbone | nn.Module,
    config: SearchConfig,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    overwrite: bool = False,
    command: str = "",
    progress: bool = True,
    log: Any = print,
) -> SearchResult:
    """Search per-pair factors for ``config.target_length`` (module docstring); writes
    ``out_dir/candidates.jsonl`` (every scored candidate), ``out_dir/adapter`` (the best as a
    ``longrope`` spec) and ``out_dir/search.json``. The model is left with the best spec."""
    backbone, out = as_backbone(model, tokenizer), Path(out_dir)
    start = time.perf_counter()
    trained_at = backbone.training_length
    factor = config.target_length / trained_at
    if factor <= 1:
        raise ValueError(
            f"target_length={config.target_length} is not allowed: the model was trained at "
            f"{trained_at}; a search needs a longer target"
        )
    if config.parents < 2:  # _evolve crosses two parents; with one it only mutates
        warnings.warn(
            f"parents={config.parents}: no crossover (it needs two parents), so this search "
            "only mutates the best candidate; --parents 2 or more to cross candidates",
            stacklevel=2,
        )
    fingerprint = backbone.fingerprint()
    if not isinstance(fingerprint.get("base"), int | float) or not fingerprint.get("head_dim"):
        current = backbone.encoding.spec if backbone.encoding is not None else "its own"
        raise ValueError(
            f"the model's positions are {current!r}, not rotary: a factor search rescales "
            "RoPE's per-pair frequencies; allowed: a model with rotary positions"
        )
    rope: PositionEncoding = backbone.build_encoding("rope")
    context = {"factor": factor, "original_length": trained_at}
    provenance = {"model": backbone.identity(), "config": config.to_dict()}
    if config.objective == "needle-ppl":  # what its documents ask (candidates scored on needles
        # at uniform depths of the whole document are not reused for these)
        provenance["needles"] = f"each more than {trained_at} tokens before its question"
    if check_replaceable(out / SEARCH_JSON, "search", provenance, overwrite=overwrite):
        return _finished(backbone, config, out, log)
    if overwrite:
        (out / CANDIDATES).unlink(missing_ok=True)
    dim = rope.rotary_dim
    seeds = initial_factors(dim, fingerprint["base"], factor, trained_at)
    scorer = _Scorer(backbone, config, out / CANDIDATES, digest(provenance), context)
    log(f"searching {schedules.n_pairs(dim)} per-pair factors for {config.target_length} "
        f"tokens ({factor:g}x), budget {config.budget} forwards")  # fmt: skip
    bar = tqdm(total=config.budget, initial=scorer.forwards, desc="search", unit="forward",
               disable=not progress)  # fmt: skip
    with torch.no_grad():
        best = _evolve(scorer, config, seeds, MAX_FACTOR_TIMES_S * factor, bar)
        baselines = {name: scorer(f, name) for name, f in seeds.items()}
    bar.close()
    spec = _spec(best["factors"], factor, trained_at)
    encoding = backbone.set_encoding(spec)
    write_adapter(
        encoding, fingerprint, out / "adapter", weights_sample=backbone.weights_sample(),
        layers=backbone.encoded_layers(),
    )  # fmt: skip
    record = SearchRecord(
        meta=run_metadata(command, spec=encoding.spec, seed=config.seed),
        provenance=json.loads(to_json(provenance)),  # as the file holds it
        spec=encoding.spec, nll=best["nll"], origin=best["origin"], baselines=baselines,
        forwards=scorer.forwards, candidates=len(scorer.records), factor=factor,
        trained_at=trained_at, config=config, elapsed_s=time.perf_counter() - start,
        adapter=str(out / "adapter"),
    )  # fmt: skip
    write_result(out / SEARCH_JSON, "search", record)
    unseen = _unseen_pairs(backbone, encoding, config.target_length, log)
    return SearchResult(
        out, record.spec, record.nll, baselines, record.forwards, record.elapsed_s, unseen
    )
