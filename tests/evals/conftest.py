"""Shared fixtures: tokenizers (bytes, a small BPE with BOS and a chat template) and models,
hand-built ones and a small ropekit Decoder really trained to retrieve."""

from __future__ import annotations

import pytest
import torch

from ropekit.data import ByteTokenizer, HFTokenizer
from ropekit.evals import LanguageModel, as_language_model

from .models import SuffixCopyLM

# The trained retriever (`trained_retriever`): `ropekit demo`'s two-stage base-model recipe
# (`DemoConfig.base_stages`) on a smaller model, with fewer steps. Found by experiment: the copy
# circuit forms around step 175 of the recall stage (its loss drops from a plateau of ~1.3 to
# ~0.3); a narrower (d_model 64 or 96) or shallower (2 layers) model, passkey records alone (no
# kv), or a recall stage at 128 bytes did not form it within 400-800 steps. Trained on recall
# alone, the model read 5-digit keys imprecisely in some needle layouts (0.5-1.0 at 96 bytes
# over perturbed runs); the short mixture stage at 128 made it 0.95-1.0 at 128 in every
# perturbed run (weights nudged by 1e-5 at init, to stand in for another CPU's rounding).
RETRIEVER_SHAPE = {"d_model": 128, "n_layers": 3, "n_heads": 4}
RETRIEVER_LENGTH = 128  # bytes: the training length (of the last stage)
# name, context, steps, share of samples with a retrieval record, warmup steps, min_lr_ratio
RETRIEVER_STAGES = (
    # Every sample a record (passkey or one kv fact) at a context the record and its question
    # nearly fill, constant learning rate: where the copy circuit forms.
    ("recall", 96, 250, 1.0, 50, 1.0),
    # Shakespeare at the training length, half the samples with a record, cosine decay.
    ("mixture", RETRIEVER_LENGTH, 100, 0.5, 0, 0.1),
)

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
def copy_lm(byte_tok) -> LanguageModel:
    """A model that retrieves: exact induction over the whole context."""
    return as_language_model(SuffixCopyLM(), byte_tok)


@pytest.fixture(scope="session")
def short_sighted_lm(byte_tok) -> LanguageModel:
    """The same mechanism with attention limited to the last 32 tokens."""
    return as_language_model(SuffixCopyLM(window=32), byte_tok)


@pytest.fixture(autouse=True)
def one_thread():
    """The models here are tiny: one thread beats OpenMP's fork/join on every small op (by
    several times on a busy 2-core machine). Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_retriever(out):
    """A byte-level RoPE `Decoder` trained with the library's loop on the synthetic retrieval
    mixture (`RETRIEVER_STAGES`) into the folder ``out``, in eval mode; its training length is
    ``config.context_length``. Seeded; about 50 s on one thread."""
    from ropekit.data import RetrievalConfig, make_train_dataset
    from ropekit.model import Decoder, DecoderConfig
    from ropekit.train import TrainConfig, train

    threads = torch.get_num_threads()  # module fixtures start before `one_thread`
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = Decoder(
            DecoderConfig(**RETRIEVER_SHAPE, encoding="rope", context_length=RETRIEVER_LENGTH)
        )
        for name, context, steps, ratio, warmup, min_lr_ratio in RETRIEVER_STAGES:
            retrieval = RetrievalConfig(
                ratio=ratio, kinds=("passkey", "kv"), n_facts=1, answer_weight=20.0
            )
            dataset = make_train_dataset(
                "shakespeare", "bytes", context, retrieval=retrieval, seed=0
            )
            config = TrainConfig(
                out_dir=out / name,
                steps=steps,
                batch_size=16,
                lr=1e-3,
                warmup_steps=warmup,
                min_lr_ratio=min_lr_ratio,
                seed=0,
                checkpoint_interval=steps,  # one checkpoint, at the end
                keep_last=1,
            )
            train(model, dataset, config)
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def shared_retriever(tmp_path_factory, worker_id: str):
    """`train_retriever`, trained once per test session however many modules and xdist
    workers ask: the first to ask trains it under a lock in the session's temporary folder
    (the one xdist's workers share) and saves it; each call returns a fresh copy loaded from
    there, so no test sees another's changes. Only this session can read the copy: the folder
    is new each session, so a changed recipe is never served an older model."""
    from filelock import FileLock

    from ropekit.model import Decoder

    base = tmp_path_factory.getbasetemp()
    session = base if worker_id == "master" else base.parent  # pytest-N, above popen-gwK
    saved = session / "trained_retriever"
    with FileLock(f"{saved}.lock"):
        if not (saved / "config.json").exists():  # written last, by `save`
            train_retriever(tmp_path_factory.mktemp("trained_retriever")).save(saved)
    return Decoder.load(saved).eval()


@pytest.fixture(scope="module")
def trained_retriever(tmp_path_factory, worker_id):
    """`shared_retriever`: a fresh copy per test module that uses it."""
    return shared_retriever(tmp_path_factory, worker_id)
