"""One small interface over every model the evaluations run: ropekit Decoders and Hugging Face
causal LMs alike.

Holds:
- `LanguageModel`: the protocol evaluations call: `token_nll`, `greedy`, `tokenizer`,
  `eos_ids`, `describe`.
- `CachedLM`: the shared algorithms (chunked scoring, batched greedy decoding with a KV cache);
  a subclass only says how to run one chunk of tokens through its model.
- `DecoderLM`: a ropekit `Decoder` (or any module with its forward contract:
  `forward(input_ids, position_ids=None, cache=KVCache, labels=None) -> .logits, .cache`).
  It has no padding mask, so prompts of unequal length are decoded in groups of equal length.
- `HFCausalLM`: a transformers causal LM; unequal prompts are left-padded, with an attention
  mask and positions counted from each row's first real token.
- `as_language_model(model, tokenizer)`: picks the adapter by the model's class.
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

import inspect
import os
import weakref
from collections.abc import Collection, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ropekit.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

# Largest float32 logits block one chunk may produce (bytes); sets the default chunk length.
LOGITS_BUDGET_BYTES = 256 * 2**20


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

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end a reply (the model's end-of-sequence tokens); empty for byte models."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-ready description of the model for result files."""
        ...


class CachedLM:
    """Chunked scoring and batched greedy decoding, shared by both adapters.

    A subclass implements `_new_cache`, `_run` (one chunk through the model) and
    `_group_prompts` (which prompts may share a batch). `chunk_size` is the number of tokens
    per forward when a sequence is fed through the cache; None picks the longest chunk whose
    float32 logits fit `LOGITS_BUDGET_BYTES`.
    """

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, chunk_size: int | None = None):
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r} is not allowed; allowed: None or >= 1")
        if not isinstance(tokenizer, Tokenizer):
            raise ValueError(
                f"tokenizer={tokenizer!r} is not allowed; allowed: a ropekit Tokenizer "
                "(ByteTokenizer, HFTokenizer, or load_tokenizer(name_or_path))"
            )
        self.model = model.eval()  # evaluation: no dropout
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size

    # ------------------------------------------------------------------ subclass hooks
    def _new_cache(self) -> Any:
        raise NotImplementedError

    def _run(
        self,
        ids: Tensor,
        cache: Any,
        mask: Tensor | None,
        positions: Tensor | None,
        last_only: bool,
    ) -> Tensor:
        """Feed ids (B, C) after what `cache` holds (None: no cache, a single full forward).

        mask (B, S) covers every key so far (cached + new), positions (B, C); both None for
        unpadded rows. Returns logits (B, C, V), or (B, 1, V) when `last_only`.
        """
        raise NotImplementedError

    def _group_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Indices of the prompts that are decoded together, group by group."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared algorithms
    @property
    def device(self) -> torch.device:
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset()

    def _chunk(self, batch: int) -> int:
        if self.chunk_size is not None:
            return self.chunk_size
        return max(64, LOGITS_BUDGET_BYTES // (4 * batch * max(self.vocab_size, 1)))

    @torch.inference_mode()
    def token_nll(self, input_ids: Tensor) -> Tensor:
        """input_ids (B, T+1) -> float32 (B, T) NLL (nats) of input_ids[:, 1:].

        The model reads input_ids[:, :-1]; the log-softmax is taken in float32 whatever the
        model's dtype, since bf16 log-probabilities lose the digits that tell models apart.
        """
        if input_ids.dim() != 2 or input_ids.shape[1] < 2:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} must be (B, T+1) with T >= 1")
        ids = input_ids.to(self.device, torch.long)
        inputs, targets = ids[:, :-1], ids[:, 1:]  # (B, T), (B, T)
        B, T = inputs.shape
        chunk = self._chunk(B)
        nll = torch.empty(B, T, dtype=torch.float32, device=ids.device)
        cache = None if chunk >= T else self._new_cache()
        for start in range(0, T, chunk):
            stop = min(T, start + chunk)
            logits = self._run(inputs[:, start:stop], cache, None, None, last_only=False)
            nll[:, start:stop] = F.cross_entropy(
                logits.float().flatten(0, 1),  # (B*C, V)
                targets[:, start:stop].flatten(),
                reduction="none",
            ).view(B, stop - start)
        return nll.cpu()

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
        for group in self._group_prompts(prompts):
            for i, ids in zip(
                group,
                self._greedy_batch([prompts[i] for i in group], max_new_tokens, stops),
                strict=True,
            ):
                out[i] = ids
        return out

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

        cache = self._new_cache()
        chunk = self._chunk(B)
        for start in range(0, P, chunk):
            stop = min(P, start + chunk)
            logits = self._run(
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
            logits = self._run(token[:, None], cache, mask if padded else None, next_position, True)
            if next_position is not None:
                next_position = next_position + 1
        return new

    def describe(self) -> dict[str, Any]:
        config = getattr(self.model, "config", None)
        to_dict = getattr(config, "to_dict", None)
        return {
            "adapter": type(self).__name__,
            "class": type(self.model).__name__,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "tokenizer": self.tokenizer.name,
            "config": to_dict() if callable(to_dict) else None,
        }


class DecoderLM(CachedLM):
    """A ropekit `Decoder` seen as a `LanguageModel`.

    The decoder has no padding mask (a pad token would be attended to), so `greedy` batches
    only prompts of equal length; tasks at one target length mostly produce equal lengths.
    """

    def _new_cache(self) -> Any:
        from ropekit.model.cache import KVCache

        return KVCache()

    def _run(self, ids, cache, mask, positions, last_only):
        # Default positions continue after the cached ones, which is what unpadded rows need.
        logits = self.model(ids, cache=cache).logits  # (B, C, V)
        return logits[:, -1:] if last_only else logits

    def _group_prompts(self, prompts):
        groups: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(len(prompt), []).append(i)
        return list(groups.values())


class HFCausalLM(CachedLM):
    """A Hugging Face causal LM (`AutoModelForCausalLM`) seen as a `LanguageModel`."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, chunk_size: int | None = None):
        super().__init__(model, tokenizer, chunk_size)
        # Not every architecture accepts logits_to_keep; where it does, decoding computes one
        # row of logits per step instead of C.
        self._keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    @property
    def eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        generation = getattr(self.model, "generation_config", None)
        for source in (getattr(generation, "eos_token_id", None), self.model.config.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        if (
            isinstance(self.tokenizer, HFTokenizer)
            and self.tokenizer.tokenizer.eos_token_id is not None
        ):
            ids.add(int(self.tokenizer.tokenizer.eos_token_id))
        return frozenset(ids)

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _run(self, ids, cache, mask, positions, last_only):
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": cache is not None}
        if cache is not None:
            kwargs["cache"] = cache
        if mask is not None:
            kwargs["attention_mask"] = mask
        if positions is not None:
            kwargs["position_ids"] = positions
        if last_only and self._keep:
            kwargs["logits_to_keep"] = 1
        logits = self.model(**kwargs).logits  # (B, C, V) or (B, 1, V)
        return logits[:, -1:] if last_only else logits

    def _group_prompts(self, prompts):
        return [list(range(len(prompts)))]  # left padding lets any prompts share a batch


def as_language_model(
    model: nn.Module | LanguageModel,
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    chunk_size: int | None = None,
) -> LanguageModel:
    """Wrap `model` for the evaluations.

    A `LanguageModel` is returned as is. A transformers `PreTrainedModel` gets `HFCausalLM`;
    any other module must follow the ropekit `Decoder` forward contract and gets `DecoderLM`.
    `tokenizer`: a ropekit `Tokenizer`, a name or path for `load_tokenizer`, or None (bytes
    for a Decoder; required for Hugging Face models).
    """
    if isinstance(model, CachedLM):
        return model
    if not isinstance(model, nn.Module):
        if isinstance(model, LanguageModel):
            return model
        raise ValueError(
            f"model={type(model).__name__} is not allowed; allowed: a ropekit Decoder, a "
            "transformers causal LM, or a LanguageModel"
        )
    from transformers import PreTrainedModel

    is_hf = isinstance(model, PreTrainedModel)
    if tokenizer is None:
        if is_hf:
            raise ValueError(
                "tokenizer=None is not allowed for a Hugging Face model; allowed: a tokenizer "
                "folder, a .gguf file, or a ropekit HFTokenizer"
            )
        tokenizer = ByteTokenizer()
    elif not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer)
    return (HFCausalLM if is_hf else DecoderLM)(model, tokenizer, chunk_size)


def place_on(lm: LanguageModel, device: torch.device | None) -> None:
    """Move a wrapped model to `device`; None leaves it where the caller put it.

    Evaluations launched as several processes call it with each process's device (its own
    GPU, or the CPU under ACCELERATE_USE_CPU), so the processes do not all share one."""
    if device is not None and isinstance(lm, CachedLM) and lm.device != torch.device(device):
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
