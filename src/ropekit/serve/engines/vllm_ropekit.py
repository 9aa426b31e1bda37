"""vLLM 0.32 with ropekit's plugin (``ropekit.serve.vllm_plugin``): a folder whose
``architectures`` name ``RopekitLlamaForCausalLM`` is served by vLLM's own Llama with each
layer's rotary replaced by the adapter in ``ropekit_adapter/``, per (layer, kv head) and with
AdaScale's per-head query temperature, within vLLM's noise floor (measured by
``make test-serving``: docs/serving). Any other folder is stock vLLM's.

Without the plugin, every engine reads the folder's ``rope_parameters``, which hold the
nearest shared schedule (``ropekit.serve.nearest``): an approximation of the adapter.

Holds: VllmRopekit, is_plugin_folder.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .base import Engine, EngineRoPE, ServedFolder
from .vllm import Vllm

_SOURCE = "ropekit.serve.vllm_plugin: RopekitRotary"


def is_plugin_folder(folder: ServedFolder) -> bool:
    """Whether ``folder`` is written for the plugin (its config names the plugin's model)."""
    from ropekit.serve.vllm_plugin import ARCHITECTURE

    return ARCHITECTURE in (folder.config.get("architectures") or ())


class VllmRopekit(Engine):
    name = "vllm+ropekit"
    label = "vLLM 0.32 with ropekit's plugin"
    export_format = "vllm"
    floor: ClassVar = Vllm.floor  # vLLM's own arithmetic: the plugin rotates in float32 as it

    def rope(self, folder: ServedFolder, length: int) -> EngineRoPE | None:
        """The adapter's frequencies, per (layer, kv head) in ``per_head``; None for a folder
        that does not name the plugin (stock vLLM serves it)."""
        if folder.gguf is not None or not is_plugin_folder(folder):
            return None
        from ropekit.serve.nearest import head_frequencies
        from ropekit.serve.vllm_plugin import ADAPTER_DIR, load_adapter_encoding

        encoding = folder.encoding
        if encoding is None:
            encoding = load_adapter_encoding(folder.path, folder.hf_config)
        theta, factors = head_frequencies(encoding)  # (L, K, F)
        notes = [
            f"{encoding.spec!r} from {ADAPTER_DIR}/: frequencies per layer and kv head "
            f"({theta.shape[0]} x {theta.shape[1]})"
        ]
        if encoding.head_rows("scale") is not None:
            notes.append("AdaScale: each head's query temperature at each token's position")
        stock = Vllm().rope(folder, length)  # vLLM's accepted length holds with the plugin
        assert stock is not None
        return dataclasses.replace(
            stock, engine=self.name, source=_SOURCE, inv_freq=theta[0, 0],
            attention_factor=factors[0], notes=(*notes, *stock.notes), per_head=theta,
        )  # fmt: skip

    def per_head_fix(self, folder: ServedFolder) -> str:
        return "install ropekit in vLLM's environment: its entry point registers the plugin"
