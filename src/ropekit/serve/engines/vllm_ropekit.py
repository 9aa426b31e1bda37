"""vLLM 0.32 with ropekit's plugin (``ropekit.serve.vllm_plugin``): a folder whose
``architectures`` name ``RopekitLlamaForCausalLM`` is served by vLLM's own Llama with each
layer's rotary replaced by the adapter in ``ropekit_adapter/``, per (layer, kv head) and with
AdaScale's per-head query temperature, within vLLM's tolerance (5x its float32 noise floor,
measured by ``make test-serving``: docs/serving). Any other folder is stock vLLM's.

Without the plugin, stock vLLM refuses such a folder (``Vllm.rope``: the architecture is
unknown to its registry); transformers loads it as a Llama and reads its ``rope_parameters``,
which hold the nearest shared schedule (``ropekit.serve.nearest``): an approximation of the
adapter.

Distance remaps (ReRoPE, Leaky ReRoPE, Self-Extend, DCA, STRING) are served by the plugin's
banded attention over vLLM's paged KV cache (unrotated keys, no extra cache memory): the
export's ``rope_parameters`` hold the base schedule (what engines without the plugin compute:
no remap) and its record names the plugin (``serve_with``, ``plugin_recipe``). Such a folder
accepts ``max_length`` tokens, or the remap's reach (``remap_reach``) where its largest
distance seen is bounded by L0.

Holds: VllmRopekit, is_plugin_folder, plugin_recipe, remap_reach.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from .base import Engine, EngineRoPE, ServedFolder
from .vllm import Vllm

_SOURCE = "ropekit.serve.vllm_plugin: RopekitRotary"
_BANDED_SOURCE = "ropekit.serve.vllm_plugin: _banded_impl (ropekit.serve.paged_attention)"
PLUGIN = "ropekit.serve.vllm_plugin"


def remap_reach(encoding: Any, original_length: int) -> int | None:
    """The longest prompt whose every remapped distance stays below L0, for the remaps whose
    largest distance grows with the length: Self-Extend (paper: floor(i / G) + W - floor(W / G)
    < L0; llama.cpp's blocks: ``self_extend_reach``) and Leaky ReRoPE (w + (d - w) / k < L0).
    None where the largest distance is bounded at any length (ReRoPE's clip, DCA's chunks) or
    is a fraction of it (STRING): the export then needs the length it is served at."""
    from .llamacpp import self_extend_reach

    c, l0 = encoding.config, int(original_length)
    if c.name == "self-extend":
        if c.mode == "llama.cpp":
            return self_extend_reach(c.group, c.window, l0)
        if c.window >= l0:
            return l0
        return c.group * (l0 - c.window + c.window // c.group)
    if c.name == "rerope" and c.leaky is not None and c.window < l0:
        return math.floor(c.window + c.leaky * (l0 - 1 - c.window)) + 1
    return None


# A remap whose parameters follow the attended length is served with each prompt in one step
# (``vllm_plugin.check_scheduling`` refuses anything else).
WHOLE_PROMPTS = (
    "--no-enable-chunked-prefill --no-enable-prefix-caching --max-num-batched-tokens MAX_MODEL_LEN"
)


def plugin_recipe(encoding: Any) -> dict[str, Any]:
    """How vLLM serves a distance remap through the plugin: the record ``export --format
    vllm`` writes (``serve_with``)."""
    flags = f" {WHOLE_PROMPTS}" if encoding.dynamic else ""
    return {
        "engine": "vllm+ropekit",
        "recipe": PLUGIN,
        "command": (
            f"vllm serve FOLDER --dtype float32{flags} with ropekit installed in vLLM's "
            "environment (pip install --no-deps ropekit: its vllm.general_plugins entry point "
            "registers the model)"
        ),
    }


def plugin_notes(recipe: dict[str, Any], spec: str, follows_length: bool = False) -> list[str]:
    """What the export record and ``inspect`` say about a remap served by the plugin."""
    exact = (
        "each prompt in one step (its parameters follow the whole prompt's length, which a "
        "chunk or another request's cached prefix does not see): the plugin refuses chunked "
        f"prefill and prefix caching ({WHOLE_PROMPTS}); decoding stays exact"
        if follows_length
        else "chunked prefill, prefix caching and decoding stay exact"
    )
    return [
        f"{spec} is computed by {recipe['recipe']} in vLLM (CPU backend): banded attention over "
        "vLLM's paged KV cache, which holds unrotated keys in the slots of rotated ones (no "
        "extra cache memory; each band's keys are rotated at every step); "
        f"{exact} (make test-serving)",
        "without the plugin stock vLLM refuses the folder (unknown architecture) and "
        "transformers computes rope_parameters, the base schedule without the remap: far from "
        "the remap beyond L0",
    ]


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

        stock = Vllm().config_rope(folder, length)  # vLLM's length rules hold with the plugin
        recipe = (folder.record or {}).get("serve_with")
        if recipe is not None and recipe["engine"] == self.name:
            # A remap: the base schedule's frequencies, the bands in attention.
            note = f"{folder.record['spec']}: banded attention over the paged KV cache"
            return dataclasses.replace(
                stock, engine=self.name, source=_BANDED_SOURCE, notes=(note, *stock.notes)
            )
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
        return dataclasses.replace(
            stock, engine=self.name, source=_SOURCE, inv_freq=theta[0, 0],
            attention_factor=factors[0], notes=(*notes, *stock.notes), per_head=theta,
        )  # fmt: skip

    def per_head_fix(self, folder: ServedFolder) -> str:
        return "install ropekit in vLLM's environment: its entry point registers the plugin"
