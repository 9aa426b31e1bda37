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

Needs vLLM and torch only (ropekit is installed into vLLM's environment with ``--no-deps``:
vLLM pins another transformers than ropekit.hf supports, and nothing here imports it).

Holds: register, RopekitLlamaForCausalLM, RopekitRotary, load_adapter_encoding,
ARCHITECTURE, ADAPTER_DIR.
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
    if encoding.dynamic:
        raise ValueError(
            f"{meta['spec']!r} follows the sequence length (dynamic); vLLM's rotary sees token "
            "positions, not sequence lengths, so the plugin cannot serve it"
        )
    state = safetensors.torch.load_file(adapter / _WEIGHTS)
    encoding.load_state_dict(state, strict=True)
    return encoding.eval().requires_grad_(False)


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
            for index in range(self.model.start_layer, self.model.end_layer):
                attn = self.model.layers[index].self_attn
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
