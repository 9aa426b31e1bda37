"""What every evaluation calls: one small interface over any model, through its Backbone.

Holds:
- `LanguageModel`: the protocol evaluations call: `token_nll`, `greedy`,
  `greedy_after_prefixes` (many questions after each cached prefix, the chunks a prefix
  shares with the one before read once), `kv_bytes_per_token`, `tokenizer`, `eos_ids`,
  `describe`, `identity`.
- `PrefixQuestions`: one prefix and the questions asked after it (each after the whole
  prefix or its own cut of it); `shared_chunks`: how much of a cached prefix another prefix
  can keep; `chunk_dividing`: prefill chunks with a boundary at every cut.
- `BackboneLM`: the one implementation, over a `Backbone` (ropekit Decoders and Hugging Face
  causal LMs alike): chunked scoring (and `prefix_nll`, the prefixes of one input scored in
  one reading, which `evaluate_perplexity` uses when a model has it) and batched greedy
  decoding with a KV cache; the backbone runs each chunk through its model and says which
  prompts may share a batch (a Decoder has no padding mask, so it groups prompts of equal
  length; Hugging Face models left-pad).
- `as_language_model(model, tokenizer)`: a `BackboneLM` for any model.
- `place_on(lm, device)`: moves a wrapped model (evaluations under several processes).
- `newline_ids(tokenizer)`: the token ids whose text holds a newline (where answers stop).

Shape legend: B batch · T tokens · C tokens in one chunk · V vocabulary.

Why chunks: scoring a 16k-token window of a 49k-vocabulary model at once needs a (T, V) float32
logits tensor of 3 GB. Feeding the window in chunks through the KV cache gives the same numbers
(attention is causal, so a token never sees later chunks) with a (C, V) tensor at a time. One
exception: encodings whose schedule follows the current length (dynamic NTK, LongRoPE) then
score each chunk with the schedule of its own prefix, as token-by-token decoding would, not
with the schedule of the whole window; set `chunk_size` >= the window for a single forward.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ropekit.backbone import Backbone, as_backbone
from ropekit.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer

# Largest float32 logits block one chunk may produce (bytes); sets the default chunk length.
LOGITS_BUDGET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class PrefixQuestions:
    """Questions asked after one prefix: each prompt is ``prefix[:cuts[i]] + questions[i]``
    (``prefix + questions[i]`` without cuts), answered with at most ``max_new_tokens[i]`` new
    ids."""

    prefix: Sequence[int]
    questions: Sequence[Sequence[int]]
    max_new_tokens: Sequence[int]
    # where each question is asked: the tokens of the prefix it follows (None: all of them)
    cuts: Sequence[int] | None = None

    def cut_points(self) -> list[int]:
        """Each question's cut (the whole prefix without cuts); ValueError for a cut outside
        1..len(prefix) or one cut per question missing."""
        P = len(self.prefix)
        if self.cuts is None:
            return [P] * len(self.questions)
        cuts = list(self.cuts)
        if len(cuts) != len(self.questions) or any(not 1 <= c <= P for c in cuts):
            raise ValueError(
                f"cuts={cuts!r} is not allowed; allowed: one cut per question "
                f"({len(self.questions)}), each in 1..{P} (the prefix's tokens)"
            )
        return cuts


def chunk_dividing(chunk: int, cuts: Iterable[int]) -> int:
    """The longest chunk of at most ``chunk`` tokens that divides every cut: a prefill in such
    chunks has a chunk boundary at each cut, so the cache cropped to a cut holds exactly the
    chunks a fresh prefill of the cut prefix reads (and each ran at the length it runs at
    there, which is what a length-following encoding reads)."""
    common = math.gcd(*cuts)
    if common == 0:  # no cut: any chunk
        return chunk
    return next(d for d in range(min(chunk, common), 0, -1) if common % d == 0)


def shared_chunks(held: Sequence[int], prefix: Sequence[int], chunk: int) -> int:
    """Tokens of the whole chunks of ``chunk`` tokens, counted from the start, that
    ``prefix`` shares token for token with ``held``: the part of a cache holding ``held``
    that a fresh prefill of ``prefix`` would compute exactly so. A chunk ``held`` ends inside
    is never kept: the fresh prefill reads a longer one there."""
    common = 0
    for a, b in zip(held, prefix, strict=False):
        if a != b:
            break
        common += 1
    return common // chunk * chunk


@runtime_checkable
class LanguageModel(Protocol):
    """What every evaluation needs from a model."""

    tokenizer: Tokenizer

    def token_nll(self, input_ids: Tensor) -> Tensor:
        """input_ids (B, T+1) -> float32 (B, T): NLL in nats of token t+1 given tokens <= t."""
        ...

    def greedy(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: Collection[int] = ()
    ) -> list[list[int]]:
        """Greedy continuation of each prompt: at most `max_new_tokens` new ids, ending before
        the first stop id (which is not returned)."""
        ...

    def greedy_after_prefixes(
        self, prompts: Iterable[PrefixQuestions], stop: Collection[int] = ()
    ) -> Iterator[list[list[int]]]:
        """For each prompt in turn, the greedy continuation of ``prefix + question`` for each
        of its questions (its own answer budget), as ``greedy`` would give each alone, yielded
        as soon as that prompt's questions are answered: each prefix is read once and every
        question continues the same cached prefix."""
        ...

    @property
    def kv_bytes_per_token(self) -> int | None:
        """Bytes of KV cache one token of context holds (every layer's keys and values);
        None when the model keeps no cache to size."""
        ...

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end a reply (the model's end-of-sequence tokens); empty for byte models."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-ready description of the model for result files."""
        ...

    def identity(self) -> dict[str, Any]:
        """What a result's provenance records about the model (Backbone.identity)."""
        ...


class BackboneLM:
    """Chunked scoring and batched greedy decoding of a Backbone's model.

    `chunk_size` is the number of tokens per forward when a sequence is fed through the cache;
    None picks the longest chunk whose float32 logits fit `LOGITS_BUDGET_BYTES`.
    """

    def __init__(self, backbone: Backbone, chunk_size: int | None = None):
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r} is not allowed; allowed: None or >= 1")
        tokenizer = backbone.require_tokenizer()
        if not isinstance(tokenizer, Tokenizer):
            raise ValueError(
                f"tokenizer={tokenizer!r} is not allowed; allowed: a ropekit Tokenizer "
                "(ByteTokenizer, HFTokenizer, or load_tokenizer(name_or_path))"
            )
        backbone.model.eval()  # evaluation: no dropout
        self.backbone = backbone
        self.chunk_size = chunk_size

    @property
    def model(self) -> nn.Module:
        return self.backbone.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self.backbone.require_tokenizer()

    @property
    def device(self) -> torch.device:
        return self.backbone.device

    @property
    def vocab_size(self) -> int:
        return self.backbone.vocab_size

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.backbone.eos_ids

    @property
    def scores_in_one_forward(self) -> bool:
        """``Backbone.scores_in_one_forward``: a length-following encoding's windows are read
        in one forward each."""
        return self.backbone.scores_in_one_forward

    @property
    def prefill_chunk(self) -> int:
        """Tokens per forward when one sequence is read through the cache (a probe's
        prefill, a perplexity window read alone)."""
        return self._chunk(1)

    def _chunk(self, batch: int) -> int:
        if self.chunk_size is not None:
            return self.chunk_size
        return max(64, LOGITS_BUDGET_BYTES // (4 * batch * max(self.vocab_size, 1)))

    def token_nll(self, input_ids: Tensor) -> Tensor:
        """input_ids (B, T+1) -> float32 (B, T) NLL (nats) of input_ids[:, 1:], chunked
        (``Backbone.token_nll``, ``chunk_size`` tokens per forward)."""
        if input_ids.dim() != 2 or input_ids.shape[1] < 2:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} must be (B, T+1) with T >= 1")
        return self.backbone.token_nll(input_ids, self._chunk(input_ids.shape[0]))

    def prefix_nll(self, input_ids: Tensor, lengths: Sequence[int]) -> list[Tensor]:
        """input_ids (T+1,) -> for each n of ``lengths`` the float32 (n,) NLL that
        ``token_nll(input_ids[None, : n + 1])[0]`` gives, bit for bit, with the prefix they
        share read once (``Backbone.prefix_nll``, one row's chunks)."""
        return self.backbone.prefix_nll(input_ids, lengths, self.prefill_chunk)

    @torch.inference_mode()
    def greedy(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: Collection[int] = ()
    ) -> list[list[int]]:
        """Greedy continuations with the KV cache, batched; see `LanguageModel.greedy`."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} is not allowed; allowed: >= 0")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt must hold at least one token; got an empty prompt")
        out: list[list[int]] = [[] for _ in prompts]
        if max_new_tokens == 0:
            return out
        stops = torch.tensor(sorted(set(stop)), dtype=torch.long, device=self.device)
        for group in self.backbone.group_prompts(prompts):
            for i, ids in zip(
                group,
                self._greedy_batch([prompts[i] for i in group], max_new_tokens, stops),
                strict=True,
            ):
                out[i] = ids
        return out

    @torch.inference_mode()
    def greedy_after_prefixes(
        self, prompts: Iterable[PrefixQuestions], stop: Collection[int] = ()
    ) -> Iterator[list[list[int]]]:
        """One prefill per prefix, then each of its questions after the same cached prefix
        cropped to the question's cut (and back to it after each answer); see
        `LanguageModel.greedy_after_prefixes`. Chunks are those of ``greedy`` for a batch of
        one, counted from each prefix's start, shortened to divide every cut short of the
        whole prefix (`chunk_dividing`).

        Cuts: the prefix is read up to its longest cut, then the questions are asked from the
        longest cut to the shortest, the cache cropped back each time. Attention is causal and
        every cut is a chunk boundary, so the cache cropped to a cut is the one a fresh
        prefill of the cut prefix leaves, bit for bit, for every encoding (a dynamic
        schedule's chunks ran at the lengths they run at there): one prefill answers
        questions at many distances from a needle near its start.

        The whole chunks a prefix shares token for token with the one before it are not read
        again (`shared_chunks`): the cache is cropped back to them and the rest is read in the
        chunks a fresh prefill would use. A chunk's keys and values depend only on the cache
        before it and its own tokens, and each chunk runs at the length it runs at in a fresh
        prefill (what a dynamic schedule reads), so the answers are a fresh prefill's bit for
        bit (tested). Haystacks of one length share their filler up to the first needle: at
        one needle in the middle, half of each prefix after the first."""
        backbone, device, stops = self.backbone, self.device, frozenset(stop)
        cache: Any = None
        held: tuple[int, ...] = ()  # the prefix the cache holds (after cropping the answers)
        held_chunk = 0  # the chunks it was read in
        for prompt in prompts:
            prefix, cuts = tuple(prompt.prefix), prompt.cut_points()
            P = len(prefix)
            chunk = chunk_dividing(self.prefill_chunk, [c for c in cuts if c < P])
            kept = shared_chunks(held, prefix, chunk) if chunk == held_chunk else 0
            if kept == 0:  # the first prefix, or one that shares no whole chunk
                cache = backbone.new_cache()
            else:
                backbone.crop_cache(cache, kept)
            read = max(cuts, default=P)  # nothing past the longest cut is ever asked after
            ids = torch.tensor([prefix[:read]], dtype=torch.long, device=device)  # (1, read)
            for start in range(kept, read, chunk):
                backbone.run(ids[:, start : start + chunk], cache, None, None, last_only=True)
            answers: list[list[int]] = [[] for _ in cuts]
            for i in sorted(range(len(cuts)), key=lambda i: -cuts[i]):  # longest cut first
                backbone.crop_cache(cache, cuts[i])
                budget = prompt.max_new_tokens[i]
                answers[i] = self._answer_after(cache, prompt.questions[i], budget, chunk, stops)
            backbone.crop_cache(cache, min(cuts, default=read))
            held, held_chunk = prefix[: min(cuts, default=read)], chunk
            yield answers

    def _answer_after(
        self, cache: Any, question: Sequence[int], budget: int, chunk: int, stops: frozenset[int]
    ) -> list[int]:
        """Greedy answer to ``question`` read after what ``cache`` holds (which it extends)."""
        backbone, device = self.backbone, self.device
        q = torch.tensor([list(question)], dtype=torch.long, device=device)  # (1, Q)
        for start in range(0, q.shape[1], chunk):
            logits = backbone.run(q[:, start : start + chunk], cache, None, None, True)
        new: list[int] = []
        for step in range(budget):
            token = int(logits[0, -1].argmax())
            if token in stops:
                break
            new.append(token)
            if step == budget - 1:
                break
            step_ids = torch.tensor([[token]], dtype=torch.long, device=device)  # (1, 1)
            logits = backbone.run(step_ids, cache, None, None, last_only=True)
        return new

    @property
    def kv_bytes_per_token(self) -> int | None:
        shape = self.backbone.fingerprint()
        dims = ("n_layers", "n_kv_heads", "head_dim")
        if not all(isinstance(shape.get(k), int) for k in dims):
            return None
        per_token = 2 * shape["n_layers"] * shape["n_kv_heads"] * shape["head_dim"]
        return per_token * self.backbone.dtype.itemsize  # keys and values of every layer

    def _greedy_batch(
        self, prompts: list[Sequence[int]], max_new_tokens: int, stops: Tensor
    ) -> list[list[int]]:
        device = self.device
        B = len(prompts)
        P = max(len(p) for p in prompts)
        padded = any(len(p) != P for p in prompts)
        ids = torch.zeros(B, P, dtype=torch.long, device=device)
        mask = torch.zeros(B, P, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends at column P-1
            ids[row, P - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            mask[row, P - len(prompt) :] = 1
        # A row's positions count its own tokens only, so padding never shifts them.
        positions = (mask.cumsum(-1) - 1).clamp(min=0) if padded else None  # (B, P)

        cache = self.backbone.new_cache()
        chunk = self._chunk(B)
        for start in range(0, P, chunk):
            stop = min(P, start + chunk)
            logits = self.backbone.run(
                ids[:, start:stop],
                cache,
                mask[:, :stop] if padded else None,
                positions[:, start:stop] if positions is not None else None,
                last_only=True,
            )
        new: list[list[int]] = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool, device=device)
        next_position = positions[:, -1:] + 1 if positions is not None else None  # (B, 1)
        for step in range(max_new_tokens):
            token = logits[:, -1].argmax(dim=-1)  # (B,)
            stopped = torch.isin(token, stops)
            for row in (~done & ~stopped).nonzero().flatten().tolist():
                new[row].append(int(token[row]))
            done |= stopped
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            if padded:
                mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)  # (B, S+1)
            logits = self.backbone.run(
                token[:, None], cache, mask if padded else None, next_position, True
            )
            if next_position is not None:
                next_position = next_position + 1
        return new

    def describe(self) -> dict[str, Any]:
        return {**self.backbone.describe(), "config": self.backbone.config_identity()}

    def identity(self) -> dict[str, Any]:
        return self.backbone.identity()


def as_language_model(
    model: Backbone | nn.Module | LanguageModel,
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    chunk_size: int | None = None,
) -> LanguageModel:
    """Wrap `model` for the evaluations.

    A `LanguageModel` is returned as is; a Backbone, a ropekit `Decoder` (or a module with its
    forward contract) or a transformers causal LM gets a `BackboneLM`. `tokenizer`: a ropekit
    `Tokenizer`, a name or path for `load_tokenizer`, or None (the backbone's own; bytes for a
    Decoder; required for Hugging Face models).
    """
    if isinstance(model, BackboneLM):
        return model
    if not isinstance(model, Backbone | nn.Module) and isinstance(model, LanguageModel):
        return model
    backbone = as_backbone(model, tokenizer)
    backbone.require_tokenizer()
    return BackboneLM(backbone, chunk_size)


def place_on(lm: LanguageModel, device: torch.device | None) -> None:
    """Move a wrapped model to `device`; None leaves it where the caller put it.

    Evaluations launched as several processes call it with each process's device (its own
    GPU, or the CPU under ACCELERATE_USE_CPU), so the processes do not all share one."""
    if device is not None and isinstance(lm, BackboneLM) and lm.device != torch.device(device):
        lm.model.to(device)


_NEWLINE_CACHE: weakref.WeakKeyDictionary[Tokenizer, frozenset[int]] = weakref.WeakKeyDictionary()


def newline_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids whose decoded text contains a newline: answers end at the first of them.

    Byte tokenizers: just 10. Subword vocabularies merge newlines into other tokens (".\\n"),
    so every id is decoded once (cached per tokenizer object).
    """
    if isinstance(tokenizer, ByteTokenizer):
        return frozenset({10})
    if tokenizer not in _NEWLINE_CACHE:
        if isinstance(tokenizer, HFTokenizer):  # one call into Rust instead of V Python calls
            texts = tokenizer.tokenizer.batch_decode([[i] for i in range(tokenizer.vocab_size)])
        else:
            texts = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
        _NEWLINE_CACHE[tokenizer] = frozenset(i for i, t in enumerate(texts) if "\n" in t)
    return _NEWLINE_CACHE[tokenizer]
