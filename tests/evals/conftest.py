"""Shared fixtures: tokenizers (bytes, a small BPE with BOS and a chat template) and models."""

from __future__ import annotations

import pytest
import torch

from ropekit.data import ByteTokenizer, HFTokenizer
from ropekit.evals import DecoderLM

from .models import SuffixCopyLM

# Simplest chat template: a BOS, a user turn, and the assistant's turn opened.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s><|user|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="session")
def byte_tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="session")
def bpe_tok() -> HFTokenizer:
    """A 600-token byte-level BPE trained on a few essays; adds BOS by default, like Llama."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from ropekit.data import load_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([d.text for d in load_corpus("essays")][:10], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = CHAT_TEMPLATE
    return HFTokenizer(hf, name="test-bpe")


@pytest.fixture(scope="session")
def copy_lm(byte_tok) -> DecoderLM:
    """A model that retrieves: exact induction over the whole context."""
    return DecoderLM(SuffixCopyLM(), byte_tok)


@pytest.fixture(scope="session")
def short_sighted_lm(byte_tok) -> DecoderLM:
    """The same mechanism with attention limited to the last 32 tokens."""
    return DecoderLM(SuffixCopyLM(window=32), byte_tok)


@pytest.fixture(autouse=True)
def one_thread():
    """The models here are tiny: one thread beats OpenMP's fork/join on every small op (by
    several times on a busy 2-core machine). Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
