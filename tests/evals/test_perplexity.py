"""Perplexity vs length: the bits-per-byte identity, the same targets at every length (plain and
sliding windows, with and without BOS), the position curve, the files."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from ropekit.data import heldout_stream
from ropekit.evals import (
    PerplexityConfig,
    PerplexityResult,
    as_language_model,
    evaluate_perplexity,
    run_perplexity,
)
from ropekit.evals.perplexity import VERSION
from ropekit.results import ResultError, read_record

from .models import ConstantLM, tiny_decoder, tiny_llama

# ln(256) is not exact in float32: the uniform model's NLL carries a relative error ~3e-9.
FP32_REL = 1e-7


@pytest.fixture(scope="module")
def stream(byte_tok):
    return heldout_stream("shakespeare", byte_tok)


@pytest.mark.parametrize("stride", [None, 24])
def test_uniform_model_gives_exactly_8_bits_per_byte(stream, byte_tok, stride):
    config = PerplexityConfig(lengths=(32, 64, 128), stride=stride)
    result = evaluate_perplexity(as_language_model(ConstantLM(), byte_tok), stream, config, False)
    assert result.metric == "bits_per_byte"
    for row in result.results:
        assert row.bits_per_byte == pytest.approx(8.0, rel=FP32_REL)
        assert row.bits_per_token == pytest.approx(8.0, rel=FP32_REL)
        assert row.perplexity == pytest.approx(256.0, rel=1e-6)


def test_uniform_hugging_face_model_gives_8_bits_per_byte(stream, byte_tok):
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: the uniform distribution over bytes
    config = PerplexityConfig(lengths=(16, 48), n_tokens=96)
    result = evaluate_perplexity(as_language_model(model, byte_tok), stream, config, False)
    assert [r.bits_per_byte for r in result.results] == pytest.approx([8.0, 8.0], rel=1e-7)


def _direct_nll(bias, ids):
    """Total NLL of `ids` under a context-free model with logits `bias`."""
    return float(-torch.log_softmax(bias.double(), -1)[ids].sum())


@pytest.mark.parametrize("stride", [None, 1, 20])
def test_every_length_scores_the_same_targets(stream, byte_tok, stride):
    # A context-free model gives each target the same NLL wherever it sits, so equal totals
    # at every length mean equal target sets; the direct sum pins down which targets.
    bias = torch.randn(256, generator=torch.Generator().manual_seed(0)) * 3
    config = PerplexityConfig(lengths=(20, 40, 60), n_tokens=240, stride=stride, seed=3)
    result = evaluate_perplexity(
        as_language_model(ConstantLM(bias=bias), byte_tok), stream, config, False
    )
    start = result.start
    expected = _direct_nll(bias, stream.ids[start : start + 240])
    for row in result.results:
        assert row.nll * row.tokens == pytest.approx(expected, rel=1e-6)
        assert row.bytes == stream.n_bytes(start, start + 240) == 240
    if stride is None:
        assert [r.windows for r in result.results] == [12, 6, 4]
    # Another seed, another span.
    other = evaluate_perplexity(
        as_language_model(ConstantLM(bias=bias), byte_tok),
        stream,
        PerplexityConfig((20,), 240),
        False,
    )
    assert other.start != start


def test_bos_windows_score_the_same_targets_and_bytes(bpe_tok):
    stream = heldout_stream("essays", bpe_tok)
    model = tiny_llama(vocab_size=bpe_tok.vocab_size)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1.0)  # logits depend on the input; BOS changes them
    lm = as_language_model(model, bpe_tok)
    config = PerplexityConfig(lengths=(16, 32), n_tokens=64)
    result = evaluate_perplexity(lm, stream, config, False)
    assert result.bos is True and result.metric == "perplexity"
    start = result.start
    for row in result.results:
        assert row.bytes == stream.n_bytes(start, start + 64)
        assert row.bits_per_byte == pytest.approx(row.nll * 64 / math.log(2) / row.bytes)
    # Window i of length 16 reads [BOS] + its first 15 targets and scores its 16 targets: the
    # curve's first bin is the mean, over windows, of the NLL of each window's first target.
    bos = bpe_tok.tokenizer.bos_token_id
    windows = [
        torch.cat([torch.tensor([bos]), stream.ids[start + 16 * i : start + 16 * (i + 1)]])
        for i in range(4)
    ]
    first_targets = lm.token_nll(torch.stack(windows))[:, 0]
    curve = result.results[0].position_nll
    assert curve.start[0] == 0 and curve.stop[0] == 1
    assert curve.nll[0] == pytest.approx(float(first_targets.mean()), rel=1e-6)


def test_position_curve_and_last_quarter_agree_with_the_mean(stream, byte_tok):
    config = PerplexityConfig(lengths=(32, 64), n_tokens=256, position_bins=10)
    result = evaluate_perplexity(as_language_model(tiny_decoder(), byte_tok), stream, config, False)
    for row in result.results:
        curve = row.position_nll
        widths = [b - a for a, b in zip(curve.start, curve.stop, strict=True)]
        assert curve.start[0] == 0 and curve.stop[-1] == row.length
        weighted = sum(w * v for w, v in zip(widths, curve.nll, strict=True)) / row.length
        assert weighted == pytest.approx(row.nll, rel=1e-9)
        assert len(row.last_quarter_nll_windows) == row.windows
        assert row.last_quarter_nll == pytest.approx(
            sum(row.last_quarter_nll_windows) / row.windows
        )


def test_the_last_quarter_blocks_are_its_64_token_means(stream, byte_tok):
    from ropekit.evals.perplexity import QUARTER_BLOCK

    config = PerplexityConfig(lengths=(512, 1024), n_tokens=2048)
    lm = as_language_model(tiny_decoder(), byte_tok)
    result = evaluate_perplexity(lm, stream, config, False)
    for row in result.results:
        blocks = row.last_quarter_nll_blocks
        assert len(blocks) == row.windows
        assert all(len(b) == row.length // 4 // QUARTER_BLOCK for b in blocks)
        for b, mean in zip(blocks, row.last_quarter_nll_windows, strict=True):
            assert sum(b) / len(b) == pytest.approx(mean, rel=1e-12)
            assert len(set(b)) == len(b)  # each block its own targets, not the mean repeated


def test_config_errors_name_what_is_allowed(stream, byte_tok):
    with pytest.raises(ValueError, match="lcm"):
        PerplexityConfig(lengths=(32, 48), n_tokens=100)
    with pytest.raises(ValueError, match="stride="):
        PerplexityConfig(lengths=(32, 64), stride=40)
    with pytest.raises(ValueError, match="lengths="):
        PerplexityConfig(lengths=())
    assert PerplexityConfig(lengths=(64, 32, 64)).lengths == (32, 64)
    assert PerplexityConfig(lengths=(32, 48)).n_tokens == 192  # 4 windows of 48, lcm 96
    short = stream.head(100)
    with pytest.raises(ValueError, match="held-out stream holds 100"):
        evaluate_perplexity(
            as_language_model(ConstantLM(), byte_tok), short, PerplexityConfig((64,))
        )


def test_run_perplexity_writes_json_and_png(tmp_path):
    result = run_perplexity(
        tiny_decoder(),
        PerplexityConfig((32, 64), n_tokens=128, seed=1),
        tmp_path,
        spec="rope",
        command="ropekit eval ppl --test",
        progress=False,
    )
    saved = json.loads((tmp_path / "ppl.json").read_text())
    assert saved["spec"] == "rope" and saved["seed"] == 1 and saved["data"] == "shakespeare"
    assert saved["kind"] == "perplexity" and saved["meta"]["command"] == "ropekit eval ppl --test"
    assert {"torch", "transformers", "ropekit"} <= set(saved["meta"]["versions"])
    assert [r["length"] for r in saved["results"]] == [32, 64]
    assert (tmp_path / "ppl.png").read_bytes()[:4] == b"\x89PNG"
    assert result.json == tmp_path / "ppl.json" and result.png == tmp_path / "ppl.png"
    assert result.result.spec == "rope" and result.result.results[0].length == 32


def test_a_length_following_encodings_result_says_it_was_scored_in_one_forward(tmp_path):
    """Its provenance carries the scoring (results of it scored through the cache in chunks,
    made before, are not reused); a static encoding's provenance is as it always was."""
    config = PerplexityConfig((32, 64), n_tokens=128, seed=1)
    for spec, scoring in (("rope", None), ("dynamic-ntk:factor=2", "one forward per window")):
        result = run_perplexity(
            tiny_decoder(encoding=spec), config, tmp_path / spec, spec=spec, progress=False
        ).result
        assert result.provenance.get("scoring") == scoring


class _Killed(RuntimeError):
    pass


def _scored(model, calls: list, kill_after: int | None = None):
    """``model`` as a LanguageModel whose forwards are counted (and that dies, like a kill,
    on the forward after ``kill_after``)."""
    lm = as_language_model(model)
    real = lm.token_nll

    def token_nll(ids):
        if kill_after is not None and len(calls) == kill_after:
            raise _Killed
        calls.append(ids.shape)
        return real(ids)

    lm.token_nll = token_nll
    return lm


def test_a_killed_evaluation_resumes_at_the_next_window_with_the_same_numbers(tmp_path):
    """A 32k window of SmolLM2 is minutes of CPU: a run killed part way keeps the windows it
    scored, and the rerun scores only the rest and gives an uninterrupted run's numbers."""
    config = PerplexityConfig((32, 64), n_tokens=256, batch_tokens=64, seed=1)
    whole: list = []
    expected = run_perplexity(
        _scored(tiny_decoder(), whole), config, tmp_path / "a", progress=False
    )
    assert len(whole) == 8 and not (tmp_path / "a" / "windows").exists()  # spent, removed
    out, first = tmp_path / "b", []
    with pytest.raises(_Killed):
        run_perplexity(_scored(tiny_decoder(), first, kill_after=5), config, out, progress=False)
    assert len(list((out / "windows").glob("*.npz"))) == 5 and not (out / "ppl.json").exists()
    rest: list = []
    result = run_perplexity(_scored(tiny_decoder(), rest), config, out, progress=False)
    assert len(rest) == 3  # the five windows scored before the kill were read back
    assert result.result.results == expected.result.results  # bit for bit
    assert not (out / "windows").exists()


def test_windows_scored_by_another_model_are_never_reused(tmp_path):
    config = PerplexityConfig((32, 64), n_tokens=256, batch_tokens=64, seed=1)
    out = tmp_path / "b"
    with pytest.raises(_Killed):
        run_perplexity(_scored(tiny_decoder(0), [], kill_after=5), config, out, progress=False)
    other: list = []
    result = run_perplexity(_scored(tiny_decoder(1), other), config, out, progress=False)
    assert len(other) == 8  # another model's windows were deleted unread
    fresh = run_perplexity(tiny_decoder(1), config, tmp_path / "c", progress=False)
    assert result.result.results == fresh.result.results


# Every committed ppl.json (format_version 2, written by the untyped writer; experiment E's are
# rewritten by its running comparison, so they are read, never written).
ROOT = Path(__file__).resolve().parents[2]
COMMITTED = sorted(ROOT.glob("experiments/**/ppl.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_perplexity_result_reads_as_a_perplexity_result(path):
    result = read_record(path, PerplexityResult)
    data = json.loads(path.read_text())
    assert result.lengths == tuple(r["length"] for r in data["results"]) == result.config.lengths
    assert result.headlines() == {r["length"]: r[data["metric"]] for r in data["results"]}
    for row, raw in zip(result.results, data["results"], strict=True):
        assert row.position_nll.nll == tuple(raw["position_nll"]["nll"])
        assert row.last_quarter_nll_blocks == (
            None if "last_quarter_nll_blocks" not in raw
            else tuple(map(tuple, raw["last_quarter_nll_blocks"]))
        )  # fmt: skip
        assert (row.spans is None) == ("spans" not in raw)
    assert (result.spans is None) == (result.documents is None) == ("spans" not in data)


def test_a_result_written_now_reads_back_equal_and_an_untyped_one_is_migrated(tmp_path):
    """Version 3 writes every field; version 2 left out spans and documents (joined text) and,
    before they were kept, the blocks: read as None."""
    run = run_perplexity(tiny_decoder(), PerplexityConfig((32, 64), 128), tmp_path / "a",
                         spec="rope", progress=False)  # fmt: skip
    assert read_record(run.json, PerplexityResult) == run.result
    data = json.loads(run.json.read_text())
    assert data["format_version"] == VERSION and data["spans"] is None
    del data["spans"], data["documents"]
    for row in data["results"]:
        del row["spans"], row["last_quarter_nll_blocks"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**data, "format_version": 2}))
    migrated = read_record(old, PerplexityResult)
    assert migrated.results[0].last_quarter_nll_blocks is None
    blocks = [dataclasses.replace(r, last_quarter_nll_blocks=None) for r in run.result.results]
    assert migrated == dataclasses.replace(run.result, results=tuple(blocks))
    old.write_text(json.dumps(data))  # the same left out at version 3: refused, naming it
    with pytest.raises(
        ResultError, match=r"perplexity\.results\[0\]\.last_quarter_nll_blocks is missing"
    ):
        read_record(old, PerplexityResult)


def test_a_renamed_field_is_refused_naming_it_and_the_folder_is_not_reused(tmp_path):
    run = run_perplexity(tiny_decoder(), PerplexityConfig((32,), 64), tmp_path, progress=False)
    data = json.loads(run.json.read_text())
    data["results"][0]["ppl"] = data["results"][0].pop("perplexity")
    run.json.write_text(json.dumps(data))
    with pytest.raises(ResultError, match=r"perplexity\.results\[0\]\.ppl is not a field"):
        read_record(run.json, PerplexityResult)
    with pytest.raises(ResultError, match=r"results\[0\]\.ppl is not a field"):
        run_perplexity(tiny_decoder(), PerplexityConfig((32,), 64), tmp_path, progress=False)
