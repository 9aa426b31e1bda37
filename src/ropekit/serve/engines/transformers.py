"""transformers 5.24: the reference meaning of ``rope_parameters``
(``transformers/modeling_rope_utils.py``: ``ROPE_INIT_FUNCTIONS`` and ``dynamic_rope_update``).

dynamic measures its stretch against ``max_position_embeddings`` with L = max(positions) + 1;
longrope switches short -> long factors once L > ``original_max_position_embeddings``; yarn and
longrope take a missing ``factor`` as max_position_embeddings / original. No length limit is
enforced. Frequencies come from ropekit's pure schedules (``ropekit.encodings.schedules``,
tested against transformers' own functions).

Holds: Transformers, transformers_rope.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ropekit.encodings import schedules

from .base import Engine, EngineRoPE, ServedFolder, original_length, rotary_dims


class Transformers(Engine):
    """The reference: ropekit's exports are exact against it, and every other engine is
    compared with it."""

    name = "transformers"
    label = "transformers 5.24"
    export_format = "hf"
    floor: ClassVar = {
        1024: {"max": 2.1928916885904925e-04, "mean": 2.050709049470743e-05},
        9216: {"max": 6.824548629451588e-03, "mean": 1.6846919475156655e-04},
    }

    def rope(self, folder: ServedFolder, length: int) -> EngineRoPE | None:
        """None for a GGUF file without ropekit's record: no rope_parameters to mean."""
        if folder.gguf is not None and folder.record is None:
            return None
        return transformers_rope(folder.config, length)

    def caveats(self, folder: ServedFolder) -> list[tuple[str, str]]:
        if folder.rope_type != "dynamic":
            return []
        # dynamic_rope_update recomputes inv_freq from the current forward's positions only,
        # so keys cached by earlier forwards keep the angles of the length they were cached at.
        return [
            (
                "dynamic NTK through the KV cache: keys cached before the sequence passed "
                "max_position_embeddings keep the angles of their shorter length (measured: "
                "SmolLM2's 9216-token prompt split at 8192 with the cache, 14 max / 1.8 mean "
                "|d log p|, docs/serving); one uncached forward is exact",
                "score prompts in one forward, or export a fixed schedule (yarn, or ntk at "
                "the target) for cached generation",
            )
        ]


def transformers_rope(config: dict[str, Any], length: int) -> EngineRoPE:
    """transformers' RoPE for ``config`` (a config.json dict) at ``length`` tokens."""
    dim, p = rotary_dims(config)
    kind = p.get("rope_type", "default")
    base = float(p["rope_theta"])
    source = "transformers/modeling_rope_utils.py: ROPE_INIT_FUNCTIONS[" + repr(kind) + "]"
    max_pos = int(config["max_position_embeddings"])
    if kind == "default":
        theta, af = schedules.rope(dim, base)
    elif kind == "proportional":
        # p-RoPE: the exponent keeps the whole head; partial_rotary_factor is the share of
        # pairs that keep their frequency (_compute_proportional_rope_parameters).
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        share = float(p.get("partial_rotary_factor") or 1.0)
        theta, af = schedules.rope(head_dim, base)
        theta = schedules.proportional(
            theta / float(p.get("factor") or 1.0), int(share * head_dim // 2)
        )
    elif kind == "linear":
        theta, af = schedules.linear(dim, base, float(p["factor"]))
    elif kind == "dynamic":
        source += ", dynamic_rope_update"
        theta, af = schedules.dynamic_ntk(dim, base, float(p["factor"]), max_pos, length)
    elif kind == "yarn":
        l0 = original_length(p, config)
        theta, af = schedules.yarn(
            dim,
            base,
            float(p.get("factor") or max_pos / l0),
            l0,
            float(p.get("beta_fast") or 32),
            float(p.get("beta_slow") or 1),
            p.get("mscale"),
            p.get("mscale_all_dim"),
            p.get("attention_factor"),
            bool(p.get("truncate", True)),
        )
    elif kind == "llama3":
        theta, af = schedules.llama3(
            dim,
            base,
            float(p["factor"]),
            original_length(p, config),
            float(p["low_freq_factor"]),
            float(p["high_freq_factor"]),
        )
    elif kind == "longrope":
        source += ", dynamic_rope_update (longrope_frequency_update)"
        l0 = original_length(p, config)
        theta, af = schedules.longrope(
            dim,
            base,
            p["short_factor"],
            p["long_factor"],
            l0,
            float(p.get("factor") or max_pos / l0),
            p.get("attention_factor"),
            length,
        )
    else:
        return EngineRoPE("transformers", source, None, None, None, f"rope_type={kind!r} unknown")
    return EngineRoPE("transformers", source, theta, float(af), None)
