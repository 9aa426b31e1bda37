"""Perplexity on single documents (`PerplexityConfig.single_documents`): every window reads one
held-out document only, spans spread over several documents, the same targets at every
length, spans named by document and offset, per-span numbers, clear refusals; and
`run_perplexity` called per domain with a stream tokenized once.

The documents of the synthetic streams are each one letter repeated ("aaaa", "bbbb", ...), so
a window that reads two documents, or a separator, shows in its tokens."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from ropekit.data import Document, encode_documents, heldout_stream
from ropekit.evals import PerplexityConfig, as_language_model, evaluate_perplexity, run_perplexity

from .models import ConstantLM, tiny_decoder

# Every document is shorter than the 256 targets of the tests, three of them hold exactly one
# span of 64 targets and its context token, none holds more than two.
SIZES = (65, 100, 65, 40, 130, 65, 90)


class Recorder:
    """A LanguageModel that scores every token 0 nats and keeps every input row it reads."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.rows: list[list[int]] = []

    def token_nll(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.rows += input_ids.tolist()
        return torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1)


def _stream(tokenizer, sizes=SIZES, letter=lambda i: chr(97 + i)):
    docs = [Document(f"doc{i}", letter(i) * n) for i, n in enumerate(sizes)]
    return encode_documents(docs, tokenizer)


def _documents_read(tokenizer, row: list[int], skip: int = 0) -> set[str]:
    """The characters a window's tokens decode to (its BOS skipped)."""
    return set(tokenizer.decode(row[skip:]))


@pytest.mark.parametrize("seed", range(8))
def test_no_window_crosses_a_document_boundary(byte_tok, seed):
    stream = _stream(byte_tok)
    lm = Recorder(byte_tok)
    config = PerplexityConfig((16, 32, 64), n_tokens=256, seed=seed, single_documents=True)
    result = evaluate_perplexity(lm, stream, config, False)
    assert len(lm.rows) == 16 + 8 + 4
    for row in lm.rows:  # input and targets: the token before the window, then the window
        assert len(_documents_read(byte_tok, row)) == 1, byte_tok.decode(row)
    spans = result.spans
    assert len(spans) == 4 and result.documents == 4  # 4 spans, in 4 documents
    assert [s.start for s in spans] == sorted(s.start for s in spans)
    for s in spans:
        d = int(s.document.removeprefix("doc"))
        assert 1 <= s.offset <= SIZES[d] - 64  # after the context token, inside the text
        assert s.start == int(stream.doc_starts[d]) + s.offset
        assert s.tokens == 64 and s.bytes == 64


def test_the_joined_stream_does_cross(byte_tok):
    # The check above fails on the default mode: its one span of 256 crosses documents.
    lm = Recorder(byte_tok)
    evaluate_perplexity(lm, _stream(byte_tok), PerplexityConfig((64,), n_tokens=256), False)
    assert any(len(_documents_read(byte_tok, row)) > 1 for row in lm.rows)


def test_with_bos_every_window_lies_in_one_document(bpe_tok):
    stream = _stream(bpe_tok, sizes=(400, 300, 900, 350), letter=lambda i: "xyzw"[i] + " ")
    lm = Recorder(bpe_tok)
    config = PerplexityConfig((16, 32), n_tokens=128, single_documents=True)
    result = evaluate_perplexity(lm, stream, config, False)
    assert result.bos is True
    bos = bpe_tok.tokenizer.bos_token_id
    for row in lm.rows:
        assert row[0] == bos
        assert len(_documents_read(bpe_tok, row, skip=1) - {" "}) == 1, bpe_tok.decode(row)
    assert result.documents == 4


def test_spans_fill_fewer_documents_without_overlapping(byte_tok):
    # 12 spans of 32 (+1 context): room for 1, 3, 1, 1, 3, 1, 2 in the documents above.
    stream = _stream(byte_tok)
    config = PerplexityConfig((32,), n_tokens=12 * 32, seed=2, single_documents=True)
    result = evaluate_perplexity(Recorder(byte_tok), stream, config, False)
    spans = result.spans
    assert len(spans) == 12 and result.documents == 7  # every document gets one first
    for a, b in itertools.pairwise(spans):
        assert a.start + 32 + 1 <= b.start  # a span and the next one's context token


def test_every_length_scores_the_same_targets_and_spans_report_their_own(byte_tok):
    stream = heldout_stream("shakespeare", byte_tok)
    bias = torch.randn(256, generator=torch.Generator().manual_seed(0)) * 3
    lm = as_language_model(ConstantLM(bias=bias), byte_tok)
    config = PerplexityConfig((64, 128), n_tokens=4 * 128, seed=1, single_documents=True)
    result = evaluate_perplexity(lm, stream, config, False)
    logp = torch.log_softmax(bias.double(), -1)
    spans = result.spans
    assert result.documents == 4 and result.start is None
    direct = [float(-logp[stream.ids[s.start : s.start + 128]].sum()) for s in spans]
    for row in result.results:
        assert row.tokens == 512 and row.bytes == sum(s.bytes for s in spans)
        assert row.nll * 512 == pytest.approx(sum(direct), rel=1e-6)
        assert len(row.spans) == 4
        for own, total, span in zip(row.spans, direct, spans, strict=True):
            assert own.document == span.document
            assert own.nll * 128 == pytest.approx(total, rel=1e-6)
            assert own.bits_per_byte == pytest.approx(total / math.log(2) / span.bytes)
            assert own.perplexity == pytest.approx(math.exp(own.nll))
        quarter = [s.last_quarter_nll for s in row.spans]
        assert row.last_quarter_nll == pytest.approx(sum(quarter) / 4)
    play = {s.document for s in spans}
    assert all(name.startswith("shakespeare/") for name in play)


def test_stride_windows_stay_in_their_span(byte_tok):
    stream = _stream(byte_tok)
    lm = Recorder(byte_tok)
    config = PerplexityConfig((32, 64), n_tokens=128, stride=8, single_documents=True)
    result = evaluate_perplexity(lm, stream, config, False)
    assert all(len(_documents_read(byte_tok, row)) == 1 for row in lm.rows)
    assert all(s.last_quarter_nll is None for s in result.results[0].spans)


def test_no_document_long_enough_names_the_longest(byte_tok):
    stream = _stream(byte_tok)
    config = PerplexityConfig((64, 192), n_tokens=192, single_documents=True)
    with pytest.raises(ValueError) as info:
        evaluate_perplexity(Recorder(byte_tok), stream, config, False)
    message = str(info.value)
    assert message.startswith("single_documents=True needs a held-out document of at least 193")
    assert "the longest of the 7 held-out documents, 'doc4', holds 130;" in message
    assert "\n" not in message


def test_more_spans_than_the_documents_hold_is_refused(byte_tok):
    stream = _stream(byte_tok)  # room for 1, 1, 1, 0, 2, 1, 1 spans of 64 and a context token
    config = PerplexityConfig((64,), n_tokens=64 * 8, single_documents=True)
    with pytest.raises(
        ValueError,
        match=r"hold at most 7 spans of 64 tokens; allowed: n_tokens "
        r"<= 448, or more held-out documents$",
    ):
        evaluate_perplexity(Recorder(byte_tok), stream, config, False)


def test_run_perplexity_per_domain_takes_a_stream_tokenized_once(tmp_path, byte_tok, monkeypatch):
    model = tiny_decoder()
    config = PerplexityConfig((32, 64), n_tokens=128, single_documents=True)
    first = run_perplexity(model, config, tmp_path / "a", data="kjv", progress=False)
    stream = heldout_stream("kjv", byte_tok)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr("ropekit.evals.perplexity.heldout_stream", no_tokenizing)
    second = run_perplexity(
        model, config, tmp_path / "b", data="kjv", stream=stream, progress=False
    ).result
    first = first.result
    assert second.results == first.results and second.spans == first.spans
    assert second.provenance == first.provenance
    saved = json.loads((tmp_path / "b" / "ppl.json").read_text())
    assert saved["provenance"]["config"]["single_documents"] is True
    assert saved["spans"][0]["document"].startswith("kjv/")
    again = run_perplexity(model, config, tmp_path / "b", data="kjv", stream=stream)
    assert again.reused is True and again.result == second


def test_a_stream_of_another_tokenizer_is_refused(tmp_path, bpe_tok):
    stream = heldout_stream("kjv", bpe_tok)
    with pytest.raises(ValueError, match="stream tokenizer='test-bpe' is not allowed"):
        run_perplexity(tiny_decoder(), PerplexityConfig((32,)), tmp_path, stream=stream)


def test_the_default_mode_keeps_its_provenance(tmp_path):
    # Results made before `single_documents` existed are reused: at its default it is left
    # out of the provenance, and the numbers are those of the joined stream.
    run = run_perplexity(tiny_decoder(), PerplexityConfig((32,), 64), tmp_path, progress=False)
    assert "single_documents" not in run.result.provenance["config"]
    assert run.result.spans is None and isinstance(run.result.start, int)


@pytest.mark.parametrize("single", [True, False])
def test_a_part_scores_exactly_the_windows_the_whole_scores_there(byte_tok, single):
    """A comparison that races reads its windows in parts (rounds): part i is span i of the
    whole (single documents) or its i-th lcm(lengths) targets (joined text), row for row."""
    stream = heldout_stream("shakespeare", byte_tok)
    lm = as_language_model(tiny_decoder(), byte_tok)
    whole_config = PerplexityConfig((32, 64), n_tokens=3 * 64, seed=2, single_documents=single)
    whole = evaluate_perplexity(lm, stream, whole_config, False)
    for i in range(3):
        config = PerplexityConfig((32, 64), n_tokens=3 * 64, seed=2, single_documents=single,
                                  part=i)  # fmt: skip
        part = evaluate_perplexity(lm, stream, config, False)
        if single:
            assert part.spans == whole.spans[i : i + 1]
        else:
            assert part.start == whole.start + i * 64
        for mine, theirs in zip(part.results, whole.results, strict=True):
            per = len(theirs.last_quarter_nll_windows) // 3
            assert mine.tokens == 64 and mine.windows == per
            assert (
                mine.last_quarter_nll_windows
                == theirs.last_quarter_nll_windows[i * per : (i + 1) * per]
            )
    with pytest.raises(ValueError, match=r"part=3 is not allowed; allowed: None, or 0\.\.2"):
        PerplexityConfig((32, 64), n_tokens=3 * 64, part=3)
