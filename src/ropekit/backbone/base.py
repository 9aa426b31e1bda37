"""The seam: one interface for "a language model whose positional encoding ropekit owns".

Shape legend: B batch · T tokens · C tokens in one chunk · S keys so far · V vocabulary.

Training, evaluation and analysis never ask which kind of model they hold; they call a
``Backbone``. Two implementations exist, ``DecoderBackbone`` (ropekit's reference decoder, or
any module with its forward contract) and ``HFBackbone`` (a transformers causal LM of a
supported architecture, PEFT-wrapped or not). Everything that differs between them lives
behind these methods:

- the encoding: ``encoding``, ``set_encoding(spec)``, ``own_encoding()`` (an unpatched model's
  own RoPE as a ropekit encoding, for analysis), ``encoded_layers()`` (the layers that encoding
  rotates, with their types), ``training_length``;
- identity: ``fingerprint()`` (what an adapter must match: architecture, heads, base, L0) and
  ``identity()`` (what a result's provenance records: that plus a digest of every weight),
  ``weights_sample()`` (a few weights, which an adapter records to refuse another model of
  the same shape);
- training: ``lora_targets``, ``enable_grad_checkpointing()``, ``training_logits(module,
  batch)`` (the logits the loss is taken on, with the inputs each kind needs),
  ``block_names()`` (the decoder blocks, which sharded training wraps one by one);
- scoring, for evals: ``new_cache()``, ``run(ids, cache, mask, positions, last_only)``,
  ``cache_length(cache)``, ``crop_cache(cache, length)`` (back to a prefix, so many questions
  share one prefill), ``token_nll(ids, chunk)``, ``prefix_nll(ids, lengths, chunk)`` (the
  prefixes of one input in one reading), ``group_prompts(prompts)``, ``eos_ids``,
  ``vocab_size``, ``forward_logits(ids)``;
- ``cast(dtype)``: compute in float32, bfloat16 or float16 (the encoding's parameters kept);
- ``describe()``: the JSON a result file carries about the model.

Adapters (positional parameters and LoRA weights) are written and applied through the
backbone in ``adapters.py``; models are opened in ``load.py``.

Holds: Backbone, parameter_digest, COMPUTE_DTYPES, WEIGHTS_SAMPLE, FULL_ATTENTION.
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import copy
import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ropekit.data.tokenizers import Tokenizer, tokenizer_identity
from ropekit.encodings import PositionEncoding, Spec
from ropekit.utils import warn_if_emulated

# The compute dtypes a model can be scored in (``Backbone.cast``; ``--dtype`` on the command line).
# How many backbone weights an adapter records of its model (Backbone.weights_sample).
WEIGHTS_SAMPLE = 64
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The type of a layer that attends to every earlier token (transformers' name): every layer of a
# model whose layers are all alike (``Backbone.encoded_layers``).
FULL_ATTENTION = "full_attention"


def parameter_digest(tensors: Mapping[str, Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of ``tensors`` (sorted by name): equal
    digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        data = t.cpu().contiguous().reshape(-1)  # 0-dim tensors (AdaRoPE knobs) too
        if data.numel():
            h.update(memoryview(data.view(torch.uint8).numpy()))
    return h.hexdigest()


class Backbone(abc.ABC):
    """A language model and its tokenizer, seen the same way whatever its kind (module
    docstring)."""

    kind: ClassVar[str]  # "decoder" | "hf": recorded in result files, never branched on

    def __init__(self, model: nn.Module, tokenizer: Tokenizer | None) -> None:
        self.model = model
        # None only for a Hugging Face model opened without one: enough to attach encodings
        # and adapters; scoring and training data need it (``require_tokenizer``).
        self.tokenizer = tokenizer
        self.source: Path | None = None  # the folder it was opened from (load.py), if any
        # What was applied on top of the weights the backbone was opened with (adapters.py).
        self.adapter_sha256: str | None = None
        self._digest: tuple[tuple, str] | None = None

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(
                "tokenizer=None is not allowed for a Hugging Face model; allowed: a tokenizer "
                "folder, a .gguf file, or a ropekit HFTokenizer"
            )
        return self.tokenizer

    # ------------------------------------------------------------------ the encoding
    @property
    @abc.abstractmethod
    def encoding(self) -> PositionEncoding | None:
        """The ropekit encoding every attention layer calls (None: the model's own RoPE)."""

    @abc.abstractmethod
    def build_encoding(self, spec: Spec | str) -> PositionEncoding:
        """The encoding ``spec`` names, built for this model's shape (not attached); options
        the spec omits (base, original length, pairing, fraction) come from the model."""

    @abc.abstractmethod
    def set_encoding(self, spec: Spec | str | PositionEncoding) -> PositionEncoding:
        """Attach the encoding ``spec`` names (``build_encoding``) or one built already."""

    @abc.abstractmethod
    def own_encoding(self) -> contextlib.AbstractContextManager[tuple[PositionEncoding, bool]]:
        """A block in which the model runs through a ropekit encoding: yields (encoding,
        whether it was attached just for this block, and is removed on exit)."""

    def encoded_layers(self) -> dict[int, str]:
        """Layer index -> layer type, for the layers whose attention calls ``encoding`` (inside
        ``own_encoding`` for a model that runs its own RoPE), in layer order. Here every layer
        of the encoding, all of one type; a model whose spec covers only some layer types
        (others on their own RoPE, or NoPE) names those."""
        encoding = self.encoding
        return dict.fromkeys(range(0 if encoding is None else encoding.n_layers), FULL_ATTENTION)

    @property
    @abc.abstractmethod
    def training_length(self) -> int:
        """The context the model was trained at (L0, tokens)."""

    # ------------------------------------------------------------------ identity
    @abc.abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """What an adapter records about the model it belongs to and must match to load:
        architecture, n_layers, n_heads, n_kv_heads, head_dim, base, original_length."""

    @abc.abstractmethod
    def config_identity(self) -> dict[str, Any]:
        """The configuration a result depends on, beyond the fingerprint (JSON-ready)."""

    def positional_parameters(self) -> dict[str, Tensor]:
        encoding = self.encoding
        return {} if encoding is None else dict(encoding.named_parameters())

    def lora_parameters(self) -> dict[str, Tensor]:
        """LoRA weights added by ``adapters.add_lora`` (empty when none)."""
        return {n: p for n, p in self.model.named_parameters() if "lora_" in n}

    def backbone_parameters(self) -> dict[str, Tensor]:
        """Every weight that is neither positional nor LoRA, each shared tensor once."""
        skip = {id(p) for p in self.positional_parameters().values()}
        skip |= {id(p) for p in self.lora_parameters().values()}
        state: dict[str, Tensor] = {}
        seen: set[int] = set()
        for name, p in self.model.named_parameters(remove_duplicate=True):
            if id(p) not in skip and id(p) not in seen:
                seen.add(id(p))
                state[name] = p
        return state

    def weights_digest(self) -> str:
        """``parameter_digest`` of the backbone weights, cached while no weight changes (the
        key is every tensor's storage and version counter)."""
        params = self.backbone_parameters()
        key = tuple((n, p.data_ptr(), p._version) for n, p in sorted(params.items()))
        if self._digest is None or self._digest[0] != key:
            self._digest = (key, parameter_digest(params))
        return self._digest[1]

    def weights_sample(self, n: int = WEIGHTS_SAMPLE) -> list[float]:
        """``n`` backbone weights at evenly spaced positions of the parameters laid end to end
        (sorted by name): what an adapter records of the model it was made for. Unlike
        ``weights_digest`` it survives a cast, so the same model loaded in bfloat16 or float32
        still matches (``adapters.check_weights``), while another model of the same shape
        differs at almost every position."""
        params = sorted(self.backbone_parameters().items())
        ends = list(itertools.accumulate(p.numel() for _, p in params))
        sample = []
        for k in range(n):
            position = (2 * k + 1) * ends[-1] // (2 * n)  # the middle of the k-th of n strides
            i = bisect.bisect_right(ends, position)
            start = ends[i - 1] if i else 0
            sample.append(float(params[i][1].detach().reshape(-1)[position - start]))
        return sample

    def identity(self) -> dict[str, Any]:
        """What a result's provenance records about the model: kind, fingerprint, config, a
        digest of the weights, the encoding's spec and a digest of its parameters, LoRA
        weights, tokenizer. The adapter file they came from is not part of it (``describe``
        names it): a model trained in memory and the same model reloaded from its adapter
        are the same model."""
        encoding = self.encoding
        lora = self.lora_parameters()
        return {
            "kind": self.kind,
            "fingerprint": self.fingerprint(),
            "config": self.config_identity(),
            "weights": self.weights_digest(),
            "spec": None if encoding is None else encoding.spec,
            "positional": parameter_digest(self.positional_parameters()) if encoding else None,
            "lora": parameter_digest(lora) if lora else None,
            "tokenizer": tokenizer_identity(self.tokenizer),
        }

    # ------------------------------------------------------------------ training
    lora_targets: ClassVar[tuple[str, ...]] = ()  # default LoRA target module names

    @abc.abstractmethod
    def enable_grad_checkpointing(self) -> Callable[[], None]:
        """Recompute each layer in the backward (non-reentrant); returns the switch back."""

    @abc.abstractmethod
    def training_logits(self, module: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
        """Logits (B, T, V) of ``module`` (this backbone's model, its data-parallel wrapper, or
        its sharded training copy) on a training batch: ``input_ids`` (B, T) and optional
        ``position_ids`` (B, T)."""

    @abc.abstractmethod
    def block_names(self) -> tuple[str, ...]:
        """Qualified names, in ``self.model.named_modules()``, of the decoder blocks (the
        transformer layers) in order: the units sharded training (FSDP2) gathers one at a
        time, so only one block's full weights exist at once."""

    # ------------------------------------------------------------------ scoring
    def cast(self, dtype: torch.dtype) -> None:
        """Compute in ``dtype``: every floating weight and buffer of the model is cast, except
        the encoding's (positional parameters stay in the dtype they train in; rotation angles
        are formed in float64 and cast to the activations' dtype at use). The weights digest
        (``identity``) then differs, so a result scored in one dtype is never reused as
        another's."""
        if dtype not in COMPUTE_DTYPES.values():
            allowed = ", ".join(COMPUTE_DTYPES)
            raise ValueError(f"dtype={dtype} is not allowed; allowed: {allowed}")
        warn_if_emulated(dtype, self.device, "the model's compute")
        encoding = self.encoding
        keep = set() if encoding is None else {id(t) for t in encoding.parameters()}
        keep |= set() if encoding is None else {id(t) for t in encoding.buffers()}
        changed = False
        with torch.no_grad():
            for module in self.model.modules():
                for store in (module._parameters, module._buffers):
                    for name, t in store.items():
                        if t is None or id(t) in keep or not t.is_floating_point():
                            continue
                        if t.dtype != dtype:
                            changed = True
                            if isinstance(t, nn.Parameter):
                                t.data = t.data.to(dtype)
                            else:
                                store[name] = t.to(dtype)
        if changed:
            self._digest = None  # the weights' bytes changed under the same storages' names

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: that of the backbone's floating weights."""
        for t in self.backbone_parameters().values():
            if t.is_floating_point():
                return t.dtype
        return torch.float32

    @property
    def device(self) -> torch.device:
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return self.require_tokenizer().vocab_size

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end a reply (the model's end-of-sequence tokens); empty for byte models."""
        return frozenset()

    @abc.abstractmethod
    def new_cache(self) -> Any:
        """An empty KV cache of the model's kind."""

    @abc.abstractmethod
    def run(
        self,
        ids: Tensor,
        cache: Any,
        mask: Tensor | None,
        positions: Tensor | None,
        last_only: bool,
    ) -> Tensor:
        """Feed ids (B, C) after what ``cache`` holds (None: no cache, one full forward).

        mask (B, S) covers every key so far (cached + new), positions (B, C); both None for
        unpadded rows. Returns logits (B, C, V), or (B, 1, V) when ``last_only``."""

    @abc.abstractmethod
    def final_hidden(self, ids: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        """One plain forward over ids (B, T) (positions 0..T-1, no cache) without the logits:
        the hidden states (B, T, d) the head reads, and the head (hidden -> logits)."""

    @abc.abstractmethod
    def cache_length(self, cache: Any) -> int:
        """S: the tokens ``cache`` holds."""

    @abc.abstractmethod
    def crop_cache(self, cache: Any, length: int) -> None:
        """Keep the first ``length`` tokens of ``cache`` (0 <= length <= S), in place: what
        follows then continues that prefix exactly as after a fresh prefill of it (positions
        included). ValueError for a length out of range or a cache that cannot be cropped."""

    @abc.abstractmethod
    def group_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Indices of the prompts that can be decoded in one batch, group by group."""

    @torch.inference_mode()
    def token_nll(self, input_ids: Tensor, chunk: int) -> Tensor:
        """input_ids (B, T+1) -> float32 (B, T): NLL (nats) of token t+1 given tokens <= t.

        The model reads input_ids[:, :-1] in chunks of ``chunk`` tokens through the KV cache
        (one forward when the sequence fits): attention is causal, so the numbers are a single
        forward's, with a (B, chunk, V) logits tensor at a time instead of (B, T, V). An
        encoding that follows the length attended (``scores_in_one_forward``: dynamic NTK,
        LongRoPE, DCA's scale, STRING's shift) would see a shorter length in the early chunks,
        so it reads the whole sequence in one forward and only its logits are taken a chunk at
        a time (as transformers and the methods' authors define them). The log-softmax is
        taken in float32 whatever the model's dtype (bf16 log-probabilities lose the digits
        that tell models apart).
        """
        return self._read(input_ids, chunk, ())[0]

    @torch.inference_mode()
    def prefix_nll(self, input_ids: Tensor, lengths: Sequence[int], chunk: int) -> list[Tensor]:
        """input_ids (T+1,) -> for each n of ``lengths`` (1 <= n <= T) the float32 (n,) NLL
        that ``token_nll(input_ids[None, : n + 1], chunk)[0]`` gives, bit for bit, with the
        prefix they share read once.

        A prefix of more than one chunk is read in the same chunks as the longest, through
        the same cache, up to its own last chunk: those rows are the longest's. Its last
        chunk, when shorter than the longest's there, is read on a copy of the cache
        (``copy.deepcopy``, transformers' way to reuse a prompt's cache) before the longest
        goes on. A prefix of one chunk or less is one forward without a cache, and every
        prefix of a length-following encoding is one forward of its own (``token_nll``): those
        are read alone, since the longest's numbers are not theirs."""
        T = input_ids.shape[-1] - 1
        if input_ids.dim() != 1 or not lengths or any(not 1 <= n <= T for n in lengths):
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and lengths={list(lengths)!r} are not "
                f"allowed; allowed: input_ids (T+1,) and lengths in 1..T, here 1..{T}"
            )
        ids, longest = input_ids[None], max(lengths)
        shared = () if self.scores_in_one_forward else {n for n in lengths if chunk < n < longest}
        whole, forked = self._read(ids[:, : longest + 1], chunk, sorted(shared))
        rows = {longest: whole[0]} | {n: row[0] for n, row in forked.items()}
        alone = {n: self.token_nll(ids[:, : n + 1], chunk)[0] for n in set(lengths) - set(rows)}
        return [(rows | alone)[n] for n in lengths]

    def _read(
        self, input_ids: Tensor, chunk: int, forks: Sequence[int]
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """``token_nll``'s reading of input_ids (B, T+1), and for each fork n (chunk < n < T,
        read through the cache) the (B, n) rows of its prefix: the reading's own up to the
        start of n's last chunk, then that chunk read alone on a copy of the cache."""
        ids = input_ids.to(self.device, torch.long)
        inputs, targets = ids[:, :-1], ids[:, 1:]  # (B, T), (B, T)
        B, T = inputs.shape
        nll = torch.empty(B, T, dtype=torch.float32, device=ids.device)
        whole = chunk < T and self.scores_in_one_forward
        hidden, head = self.final_hidden(inputs) if whole else (None, None)  # (B, T, d)
        cache = None if chunk >= T or whole else self.new_cache()
        tails: dict[int, Tensor] = {}  # fork -> NLL of its last chunk, (B, C)
        for start in range(0, T, chunk):
            stop = min(T, start + chunk)
            for n in forks:  # a fork whose last chunk starts here and ends before this one
                if (n - 1) // chunk * chunk == start and n < stop:
                    fork = copy.deepcopy(cache)
                    logits = self.run(inputs[:, start:n], fork, None, None, last_only=False)
                    tails[n] = _nll(logits, targets[:, start:n])
            if whole:
                logits = head(hidden[:, start:stop])  # (B, C, V)
            else:
                logits = self.run(inputs[:, start:stop], cache, None, None, last_only=False)
            nll[:, start:stop] = _nll(logits, targets[:, start:stop])
        # A fork whose last chunk is the reading's own chunk there is the reading's prefix.
        forked = {n: nll[:, :n] for n in forks} | {
            n: torch.cat([nll[:, : n - tail.shape[1]], tail], 1) for n, tail in tails.items()
        }
        return nll.cpu(), {n: row.cpu().clone() for n, row in forked.items()}

    @property
    def scores_in_one_forward(self) -> bool:
        """Whether ``token_nll`` reads a long sequence in one forward (its encoding follows the
        length attended) rather than in chunks through the cache."""
        encoding = self.encoding
        return encoding is not None and bool(encoding.dynamic)

    def forward_logits(self, ids: Tensor) -> Tensor:
        """Logits (B, T, V) of one plain forward over ids (B, T): positions 0..T-1, no cache."""
        return self.run(ids, None, None, None, last_only=False)

    def describe(self) -> dict[str, Any]:
        """JSON-ready description of the model for result files."""
        return {
            "backbone": self.kind,
            "class": type(self.model).__name__,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "tokenizer": None if self.tokenizer is None else self.tokenizer.name,
            "fingerprint": self.fingerprint(),
            "adapter_sha256": self.adapter_sha256,
        }


def _nll(logits: Tensor, targets: Tensor) -> Tensor:
    """(B, C, V) logits and (B, C) targets -> float32 (B, C) NLL: the log-softmax in float32
    whatever the model's dtype (bf16 log-probabilities lose the digits that tell models
    apart)."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return nll.view(targets.shape)
