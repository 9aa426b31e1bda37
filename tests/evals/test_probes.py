"""Many probes per long forward: the answers from one cached prefix are the answers of one full
prompt per probe, the prefix is read once per haystack, the run resumes and checks its
settings, the summary's intervals are Wilson's, and bad settings are refused in one line.

Models: `SuffixCopyLM` (exact induction: it really retrieves) and its short-sighted twin; a
1-layer ropekit Decoder (static and dynamic schedules) and a tiny Llama (unpatched and
patched, static and dynamic) with sharp random attention, so their answers depend on the
context, in float64, so near-ties do not hang on float noise; and, marked slow, the decoder
really trained to retrieve (conftest).
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from ropekit.evals import as_language_model
from ropekit.evals.adapters import newline_ids, shared_chunks
from ropekit.evals.intervals import wilson_interval
from ropekit.evals.probe_haystacks import ProbeConfig, build_haystack, probe_task
from ropekit.evals.probe_summary import (
    VERSION,
    ProbesResult,
    distractor_answers,
    exact_match,
    summarize_records,
)
from ropekit.evals.probes import answer_haystacks, answer_probes, answer_separately, run_probes
from ropekit.evals.prompts import PromptFormat
from ropekit.evals.tasks import TaskDoesNotFit
from ropekit.hf import patch
from ropekit.results import ProvenanceMismatch, ResultError, encode, read_record, read_records

from ..model.tiny import tiny_model as sharp_decoder
from ..tiny import tiny_model as sharp_llama
from .models import SuffixCopyLM, tiny_llama

OPTIONS = {"progress": False}
GRAIN = 8  # cut points every 8 tokens: several behind the needles of a few hundred bytes


class RunCounter:
    """Counts, per call of ``Backbone.run``, the tokens fed and the calls that feed more than
    one (prefills): wraps the backbone's method on the instance."""

    def __init__(self, lm):
        self.tokens, self.prefills = 0, 0
        backbone = lm.backbone
        inner = backbone.run

        def run(ids, *args, **kwargs):
            self.tokens += ids.shape[1]
            self.prefills += ids.shape[1] > 1
            return inner(ids, *args, **kwargs)

        backbone.run = run


def _haystack(lm, length=384, needles=4, index=0, task="niah_single_2", chat=False, **options):
    config = ProbeConfig((length,), needles=needles, task=task, chat=chat, grain=GRAIN, **options)
    fmt = PromptFormat(lm.tokenizer, chat=chat)
    return build_haystack(probe_task(task), fmt, config, length, index)


def _same_answers(lm, haystack, stop=()):
    cached = answer_probes(lm, haystack, stop)
    separate = answer_separately(lm, haystack, stop)
    assert cached == separate
    return cached


# ----------------------------------------------------------------------------- haystacks
def test_haystack_shares_one_prefix_and_fits_its_length(byte_tok):
    lm = as_language_model(SuffixCopyLM(), byte_tok)
    hay = _haystack(lm, length=512, needles=5)
    text = byte_tok.decode(list(hay.prefix))
    assert len({p.key for p in hay.probes}) == len({p.value for p in hay.probes}) == 5
    longest = max(len(hay.prefix) + len(p.question) + p.max_new_tokens for p in hay.probes)
    assert 512 - 8 < longest <= 512  # filled to the length, answer budget included
    for p in hay.probes:
        needle = f"The value of key {p.key} is {p.value}."
        assert text.count(needle) == 1
        assert byte_tok.decode(list(hay.prefix[p.needle_position :])).startswith(needle)
        question = byte_tok.decode(list(p.question))
        assert question == f"\nWhat is the value of key {p.key}? The value of key {p.key} is"
        assert hay.prompt(p) == [*hay.prefix[: p.cut], *p.question]
    by_depth = sorted(hay.probes, key=lambda p: p.depth)
    assert all(p.needle_depth < 0.1 for p in by_depth)  # near the start


def test_a_haystack_of_distractor_needles(byte_tok):
    lm = as_language_model(SuffixCopyLM(), byte_tok)
    hay = _haystack(lm, length=512, task="niah_multikey_2")
    text = byte_tok.decode(list(hay.prefix))
    assert text.count("The value of key") >= len(hay.probes) + 5  # filler of other needles
    for p in hay.probes:
        assert text.count(f"key {p.key} ") == 1 and text.count(p.value) == 1


# ----------------------------------------------------------------------------- answers
def test_copy_model_answers_every_probe_from_one_prefix_as_from_full_prompts(byte_tok):
    lm = as_language_model(SuffixCopyLM(), byte_tok)
    hay = _haystack(lm, length=512, needles=5)
    stop = newline_ids(byte_tok)
    answers = _same_answers(lm, hay, stop)
    assert [byte_tok.decode(a) for a in answers] == [f" {p.value}." for p in hay.probes]


def test_the_prefix_is_read_once_per_haystack(byte_tok):
    lm = as_language_model(SuffixCopyLM(), byte_tok)
    hay = _haystack(lm, length=512, needles=5)
    counter = RunCounter(lm)
    answer_probes(lm, hay, ())  # stop=(): every probe generates its whole budget
    questions = sum(len(p.question) + p.max_new_tokens - 1 for p in hay.probes)
    longest = max(p.cut for p in hay.probes)  # nothing past the longest cut is read
    assert counter.tokens == longest + questions
    counter.tokens = 0
    answer_separately(lm, hay, ())
    assert counter.tokens == sum(p.cut for p in hay.probes) + questions


class QuestionLogits:
    """Records the logits of every ``Backbone.run`` call that reads past ``prefix`` tokens of
    the cache (the questions and their answers), wrapping the backbone's method."""

    def __init__(self, lm, prefix):
        self.logits = []
        backbone = lm.backbone
        inner = backbone.run

        def run(ids, cache, *args, **kwargs):
            before = backbone.cache_length(cache)
            out = inner(ids, cache, *args, **kwargs)
            if before >= prefix:
                self.logits.append(out.clone())
            return out

        backbone.run = run

    def take(self):
        taken, self.logits = self.logits, []
        return taken


def _haystacks(lm, count=3, length=300, task="niah_single_1"):
    # one needle anywhere in the first half: the haystacks share their filler up to it
    config = ProbeConfig(
        (length,), needles=1, haystacks=count, task=task, grain=32, needles_within=0.5
    )
    fmt = PromptFormat(lm.tokenizer)
    return [build_haystack(probe_task(task), fmt, config, length, h) for h in range(count)]


def test_shared_chunks_are_whole_chunks_of_the_common_start():
    assert shared_chunks([1, 2, 3, 4, 5], [1, 2, 3, 4, 9], 2) == 4
    assert shared_chunks([1, 2, 3, 4, 5], [1, 2, 3, 9, 9], 2) == 2  # chunk [2, 4) differs
    assert shared_chunks([1, 2, 3], [1, 2, 3, 4, 5, 6], 2) == 2  # [2, 4) was read shorter
    assert shared_chunks([1, 2, 3, 4], [1, 2, 3, 4, 5, 6], 2) == 4  # ... or whole: kept
    assert shared_chunks([1, 2, 3, 4], [1, 2, 3, 4], 4) == 4
    assert shared_chunks([], [1, 2], 1) == 0
    assert shared_chunks([7, 2], [1, 2], 1) == 0


@pytest.mark.parametrize(
    ("encoding", "hf"),
    [
        ("rope", False),
        ("dynamic-ntk:factor=2", False),
        ("self-extend:group=2,window=4", False),
        (None, True),
        ("dynamic-ntk:factor=2", True),
        ("rerope:window=8,leaky=4", True),
        ("string:shift=4,window=2", True),
        ("dca", True),
    ],
)
def test_haystacks_read_their_shared_filler_once_bit_for_bit(byte_tok, encoding, hf):
    """Haystacks that differ from their needle on keep the whole chunks they share in the
    cache; every logit of every question and answer is then the fresh prefill's, bit for bit,
    two layers deep and past the original length (dynamic schedules and attention-level
    methods included: each chunk runs where it runs in a fresh prefill)."""
    if hf:
        model = sharp_llama("llama", vocab_size=256).double()  # original length 32
        if encoding is not None:
            patch(model, encoding)
    else:
        model = sharp_decoder(encoding, n_layers=2).double().eval()
    chunk = 32
    lm = as_language_model(model, byte_tok, chunk_size=chunk)
    hays = _haystacks(lm)
    prefix = min(len(h.prefix) for h in hays)
    # The whole chunks before the first token two neighbours differ in: the filler up to
    # the needle.
    common = [
        next(i for i, (x, y) in enumerate(zip(a.prefix, b.prefix, strict=False)) if x != y)
        for a, b in itertools.pairwise(hays)
    ]
    kept = [c // chunk * chunk for c in common]
    assert all(0 < k < prefix for k in kept)
    counter, logits = RunCounter(lm), QuestionLogits(lm, prefix)
    shared = list(answer_haystacks(lm, hays, ()))
    shared_logits, shared_tokens = logits.take(), counter.tokens
    counter.tokens = 0
    alone = [answer_probes(lm, hay, ()) for hay in hays]
    alone_logits = logits.take()
    assert shared == alone
    assert len(shared_logits) == len(alone_logits) > len(hays)
    assert all(torch.equal(a, b) for a, b in zip(shared_logits, alone_logits, strict=True))
    # the shared chunks were read once (and nothing past a haystack's one cut)
    assert shared_tokens == counter.tokens - sum(kept)


@pytest.mark.parametrize(
    "encoding",
    [
        "rope",
        "alibi",
        "dynamic-ntk:factor=2",
        "longrope:factor=4,long_factor=[2]",
        "self-extend:group=2,window=4",
    ],
)
def test_decoder_answers_equal_one_prompt_per_probe(byte_tok, encoding):
    # One layer: with a dynamic schedule, a cached decoder is then exact at any length (the
    # layer's inputs do not depend on the length; ropekit.model.cache), so the probes must
    # match full prompts far past the original length of 8 too. Sharp random attention
    # (init_std 0.25) makes the answers depend on the context.
    model = sharp_decoder(encoding, n_layers=1).double().eval()
    lm = as_language_model(model, byte_tok, chunk_size=100)  # chunks cross the prefix's end
    hay = _haystack(lm, length=300, needles=3)
    answers = _same_answers(lm, hay)  # no stop ids: every answer runs its whole budget
    assert all(len(a) == p.max_new_tokens for a, p in zip(answers, hay.probes, strict=True))
    assert len({tuple(a) for a in answers}) > 1  # the questions differ, so do the answers


@pytest.mark.parametrize("spec", [None, "yarn:factor=2", "adarope:init=yarn,factor=2"])
def test_hugging_face_answers_equal_one_prompt_per_probe(byte_tok, spec):
    model = sharp_llama("llama", vocab_size=256).double()
    if spec is not None:
        patch(model, spec)
    lm = as_language_model(model, byte_tok, chunk_size=128)
    hay = _haystack(lm, length=300, needles=3)
    answers = _same_answers(lm, hay)
    assert len({tuple(a) for a in answers}) > 1


def test_hugging_face_dynamic_schedule_answers_from_the_cropped_cache(byte_tok):
    # Two layers past the original length: cached answers read the haystack as prefilled
    # (module docstring), so the reference is the same prefill followed by each question in a
    # fresh cache, with the prefix and the question in separate forwards.
    model = sharp_llama("llama", vocab_size=256).double()  # original length 32
    patch(model, "dynamic-ntk:factor=2")
    lm = as_language_model(model, byte_tok, chunk_size=GRAIN)  # chunks end at every cut
    hay = _haystack(lm, length=300, needles=3)
    answers = answer_probes(lm, hay, ())
    expected = []
    for p in hay.probes:
        fresh = answer_probes(lm, dataclasses.replace(hay, probes=(p,)), ())
        expected += fresh
    assert answers == expected


def test_chat_prompts_share_the_prefix_and_match_full_prompts(bpe_tok):
    lm = as_language_model(SuffixCopyLM(vocab_size=bpe_tok.vocab_size), bpe_tok)
    hay = _haystack(lm, length=400, needles=3, chat=True)
    assert bpe_tok.decode(list(hay.prefix)).startswith("<s><|user|>\n")
    for p in hay.probes:
        assert bpe_tok.decode(list(p.question)).endswith(
            f"<|assistant|>\nThe value of key {p.key} is"
        )
    answers = _same_answers(lm, hay, newline_ids(bpe_tok))
    for answer, probe in zip(answers, hay.probes, strict=True):
        assert exact_match(bpe_tok.decode(answer).strip(), probe.value)


# ----------------------------------------------------------------------------- the run
CONFIG = ProbeConfig((384, 768), needles=4, haystacks=3, seed=1, grain=GRAIN)


def test_run_writes_records_and_wilson_summaries_and_tells_retrievers_apart(tmp_path, byte_tok):
    results = {}
    for name, model in (("copy", SuffixCopyLM()), ("short", SuffixCopyLM(window=32))):
        results[name] = run_probes(
            model, CONFIG, tmp_path / name, tokenizer=byte_tok, spec="x", **OPTIONS
        )
    copy, short = results["copy"], results["short"]
    assert copy.overall.accuracy == 1.0 and copy.overall.n == 24
    assert short.overall.accuracy == 0.0
    assert copy.probes_per_length == 12 and copy.prefills_per_length == 3
    for entry in copy.by_length:
        assert entry.n == 12 and entry.haystacks == 3
        assert entry.other_needle == entry.nearest_needle == 0  # no wrong answer
        assert (entry.low, entry.high) == wilson_interval(entry.correct, 12)
    assert sum(e.n for e in copy.by_distance) == 24 and copy.reach.distance > 0
    assert short.reach.distance == 0 and all(e.correct == 0 for e in short.by_distance)

    out = tmp_path / "copy"
    saved = json.loads((out / "summary.json").read_text())
    assert saved["kind"] == "probes" and saved["overall"] == encode(copy.overall)
    assert (out / "accuracy_vs_distance.png").is_file()
    for entry in copy.by_length:
        stage = out / str(entry.length)
        records = read_records(stage / "probes.jsonl")
        assert len(records) == 12
        assert {r["stage"] for r in records} == {entry.stage}
        assert all(r["correct"] and r["contains"] for r in records)
        assert all(r["prompt_tokens"] < entry.length for r in records)
        assert all(r["distance"] == r["cut"] - r["needle_position"] > 0 for r in records)
        stage_summary = json.loads((stage / "summary.json").read_text())
        assert stage_summary["kind"] == "probe-stage" and stage_summary["complete"]
        assert stage_summary["provenance"]["probes"]["length"] == entry.length


def test_wrong_answers_naming_another_needle_are_counted_per_haystack_and_length():
    """A model that copies the needle nearest the question fails key binding, not length:
    its wrong answers are counted apart (another needle's value; the nearest one's)."""

    def rec(length, haystack, position, value, pred):
        return {"length": length, "haystack": haystack, "needle_position": position,
                "value": value, "pred": pred, "correct": pred.rstrip(".") == value}  # fmt: skip

    records = [
        rec(100, 0, 10, "111", "333."),  # the nearest needle's value
        rec(100, 0, 50, "222", "111"),  # another needle's, not the nearest
        rec(100, 0, 90, "333", "333"),  # right: never counted
        rec(100, 1, 10, "444", "999"),  # no needle's value
        rec(200, 0, 10, "555", "222"),  # 222 is a needle of another length: not counted
        rec(200, 0, 90, "666", "555"),
    ]
    assert distractor_answers(records[:4]) == {"other_needle": 2, "nearest_needle": 1}
    assert distractor_answers(records) == {"other_needle": 3, "nearest_needle": 1}
    summary = summarize_records([{**r, "distance": 1} for r in records], [0, 1000], 0.5)
    assert [(e["other_needle"], e["nearest_needle"]) for e in summary["by_length"]] == [
        (2, 1),
        (1, 0),
    ]


def test_each_length_has_its_accuracy_by_the_substring_rule_beside_exact_match():
    """RULER's rule counts "7432144.0000" for 7432144; exact match does not. The two are
    summed apart per length, and a record without the substring verdict leaves it unknown."""

    def rec(length, haystack, value, pred):
        return {"length": length, "haystack": haystack, "needle_position": haystack,
                "value": value, "pred": pred, "depth": 0.0, "needle_depth": 0.0,
                "correct": exact_match(pred, value), "contains": value in pred}  # fmt: skip

    records = [
        rec(100, 0, "7432144", "7432144.0000"),  # right by the substring rule only
        rec(100, 1, "1111", "1111."),  # right by both
        rec(100, 2, "2222", "2223"),  # wrong by both
        rec(200, 0, "3333", "the value is 3333"),  # right by the substring rule only
    ]
    records = [{**r, "distance": 1} for r in records]
    by_length = summarize_records(records, [0, 1000], 0.5)["by_length"]
    assert [(e["correct"], e["substring"]["correct"]) for e in by_length] == [(1, 2), (0, 1)]
    assert (by_length[0]["substring"]["low"], by_length[0]["substring"]["high"]) == (
        wilson_interval(2, 3)
    )
    unknown = summarize_records(
        [{k: v for k, v in r.items() if k != "contains"} for r in records], [0, 1000], 0.5
    )
    assert all(e["substring"] is None for e in unknown["by_length"])


def test_a_summary_from_before_the_substring_rule_reads_as_unknown_and_a_rerun_counts_it(
    tmp_path, byte_tok
):
    """Migration, never a silent recompute: a version 3 summary reads with the substring
    accuracy None; rerunning in the folder sums it from the stored answers, no model call."""
    lm = as_language_model(SuffixCopyLM(window=300), byte_tok)
    first = run_probes(lm, CONFIG, tmp_path, **OPTIONS)
    assert [e.substring.correct for e in first.by_length] == [e.correct for e in first.by_length]
    path = tmp_path / "summary.json"
    old = json.loads(path.read_text())
    old["format_version"] = 3
    for entry in old["by_length"]:
        del entry["substring"]
    path.write_text(json.dumps(old))
    migrated = read_record(path, ProbesResult)
    assert [e.substring for e in migrated.by_length] == [None, None]
    assert [e.correct for e in migrated.by_length] == [e.correct for e in first.by_length]
    counter = RunCounter(lm)
    again = run_probes(lm, CONFIG, tmp_path, **OPTIONS)
    assert counter.tokens == 0
    assert again.by_length == first.by_length
    assert json.loads(path.read_text())["format_version"] == VERSION


def test_a_finished_run_makes_no_model_call_and_a_partial_one_prefills_only_what_is_missing(
    tmp_path, byte_tok
):
    lm = as_language_model(SuffixCopyLM(), byte_tok)
    first = run_probes(lm, CONFIG, tmp_path, **OPTIONS)
    counter = RunCounter(lm)
    again = run_probes(lm, CONFIG, tmp_path, **OPTIONS)
    assert counter.tokens == 0
    assert again.by_length == first.by_length

    # A run killed during haystack 2 of length 512: its probes were never written.
    path = tmp_path / "768" / "probes.jsonl"
    records = read_records(path)
    kept = [r for r in records if r["haystack"] != 2]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    resumed = run_probes(lm, CONFIG, tmp_path, **OPTIONS)
    hay = build_haystack(probe_task(CONFIG.task), PromptFormat(byte_tok), CONFIG, 768, 2)
    questions = sum(len(p.question) + p.max_new_tokens - 1 for p in hay.probes)
    # one haystack's prefix up to its longest cut, and its questions (the copy model's
    # answers run their whole budget: it never emits a newline token before it)
    assert counter.tokens <= max(p.cut for p in hay.probes) + questions

    def answers(rows):  # all but the wall time
        return [{k: v for k, v in r.items() if k != "haystack_seconds"} for r in rows]

    assert answers(read_records(path)) == answers(records)
    assert read_records(path)[:8] == records[:8]  # the kept records are kept as they were
    assert resumed.by_length == first.by_length


def test_other_settings_in_the_same_folder_are_refused_unless_overwritten(tmp_path, byte_tok):
    lm = as_language_model(SuffixCopyLM(), byte_tok)
    config = ProbeConfig((300,), needles=2, haystacks=1, grain=GRAIN)
    run_probes(lm, config, tmp_path, **OPTIONS)
    other = dataclasses.replace(config, seed=5)
    with pytest.raises(ProvenanceMismatch, match=r"probes\.seed is 0 there, 5 now"):
        run_probes(lm, other, tmp_path, **OPTIONS)
    summary = run_probes(lm, other, tmp_path, overwrite=True, **OPTIONS)
    assert summary.seed == 5
    records = read_records(tmp_path / "300" / "probes.jsonl")
    assert {r["stage"] for r in records} == {summary.by_length[0].stage}
    with pytest.raises(ProvenanceMismatch, match="model"):
        run_probes(as_language_model(SuffixCopyLM(sharpness=4.0), byte_tok), other, tmp_path)


def test_hugging_face_model_end_to_end(tmp_path, byte_tok):
    summary = run_probes(
        tiny_llama(),
        ProbeConfig((300,), needles=2, haystacks=1, grain=GRAIN),
        tmp_path,
        tokenizer=byte_tok,
    )
    assert summary.overall.n == 2 and summary.model["backbone"] == "hf"


# ----------------------------------------------------------------------------- scoring
@pytest.mark.parametrize(
    ("prediction", "value", "expected"),
    [
        ("4819302.", "4819302", True),
        ("4819302", "4819302", True),
        ('"Apple".', "apple", True),
        ("4819302. The value of key x is 1.", "4819302", True),
        ("48193021", "4819302", False),
        ("the value is 4819302", "4819302", False),
        ("", "4819302", False),
        ("481930", "4819302", False),
    ],
)
def test_exact_match(prediction, value, expected):
    assert exact_match(prediction, value) is expected


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lengths": ()}, r"lengths=\(\) is not allowed; allowed: one or more integers >= 1"),
        ({"lengths": (0,)}, r"lengths=\(0,\) is not allowed"),
        ({"needles": 0}, "needles=0 is not allowed; allowed: an integer >= 1"),
        ({"haystacks": 1.5}, "haystacks=1.5 is not allowed"),
        ({"max_new_tokens": 0}, "max_new_tokens=0 is not allowed"),
        ({"confidence": 1.0}, "confidence=1.0 is not allowed; allowed: 0 < confidence < 1"),
        ({"grain": 0}, "grain=0 is not allowed; allowed: None or an integer >= 1"),
        ({"bins": 0}, "bins=0 is not allowed; allowed: an integer >= 1"),
        ({"needles_within": 1.0}, "needles_within=1.0 is not allowed; allowed: 0 <= value < 1"),
        ({"reach_accuracy": 0}, "reach_accuracy=0 is not allowed; allowed: 0 < value <= 1"),
        ({"task": "cwe"}, "task='cwe' is not allowed for probes: it is a common_words task"),
        ({"task": "niah_multivalue"}, "asking 1 key.s. with 4 value.s."),
        ({"task": "nope"}, "task='nope' is not allowed; allowed: "),
    ],
)
def test_bad_settings_are_one_line_value_errors(options, message):
    with pytest.raises(ValueError, match=message) as info:
        ProbeConfig(**{"lengths": (256,), **options})
    assert "\n" not in str(info.value)


def test_a_length_too_short_for_the_needles_names_the_shortest(tmp_path, byte_tok):
    with pytest.raises(TaskDoesNotFit, match=r"do not fit length=150.*allowed: length >= \d+"):
        run_probes(SuffixCopyLM(), ProbeConfig((150,), needles=3), tmp_path, tokenizer=byte_tok)


def test_probes_speak_only_the_language_model_protocol(tmp_path, byte_tok):
    """Any LanguageModel runs the probes, not only ropekit's BackboneLM (they once downcast
    to it and called a private method): one that only delegates the protocol gives the same
    answers, and greedy_after_prefixes equals each prompt decoded alone."""
    inner = as_language_model(SuffixCopyLM(), byte_tok)

    class Delegating:  # the protocol and nothing else
        tokenizer = byte_tok
        eos_ids = frozenset()
        kv_bytes_per_token = None

        def token_nll(self, ids):
            return inner.token_nll(ids)

        def greedy(self, prompts, max_new_tokens, stop=()):
            return inner.greedy(prompts, max_new_tokens, stop)

        def greedy_after_prefixes(self, prompts, stop=()):
            return inner.greedy_after_prefixes(prompts, stop)

        def describe(self):
            return inner.describe()

        def identity(self):
            return inner.identity()

    config = ProbeConfig((256,), needles=2, haystacks=1, grain=GRAIN)
    plain = run_probes(Delegating(), config, tmp_path / "plain")
    ours = run_probes(inner, config, tmp_path / "ours")
    assert plain.by_length == ours.by_length
    hay = build_haystack(probe_task(config.task), PromptFormat(byte_tok), config, 256, 0)
    assert answer_probes(Delegating(), hay, ()) == answer_separately(inner, hay, ())


# ----------------------------------------------------------------------------- trained model
@pytest.mark.slow
def test_trained_retriever_answers_probes_as_full_prompts(trained_retriever, tmp_path, byte_tok):
    """The decoder trained on the retrieval mixture (one kv fact per 128-byte sample), probed
    in that format: with two needles per haystack (a distractor it never saw in training)
    its cached answers are its full-prompt answers, right or wrong; with one needle per
    haystack it reads the 4-digit value (chance: 1e-4 per probe)."""
    stop = newline_ids(byte_tok)
    fmt = PromptFormat(byte_tok)
    # 192 bytes: two needles at 128 leave no filler for two cut points behind them; the
    # reference reads in the probes' chunks (float32: other chunks could flip a near-tie)
    lm = as_language_model(trained_retriever, byte_tok, chunk_size=16)
    two = ProbeConfig((192,), needles=2, haystacks=10, task="kv1_shakespeare", grain=16)
    for h in range(two.haystacks):
        _same_answers(lm, build_haystack(probe_task(two.task), fmt, two, 192, h), stop)
    lm = as_language_model(trained_retriever, byte_tok)
    one = ProbeConfig((128,), needles=1, haystacks=20, task="kv1_shakespeare", grain=1)
    summary = run_probes(lm, one, tmp_path, **OPTIONS)
    assert summary.overall.n == 20
    assert summary.overall.accuracy >= 0.5, summary.overall


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lengths": (128,), "needles": 100_000}, "needles=100000 cannot fit in 128 tokens"),
        (
            {"lengths": (128,), "haystacks": 10**9},
            "128000000000 prompt tokens|limit is 100,000,000",
        ),
        ({"lengths": (10**8,), "needles": 1}, "length 100000000 needs a KV cache of"),
    ],
)
def test_sizes_that_cannot_run_are_refused_at_once_and_leave_the_folder(
    tmp_path, byte_tok, options, message
):
    """Each of these once ran for minutes (building haystacks) before any output."""
    import time

    out = tmp_path / "out"
    start = time.perf_counter()
    model = sharp_decoder("rope") if options["lengths"][0] > 10**6 else SuffixCopyLM()
    with pytest.raises(ValueError, match=message):
        run_probes(model, ProbeConfig(**options), out, tokenizer=byte_tok)
    assert time.perf_counter() - start < 5 and not out.exists()


def test_a_length_refused_leaves_the_other_lengths_folders_as_they_were(tmp_path, byte_tok):
    with pytest.raises(TaskDoesNotFit):
        run_probes(
            SuffixCopyLM(), ProbeConfig((150, 512), needles=3, grain=GRAIN), tmp_path,
            tokenizer=byte_tok,
        )  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_the_summary_is_a_typed_record_and_an_untyped_one_is_migrated(tmp_path, byte_tok):
    """summary.json reads back as the ProbesResult run_probes returned; one written by the
    untyped writer (format_version 2, as a running comparison's probes are) reads the same,
    its distractor counts None where they were not counted yet; a renamed field is refused,
    and the folder is then not reused."""
    config = ProbeConfig((300,), needles=2, haystacks=1, grain=GRAIN)
    summary = run_probes(SuffixCopyLM(), config, tmp_path, tokenizer=byte_tok, **OPTIONS)
    path = tmp_path / "summary.json"
    assert read_record(path, ProbesResult) == summary and summary.task.name == config.task
    data = json.loads(path.read_text())
    assert data["format_version"] == VERSION
    for entry in data["by_length"]:
        del entry["other_needle"], entry["nearest_needle"]
    path.write_text(json.dumps({**data, "format_version": 2}))
    old = read_record(path, ProbesResult)
    assert old.by_length[0].other_needle is None
    assert old.by_distance == () and old.reach is None  # from before distances
    fields = ("by_length", "by_distance", "reach", "trained_length")
    assert dataclasses.replace(old, **{f: getattr(summary, f) for f in fields}) == summary
    data["by_length"][0]["prefills"] = data["by_length"][0].pop("haystacks")
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError, match=r"probes\.by_length\[0\]\.prefills is not a field"):
        read_record(path, ProbesResult)
    with pytest.raises(ResultError, match=r"by_length\[0\]\.prefills is not a field"):
        run_probes(SuffixCopyLM(), config, tmp_path, tokenizer=byte_tok, **OPTIONS)
