"""vLLM plugin: serve a ropekit positional adapter (per-head AdaRoPE and AdaScale included)
inside vLLM's own Llama model, with vLLM's attention and KV cache.

vLLM loads out-of-tree models through its ``vllm.general_plugins`` entry point (vLLM,
``vllm/plugins/__init__.py: load_general_plugins``): ropekit's ``pyproject.toml`` names
``register`` there, which adds the architecture ``RopekitLlamaForCausalLM`` to vLLM's
``ModelRegistry`` by import string (so the model module is imported only where it is used).
A folder written by ``export(..., format="vllm")`` names that architecture in ``config.json``
and holds the adapter in ``ropekit_adapter/`` (``adapter.json`` + ``adapter.safetensors``).

``RopekitLlamaForCausalLM`` is vLLM's ``LlamaForCausalLM`` with each layer's ``rotary_emb``
replaced by ``RopekitRotary``: vLLM's ``LlamaAttention.forward`` calls
``q, k = self.rotary_emb(positions, q, k)`` on flat token rows right before attention and the
KV-cache write, so ropekit's own ``rotate_q`` / ``rotate_k`` run on them:

    q (N, H*D) -> (1, H, N, D)   rotate_q(q, positions, layer): per-(layer, kv head) theta,
                                 then AdaScale lambda_h(L), L = position + 1
    k (N, K*D) -> (1, K, N, D)   rotate_k(k, positions, layer): per-(layer, kv head) theta

Both depend only on each token's own absolute position, so keys can be cached rotated (the
frequencies are fixed once trained) and a query's temperature needs only its own position:
cached decoding and chunked prefill compute what one full forward computes. Dynamic
schedules (whose angles follow the whole sequence's length) are refused: vLLM hands the
rotary no sequence lengths.

Distance remaps (``remaps_distance``: ReRoPE, Leaky ReRoPE, Self-Extend, DCA, STRING) need a
different rotation of q and k for each band of distances, so one rotary call cannot express
them. For those the layer's ``rotary_emb`` (``HeldRotary``) passes q through unrotated and
rotates k as the remap's far band reads it (``paged_attention.rotate_for_cache``: the band
that reaches back to the first key; DCA's and STRING's only key rotation), so vLLM's KV cache
holds those keys in the slots and dtype it gives stock's rotated keys (no extra cache memory:
2 x K x D numbers per token and layer, keys and values, as stock), and the layer's attention
backend (``attn.impl``, vLLM's CPU backend,
``vllm/v1/attention/backends/cpu_attn.py: CPUAttentionBackendImpl``) is given ropekit's
attention in its place (``_banded_impl``): ``do_kv_cache_update`` stores each new key and
value at its slot, and ``forward`` reads every request's keys and values back through the
block table and computes ropekit's banded attention for its new queries
(``ropekit.serve.paged_attention``: the other bands' keys turned from the held ones, only
over the keys those bands cover): a whole prompt, a chunk of one whose earlier chunks are in
the cache, prompt blocks found in the prefix cache, and decoding steps alike. An encoding
whose rotations do not compose (``paged_attention.rotations_compose``) keeps its keys
unrotated (``Unrotated``) and has every band's keys rotated at use. A request's
positions come from the step's metadata (``query_start_loc``, ``seq_lens``: its new tokens
are the last of its keys). Length-following remaps (DCA's logit scale, STRING's shift of the
attended length) take L = the request's keys at that step, as ropekit's cached decoding does.
A single forward gives every prompt token L = the whole prompt; a step sees only the keys so
far, so a chunk of a chunked prefill would attend at its own shorter L (and its outputs feed
the later layers' keys), and a prefix block found in the cache would hold keys computed at the
L of whichever request wrote it. The plugin therefore refuses to serve them with chunked
prefill or prefix caching (``check_scheduling``): each prompt is then one step at its whole
length, as in the patched model's single forward, and each decoded token one step at L + 1,
as in ropekit's cached decoding.

Needs vLLM, torch and numba only, all three in vLLM's environment (vLLM requires numba; the
decoding step, the rotary for new keys and the cache write run as its compiled loops,
``paged_kernels``). ropekit is installed there with ``--no-deps``: vLLM pins another
transformers than ropekit.hf supports, and nothing here imports it.

Holds: register, RopekitLlamaForCausalLM, RopekitRotary, HeldRotary, Unrotated,
load_adapter_encoding, check_scheduling, ARCHITECTURE, ADAPTER_DIR.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

ARCHITECTURE = "RopekitLlamaForCausalLM"
ADAPTER_DIR = "ropekit_adapter"
_WEIGHTS = "adapter.safetensors"  # the file names of ropekit.backbone.adapters
_CONFIG = "adapter.json"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make the architecture known to vLLM."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:RopekitLlamaForCausalLM")


def load_adapter_encoding(folder: str | Path, config: Any) -> Any:
    """The ropekit encoding stored in ``folder/ropekit_adapter`` for a model with this HF
    ``config`` (heads, kv heads, head dim, layers), its parameters loaded strictly."""
    import safetensors.torch

    from ropekit.encodings import build

    adapter = Path(folder) / ADAPTER_DIR
    meta = json.loads((adapter / _CONFIG).read_text(encoding="utf-8"))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    encoding = build(
        meta["spec"],
        n_heads=config.num_attention_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
        head_dim=head_dim,
        n_layers=config.num_hidden_layers,
    )
    if encoding.dynamic and not encoding.remaps_distance:
        raise ValueError(
            f"{meta['spec']!r} follows the sequence length (dynamic); vLLM's rotary sees token "
            "positions, not sequence lengths, so the plugin cannot serve it"
        )
    state = safetensors.torch.load_file(adapter / _WEIGHTS)
    encoding.load_state_dict(state, strict=True)
    return encoding.eval().requires_grad_(False)


def check_scheduling(encoding: Any, *, chunked_prefill: bool, prefix_caching: bool) -> None:
    """ValueError, saying how to serve it, where ``encoding`` follows the attended length (a
    dynamic remap: DCA's logit scale, STRING's shift) and vLLM would hand the plugin part of a
    prompt: a chunk (chunked prefill) or blocks another request wrote (prefix caching); the
    module docstring says why either computes other log-probs than a single forward."""
    if not (encoding.remaps_distance and encoding.dynamic):
        return
    on = [name for name, flag in (("chunked prefill", chunked_prefill),
                                  ("prefix caching", prefix_caching)) if flag]  # fmt: skip
    if on:
        raise ValueError(
            f"{encoding.spec!r} follows the attended length: each prompt token must see the "
            f"whole prompt's length, as in one forward, but {' and '.join(on)} hands the plugin "
            "part of it; serve it with --no-enable-chunked-prefill --no-enable-prefix-caching "
            "and --max-num-batched-tokens >= --max-model-len (LLM(enable_chunked_prefill=False, "
            "enable_prefix_caching=False, max_num_batched_tokens=max_model_len))"
        )


class RopekitRotary(nn.Module):
    """vLLM's rotary call signature over one layer of a ropekit encoding."""

    def __init__(self, encoding: nn.Module, layer: int, head_dim: int) -> None:
        super().__init__()
        # Shared by every layer and owned by the model (``ropekit_encoding``); held outside
        # the module tree so its parameters have one name, which load_weights reports.
        self._encoding = (encoding,)
        self.layer = layer
        self.head_dim = head_dim

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = positions.flatten()[None]  # (1, N)
        n = pos.shape[1]
        q = query.view(n, -1, self.head_dim).transpose(0, 1)[None]  # (1, H, N, D)
        q = self._encoding[0].rotate_q(q, pos, layer=self.layer)
        query_out = q[0].transpose(0, 1).reshape(query.shape).to(query.dtype)  # (N, H*D)
        if key is None:
            return query_out, None
        k = key.view(n, -1, self.head_dim).transpose(0, 1)[None]  # (1, K, N, D)
        k = self._encoding[0].rotate_k(k, pos, layer=self.layer)
        return query_out, k[0].transpose(0, 1).reshape(key.shape).to(key.dtype)


class HeldRotary(nn.Module):
    """vLLM's rotary call signature for a remap: q as it is (the attention rotates it per
    band), k rotated as the remap's far band reads it, which the KV cache then holds
    (``paged_attention.rotate_for_cache``; module docstring)."""

    def __init__(self, encoding: nn.Module, layer: int, head_dim: int) -> None:
        super().__init__()
        self._encoding = (encoding,)  # owned by the model (RopekitRotary says why)
        self.layer = layer
        self.head_dim = head_dim

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from ropekit.serve.paged_attention import rotate_for_cache

        if key is None:
            return query, None
        pos = positions.flatten()[None]  # (1, N)
        k = key.view(pos.shape[1], -1, self.head_dim).transpose(0, 1)[None]  # (1, K, N, D)
        k = rotate_for_cache(self._encoding[0], k, pos, self.layer)
        return query, k[0].transpose(0, 1).reshape(key.shape).to(key.dtype)


class Unrotated(nn.Module):
    """vLLM's rotary call signature that leaves q and k as they are: the KV cache keeps the
    keys unrotated, for a remap whose rotations do not compose (module docstring)."""

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return query, key


_BANDED_CLASSES: dict[type, type] = {}


def _split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache), each (P, K, b, D), of one layer's cache in vLLM's CPU
    backend layout: (P, K, b, 2 D) read as (P, K, 2 b, D), keys in the first b rows of each
    block and values in the last b (``CPUAttentionBackendImpl.forward``)."""
    P, K, b, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(P, K, 2 * b, -1).chunk(2, dim=2)
    return key_cache, value_cache


def _do_kv_cache_update(self, layer_module, key, value, kv_cache, slot_mapping) -> None:
    """The banded backend's cache write: the keys as the rotary left them, and the values, at
    their slots."""
    from ropekit.serve import paged_attention

    paged_attention.write_paged(*_split_cache(kv_cache), key, value, slot_mapping)


def _forward(
    self, layer_module, query, key, value, kv_cache, attn_metadata, output,
    output_scale=None, output_block_scale=None,
):  # fmt: skip
    """The banded backend's attention: each request's new queries over its cached keys."""
    from ropekit.serve import paged_attention

    if attn_metadata is None:  # vLLM's warm-up and profiling runs
        return output
    encoding = self.ropekit_encoding
    if output_scale is not None or output_block_scale is not None:
        raise NotImplementedError("the ropekit plugin has no fused output quantization")
    if not attn_metadata.causal or attn_metadata.dynamic_causal is not None:
        raise ValueError(f"{encoding.spec!r} is served for causal decoders only")
    n = attn_metadata.num_actual_tokens
    plan = paged_attention.steps(attn_metadata.query_start_loc, attn_metadata.seq_lens, n)
    key_cache, value_cache = _split_cache(kv_cache)
    if self.ropekit_positions is None:
        self.ropekit_positions = paged_attention.StepPositions()
    paged_attention.paged_banded_attention(
        query[:n], key_cache, value_cache, attn_metadata.block_table, plan, encoding,
        self.ropekit_layer, self.scale, output[:n], positions=self.ropekit_positions,
        keys_held=self.ropekit_keys_held,
    )  # fmt: skip
    return output


def _banded_impl(
    impl: Any, encoding: nn.Module, layer: int, positions: Any, keys_held: bool
) -> None:
    """Turn vLLM's CPU attention backend object ``impl`` of one layer into ropekit's banded
    attention over the same KV cache (module docstring), in place: its class becomes a
    subclass of its own (so vLLM's checks of the backend still hold) whose
    ``do_kv_cache_update`` and ``forward`` are ropekit's. ``positions``: the
    ``StepPositions`` every layer shares (None: made on first use); ``keys_held``: the rotary
    hands the cache keys rotated as ``rotate_for_cache`` does (else unrotated)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    if not isinstance(impl, CPUAttentionBackendImpl):
        raise ValueError(
            f"the ropekit plugin computes {encoding.spec!r} over vLLM's CPU attention backend "
            f"(CPUAttentionBackendImpl); this vLLM chose {type(impl).__name__}"
        )
    if impl.kv_cache_dtype != "auto" or impl.sliding_window != -1 or impl.sinks is not None:
        raise ValueError(
            f"the ropekit plugin serves {encoding.spec!r} with an unquantized KV cache, no "
            f"sliding window and no attention sinks (kv_cache_dtype={impl.kv_cache_dtype!r}, "
            f"sliding_window={impl.sliding_window}); use --kv-cache-dtype auto"
        )
    cls = type(impl)
    if cls not in _BANDED_CLASSES:
        _BANDED_CLASSES[cls] = type(
            f"RopekitBanded{cls.__name__}",
            (cls,),
            {"do_kv_cache_update": _do_kv_cache_update, "forward": _forward},
        )
    impl.__class__ = _BANDED_CLASSES[cls]
    impl.ropekit_encoding, impl.ropekit_layer = encoding, layer
    impl.ropekit_positions, impl.ropekit_keys_held = positions, keys_held


def _model_class() -> type:
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.models.llama import LlamaForCausalLM

    class RopekitLlamaForCausalLM(LlamaForCausalLM):
        """vLLM's Llama with ropekit's positional encoding in every layer."""

        def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
            if get_tensor_model_parallel_world_size() != 1:
                raise ValueError(
                    "the ropekit plugin rotates whole layers' heads; tensor parallelism "
                    "(heads split across ranks) is not supported: use tensor_parallel_size=1"
                )
            config = vllm_config.model_config.hf_config
            encoding = load_adapter_encoding(vllm_config.model_config.model, config)
            self.ropekit_encoding = encoding  # registered once, so .to(device) moves it
            positions, held = None, False
            if encoding.remaps_distance:
                from ropekit.serve.paged_attention import StepPositions, rotations_compose

                check_scheduling(
                    encoding,
                    chunked_prefill=bool(vllm_config.scheduler_config.enable_chunked_prefill),
                    prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                )

                positions = StepPositions()  # one step's position tensors, for every layer
                head_dim = self.model.layers[self.model.start_layer].self_attn.head_dim
                held = rotations_compose(
                    encoding, config.num_key_value_heads, head_dim, config.num_hidden_layers
                )
            for index in range(self.model.start_layer, self.model.end_layer):
                attn = self.model.layers[index].self_attn
                if encoding.remaps_distance:
                    rotary = HeldRotary(encoding, index, attn.head_dim) if held else Unrotated()
                    attn.rotary_emb = rotary
                    _banded_impl(attn.attn.impl, encoding, index, positions, held)
                else:
                    attn.rotary_emb = RopekitRotary(encoding, index, attn.head_dim)

        def load_weights(self, weights: Any) -> set[str]:
            # The encoding's parameters come from the adapter, not from the checkpoint.
            loaded = super().load_weights(weights)
            own = {f"ropekit_encoding.{n}" for n, _ in self.ropekit_encoding.named_parameters()}
            return loaded | own

    return RopekitLlamaForCausalLM


def __getattr__(name: str) -> Any:
    # vLLM resolves "ropekit.serve.vllm_plugin:RopekitLlamaForCausalLM" by attribute access;
    # the class is built on first use so importing this module needs no vLLM.
    if name == "RopekitLlamaForCausalLM":
        cls = _model_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
