"""ropekit.evals: what a model can read. Perplexity vs length, needle/passkey, RULER-style tasks.

Modules:
- `adapters`: `LanguageModel` (token_nll, greedy) over any Backbone (Decoders, Hugging Face LMs).
- `prompts`: `PromptFormat`, plain or chat-template prompts, token positions of characters.
- `haystack`: haystacks (noise, essays, any corpus), needle insertion, keys and values.
- `tasks`: base tasks, the registry of named variants (`TASKS`), `generate_sample`.
- `scoring`: RULER's string_match_all / string_match_part, `effective_length`.
- `perplexity`: `evaluate_perplexity`, `run_perplexity` (`ropekit eval ppl`) and what they
  return (`PerplexityResult`, ppl.json's record; `PerplexityRun`),
  `check_single_documents` / `DocumentsTooShort` (do single-document spans fit?).
- `runner`: `run_needle`, `run_passkey`, `run_ruler`, `run_tasks`: staged, resumable; each
  returns a `TasksResult` (summary.json's record).
- `probes`: `run_probes` (`ropekit eval probes`): retrieval accuracy against needle
  distance and the reach, many probes per long prefill: needles near the start of each
  haystack (`probe_haystacks`: `ProbeConfig`), each asked from its own cut point of the
  cached prefill; the summary (`probe_summary`: `ProbesResult`).
- `intervals`: `wilson_interval`, `accuracy_entry` (Wilson score intervals of accuracies),
  `difference_interval` (Newcombe's interval for the difference of two),
  `paired_difference_interval` (the same for two runs asked the same probes;
  `probe_summary.paired_probes` counts their 2x2 table).
- `plots`: pictures (files go through `ropekit.results`).
"""

from ropekit.evals.adapters import (
    BackboneLM,
    LanguageModel,
    as_language_model,
    newline_ids,
)
from ropekit.evals.intervals import (
    accuracy_entry,
    difference_interval,
    paired_difference_interval,
    wilson_interval,
)
from ropekit.evals.perplexity import (
    DocumentsTooShort,
    PerplexityConfig,
    PerplexityResult,
    PerplexityRun,
    check_single_documents,
    evaluate_perplexity,
    run_perplexity,
)
from ropekit.evals.probe_haystacks import ProbeConfig
from ropekit.evals.probe_summary import PairedProbes, ProbesResult, paired_probes
from ropekit.evals.probes import run_probes
from ropekit.evals.prompts import PromptFormat
from ropekit.evals.runner import (
    EvalConfig,
    TasksResult,
    run_needle,
    run_passkey,
    run_ruler,
    run_tasks,
)
from ropekit.evals.scoring import (
    effective_length,
    match_all,
    match_part,
    string_match_all,
    string_match_part,
)
from ropekit.evals.tasks import (
    ALIASES,
    RULER_TASKS,
    TASKS,
    Sample,
    TaskDoesNotFit,
    TaskSpec,
    generate_sample,
    get_task,
    register_task,
)

__all__ = [
    "ALIASES",
    "RULER_TASKS",
    "TASKS",
    "BackboneLM",
    "DocumentsTooShort",
    "EvalConfig",
    "LanguageModel",
    "PairedProbes",
    "PerplexityConfig",
    "PerplexityResult",
    "PerplexityRun",
    "ProbeConfig",
    "ProbesResult",
    "PromptFormat",
    "Sample",
    "TaskDoesNotFit",
    "TaskSpec",
    "TasksResult",
    "accuracy_entry",
    "as_language_model",
    "check_single_documents",
    "difference_interval",
    "effective_length",
    "evaluate_perplexity",
    "generate_sample",
    "get_task",
    "match_all",
    "match_part",
    "newline_ids",
    "paired_difference_interval",
    "paired_probes",
    "register_task",
    "run_needle",
    "run_passkey",
    "run_perplexity",
    "run_probes",
    "run_ruler",
    "run_tasks",
    "string_match_all",
    "string_match_part",
    "wilson_interval",
]
