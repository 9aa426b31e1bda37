"""``analyze``: held-out windows in, ``analysis.json`` and PNGs out (``ropekit analyze``).

Shape legend: N windows · W window length · L layers analysed · H query heads · K key/value
heads · F rotary pairs · R relative distances · n_L context lengths · n_b betas.

What it measures, in this order, on one set of N held-out windows of W = max(lengths,
target_length) tokens drawn at seeded random places from the held-out stream:

1. Effective length E_beta per layer and head against context length (``heads``): each window
   is run once at max(lengths); since attention is causal, the queries 0..n-1 of that forward
   attend exactly as in a forward over the first n tokens (up to float rounding), so the value
   at length n is the mean of E_beta over the first n queries (``window_mean``) and over their
   last quarter, queries that see about n keys (``last_quarter``). Dynamic schedules (dynamic
   NTK, LongRoPE) change frequencies with the sequence length, so for them every length is its
   own forward.
2. Frequency utilization at max(lengths) (rotary encodings): mean |pair contribution|, its CoV
   across pairs, the utilization-weighted (log-)frequency, and the contribution by distance
   for a few heads.
3. The schedule (``schedules``): effective base per layer and kv head; for AdaRoPE /
   tuned-yarn the learned minus initial log-frequency and AdaScale's gamma and tau.
4. Head influence (``influence``, AdaRoPE): delta NLL at target_length when one head's AdaFreq
   or AdaScale parameters are reverted to init, on the first ``influence_windows`` windows.

The layers analysed are those the encoding rotates (``Backbone.encoded_layers``): a spec may
cover only some layer types (Gemma 3: its global layers), and the others (the model's own RoPE,
NoPE) are neither captured nor reported; every section's layer axis runs over them, each
labelled by its index and type (``record.AnalysedLayer``). An unpatched model runs its own RoPE
on the layers of its family's default types.

The capture forwards stop once every analysed layer has been seen (the LM head is never run),
so no (B, W, V) logits tensor is made. Writes JSON first (spec, seed, versions, command, config,
data), then the figures of ``plots``. The result is an ``AnalysisResult`` (``record``), read
back by ``read_record``.

Holds: AnalysisConfig, AnalysisRun, held_out_windows, analyze_windows, analyze, summary_lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ropekit.backbone import Backbone, as_backbone
from ropekit.data import heldout_stream
from ropekit.data.streams import TokenStream
from ropekit.data.tokenizers import Tokenizer
from ropekit.encodings import PositionEncoding
from ropekit.encodings.base import check_choice
from ropekit.results import check_replaceable, read_record, run_metadata, write_result

from .capture import CAPTURE_METHODS, capture_qk, forward_logits
from .heads import HeadStatistics
from .influence import INFLUENCE_KINDS, head_influence, influence_units, mean_nll
from .metrics import (
    BiasFn,
    check_beta,
    coefficient_of_variation,
    fit_effective_base,
    kv_head_index,
    weighted_mean,
)
from .plots import beta_label, planned_figures, write_figures
from .record import (
    AnalysedLayer,
    AnalysisResult,
    DistanceProfile,
    EffectiveBase,
    EffectiveLength,
    Influence,
    InfluenceKind,
    InfluenceUnit,
    Learned,
    ModelShape,
    ProfileHead,
    Schedule,
    Sections,
    Utilization,
    Windows,
    nested,
)
from .schedules import effective_bases, head_log_frequencies, learned_schedule, rotary_layout

JSON_NAME = "analysis.json"


def _require_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= {minimum}")


@dataclasses.dataclass(frozen=True)
class AnalysisConfig:
    """What ``analyze`` measures and on how much data. Lengths are in the model's tokens."""

    lengths: tuple[int, ...]  # context lengths at which E_beta is reported, e.g. (256, 512, 1024)
    n_windows: int = 4  # held-out windows of the longest length (the same ones for everything)
    betas: tuple[float, ...] = (2.0,)  # orders of E_beta; paper: 2; 1 = exp(entropy); inf allowed
    seed: int = 0  # picks the windows, the sampled query-key pairs and the profile queries
    target_length: int | None = None  # influence NLL is measured here; None: max(lengths)
    influence: bool = True  # run head influence (AdaRoPE only): one NLL pass per head
    influence_windows: int | None = None  # windows for influence; None: all n_windows
    qk_pairs: int = 2048  # causal (query, key) pairs sampled per window for utilization
    max_distance: int = 128  # Figure 1 profile covers distances 0..max_distance-1
    batch_tokens: int = 8192  # tokens per forward: batch = max(1, batch_tokens // length)
    chunk_elements: int = 2**22  # attention logits alive at once (B * H * queries * keys)
    top_k: int = 10  # most influential heads listed per kind
    capture: str = "auto"  # q/k capture path: auto, probe (Decoder), encoding (capture.py)

    def __post_init__(self) -> None:
        lengths = self.lengths
        if isinstance(lengths, int) or not lengths:
            raise ValueError(f"lengths={lengths!r} is not allowed; give one or more integers >= 2")
        for n in lengths:
            _require_int("lengths", n, 2)
        object.__setattr__(self, "lengths", tuple(sorted(set(lengths))))
        if isinstance(self.betas, int | float) or not self.betas:
            raise ValueError(f"betas={self.betas!r} is not allowed; give one or more numbers > 0")
        object.__setattr__(self, "betas", tuple(check_beta(b) for b in self.betas))
        for name, minimum in (
            ("n_windows", 1),
            ("seed", 0),
            ("qk_pairs", 1),
            ("max_distance", 1),
            ("batch_tokens", 1),
            ("chunk_elements", 1),
            ("top_k", 1),
        ):
            _require_int(name, getattr(self, name), minimum)
        if self.target_length is not None:
            _require_int("target_length", self.target_length, 2)
        if self.influence_windows is not None:
            _require_int("influence_windows", self.influence_windows, 1)
            if self.influence_windows > self.n_windows:
                raise ValueError(
                    f"influence_windows={self.influence_windows} is not allowed; it must be "
                    f"<= n_windows={self.n_windows} (influence reuses the same windows)"
                )
        if not isinstance(self.influence, bool):
            raise ValueError(f"influence={self.influence!r} is not allowed; use True or False")
        check_choice("capture", self.capture, CAPTURE_METHODS)

    @property
    def max_length(self) -> int:
        return self.lengths[-1]

    @property
    def influence_length(self) -> int:
        return self.max_length if self.target_length is None else self.target_length

    @property
    def window_length(self) -> int:
        return max(self.max_length, self.influence_length)

    @property
    def primary_beta(self) -> int:
        """Index of the beta shown in figures and summaries: 2 (the paper's E_2) if present."""
        return self.betas.index(2.0) if 2.0 in self.betas else 0


def held_out_windows(
    model: Backbone | nn.Module,
    tokenizer: Tokenizer | str | os.PathLike[str] | None,
    data: Any,
    config: AnalysisConfig,
) -> tuple[Tensor, dict[str, Any]]:
    """N windows (N, W) of held-out token ids and a JSON description of where they came from.

    ``data`` is a data spec for ``ropekit.data.heldout_stream`` (a corpus name, files, a list),
    a ``TokenStream``, a 1-D id tensor (a stream) or a 2-D id tensor (rows used as windows).
    From a stream, N non-overlapping slots of W tokens are drawn at random with ``seed``.
    """
    W, N = config.window_length, config.n_windows
    info: dict[str, Any] = {"window_length": W, "n_windows": N}
    if isinstance(data, Tensor) and data.dim() == 2:
        if data.shape[0] < N or data.shape[1] < W:
            raise ValueError(
                f"data {tuple(data.shape)} is not allowed; windows need at least "
                f"(n_windows={N}, window length={W})"
            )
        windows = data[:N, :W].long()
        info.update(source="tensor", starts=None)
    else:
        if isinstance(data, TokenStream):
            ids, info["source"], info["tokenizer"] = data.ids, "token stream", data.tokenizer
        elif isinstance(data, Tensor) and data.dim() == 1:
            ids, info["source"] = data.long(), "tensor"
        else:
            stream = heldout_stream(data, as_backbone(model, tokenizer).require_tokenizer())
            ids = stream.ids
            info.update(
                source=data if isinstance(data, str) else [str(d) for d in data],
                tokenizer=stream.tokenizer,
                split="validation",
            )
        slots = len(ids) // W
        if slots < N:
            raise ValueError(
                f"n_windows={N} is not allowed: the held-out stream of {len(ids)} tokens holds "
                f"{slots} windows of {W} tokens; allowed: n_windows <= {slots}, shorter "
                "lengths, or more data"
            )
        chosen = np.sort(np.random.default_rng(config.seed).choice(slots, N, replace=False))
        starts = [int(c) * W for c in chosen]
        windows = torch.stack([ids[s : s + W] for s in starts])
        info["starts"] = starts
    vocab = as_backbone(model).vocab_size
    if int(windows.max()) >= vocab:
        raise ValueError(
            f"token id {int(windows.max())} is not allowed for a model with vocab_size={vocab}; "
            "is the tokenizer the model's own?"
        )
    return windows, info


class _AllLayersSeen(Exception):
    """Raised from the capture consumer once the last analysed layer is reduced: the rest of
    the forward (final norm, LM head, logits) is not needed."""


def _layer_bias(encoding: PositionEncoding, layer: int) -> BiasFn:
    def bias(q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        return encoding.score_bias(q_pos, k_pos, layer)  # (1, H, Tc, S) or None

    return bias


def _collect(
    model: nn.Module, windows: Tensor, stats: HeadStatistics, config: AnalysisConfig, bar: tqdm
) -> str:
    """Run windows (N, T) through the model in batches, reducing each of ``stats.layers`` into
    ``stats``."""
    n_layers = len(stats.layers)
    device = as_backbone(model).device
    batch = max(1, config.batch_tokens // windows.shape[1])

    def on_layer(layer: int, q: Tensor, k: Tensor) -> None:
        stats.update(layer, q, k)
        if len(stats.seen) == n_layers:
            raise _AllLayersSeen

    with capture_qk(model, on_layer, config.capture) as method:
        for b in range(0, windows.shape[0], batch):
            ids = windows[b : b + batch].to(device)  # (B, T)
            stats.begin_batch(ids.shape[0])
            with contextlib.suppress(_AllLayersSeen):
                forward_logits(model, ids)
            if len(stats.seen) != n_layers:
                raise RuntimeError(
                    f"captured layers {sorted(stats.seen)} of {list(stats.layers)}: the model's "
                    "attention does not route every layer its backbone names through the "
                    "ropekit encoding"
                )
            bar.update(ids.shape[0])
    return method


def _pearson(x: Tensor, y: Tensor) -> float | None:
    x, y = x.double().flatten(), y.double().flatten()
    ok = torch.isfinite(x) & torch.isfinite(y)
    x, y = x[ok] - x[ok].mean(), y[ok] - y[ok].mean()
    denominator = float((x.pow(2).sum() * y.pow(2).sum()).sqrt())
    return float((x * y).sum()) / denominator if denominator > 0 else None


def _beta_json(beta: float) -> float | str:
    return beta if math.isfinite(beta) else "inf"


def _profile_heads(
    cov: Tensor, influence: Influence | None, group: int, layers: Sequence[int]
) -> list[tuple[int, int, str]]:
    """The heads whose distance profile is kept, as (layer, query head, why), of the layers
    ``cov``'s rows hold: the most concentrated and the most uniform utilization (paper,
    Figure 2 b vs a), and a reader of the most influential AdaFreq kv head (Figure 10 right)
    when its layer is one of them."""
    flat = torch.where(torch.isfinite(cov), cov, torch.nan).flatten()
    picks: list[tuple[int, int, str]] = []
    if bool(torch.isfinite(flat).any()):
        n_heads = cov.shape[1]
        for index, why in (
            (int(torch.nan_to_num(flat, nan=-math.inf).argmax()), "max CoV (concentrated)"),
            (int(torch.nan_to_num(flat, nan=math.inf).argmin()), "min CoV (uniform)"),
        ):
            picks.append((layers[index // n_heads], index % n_heads, why))
    top = influence.freq.top if influence is not None and influence.freq is not None else ()
    if top and top[0].layer in layers and top[0].head is not None:
        picks.append((top[0].layer, top[0].head * group, "top AdaFreq influence"))
    seen, unique = set(), []
    for layer, head, why in picks:
        if (layer, head) not in seen:
            seen.add((layer, head))
            unique.append((layer, head, why))
    return unique


def _effective_lengths(
    model: Backbone | nn.Module,
    encoding: PositionEncoding,
    layers: tuple[AnalysedLayer, ...],
    windows: Tensor,
    config: AnalysisConfig,
    progress: bool,
) -> tuple[EffectiveLength, HeadStatistics, str]:
    """Section 1: E_beta per analysed layer and head against length; the statistics at
    max(lengths) (utilization and the distance profile read them) and the capture path used."""
    n_layers, H, K = len(layers), encoding.n_heads, encoding.n_kv_heads
    layout = rotary_layout(encoding)
    lengths, L_max = config.lengths, config.max_length
    # Causal attention: one forward at L_max serves every shorter length, unless the schedule
    # itself follows the sequence length.
    runs = [(n, (n,)) for n in lengths] if encoding.dynamic else [(L_max, lengths)]
    window_mean = torch.zeros(len(config.betas), len(lengths), n_layers, H, dtype=torch.float64)
    last_quarter = torch.zeros_like(window_mean)
    at_max, method = None, config.capture
    total = windows.shape[0] * len(runs)
    bar = tqdm(total=total, desc="analysis", unit="window", disable=not progress)
    for run_length, served in runs:
        stats = HeadStatistics(
            layers=[layer.index for layer in layers],
            n_heads=H,
            n_kv_heads=K,
            length=run_length,
            betas=config.betas,
            bias=functools.partial(_layer_bias, encoding),
            layout=layout if run_length == L_max else None,
            qk_pairs=config.qk_pairs,
            max_distance=config.max_distance,
            chunk_elements=config.chunk_elements,
            seed=config.seed,
        )
        method = _collect(model, windows[:, :run_length], stats, config, bar)
        by_position = stats.effective_length_by_position().permute(1, 0, 2, 3)  # (n_b, L, H, T)
        for n in served:
            i = lengths.index(n)
            window_mean[:, i] = by_position[..., :n].mean(-1)
            last_quarter[:, i] = by_position[..., n - max(1, n // 4) : n].mean(-1)
        if run_length == L_max:
            at_max = stats
    bar.close()
    assert at_max is not None
    section = EffectiveLength(
        betas=tuple(_beta_json(b) for b in config.betas),
        primary_beta_index=config.primary_beta,
        lengths=lengths,
        dynamic_schedule=encoding.dynamic,
        window_mean=nested(window_mean.tolist()),  # (n_b, n_L, L, H)
        last_quarter=nested(last_quarter.tolist()),  # (n_b, n_L, L, H)
    )
    return section, at_max, method


def _utilization(
    encoding: PositionEncoding,
    at_max: HeadStatistics,
    config: AnalysisConfig,
    influence: Influence | None,
) -> Utilization:
    """Section 2 (rotary encodings): per-pair utilization of the analysed layers at
    max(lengths), its CoV, and the distance profile of the heads ``_profile_heads`` picks."""
    H, K = encoding.n_heads, encoding.n_kv_heads
    layout, L_max = rotary_layout(encoding), config.max_length
    u = at_max.utilization()  # (L, H, F)
    cov = coefficient_of_variation(u)  # (L, H)
    kv = kv_head_index(H, K)
    log_theta = torch.stack(
        [head_log_frequencies(encoding, layer, L_max)[kv] for layer in at_max.layers]
    )  # (L, H, F)
    weighted_log = weighted_mean(log_theta, u)  # (L, H)
    mean_log = log_theta.mean(-1)  # (L, H)
    profile = at_max.distance_profile()  # (L, H, F, R)
    group = encoding.n_heads // encoding.n_kv_heads
    heads = _profile_heads(cov, influence, group, at_max.layers)
    return Utilization(
        length=L_max,
        pairing=layout.pairing,
        n_pairs=layout.n_pairs,
        qk_pairs_per_window=config.qk_pairs,
        mean_abs=nested(u.tolist()),  # (L, H, F) in logit units
        cov=nested(cov.tolist()),  # (L, H)
        max_cov=math.sqrt(layout.n_pairs - 1),
        weighted_frequency=nested(weighted_mean(log_theta.exp(), u).tolist()),  # (L, H)
        weighted_log_frequency=nested(weighted_log.tolist()),  # (L, H)
        mean_log_frequency=nested(mean_log.tolist()),  # (L, H)
        # Paper, Figure 8 right: learned mean ln theta vs utilization-weighted mean ln theta.
        log_frequency_correlation=_pearson(mean_log, weighted_log),
        distance_profile=DistanceProfile(
            distances=tuple(at_max.distances.tolist()),
            heads=tuple(
                ProfileHead(
                    layer, head, why, nested(profile[at_max.layers.index(layer), head].tolist())
                )  # contribution (F, R)
                for layer, head, why in heads
            ),
        ),
    )


def _schedule(
    encoding: PositionEncoding, layers: tuple[AnalysedLayer, ...], config: AnalysisConfig
) -> Schedule | None:
    """Section 3: effective base per analysed layer and kv head; what AdaRoPE / tuned-yarn
    learned (its parameters as they are, every row)."""
    bases = effective_bases(encoding, config.max_length, [layer.index for layer in layers])
    if bases is None:
        return None
    layout = rotary_layout(encoding)
    state = learned_schedule(encoding)
    learned = None if state is None else Learned.of(state)
    initial = None
    if learned is not None and layout is not None and layout.n_pairs >= 2:
        xi_init = torch.tensor(learned.xi_init, dtype=torch.float64)
        initial = float(fit_effective_base(xi_init, layout.rotary_dim)[0])
    fit = EffectiveBase(**{k: nested(v) for k, v in bases.items()})
    return Schedule(effective_base=fit, initial_base=initial, learned=learned)


def _influence(
    model: Backbone | nn.Module,
    encoding: PositionEncoding,
    layers: tuple[AnalysedLayer, ...],
    windows: Tensor,
    config: AnalysisConfig,
    progress: bool,
) -> Influence:
    """Section 4 (AdaRoPE): delta NLL at the target length per head of the analysed layers
    (and per shared row) whose AdaFreq or AdaScale parameters are reverted to init."""
    T = config.influence_length
    n = config.influence_windows or config.n_windows
    sample = windows[:n, :T]
    batch = max(1, config.batch_tokens // T)
    baseline = mean_nll(model, sample, batch)
    kinds: dict[str, InfluenceKind | None] = {}
    for kind in INFLUENCE_KINDS:
        if not influence_units(encoding, kind):
            kinds[kind] = None
            continue
        rows = head_influence(
            model, encoding, sample, kind, batch_size=batch, baseline=baseline,
            progress=progress, layers={layer.index for layer in layers},
        )["units"]  # fmt: skip
        units = tuple(InfluenceUnit(**row) for row in rows)
        top = sorted(units, key=lambda u: u.delta_nll, reverse=True)[: config.top_k]
        kinds[kind] = InfluenceKind(units=units, top=tuple(top))
    return Influence(target_length=T, windows=n, baseline_nll=baseline, **kinds)


def analyze_windows(
    model: Backbone | nn.Module,
    encoding: PositionEncoding,
    windows: Tensor,
    config: AnalysisConfig,
    progress: bool = False,
) -> Sections:
    """The numbers of the analysis (module docstring) on windows (N, W); writes nothing."""
    layers = tuple(
        AnalysedLayer(index, kind) for index, kind in as_backbone(model).encoded_layers().items()
    )
    skipped: dict[str, str] = {}
    effective, at_max, method = _effective_lengths(
        model, encoding, layers, windows, config, progress
    )
    influence = None
    if not config.influence:
        skipped["influence"] = "influence=False"
    elif not any(influence_units(encoding, kind) for kind in INFLUENCE_KINDS):
        skipped["influence"] = f"encoding {encoding.spec!r} has no per-head learned parameters"
    else:  # before utilization: its distance profile shows the most influential head
        influence = _influence(model, encoding, layers, windows, config, progress)
    utilization = None
    if rotary_layout(encoding) is None:
        skipped["utilization"] = f"encoding {encoding.spec!r} has no rotary pairs"
    else:
        utilization = _utilization(encoding, at_max, config, influence)
    schedule = _schedule(encoding, layers, config)
    if schedule is None:
        skipped["schedule"] = f"encoding {encoding.spec!r} has no rotary frequencies"
    return Sections(
        spec=encoding.spec,
        layers=layers,
        effective_length=effective,
        utilization=utilization,
        schedule=schedule,
        influence=influence,
        capture=method,
        skipped=dict(sorted(skipped.items(), key=lambda item: _SECTION_ORDER.index(item[0]))),
    )


# The order of the sections in a result (and of the reasons they were skipped).
_SECTION_ORDER = ("utilization", "schedule", "influence")


@dataclasses.dataclass(frozen=True)
class AnalysisRun:
    """What ``analyze`` returns: the result and where it is (or was found)."""

    result: AnalysisResult
    json: Path  # analysis.json
    figures: dict[str, Path]  # figure name -> its PNG
    reused: bool  # found there, of this model, data and config: nothing was measured

    def lines(self) -> list[str]:
        """``summary_lines`` and where the files are, for the CLI."""
        wrote = "found" if self.reused else "wrote"
        return [
            *summary_lines(self.result),
            f"{wrote} {self.json} and {len(self.figures)} figures in {self.json.parent}",
        ]


def analyze(
    model: Backbone | nn.Module,
    config: AnalysisConfig,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    data: Any = "shakespeare",
    command: str = "",
    progress: bool = True,
    overwrite: bool = False,
) -> AnalysisRun:
    """Analyse the heads of ``model`` as ``config`` says and write ``analysis.json`` and PNGs
    into ``out_dir``.

    ``model`` is a Backbone, a ropekit Decoder or a Hugging Face causal LM (patched by
    ``ropekit.hf.patch`` or ``load_adapter``; an unpatched one is analysed with its own RoPE,
    patched for the duration). ``tokenizer`` turns ``data`` into held-out tokens (None: the
    model's own; bytes for Decoders); ``data`` is a corpus name, files, a TokenStream or id
    tensor (``held_out_windows``). The result's provenance is the model, the windows (a digest
    of their tokens) and the config: an ``analysis.json`` of exactly that provenance is returned
    as it is; one of another is refused, naming the field, unless ``overwrite``.
    """
    out = Path(out_dir)
    json_path = out / JSON_NAME
    backbone = as_backbone(model, tokenizer)
    module = backbone.model
    was_training = module.training
    module.eval()  # no dropout
    try:
        with backbone.own_encoding() as (encoding, patched_here), torch.no_grad():
            windows, data_info = held_out_windows(backbone, None, data, config)
            data_info["tokens"] = hashlib.sha256(windows.numpy().tobytes()).hexdigest()
            provenance = {
                "model": backbone.identity(), "data": data_info, "config": _config_json(config),
            }  # fmt: skip
            if check_replaceable(json_path, "analysis", provenance, overwrite=overwrite):
                return _reused(json_path, out)
            sections = analyze_windows(backbone, encoding, windows, config, progress)
    finally:
        module.train(was_training)
    shape = ModelShape(
        class_name=type(module).__name__,
        n_layers=encoding.n_layers,
        n_heads=encoding.n_heads,
        n_kv_heads=encoding.n_kv_heads,
        head_dim=encoding.head_dim,
        patched_for_analysis=patched_here,
    )
    meta = run_metadata(command, spec=encoding.spec, seed=config.seed)
    fields = {f.name: getattr(sections, f.name) for f in dataclasses.fields(Sections)}
    result = AnalysisResult(
        meta=meta,
        provenance=provenance,
        **fields,
        seed=config.seed,
        model=shape,
        data=_windows(data_info),
        config=_config_json(config),
        figures=planned_figures(sections),
    )
    write_result(json_path, "analysis", result, indent=1)
    figures = write_figures(result, out)
    return AnalysisRun(result, json_path, figures, reused=False)


def _windows(info: dict[str, Any]) -> Windows:
    """``held_out_windows``' description (with the tokens' digest) as its record. The
    description stays as it is in the provenance (an older file's provenance must still
    match), so the fields it leaves out (no tokenizer for given ids, no split but for a data
    spec) are filled in here."""
    fields = {"tokenizer": None, "split": None, **info}
    fields["source"] = nested(fields["source"])
    fields["starts"] = nested(fields["starts"])
    return Windows(**fields)


def _config_json(config: AnalysisConfig) -> dict[str, Any]:
    """The config as JSON (JSON has no infinity: an order E_inf is the string "inf")."""
    out = dataclasses.asdict(config)
    out["betas"] = [_beta_json(b) for b in config.betas]
    return out


def _reused(json_path: Path, out: Path) -> AnalysisRun:
    """A finished analysis of this very model, data and config, read back."""
    result = read_record(json_path, AnalysisResult)
    figures = {name: out / file for name, file in result.figures.items()}
    return AnalysisRun(result, json_path, figures, reused=True)


def _stats(values: np.ndarray) -> tuple[float, float, float]:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return math.nan, math.nan, math.nan
    return float(np.median(values)), float(values.min()), float(values.max())


def summary_lines(result: AnalysisResult) -> list[str]:
    """A short human summary of an analysis, one line per finding, for the CLI and the
    report."""
    m, data = result.model, result.data
    lines = [
        f"{m.class_name} with {result.spec}: {m.n_layers} layers x {m.n_heads} heads "
        f"({m.n_kv_heads} kv); {data.n_windows} held-out windows of {data.window_length} "
        f"tokens; capture via {result.capture}",
        f"analysed layers ({len(result.layers)} of {m.n_layers}, those the encoding rotates): "
        + ", ".join(layer.label for layer in result.layers),
    ]
    el = result.effective_length
    b, lengths = el.primary_beta_index, el.lengths
    beta = beta_label(el.betas[b])
    e = np.array(el.window_mean, dtype=float)[b]  # (n_L, L, H)
    med, lo, hi = _stats(e[-1].ravel())
    lines.append(
        f"effective length E_{beta} at {lengths[-1]} tokens (mean over queries): median "
        f"{med:.1f}, min {lo:.1f}, max {hi:.1f} keys over {e.shape[1] * e.shape[2]} heads"
    )
    if len(lengths) > 1:
        med, lo, hi = _stats((e[-1] / e[0]).ravel())
        lines.append(
            f"  growth {lengths[0]} -> {lengths[-1]} tokens (x{lengths[-1] / lengths[0]:g}): "
            f"median x{med:.2f}, min x{lo:.2f}, max x{hi:.2f}"
        )
    util = result.utilization
    if util is not None:
        med, lo, hi = _stats(np.array(util.cov, dtype=float).ravel())
        lines.append(
            f"frequency utilization CoV across {util.n_pairs} pairs: median {med:.2f}, "
            f"min {lo:.2f}, max {hi:.2f} (one pair only: {util.max_cov:.2f})"
        )
    if result.schedule is not None:
        lines += _schedule_lines(result.schedule, result.layers)
    influence = result.influence
    names = {"freq": "AdaFreq", "scale": "AdaScale"}
    for kind, section in (influence.kinds() if influence is not None else {}).items():
        top = ", ".join(f"{u.label} {u.delta_nll:+.4f}" for u in section.top[:3])
        lines.append(
            f"{names[kind]} influence at {influence.target_length} tokens (baseline NLL "
            f"{influence.baseline_nll:.4f} nats): top {top}"
        )
    lines += [f"skipped {what}: {why}" for what, why in result.skipped.items()]
    return lines


def _schedule_lines(schedule: Schedule, layers: tuple[AnalysedLayer, ...]) -> list[str]:
    per_layer = schedule.effective_base.per_layer
    initial = schedule.initial_base
    lines = [
        "effective base per layer: "
        + ", ".join(f"L{layer.index} {v:.3g}" for layer, v in zip(layers, per_layer, strict=True))
        + (f" (initial {initial:.3g})" if initial else "")
    ]
    learned = schedule.learned
    if learned is None:
        return lines
    if learned.dxi is not None:
        dxi = np.abs(np.array(learned.dxi, dtype=float))
        lines.append(
            f"learned - initial ln theta: mean |dxi| {dxi.mean():.3g}, max {dxi.max():.3g}"
        )
    if learned.gamma is not None and learned.tau is not None:
        gamma = np.array(learned.gamma, dtype=float).ravel()
        tau = np.array(learned.tau, dtype=float).ravel()
        lines.append(
            f"AdaScale gamma: mean {gamma.mean():.3f} (range {gamma.min():.3f} to "
            f"{gamma.max():.3f}); tau: median {np.median(tau):.3f} (range {tau.min():.3f} "
            f"to {tau.max():.3f})"
        )
    if learned.knobs:
        knobs = ", ".join(f"{k} {v:.4g}" for k, v in learned.knobs.items())
        lines.append(f"tuned-yarn knobs: {knobs}")
    return lines
