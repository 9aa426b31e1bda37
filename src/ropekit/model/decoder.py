"""The reference decoder: a small Llama-style language model that takes any position encoding.

Shape legend: B batch · T new (query) tokens · S keys (cached + new; S = T without a cache) ·
H query heads · K key/value heads · D head dim · d model width · M SwiGLU hidden width ·
V vocabulary.

    tokens -> embedding -> encoding.embed -> n_layers x Block -> RMSNorm -> LM head -> logits
    Block:  x = x + Attention(RMSNorm(x));  x = x + SwiGLU(RMSNorm(x))      (pre-norm)

The encoding is ONE module, ``model.encoding``, shared by every layer; each attention passes
its layer index so per-layer parameters (AdaRoPE) are selected there. Absolute encodings add
to the token states (``embed``), rotary ones rotate q and k (``rotate_q``/``rotate_k``), bias
ones add to the attention logits (``score_bias``); every path is always called, and the
defaults are identities. Encodings that remap the query-key distance (``remaps_distance``:
ReRoPE, Self-Extend, DCA, STRING) attend instead through their ``bands``
(``ropekit.encodings.bands.banded_attention``: per band, q and k rotated at that band's
positions, merged to round-off, in blocks of query rows), with the cache holding unrotated keys.

Masking: attention is causal within a row. A position that does not exceed its predecessor
in ``position_ids`` starts a new document (packed rows), and tokens then attend only within
their document; gaps (positions that jump forward) stay within one document.

Score biases (ALiBi) never need an (H, T, S) tensor per layer: with autograd the masked bias is
built once per forward and shared by the layers (``Visibility.score_bias``); without autograd
and without probe hooks, attention runs in blocks of query rows, each with its own slice of the
bias over the keys it can see (``Attention._attend_in_row_blocks``), so memory stays O(T).

Analysis hook: every attention owns an identity child module ``attn.probe`` (a ``Probe``),
called as ``q, k = self.probe(q, k, bias)`` just before SDPA. A standard forward hook,
``model.blocks[i].attn.probe.register_forward_hook(fn)``, is called as
``fn(probe, (q, k, bias), (q, k))`` with
  - q (B, H, T, D): the queries after ``rotate_q`` (rotation and AdaScale temperature);
  - k (B, K, S, D): every key the queries attend to, cached ones included, after
    ``rotate_k``; with grouped-query attention query head h reads key head h // (H / K);
  - bias (B|1, H, T, S) float, or None: the additive mask SDPA receives, i.e. the encoding's
    score bias where attention is allowed and -inf where the causal/document mask forbids it;
    None when the encoding has no score bias (the mask is then causal, plus documents);
  - ``probe.layer``: the layer index.
The attention logits are ``q @ k.T / sqrt(D) (+ bias)``. A hook may return a replacement
``(q, k)`` to intervene (e.g. ablate a head). In training the tensors carry autograd
history: detach what a hook keeps.

Holds: Probe, Visibility, Attention, SwiGLU, Block, DecoderOutput, Decoder, lm_loss,
load_decoder.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import checkpoint as activation_checkpoint

from ropekit.encodings import PositionEncoding, banded_attention, build
from ropekit.encodings.bands import RotatedKeys

from .cache import KVCache
from .checkpoint import fill_decoder, read_decoder, save_decoder
from .config import DecoderConfig

IGNORE_INDEX = -100  # label value that carries no loss (PyTorch and Hugging Face convention)
# Score biases outside autograd are built for blocks of query rows of at most max(q.numel(),
# SCORE_BIAS_BLOCK) entries (Attention._attend_in_row_blocks): O(T) memory at long context.
SCORE_BIAS_BLOCK = 1 << 20


class Probe(nn.Module):
    """Identity on (q, k): the place analysis code hooks into (see the module docstring)."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, q: Tensor, k: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return q, k

    def extra_repr(self) -> str:
        return f"layer={self.layer}"


class Visibility:
    """Which keys each query may attend to, in the cheapest form SDPA accepts.

    ``causal``: one unbroken sequence and no cache, so SDPA's ``is_causal`` does it without a
    mask tensor. Otherwise ``allowed`` is a bool mask, True where attention is allowed, or
    None when every key is visible (one new token after an unbroken cache).
    """

    def __init__(self, positions: Tensor, key_positions: Tensor, packed: bool) -> None:
        self.T, self.S = positions.shape[-1], key_positions.shape[-1]
        self.device = positions.device
        past = self.S - self.T  # cached keys; query i sits at key index past + i
        documents = None
        if packed and self.S > 1:
            starts = key_positions[:, 1:] <= key_positions[:, :-1]  # (B|1, S-1)
            if bool(starts.any()):
                documents = F.pad(starts.cumsum(-1), (1, 0))  # (B|1, S) document of each key
        self.causal = documents is None and past == 0 and self.T > 1
        self.allowed: Tensor | None = None
        if documents is not None or (past > 0 and self.T > 1):
            # Key j is visible to query i iff j <= past + i.
            ones = torch.ones(self.T, self.S, dtype=torch.bool, device=self.device)
            allowed = ones.tril(diagonal=past)  # (T, S)
            if documents is not None:
                same = documents[:, past:, None] == documents[:, None, :]  # (B|1, T, S)
                allowed = (allowed & same)[:, None]  # (B|1, 1, T, S)
            self.allowed = allowed

    def forbidden_rows(self, start: int, stop: int, keys: int) -> Tensor | None:
        """``forbidden[..., start:stop, :keys]`` for a block of query rows; in the causal case
        built for the block alone, never as the (T, S) mask."""
        if self.allowed is not None:
            return ~self.allowed[..., start:stop, :keys]
        if self.causal:
            ones = torch.ones(stop - start, keys, dtype=torch.bool, device=self.device)
            return ones.triu(diagonal=start + 1)  # (rows, keys): key j > query i is hidden
        return None

    def allowed_rows(self, start: int, stop: int, keys: int) -> Tensor | None:
        """``allowed[..., start:stop, :keys]`` (True = visible) for a block of query rows;
        None when only causality restricts them."""
        if self.allowed is None:
            return None
        return self.allowed[..., start:stop, :keys]

    def score_bias(
        self,
        encoding: PositionEncoding,
        positions: Tensor,
        key_positions: Tensor,
        layer: int,
        dtype: torch.dtype,
    ) -> Tensor | None:
        """The encoding's bias in ``dtype`` with the mask folded in, (B|1, H, T, S) or None.
        An encoding whose bias does not depend on the layer (``layer_independent_bias``, e.g.
        ALiBi) gets it built once per forward and shared by every layer (autograd then keeps
        one copy for backward, not one per layer)."""
        shared = encoding.layer_independent_bias
        biases = self.__dict__.setdefault("_biases", {})  # dtype -> the shared bias
        if shared and dtype in biases:
            return biases[dtype]
        bias = encoding.score_bias(positions, key_positions, layer)  # (1|B, H, T, S)
        if bias is not None:
            bias = self.fold_into(bias.to(dtype))
        if shared:
            biases[dtype] = bias
        return bias

    @functools.cached_property
    def forbidden(self) -> Tensor | None:
        """The complement of the mask, built once per forward and shared by every layer."""
        if self.allowed is not None:
            return ~self.allowed
        if self.causal:
            ones = torch.ones(self.T, self.S, dtype=torch.bool, device=self.device)
            return ones.triu(diagonal=1)  # (T, S)
        return None

    def fold_into(self, bias: Tensor, forbidden: Tensor | None = None) -> Tensor:
        """bias (B|1, H, T, S) with -inf where attention is forbidden (``self.forbidden``, or
        the given block of it).

        In place when the bias already has the full shape, so a layer builds one (T, S)
        tensor, not a bias plus a float mask plus their sum.
        """
        forbidden = self.forbidden if forbidden is None else forbidden
        if forbidden is None:
            return bias
        if torch.broadcast_shapes(bias.shape, forbidden.shape) == bias.shape:
            return bias.masked_fill_(forbidden, float("-inf"))
        return bias.masked_fill(forbidden, float("-inf"))  # a (1, ...) bias over B documents


class Attention(nn.Module):
    """Grouped-query self-attention with the position encoding applied to q and k."""

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads = H = config.n_heads
        self.n_kv_heads = K = config.n_kv_heads
        self.head_dim = D = config.head_dim
        # q, k and v from one matmul (as fast as three on this CPU, one launch on a GPU).
        self.qkv = nn.Linear(config.d_model, (H + 2 * K) * D, bias=False)
        self.proj = nn.Linear(H * D, config.d_model, bias=False)
        self.probe = Probe(layer)

    def forward(
        self,
        x: Tensor,
        encoding: PositionEncoding,
        positions: Tensor,
        key_positions: Tensor,
        visibility: Visibility,
        cache: KVCache | None,
    ) -> Tensor:
        B, T, _ = x.shape
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split((H * D, K * D, K * D), dim=-1)  # (B, T, H*D), 2 x (B, T, K*D)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)
        v = v.view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)

        if encoding.remaps_distance:
            # Distance remaps attend in bands, each rotating q and the (unrotated, cached
            # unrotated) keys at its own positions (ropekit.encodings.bands).
            if cache is not None:
                k, v = cache.update(self.layer, k, v)  # (B, K, S, D) unrotated
            memo = None if cache is None else cache.rotated_keys(self.layer)
            y = self._attend_in_bands(q, k, v, encoding, positions, key_positions, visibility, memo)
            return self.proj(y.transpose(1, 2).reshape(B, T, H * D))  # (B, T, d)
        q = encoding.rotate_q(q, positions, self.layer)
        if not encoding.dynamic:
            k = encoding.rotate_k(k, positions, self.layer)  # rotated once, cached rotated
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, K, S, D)
        if encoding.dynamic:
            # The schedule follows the current length: every key (cached ones are kept
            # unrotated) is rotated at this step's length, as a full forward would (KVCache).
            k = encoding.rotate_k(k, key_positions, self.layer)

        if encoding.has_score_bias and not _needs_full_bias(self.probe, q, k, v):
            y = self._attend_in_row_blocks(q, k, v, encoding, positions, key_positions, visibility)
            return self.proj(y.transpose(1, 2).reshape(B, T, H * D))  # (B, T, d)
        bias = visibility.score_bias(encoding, positions, key_positions, self.layer, q.dtype)
        q, k = self.probe(q, k, bias)  # bias (1|B, H, T, S) or None

        y = _attention(
            q,
            k,
            v,
            attn_mask=visibility.allowed if bias is None else bias,
            is_causal=bias is None and visibility.causal,
        )  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * D))  # (B, T, d)

    def _attend_in_bands(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        encoding: PositionEncoding,
        positions: Tensor,
        key_positions: Tensor,
        visibility: Visibility,
        rotated_keys: RotatedKeys | None = None,
    ) -> Tensor:
        """Attention of a distance-remapping encoding: its bands, merged (to round-off), blockwise
        over query rows (``banded_attention``); causal, with documents from ``visibility``.
        The probe is not called: no single (q, k) pair of tensors describes these logits."""
        S, T = k.shape[-2], q.shape[-2]
        return banded_attention(
            q,
            k,
            v,
            encoding.bands(positions, key_positions, self.layer),
            key_positions,
            functools.partial(encoding.rotate_band, layer=self.layer),
            causal_offset=S - T,
            mask=visibility.allowed_rows if visibility.allowed is not None else None,
            rotated_keys=rotated_keys,
        )  # (B, H, T, D)

    def _attend_in_row_blocks(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        encoding: PositionEncoding,
        positions: Tensor,
        key_positions: Tensor,
        visibility: Visibility,
    ) -> Tensor:
        """Biased attention without the (H, T, S) bias: blocks of query rows, each with the
        bias of its rows over only the keys they can see (no autograd here, so nothing is
        kept). Rows are independent in attention, so the result is the full call's."""
        H, T = q.shape[1], q.shape[2]
        S, past = k.shape[-2], k.shape[-2] - T
        allowed = visibility.allowed
        batch = max(positions.shape[0], key_positions.shape[0])
        if allowed is not None and allowed.dim() == 4:
            batch = max(batch, allowed.shape[0])  # (B|1, 1, T, S): folding broadcasts to B
        # Bias entries per block: at most as many as q has (or SCORE_BIAS_BLOCK), so the bias
        # never outgrows the activations.
        rows = max(1, max(q.numel(), SCORE_BIAS_BLOCK) // (batch * H * S))
        out = []
        for start in range(0, T, rows):
            stop = min(T, start + rows)
            keys = min(S, past + stop)  # keys past the block's last query are all masked
            bias = encoding.score_bias(
                positions[:, start:stop], key_positions[:, :keys], self.layer
            )  # (1|B, H, rows, keys)
            mask = visibility.forbidden_rows(start, stop, keys)
            if bias is None:
                attn_mask = None if mask is None else ~mask
            else:
                attn_mask = visibility.fold_into(bias.to(q.dtype), mask)
            out.append(
                _attention(q[:, :, start:stop], k[:, :, :keys], v[:, :, :keys], attn_mask=attn_mask)
            )  # (B, H, rows, D)
        return out[0] if len(out) == 1 else torch.cat(out, dim=2)  # (B, H, T, D)


def _attention(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """PyTorch's attention of q (B, H, T, D) over k, v (B, K, S, D), K dividing H. On CUDA
    in float32 no fused kernel takes grouped heads (flash takes half precision only, the
    memory-efficient kernel no ``enable_gqa``), and the math kernel it would fall to holds
    (T, S) logits per head: there the key/value heads are repeated instead (measured on an
    H200, SmolLM2-135M's shape at 16k: plain RoPE's forward 1.40 s on the math kernel)."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and q.is_cuda and q.dtype == torch.float32:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1], **kwargs)


def _needs_full_bias(probe: Probe, *tensors: Tensor) -> bool:
    """Autograd must keep the bias for backward (built once, shared by the layers), or a hook
    on the probe must see the whole of it: the row-block path serves neither."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True
    hooks = nn.modules.module
    return bool(
        probe._forward_hooks
        or probe._forward_pre_hooks
        or hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
    )


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020).

    gate and up stay two matmuls: fusing them saves nothing here, and its backward must
    concatenate the two gradients (measured ~5% slower per MLP on this CPU).
    """

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # (B, T, M) -> (B, T, d)


class Block(nn.Module):
    """Pre-norm transformer block: residual attention, then residual SwiGLU."""

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = Attention(config, layer)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.ffn_hidden)

    def forward(
        self,
        x: Tensor,
        encoding: PositionEncoding,
        positions: Tensor,
        key_positions: Tensor,
        visibility: Visibility,
        cache: KVCache | None,
    ) -> Tensor:
        x = x + self.attn(self.attn_norm(x), encoding, positions, key_positions, visibility, cache)
        return x + self.mlp(self.mlp_norm(x))


@dataclasses.dataclass
class DecoderOutput:
    """What ``Decoder.forward`` returns."""

    logits: Tensor  # (B, T, V)
    loss: Tensor | None = None  # mean next-token cross-entropy (nats) when labels were given
    cache: KVCache | None = None  # the cache passed in, now holding these tokens too


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy over labels != -100, computed in float32.

    Labels are aligned with the inputs (the Hugging Face convention for ``model(...,
    labels=)``): ``logits[:, t]`` is scored against ``labels[:, t + 1]``, so
    ``labels = input_ids`` trains a language model. ropekit's training loop does *not* use
    this: ``ropekit.train.loss.cross_entropy_sum`` takes labels already shifted (packed
    samples are cut from T + 1 tokens, ``labels[:, t]`` is the token after input t) and
    scores ``logits[:, t]`` against ``labels[:, t]``; it calls the model without labels.
    """
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels {tuple(labels.shape)} must be (B, T) = {tuple(logits.shape[:2])}")
    # Shift the labels rather than the logits: no copy of the (B, T, V) tensor.
    target = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T)
    return F.cross_entropy(
        logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE_INDEX
    )  # (B*T, V) against (B*T,)


def one_layer_type(encoding: PositionEncoding) -> PositionEncoding:
    """Refuse a spec's ``layers=`` naming types: every layer of this decoder is one type."""
    if encoding.layers not in (None, "all", "rope"):
        raise ValueError(
            f"layers={encoding.layers!r}: ropekit's decoder has one layer type, so a spec "
            "covers every layer (layers=all); layer types are those of Hugging Face models "
            "with several (Gemma 3's local and global layers)"
        )
    return encoding


class Decoder(nn.Module):
    """Decoder-only language model with a pluggable position encoding (module docstring)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.encoding = one_layer_type(
            build(
                config.encoding,
                n_heads=config.n_heads,
                n_kv_heads=config.n_kv_heads,
                head_dim=config.head_dim,
                n_layers=config.n_layers,
                d_model=config.d_model,
                **config.encoding_context(),
            )
        )
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, init_std) everywhere, the residual output projections scaled by
        1/sqrt(2 n_layers) so the residual stream's variance does not grow with depth. The
        encoding keeps its own init (AdaRoPE must start exactly at its base schedule)."""
        std = self.config.init_std
        nn.init.normal_(self.embed.weight, std=std)
        if not self.config.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        residual_std = std / (2 * self.config.n_layers) ** 0.5
        for block in self.blocks:
            nn.init.normal_(block.attn.qkv.weight, std=std)
            nn.init.normal_(block.attn.proj.weight, std=residual_std)
            nn.init.normal_(block.mlp.gate.weight, std=std)
            nn.init.normal_(block.mlp.up.weight, std=std)
            nn.init.normal_(block.mlp.down.weight, std=residual_std)
            block.attn_norm.reset_parameters()
            block.mlp_norm.reset_parameters()
        self.norm.reset_parameters()

    def _positions(
        self, input_ids: Tensor, position_ids: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        """Validated positions (B|1, T); the default continues after the cached ones."""
        B, T = input_ids.shape
        if position_ids is None:
            positions = torch.arange(T, device=input_ids.device)[None]  # (1, T)
            if cache is not None and cache.positions is not None:
                positions = positions + cache.positions[:, -1:] + 1  # after the last cached one
            return positions  # (B|1, T)
        if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
            raise ValueError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
        shape_ok = position_ids.dim() == 2 and position_ids.shape[1] == T
        if not shape_ok or position_ids.shape[0] not in (1, B):
            raise ValueError(
                f"position_ids {tuple(position_ids.shape)} must be (B, T) or (1, T) for "
                f"input_ids {tuple(input_ids.shape)}"
            )
        return position_ids.to(input_ids.device)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        cache: KVCache | None = None,
        labels: Tensor | None = None,
    ) -> DecoderOutput:
        """Logits for input_ids (B, T); with ``cache``, the tokens continue the cached ones.

        position_ids (B|1, T): absolute positions; default arange, continuing after the last
        cached position. Packed (restarting) and offset positions are allowed.
        labels (B, T): aligned with input_ids, shifted here (``lm_loss``, the Hugging Face
        convention; the training loop's loss takes pre-shifted labels instead); -100 = no loss.
        """
        h = self.final_hidden(input_ids, position_ids, cache)  # (B, T, d)
        logits = self.lm_head(h)  # (B, T, V)
        loss = None if labels is None else lm_loss(logits, labels)
        return DecoderOutput(logits=logits, loss=loss, cache=cache)

    def final_hidden(
        self, input_ids: Tensor, position_ids: Tensor | None = None, cache: KVCache | None = None
    ) -> Tensor:
        """The normed hidden states (B, T, d) the head reads (``forward`` without the head),
        for scoring a long window in one forward with its logits taken a chunk at a time."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} must be (B, T)")
        positions = self._positions(input_ids, position_ids, cache)  # (B|1, T)
        packed = position_ids is not None or cache is not None  # default positions never restart
        key_positions = positions if cache is None else cache.append_positions(positions)
        visibility = Visibility(positions, key_positions, packed)  # shared by every layer

        h = self.encoding.embed(self.embed(input_ids), positions)  # (B, T, d)
        # Checkpointing only where activations would be kept for a backward: training, grad
        # on, no cache (a cache's appended keys must not be appended again by a recompute).
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        recompute = recompute and cache is None
        for block in self.blocks:
            args = (h, self.encoding, positions, key_positions, visibility, cache)
            if recompute:
                h = activation_checkpoint.checkpoint(block, *args, use_reentrant=False)
            else:
                h = block(*args)
        return self.norm(h)  # (B, T, d)

    # Off by default; ``gradient_checkpointing_enable`` sets it on the instance.
    gradient_checkpointing: bool = False

    def gradient_checkpointing_enable(self) -> None:
        """Keep only each block's input in training and recompute the block in the backward.

        Saved activations drop from every intermediate of every block (attention inputs,
        q/k/v, SwiGLU hidden states: ~tens of (B, T, d) tensors per layer) to one (B, T, d)
        tensor per layer, for about one extra forward per step (~30% more time). Worth it when
        the sequence, not the weights, fills memory: long-context extension. Non-reentrant
        ``torch.utils.checkpoint`` (``use_reentrant=False``), so gradients reach parameters
        even when no block input requires grad (positional-only training freezes all of them).
        Same switch name as transformers' ``PreTrainedModel``.
        """
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        """Undo ``gradient_checkpointing_enable``."""
        self.gradient_checkpointing = False

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | tuple[int, ...] | None = None,
    ) -> Tensor:
        """Greedy decoding with the KV cache; returns the new tokens (B, N), N <= max_new_tokens.

        Rows are prompts of equal length (no padding: a padded batch would need per-row
        positions and a padding mask). A row that emits a stop token keeps repeating it while
        other rows continue; generation ends when every row has stopped or after
        ``max_new_tokens``.
        """
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} must be (B, T) with T >= 1")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        stops = torch.tensor(list(stop_token_ids or ()), dtype=torch.long, device=input_ids.device)
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        cache = KVCache()
        new: list[Tensor] = []
        tokens = input_ids
        for _ in range(max_new_tokens):
            logits = self(tokens, cache=cache).logits[:, -1]  # (B, V)
            token = logits.argmax(dim=-1)  # (B,)
            if new:
                token = torch.where(done, new[-1], token)  # stopped rows repeat their stop token
            new.append(token)
            done |= torch.isin(token, stops)
            if bool(done.all()):
                break
            tokens = token[:, None]  # (B, 1)
        if not new:
            return input_ids.new_empty(input_ids.shape[0], 0)
        return torch.stack(new, dim=1)  # (B, N)

    def save(self, directory: str | Path) -> Path:
        """Write ``model.safetensors`` and ``config.json`` into ``directory`` (atomically)."""
        return save_decoder(self, directory)

    @classmethod
    def load(cls, directory: str | Path) -> Decoder:
        """The decoder saved in ``directory``, on the CPU; clear errors on missing or bad files
        (a corrupted or swapped weights file, a config that no longer builds the recorded
        encoding, weights that do not fit)."""
        config, tensors, record = read_decoder(directory)
        model = cls(config)
        fill_decoder(model, tensors, record, directory)
        return model


def load_decoder(directory: str | Path) -> Decoder:
    """``Decoder.load(directory)``: the decoder saved there, weights checked, on the CPU."""
    return Decoder.load(directory)
