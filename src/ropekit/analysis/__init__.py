"""ropekit.analysis: look inside a model's attention heads (AdaRoPE paper, Figures 1-4, 6-12).

Modules:

- ``metrics``: the pure math: effective length E_beta, causal attention in query chunks,
  per-pair logit contributions, CoV, weighted means, the effective-base fit.
- ``capture``: the model's ropekit encoding, and per-layer capture of rotated q and k for
  ropekit Decoders (``probe`` hooks) and patched Hugging Face models (wrapped ``rotate_q`` /
  ``rotate_k``).
- ``heads``: ``HeadStatistics``, the running per-layer reductions (effective length per query
  position, frequency utilization, contribution by distance).
- ``schedules``: frequencies per layer and kv head, effective base, learned minus initial.
- ``influence``: revert one head's AdaFreq or AdaScale parameters and measure delta NLL.
- ``plots``: the PNGs.
- ``record``: ``AnalysisResult``, analysis.json as a typed record (its sections as dataclasses).
- ``run``: ``analyze`` (the library function behind ``ropekit analyze``) and ``summary_lines``.

Typical use:

    run = analyze(model, AnalysisConfig((64, 128, 256)), "runs/analysis")
    print("\\n".join(summary_lines(run.result)))
"""

from .capture import capture_qk, model_encoding, own_encoding
from .heads import HeadStatistics
from .influence import Unit, head_influence, influence_units, mean_nll, reverted
from .metrics import (
    coefficient_of_variation,
    effective_length,
    fit_effective_base,
    iter_log_attention,
    log_effective_length,
    pair_contributions,
    weighted_mean,
)
from .record import AnalysisResult, Sections
from .run import (
    AnalysisConfig,
    AnalysisRun,
    analyze,
    analyze_windows,
    held_out_windows,
    summary_lines,
)
from .schedules import effective_bases, head_log_frequencies, learned_schedule, rotary_layout

__all__ = [
    "AnalysisConfig",
    "AnalysisResult",
    "AnalysisRun",
    "HeadStatistics",
    "Sections",
    "Unit",
    "analyze",
    "analyze_windows",
    "capture_qk",
    "coefficient_of_variation",
    "effective_bases",
    "effective_length",
    "fit_effective_base",
    "head_influence",
    "head_log_frequencies",
    "held_out_windows",
    "influence_units",
    "iter_log_attention",
    "learned_schedule",
    "log_effective_length",
    "mean_nll",
    "model_encoding",
    "own_encoding",
    "pair_contributions",
    "reverted",
    "rotary_layout",
    "summary_lines",
    "weighted_mean",
]
