"""Token streams: whole documents end to end, with exact byte accounting."""

import pytest

from ropekit.data import (
    ByteTokenizer,
    Document,
    EmptyCorpusError,
    HFTokenizer,
    encode_documents,
    heldout_stream,
    validation_documents,
)

DOCS = [Document("a", "first — ü"), Document("b", "second"), Document("c", "third 😀")]


def test_byte_stream_is_documents_joined_by_a_blank_line():
    stream = encode_documents(DOCS, ByteTokenizer())
    joined = "\n\n".join(d.text for d in DOCS)
    assert ByteTokenizer().decode(stream.ids.tolist()) == joined
    assert stream.n_bytes() == len(stream) == len(joined.encode("utf-8"))
    assert stream.bytes_per_token == 1.0
    assert stream.names == ("a", "b", "c")
    for d, doc in enumerate(DOCS):
        piece = stream.ids[stream.doc_starts[d] : stream.doc_starts[d + 1]].tolist()
        assert ByteTokenizer().decode(piece).removesuffix("\n\n") == doc.text


def test_hf_stream_separates_by_eos_which_covers_no_bytes(hf_tokenizer: HFTokenizer):
    stream = encode_documents(DOCS, hf_tokenizer)
    eos = hf_tokenizer.separator
    assert stream.ids.tolist().count(eos) == len(DOCS) - 1
    assert stream.n_bytes() == sum(d.n_bytes for d in DOCS)
    for d, doc in enumerate(DOCS):
        start, stop = int(stream.doc_starts[d]), int(stream.doc_starts[d + 1])
        text = hf_tokenizer.decode([i for i in stream.ids[start:stop].tolist() if i != eos])
        assert text == doc.text
        assert stream.n_bytes(start, stop) == doc.n_bytes


def test_head_keeps_the_first_tokens_and_their_documents():
    stream = encode_documents(DOCS, ByteTokenizer())
    head = stream.head(15)
    assert head.ids.tolist() == stream.ids[:15].tolist()
    assert head.n_bytes() == 15
    assert head.names == ("a", "b")
    assert head.doc_starts.tolist() == [0, int(stream.doc_starts[1]), 15]
    with pytest.raises(ValueError, match="n_tokens=0"):
        stream.head(0)


def test_heldout_stream_has_exactly_n_tokens_of_held_out_plays():
    n = 16 * 4096
    stream = heldout_stream("shakespeare", "bytes", n_tokens=n)
    assert len(stream) == n
    first_play = validation_documents("shakespeare")[0]
    assert stream.names[0] == first_play.name == "shakespeare/hamlet"
    assert ByteTokenizer().decode(stream.ids[:1000].tolist()) == first_play.text[:1000]


def test_heldout_stream_too_short_says_how_long_it_is():
    total = len(heldout_stream("essays", "bytes"))
    with pytest.raises(EmptyCorpusError, match=f"more than the {total} tokens"):
        heldout_stream("essays", "bytes", n_tokens=total + 1)


def test_encoding_nothing_is_an_error():
    with pytest.raises(EmptyCorpusError):
        encode_documents([], ByteTokenizer())
