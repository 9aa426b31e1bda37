"""The evaluation tells a model that retrieves from one that cannot.

The retriever is `SuffixCopyLM`, a hand-built induction head (a real nn.Module run through the
real adapter, generator, runner and scorer). The failing model is the same mechanism with its
attention limited to the last 32 tokens, the way a model fails whose attention does not reach
the needle. Once a small trained ropekit model retrieves, it can take the retriever's place.
"""

from __future__ import annotations

import pytest

from ropekit.evals import evaluate_tasks
from ropekit.evals.runner import EvalConfig

LENGTHS = (256, 512)
CONFIG = EvalConfig(lengths=LENGTHS, samples=1, depths=(0.0, 0.5, 1.0), batch_size=3)
# Retrieval formats the copy mechanism can answer: the answer prefix repeats the needle's
# opening words, with distractor needles in the multikey variant.
TASKS = ["passkey", "niah_single_1", "niah_multikey_2"]


@pytest.fixture(scope="module")
def results(copy_lm, short_sighted_lm, tmp_path_factory):
    out = tmp_path_factory.mktemp("discriminating")
    return {
        name: evaluate_tasks(lm, TASKS, CONFIG, out / name, progress=False)
        for name, lm in (("retriever", copy_lm), ("short_sighted", short_sighted_lm))
    }


@pytest.mark.parametrize("task", TASKS)
def test_a_model_that_retrieves_scores_high_at_every_length_and_depth(results, task):
    entry = results["retriever"]["tasks"][task]
    assert all(cell["score"] >= 0.99 for cell in entry["cells"])
    assert entry["effective_length"] == max(LENGTHS)


@pytest.mark.parametrize("task", TASKS)
def test_a_model_whose_attention_does_not_reach_scores_near_zero(results, task):
    entry = results["short_sighted"]["tasks"][task]
    assert all(s["score"] <= 0.1 for s in entry["scores"])
    assert entry["effective_length"] is None
    assert results["short_sighted"]["effective_length"]["average"] is None
