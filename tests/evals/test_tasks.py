"""Task generators: every sample fits its length with the model's own tokenizer (and fills it),
needles sit at the requested depth and token position, answers appear where and as often as
they should, and everything follows the seed."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ropekit.evals import (
    ALIASES,
    TASKS,
    PromptFormat,
    TaskDoesNotFit,
    TaskSpec,
    generate_sample,
    get_task,
    register_task,
)
from ropekit.evals.haystack import NOISE
from ropekit.evals.tasks import _largest_fitting, zipf_counts

# Lengths at which every task fits; the full-size cwe needs more.
LENGTH = {"bytes": 1200, "test-bpe": 700}
CWE_LENGTH = {"bytes": 4500, "test-bpe": 3200}
# The largest haystack unit (a distractor needle line, a UUID needle's neighbour words) is
# well under this many tokens, so a fitted sample leaves less than this unused.
SLACK = 64
# Depth tolerance: snapping to a sentence end moves a needle by at most 2.5% of the context,
# plus the granularity of one sentence of noise.
DEPTH_TOLERANCE = 0.05


def _tokenizer(name, byte_tok, bpe_tok):
    return byte_tok if name == "bytes" else bpe_tok


def _length(task, tokenizer):
    return (CWE_LENGTH if task == "cwe" else LENGTH)[tokenizer.name]


def _sample(task, fmt, length, index=0, seed=0, depth=0.3):
    return generate_sample(task, fmt, length, index, seed, depth if TASKS[task].needle else None)


@pytest.mark.parametrize("tok_name", ["bytes", "test-bpe"])
@pytest.mark.parametrize("task", list(TASKS))
def test_every_sample_fits_its_length_and_fills_it(task, tok_name, byte_tok, bpe_tok):
    tokenizer = _tokenizer(tok_name, byte_tok, bpe_tok)
    fmt = PromptFormat(tokenizer)
    length = _length(task, tokenizer)
    for index in range(2):
        sample = _sample(task, fmt, length, index)
        ids = fmt.encode(sample.input)
        assert len(ids) == sample.n_tokens
        assert sample.n_tokens + sample.max_new_tokens <= length
        assert sample.n_tokens + sample.max_new_tokens > length - SLACK
        # The answer budget holds the ideal answer.
        answer = " " + ", ".join(sample.outputs)
        assert sample.max_new_tokens >= len(tokenizer.encode(answer)) - len(sample.outputs)
        assert sample.input.endswith(get_answer_prefix(sample.input))


def get_answer_prefix(text: str) -> str:
    return text.rsplit("? ", 1)[1]


@pytest.mark.parametrize("tok_name", ["bytes", "test-bpe"])
@pytest.mark.parametrize("task", [t for t, spec in TASKS.items() if spec.needle])
def test_needle_sits_at_its_depth_and_token_position(task, tok_name, byte_tok, bpe_tok):
    tokenizer = _tokenizer(tok_name, byte_tok, bpe_tok)
    fmt = PromptFormat(tokenizer)
    positions = []
    for depth in (0.0, 0.2, 0.5, 0.8, 1.0):
        sample = _sample(task, fmt, LENGTH[tok_name], depth=depth)
        assert sample.depth == depth
        # A needle goes between two haystack units: depth is quantised to one unit (a whole
        # distractor line in the needle haystacks, a word elsewhere).
        assert abs(sample.needle_depth - depth) <= DEPTH_TOLERANCE + 1 / sample.units
        ids = fmt.encode(sample.input)
        text = tokenizer.decode(ids[sample.needle_position :]).lstrip()
        needle = (
            f"The pass key is {sample.outputs[0]}." if "passkey" in task else "The value of key"
        )
        assert text.startswith(needle)
        positions.append(sample.needle_position)
    assert positions == sorted(positions)  # deeper needles come later


@pytest.mark.parametrize(
    "task", [t for t, spec in TASKS.items() if spec.base in ("passkey", "niah")]
)
def test_each_value_appears_once_in_its_needle_and_queried_keys_in_the_question(task, byte_tok):
    fmt = PromptFormat(byte_tok)
    sample = _sample(task, fmt, 1500)
    body, question = sample.input.rsplit("\n", 1)
    for value in sample.outputs:
        assert body.count(value) == 1
        assert value not in question
    if task.startswith("niah"):
        needles = re.findall(r"^The value of key (\S+) is (\S+)\.$", body, flags=re.M)
        keys = [k for k, _ in needles]
        values = [v for _, v in needles]
        spec = get_task(task)
        n_needles = spec.args.get("n_keys", 1) * spec.args.get("n_values", 1)
        if spec.args.get("haystack") != "needles":
            assert len(needles) == n_needles
        assert len(set(values)) == len(values)  # every needle (and distractor) is distinct
        assert set(sample.outputs) <= set(values)
        asked = {k for k, v in needles if v in sample.outputs}
        assert all(question.count(k) == 2 for k in asked)  # question and answer prefix
        assert len(set(keys)) == len(keys) or spec.args.get("n_values", 1) > 1


def test_variable_tracking_chain_is_complete_and_in_order(byte_tok):
    sample = _sample("vt", PromptFormat(byte_tok), 1500)
    statements = re.findall(r"^VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.$", sample.input, flags=re.M)
    assert len(statements) == 5
    value = statements[0][1]
    assert [name for name, _ in statements] == list(sample.outputs)
    for (previous, _), (_, source) in itertools.pairwise(statements):
        assert source == f"VAR {previous}"
    assert sample.input.endswith(f"The variables assigned the value {value} are")


@pytest.mark.parametrize("task", ["cwe", "cwe_small"])
def test_common_words_appear_exactly_as_often_as_stated(task, byte_tok):
    spec = get_task(task)
    sample = _sample(task, PromptFormat(byte_tok), CWE_LENGTH["bytes"])
    entries = re.findall(r"(\d+)\. ([a-z]+)", sample.input.split("\n")[1])
    assert [int(n) for n, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries)
    assert {w: counts[w] for w in sample.outputs} == dict.fromkeys(
        sample.outputs, spec.args["freq_common"]
    )
    others = {c for w, c in counts.items() if w not in sample.outputs}
    assert others == {spec.args["freq_uncommon"]}


def test_frequent_words_answer_is_the_true_top_three(byte_tok):
    sample = _sample("fwe", PromptFormat(byte_tok), 1500)
    counts = Counter(sample.input.split("\n")[1].split())
    top = [w for w, _ in counts.most_common(4)]
    assert tuple(top[:3]) == sample.outputs
    assert counts[top[0]] > counts[top[1]] > counts[top[2]] > counts[top[3]]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(4, 5000), alpha=st.floats(1.2, 3.0), n_top=st.integers(1, 5))
def test_zipf_counts_sum_to_the_text_and_rank_the_top_strictly(n, alpha, n_top):
    counts = zipf_counts(n, alpha, n_top)
    if counts is None:
        return
    assert sum(counts) == n
    top, rest = counts[:n_top], counts[n_top:]
    assert all(a > b for a, b in itertools.pairwise(top))
    assert not rest or top[-1] > max(rest)


class _Counted:
    """A prompt's token count after n units of text: ``costs[i]`` tokens for unit i (one
    token a unit past them), over a fixed preamble; remembers how often it was asked."""

    def __init__(self, preamble: int, costs: list[int]):
        self.totals = list(itertools.accumulate(costs, initial=preamble))
        self.calls = 0

    def __call__(self, n: int) -> int:
        self.calls += 1
        last = len(self.totals) - 1
        return self.totals[min(n, last)] + max(0, n - last)


@settings(max_examples=300, deadline=None)
@given(
    preamble=st.integers(0, 50),
    costs=st.lists(st.integers(0, 9), max_size=300),
    lo=st.integers(0, 40),
    room=st.integers(0, 600),
)
def test_the_fitter_finds_the_largest_fitting_size_as_a_scan_does(preamble, costs, lo, room):
    count = _Counted(preamble, costs)
    budget = count(lo) + room
    cap = lo + 64 * (budget + 1)
    scan = min(cap, next(n for n in itertools.count(lo) if count(n) > budget) - 1)
    assert _largest_fitting(count, lo, budget) == scan


def test_the_fitter_stops_at_its_cap_when_units_cost_nothing():
    # No unit of text costs less than 1/64 of a token: past 64 units a token, it stops.
    assert _largest_fitting(lambda n: 5, 3, 10) == 3 + 64 * 11


def test_the_fitter_counts_a_32k_prompt_a_handful_of_times():
    # Essay-like: about 1.3 tokens a word, each word 1-2 tokens (seeded), the budget of a
    # 32k probe: gallop-and-bisect counted 17 times here, each a tokenization of the prompt.
    rng = np.random.default_rng(0)
    count = _Counted(60, [int(c) for c in rng.choice([1, 2], 30_000, p=[0.7, 0.3])])
    n = _largest_fitting(count, 0, 32_700)
    assert count(n) <= 32_700 < count(n + 1)
    assert count.calls - 2 <= 7  # the two counts above are the assertion's


def test_samples_follow_the_seed_and_keep_their_needle_across_lengths(byte_tok):
    fmt = PromptFormat(byte_tok)
    a = generate_sample("niah_single_2", fmt, 800, 3, seed=7, depth=0.5)
    assert generate_sample("niah_single_2", fmt, 800, 3, seed=7, depth=0.5) == a
    assert generate_sample("niah_single_2", fmt, 800, 3, seed=8, depth=0.5).outputs != a.outputs
    assert generate_sample("niah_single_2", fmt, 800, 4, seed=7, depth=0.5).outputs != a.outputs
    # One draw, one needle: at any length and depth (heatmap cells differ only in placement).
    b = generate_sample("niah_single_2", fmt, 1600, 9, seed=7, depth=0.1, draw=3)
    assert b.outputs == a.outputs and b.index == 9 and b.n_tokens > a.n_tokens


def test_chat_prompts_fit_and_open_the_answer_in_the_assistant_turn(bpe_tok, byte_tok):
    fmt = PromptFormat(bpe_tok, chat=True)
    assert fmt.prefix == ()  # the template writes its own BOS
    sample = generate_sample("passkey", fmt, 400, 0, 0, depth=0.5)
    assert sample.input.startswith("<s><|user|>\n")
    assert sample.input.endswith("What is the pass key?\n<|assistant|>\nThe pass key is")
    assert len(fmt.encode(sample.input)) == sample.n_tokens <= 400 - sample.max_new_tokens
    assert abs(sample.needle_depth - 0.5) <= DEPTH_TOLERANCE
    assert PromptFormat(bpe_tok).prefix == (bpe_tok.encode("<s>")[0],)  # plain: BOS added
    with pytest.raises(ValueError, match="chat=True"):
        PromptFormat(byte_tok, chat=True)


def test_passkey_uses_the_retrieval_mixture_format(byte_tok):
    sample = generate_sample("passkey", PromptFormat(byte_tok), 300, 0, 0, depth=0.5)
    key = sample.outputs[0]
    assert re.fullmatch(r"[1-9]\d{4}", key)
    assert f"\nThe pass key is {key}. Remember it.\n" in sample.input
    assert sample.input.endswith("\nWhat is the pass key? The pass key is")
    haystack = sample.input.replace(f"\nThe pass key is {key}. Remember it.\n", " ")
    assert set(haystack.rsplit("\n", 1)[0].split()) <= set(NOISE.split())


def test_registry_errors_name_what_is_allowed(byte_tok):
    fmt = PromptFormat(byte_tok)
    with pytest.raises(ValueError, match=r"allowed: .*niah_single_1"):
        get_task("niah_sngle")
    assert get_task("variable_tracking") is TASKS[ALIASES["variable_tracking"]]
    with pytest.raises(ValueError, match=r"allowed arguments of niah: .*n_keys"):
        TaskSpec("bad", "niah", {"n_key": 2})
    with pytest.raises(ValueError, match="base="):
        TaskSpec("bad", "haystack_soup")
    with pytest.raises(ValueError, match="already registered"):
        register_task(TASKS["passkey"])
    with pytest.raises(ValueError, match="value_type="):
        generate_sample(TaskSpec("x", "niah", {"value_type": "emoji"}), fmt, 500, 0, 0)
    with pytest.raises(TaskDoesNotFit, match="length >= "):
        generate_sample("cwe", fmt, 1000, 0, 0)
    with pytest.raises(ValueError, match="depth="):
        generate_sample("passkey", fmt, 500, 0, 0, depth=1.5)
    custom = TaskSpec("passkey_7", "passkey", {"digits": 7}, needle=True)
    assert len(generate_sample(custom, fmt, 400, 0, 0, depth=0.5).outputs[0]) == 7
