"""Many retrieval probes per long prefill (``ropekit.evals.probes``) against one prompt per probe,
on SmolLM2-135M at 8k tokens: the time per probe of each, measured in one run (`run_many`).
And (`run_shared`) haystacks that share their filler up to the needle, read in turn with the
shared chunks kept in the cache (``answer_haystacks``), against each haystack prefilled alone
(``answer_probes``): the time per haystack of each, in one run.

One haystack of 8192 tokens (Paul Graham essays, ``niah_single_2``) carries ``needles``
key/value needles. ``answer_probes`` prefills it once and answers every key from the cropped
cache; ``answer_separately`` prefills the whole prompt again for each probe, so its time per
probe does not depend on how many there are and a few probes measure it (an 8k prefill of
this model takes about a minute on one busy core). Ratio = seconds per probe with the shared
prefill / seconds per probe with one prompt each (target <= 0.2, i.e. >= 5x the probes per
second). The runs are minutes long, so each path runs once, interleaved (one prompt, the
shared run, one prompt) after a short warm-up forward. The note gives both rates, the
shared path's prefill and per-question times, and whether the answers of the probes both
paths ran agree.

The shared filler: experiment E's probe (``niah_single_1``, one needle, in the middle of the
haystack) and its 5 haystacks, at 8k. Ratio = seconds with the shared chunks / seconds with
each haystack alone (target <= 0.85); the paths run interleaved (one alone, all shared, the
rest alone). A later haystack keeps about half its tokens, but the cheaper half (their
attention reaches half as far), so the ratio stays well above the tokens' (0.73). The note
gives the tokens each path read and whether the answers agree (they are the same
computation: they must).

Both are skipped when the model is not installed (``ropekit models install smollm2-135m``).
`python -m benchmarks probes-shared` runs the second alone.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ropekit.evals import as_language_model
from ropekit.evals.adapters import newline_ids
from ropekit.evals.probe_haystacks import ProbeConfig, build_haystack, probe_task
from ropekit.evals.probe_summary import exact_match
from ropekit.evals.probes import answer_haystacks, answer_probes, answer_separately
from ropekit.evals.prompts import PromptFormat

from .common import Result, installed_backbone

MODEL = "smollm2-135m"


def run(device: str = "cpu") -> list[Result]:
    """Both rows."""
    return run_many(device) + run_shared(device)


def run_many(
    device: str = "cpu", length: int = 8192, needles: int = 8, separate: int = 2
) -> list[Result]:
    backbone = installed_backbone(MODEL, device, "probes")
    if backbone is None:
        return []
    lm = as_language_model(backbone)
    config = ProbeConfig((length,), needles=needles, haystacks=1)
    haystack = build_haystack(
        probe_task(config.task), PromptFormat(lm.tokenizer), config, length, 0
    )
    stop = newline_ids(lm.tokenizer) | lm.eos_ids

    # Seconds the shared path spends prefilling: forwards after which the cache holds at most
    # the prefix (the rest of its time goes to the questions and their answers).
    spent = {"prefill": 0.0}
    inner = backbone.run

    def timed_run(ids, cache, *args, **kwargs):
        start = time.perf_counter()
        out = inner(ids, cache, *args, **kwargs)
        if cache is not None and backbone.cache_length(cache) <= len(haystack.prefix):
            spent["prefill"] += time.perf_counter() - start
        return out

    # Warm up (thread pool, allocator) on a short forward, then time the two paths
    # interleaved: one prompt, the shared prefill with all its questions, one prompt, ... so
    # a change of machine load during the minutes this takes falls on both.
    with torch.inference_mode():
        backbone.run(torch.tensor([list(haystack.prefix[:1024])]), None, None, None, True)
    separate_s: list[float] = []
    answers: dict[str, list[list[int]]] = {"separate": []}
    for i in range(separate):
        start = time.perf_counter()
        answers["separate"] += answer_separately(
            lm, dataclasses.replace(haystack, probes=haystack.probes[i : i + 1]), stop
        )
        separate_s.append(time.perf_counter() - start)
        if i == 0:
            backbone.run = timed_run
            start = time.perf_counter()
            try:
                answers["shared"] = answer_probes(lm, haystack, stop)
            finally:
                del backbone.run  # the class's method again
            shared_s = time.perf_counter() - start
    t = {"shared": shared_s, "separate": sum(separate_s)}
    per_shared = t["shared"] / needles
    per_separate = t["separate"] / separate
    agree = answers["shared"][:separate] == answers["separate"]
    right = sum(
        exact_match(lm.tokenizer.decode(a).strip(), p.value)
        for a, p in zip(answers["shared"], haystack.probes, strict=True)
    )
    note = (
        f"{MODEL}, {length} tokens (prefix {len(haystack.prefix)}), {needles} probes from one "
        f"prefill: {t['shared']:.1f} s ({spent['prefill']:.1f} s prefill, "
        f"{(t['shared'] - spent['prefill']) / needles:.2f} s per question), "
        f"{1 / per_shared:.3f} probes/s; one prompt per probe ({separate} probes): "
        f"{per_separate:.1f} s per probe ({', '.join(f'{x:.1f}' for x in separate_s)} s), "
        f"{1 / per_separate:.3f} probes/s; speedup "
        f"{per_separate / per_shared:.1f}x; answers of the {separate} probes both ran "
        f"{'agree' if agree else 'DIFFER'}; {right}/{needles} exact (base model, greedy)"
    )
    return [
        Result(
            f"many probes per prefill vs one prompt per probe: time per probe, {MODEL} "
            f"{length // 1024}k",
            per_shared / per_separate,
            0.2,
            note,
        )
    ]


def run_shared(device: str = "cpu", length: int = 8192, haystacks: int = 5) -> list[Result]:
    backbone = installed_backbone(MODEL, device, "probes")
    if backbone is None:
        return []
    lm = as_language_model(backbone)
    config = ProbeConfig((length,), needles=1, haystacks=haystacks, task="niah_single_1")
    fmt = PromptFormat(lm.tokenizer)
    hays = [
        build_haystack(probe_task(config.task), fmt, config, length, h) for h in range(haystacks)
    ]
    stop = newline_ids(lm.tokenizer) | lm.eos_ids
    tokens = {"shared": 0, "alone": 0}
    inner = backbone.run
    counting = ["alone"]

    def counted_run(ids, *args, **kwargs):
        tokens[counting[0]] += ids.shape[1]
        return inner(ids, *args, **kwargs)

    backbone.run = counted_run
    try:
        with torch.inference_mode():  # warm-up, as in run_many
            inner(torch.tensor([list(hays[0].prefix[:1024])]), None, None, None, True)
        alone_s, answers = 0.0, {"alone": [], "shared": []}
        for i, hay in enumerate(hays):
            start = time.perf_counter()
            answers["alone"].append(answer_probes(lm, hay, stop))
            alone_s += time.perf_counter() - start
            if i == 0:
                counting[0] = "shared"
                start = time.perf_counter()
                answers["shared"] = list(answer_haystacks(lm, hays, stop))
                shared_s = time.perf_counter() - start
                counting[0] = "alone"
    finally:
        del backbone.run  # the class's method again
    agree = answers["shared"] == answers["alone"]
    note = (
        f"{MODEL}, {haystacks} haystacks of {length} tokens (niah_single_1, one needle in the "
        f"middle; prefixes {len(hays[0].prefix)}): shared chunks {shared_s:.1f} s "
        f"({tokens['shared']:,} tokens read), each alone {alone_s:.1f} s "
        f"({tokens['alone']:,} tokens); answers {'agree' if agree else 'DIFFER'}"
    )
    return [
        Result(
            f"haystacks sharing their filler vs each alone: time per haystack, {MODEL} "
            f"{length // 1024}k",
            shared_s / alone_s,
            0.85,
            note,
        )
    ]
