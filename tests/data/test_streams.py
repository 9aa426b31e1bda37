"""Token streams: whole documents end to end, with exact byte accounting."""

import numpy as np
import pytest
import torch

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


# ----------------------------------------------------------------------------- the token cache
@pytest.fixture
def token_cache(tmp_path, monkeypatch):
    """A private ROPEKIT_CACHE: tests never read or fill the user's token cache."""
    monkeypatch.setenv("ROPEKIT_CACHE", str(tmp_path))
    return tmp_path / "tokens"


class Counting:
    """`tokenizer`, counting the documents it tokenizes."""

    def __init__(self, tokenizer):
        self.inner, self.calls = tokenizer, 0

    def __call__(self, text):
        self.calls += 1
        return self.inner(text)


def _streams_equal(a, b) -> bool:
    return all(
        torch.equal(getattr(a, f), getattr(b, f)) for f in ("ids", "byte_offsets", "doc_starts")
    ) and (a.names, a.tokenizer) == (b.names, b.tokenizer)


def test_the_token_cache_returns_the_same_stream_without_tokenizing(
    hf_tokenizer, token_cache, monkeypatch
):
    counter = Counting(hf_tokenizer.encode_with_bytes)
    monkeypatch.setattr(hf_tokenizer, "encode_with_bytes", counter)
    fresh = encode_documents(DOCS, hf_tokenizer, cache=True)
    assert counter.calls == len(DOCS) and len(list(token_cache.glob("*.npz"))) == 1
    cached = encode_documents(DOCS, hf_tokenizer, cache=True)
    assert counter.calls == len(DOCS)  # read from the cache
    assert _streams_equal(cached, fresh)
    renamed = [Document(f"other {d.name}", d.text) for d in DOCS]  # names are not cached
    assert encode_documents(renamed, hf_tokenizer, cache=True).names == tuple(
        d.name for d in renamed
    )
    assert counter.calls == len(DOCS)
    assert _streams_equal(encode_documents(DOCS, hf_tokenizer, cache=False), fresh)


@pytest.mark.parametrize(
    "change",
    ["one character", "documents joined otherwise", "another tokenizer", "another library"],
)
def test_any_change_to_what_the_tokens_depend_on_misses_the_cache(
    hf_tokenizer, token_cache, monkeypatch, change
):
    """The key holds every text, the tokenizer's identity and the tokenizers version: a change
    to any of them is tokenized afresh (and the first corpus's entry is left alone)."""
    import importlib.metadata

    encode_documents(DOCS, hf_tokenizer, cache=True)
    docs, tokenizer = list(DOCS), hf_tokenizer
    if change == "one character":
        docs[1] = Document("b", "secont")
    elif change == "documents joined otherwise":  # "first — ü" + "second" vs one text
        docs = [Document("a", DOCS[0].text + DOCS[1].text), DOCS[2]]
        docs.insert(1, Document("b", ""))
    elif change == "another tokenizer":
        tokenizer = ByteTokenizer()
    else:
        real = importlib.metadata.version
        monkeypatch.setattr(
            importlib.metadata,
            "version",
            lambda name: "0.0" if name == "tokenizers" else real(name),
        )
    before = set(token_cache.glob("*.npz"))
    encode_documents(docs, tokenizer, cache=True)
    assert len(set(token_cache.glob("*.npz")) - before) == 1


def test_a_damaged_cache_file_is_tokenized_afresh_and_replaced(hf_tokenizer, token_cache):
    fresh = encode_documents(DOCS, hf_tokenizer, cache=True)
    (path,) = token_cache.glob("*.npz")
    for damage in (b"not a zip file", b""):
        path.write_bytes(damage)
        assert _streams_equal(encode_documents(DOCS, hf_tokenizer, cache=True), fresh)
        assert path.stat().st_size > 100  # rewritten whole
    for counts in ([1, 2], [1, 1, 5]):  # not 3 documents; not the ids' count
        np.savez(path, ids=np.arange(3), bytes=np.ones(3), counts=np.array(counts))
        assert _streams_equal(encode_documents(DOCS, hf_tokenizer, cache=True), fresh)


def test_the_cache_is_used_by_default_only_where_tokenizing_is_slow(hf_tokenizer, token_cache):
    encode_documents(DOCS, hf_tokenizer)  # short text: not cached
    encode_documents(DOCS * 200_000, ByteTokenizer())  # bytes: instant, not cached
    assert not token_cache.exists()


def test_the_cached_layout_changes_only_with_its_version():
    """A change to how a text becomes (ids, bytes per token) must bump TOKEN_CACHE_VERSION, or
    old cache entries would be read as the new rule's tokens: this test names the code the
    version stands for, and fails when that code changes until both are updated."""
    import hashlib
    import inspect

    from ropekit.data import streams, tokenizers

    code = "".join(
        inspect.getsource(f)
        for f in (tokenizers.HFTokenizer.encode_with_bytes, tokenizers._utf8_lengths,
                  tokenizers.ByteTokenizer.encode_with_bytes, streams._cached, streams._keep)
    )  # fmt: skip
    assert (streams.TOKEN_CACHE_VERSION, hashlib.sha256(code.encode()).hexdigest()[:16]) == (
        1,
        "029ff750f09da3eb",
    )
