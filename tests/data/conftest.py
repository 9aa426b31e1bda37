"""Shared fixtures: a small Hugging Face tokenizer trained here, so no test downloads one."""

from pathlib import Path

import pytest

from ropekit.data import HFTokenizer, load_corpus, load_tokenizer


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE (GPT-2 style, 512 tokens, EOS) trained on two essays, saved as a folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator([d.text for d in load_corpus("essays")[:2]], trainer)
    folder = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(
        folder
    )
    return folder


@pytest.fixture(scope="session")
def hf_tokenizer(hf_tokenizer_dir: Path) -> HFTokenizer:
    tokenizer = load_tokenizer(hf_tokenizer_dir)
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer
