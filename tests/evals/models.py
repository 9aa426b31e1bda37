"""Small real models for the evaluation tests (nn.Modules following the ropekit Decoder forward
contract; nothing of the evaluation code is replaced).

Holds:
    ConstantLM     the same logits at every position: uniform (zeros) or any fixed vector.
    SuffixCopyLM   a hand-built induction head: it attends from the current position to the
                   earlier position whose preceding tokens match the longest suffix of the
                   context, and copies the token found there. `window` limits how far back it
                   may attend: a model whose attention does not reach the needle.
    NearestNumberLM  a `LanguageModel` (the protocol, no network) that answers every question
                   with the number nearest it in the prompt: a copier that reads no key.
    NearestNeedleLM  the same with the value of the needle nearest the question: a copier of
                   needles that binds no key to its value.
    tiny_decoder   a randomly initialised 1-layer ropekit Decoder.
    tiny_llama     the shared tiny Llama (tests/tiny.py) over bytes, context 4096.

Shapes: B batch · T new tokens · S all tokens (cached + new) · V vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from ropekit.model.cache import KVCache


@dataclass
class Output:
    logits: Tensor  # (B, T, V)
    loss: Tensor | None = None
    cache: KVCache | None = None


def _history(input_ids: Tensor, cache: KVCache | None) -> Tensor:
    """All tokens so far (B, S): the cache stores token ids as its "keys"."""
    if cache is None:
        return input_ids
    T = input_ids.shape[1]
    start = len(cache)
    cache.append_positions(torch.arange(start, start + T)[None])
    ids = input_ids.float()[:, None, :, None]  # (B, 1, T, 1)
    keys, _ = cache.update(0, ids, ids)  # (B, 1, S, 1)
    return keys[:, 0, :, 0].long()


class ConstantLM(nn.Module):
    """logits = `bias` at every position, whatever the context."""

    def __init__(self, vocab_size: int = 256, bias: Tensor | None = None):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab_size) if bias is None else bias.clone())

    def forward(self, input_ids, position_ids=None, cache=None, labels=None):
        _history(input_ids, cache)
        B, T = input_ids.shape
        return Output(self.bias.expand(B, T, -1), None, cache)


class SuffixCopyLM(nn.Module):
    """Induction by longest suffix match (Olsson et al. 2022, "In-context Learning and
    Induction Heads", made exact): the attention score of key s for the query at t is
    `sharpness` x the number of tokens ending at t that equal those ending at s - 1 (at most
    `max_match`), the value of key s is the one-hot of token s, and the logits are the log of
    the attention-weighted values. Ties go to the most recent match."""

    def __init__(
        self,
        vocab_size: int = 256,
        max_match: int = 24,
        window: int | None = None,
        sharpness: float = 8.0,
    ):
        super().__init__()
        self.vocab_size, self.max_match, self.window = vocab_size, max_match, window
        self.sharpness = nn.Parameter(torch.tensor(sharpness), requires_grad=False)

    def forward(self, input_ids, position_ids=None, cache=None, labels=None):
        h = _history(input_ids, cache)  # (B, S)
        B, T = input_ids.shape
        S = h.shape[1]
        queries = np.arange(S - T, S)  # (T,) absolute positions of the new tokens
        keys = np.arange(1, S)  # (S-1,) key s predicts token h[s]
        # Match lengths in numpy: its boolean kernels are far faster than torch's on 2 cores.
        tokens = h.numpy()
        run = np.ones((B, T, S - 1), dtype=bool)
        length = np.zeros((B, T, S - 1), dtype=np.float32)
        for j in range(self.max_match):
            q, k = queries - j, keys - 1 - j
            valid = (q >= 0)[:, None] & (k >= 0)[None, :]  # (T, S-1)
            run &= tokens[:, q.clip(0)][:, :, None] == tokens[:, k.clip(0)][:, None, :]
            run &= valid
            length += run
            if not run.any():
                break
        allowed = keys[None, :] <= queries[:, None]  # (T, S-1) causal: tokens already seen
        if self.window is not None:
            allowed &= keys[None, :] > queries[:, None] - self.window
        allowed_t = torch.from_numpy(allowed)
        recency = torch.from_numpy(keys / S * 1e-3).float()  # ties go to the latest match
        scores = self.sharpness * torch.from_numpy(length) + recency
        scores = scores.masked_fill(~allowed_t, float("-inf"))  # (B, T, S-1)
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: zeros
        # Values are one-hot tokens: weights @ one_hot(h[:, 1:]) as a scatter-add.
        index = h[:, None, 1:].expand(B, T, S - 1)
        probs = torch.zeros(B, T, self.vocab_size).scatter_add_(2, index, weights)
        # A query that sees no key (the very first token) predicts uniformly.
        probs = torch.where(allowed_t.any(-1)[None, :, None], probs, 1.0 / self.vocab_size)
        return Output(torch.log(probs + 1e-9), None, cache)


class NearestNumberLM:
    """Answers " <n>." with n the last number before the question ("\nWhat is") in its
    prompt: what a model passes a haystack with by copying the one thing in it that looks
    like an answer, without binding it to the key asked. Bytes; the protocol only."""

    ANSWER = r"\d+"  # what it copies: the last match before the question (group 1 if any)

    def __init__(self):
        from ropekit.data import ByteTokenizer

        self.tokenizer = ByteTokenizer()
        self.eos_ids: frozenset[int] = frozenset()
        self.kv_bytes_per_token = None

    def _answer(self, ids, budget: int) -> list[int]:
        text = self.tokenizer.decode(list(ids))
        found = re.findall(self.ANSWER, text[: text.rfind("\nWhat is")])
        return self.tokenizer.encode(f" {found[-1]}." if found else " none.")[:budget]

    def greedy(self, prompts, max_new_tokens, stop=()):
        return [self._answer(p, max_new_tokens) for p in prompts]

    def greedy_after_prefixes(self, prompts, stop=()):
        for p in prompts:
            cuts, budgets = p.cut_points(), p.max_new_tokens
            yield [
                self._answer([*p.prefix[:c], *q], b)
                for c, q, b in zip(cuts, p.questions, budgets, strict=True)
            ]

    def token_nll(self, input_ids):
        raise NotImplementedError("NearestNumberLM only answers")

    def describe(self):
        return {"model": "nearest-number copier"}

    def identity(self):
        return {"model": "nearest-number copier"}


class NearestNeedleLM(NearestNumberLM):
    """Answers with the value of the needle nearest the question, whatever its key: what
    SmolLM2-135M does with several needles in view (experiment D: 16 of its 17 wrong answers
    in a 20-needle haystack were the nearest needle's value)."""

    ANSWER = r"The value of key [^\n]+? is ([^\s.]+)\."


def tiny_decoder(seed: int = 0, encoding: str = "rope"):
    from ropekit.model import Decoder, DecoderConfig

    torch.manual_seed(seed)
    config = DecoderConfig(d_model=32, n_layers=1, n_heads=2, context_length=64, encoding=encoding)
    return Decoder(config).eval()


def tiny_llama(seed: int = 0, vocab_size: int = 256, attn: str = "sdpa"):
    """The shared tiny Llama (tests/tiny.py), SMALL, with a long context and no special
    tokens."""
    from ..tiny import tiny_model  # transformers: a slow import, only where needed

    return tiny_model(
        "llama", seed=seed, attn_implementation=attn, small=True, vocab_size=vocab_size,
        max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
