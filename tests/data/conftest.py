"""Shared fixtures: a small Hugging Face tokenizer trained here, so no test downloads one."""

from pathlib import Path

import pytest

from ropekit.data import HFTokenizer, load_tokenizer

from ..tiny import bpe_tokenizer_folder


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE (GPT-2 style, 512 tokens, EOS) trained on two essays, saved as a folder."""
    return bpe_tokenizer_folder(tmp_path_factory.mktemp("bpe"), vocab_size=512, essays=2)


@pytest.fixture(scope="session")
def hf_tokenizer(hf_tokenizer_dir: Path) -> HFTokenizer:
    tokenizer = load_tokenizer(hf_tokenizer_dir)
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer
