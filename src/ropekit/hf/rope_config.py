"""Translation between transformers' ``rope_parameters`` and ropekit spec strings.

transformers 5.24 keeps a model's RoPE in ``config.rope_parameters`` (``rope_type`` plus that
type's keys, ``modeling_rope_utils.ROPE_INIT_FUNCTIONS``). Both directions are explicit tables
keyed by the type's name:

- ``spec_from_config(config)``: the ropekit spec that computes what the model's own RoPE
  computes (the spec a patch must use to leave logits unchanged).
- ``rope_parameters_for(encoding, config)``: the ``rope_parameters`` (and any other config
  fields) that make plain transformers compute what a *static* ropekit encoding computes;
  learned schedules go through ``ropekit.serve.exporting.export_rope_parameters``.

Holds: spec_from_config, rope_parameters_for, format_spec, ExportRefused.
"""

from __future__ import annotations

from typing import Any

from ropekit.encodings import PositionEncoding, RotaryEncoding, Spec, schedules

from .archs import rope_parameters


class ExportRefused(ValueError):
    """An encoding that no ``rope_parameters`` can express; the message says why and what
    serving it would need."""


def format_spec(name: str, options: dict[str, Any]) -> Spec:
    """The spec ``name`` with ``options``, None ones left out (lists written as spec lists)."""
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    return Spec(name).with_options(**{k: v for k, v in given.items() if v is not None})


def _factor_or_ratio(params: dict[str, Any], config: Any) -> float:
    # yarn and longrope in transformers: a missing factor means max_position / original.
    factor = params.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / params["original_max_position_embeddings"]
    return float(factor)


def spec_from_config(config: Any, layer_type: str | None = None) -> Spec:
    """The ropekit spec equal to the model's own RoPE (``config.rope_parameters``) for layers
    of ``layer_type`` (the first rotating type when None)."""
    p = rope_parameters(config, layer_type)
    kind = p.get("rope_type", "default")
    common: dict[str, Any] = {"base": float(p["rope_theta"])}
    share = p.get("partial_rotary_factor")
    if share is not None and float(share) != 1.0:
        # transformers' one name for two widths: p-RoPE's share of pairs, or partial RoPE's
        # share of channels (archs.rope_context).
        common["proportion" if kind == "proportional" else "fraction"] = float(share)
    if kind == "default":
        return format_spec("rope", common)
    if kind == "proportional":
        return format_spec("proportional", {**common, "factor": float(p.get("factor", 1.0))})
    if kind == "linear":
        return format_spec("linear", {**common, "factor": float(p["factor"])})
    if kind == "dynamic":
        # _compute_dynamic_ntk_parameters measures the stretch against max_position_embeddings.
        return format_spec(
            "dynamic-ntk",
            {
                **common,
                "factor": float(p["factor"]),
                "original_length": int(config.max_position_embeddings),
            },
        )
    if kind == "yarn":
        return format_spec(
            "yarn",
            {
                **common,
                "factor": _factor_or_ratio(p, config),
                "original_length": int(p["original_max_position_embeddings"]),
                # _compute_yarn_parameters: `get("beta_fast") or 32`, `get("beta_slow") or 1`.
                "beta_fast": float(p.get("beta_fast") or 32),
                "beta_slow": float(p.get("beta_slow") or 1),
                "mscale": p.get("mscale"),
                "mscale_all_dim": p.get("mscale_all_dim"),
                "attention_factor": p.get("attention_factor"),
                "truncate": bool(p.get("truncate", True)),
            },
        )
    if kind == "llama3":
        return format_spec(
            "llama3",
            {
                **common,
                "factor": float(p["factor"]),
                "original_length": int(p["original_max_position_embeddings"]),
                "low_freq_factor": float(p["low_freq_factor"]),
                "high_freq_factor": float(p["high_freq_factor"]),
            },
        )
    if kind == "longrope":
        return format_spec(
            "longrope",
            {
                **common,
                "short_factor": [float(x) for x in p["short_factor"]],
                "long_factor": [float(x) for x in p["long_factor"]],
                "original_length": int(p["original_max_position_embeddings"]),
                "factor": _factor_or_ratio(p, config),
                "attention_factor": p.get("attention_factor"),
            },
        )
    raise ValueError(
        f"rope_type={kind!r} has no ropekit equivalent; supported: default, linear, dynamic, "
        "yarn, llama3, longrope, proportional"
    )


def _check_exportable_shape(encoding: PositionEncoding, config: Any) -> None:
    if encoding.rotary_dim == 0:
        raise ExportRefused(f"{encoding.spec!r} does not rotate; no rope_parameters express it")
    pairing = encoding.pairing
    if pairing != "half":
        raise ExportRefused(
            f"{encoding.spec!r} pairs channels {pairing}; {config.model_type} attention in "
            "transformers rotates with rotate_half (pairing=half), so its weights would need "
            "permuting q/k rows to serve this"
        )
    rotary_dim = encoding.rotary_dim
    if rotary_dim != encoding.head_dim:
        raise ExportRefused(
            f"{encoding.spec!r} rotates {rotary_dim} of {encoding.head_dim} channels; "
            f"{config.model_type} attention in transformers rotates the whole head "
            "(apply_rotary_pos_emb multiplies q by cos of head_dim channels)"
        )


def rope_parameters_for(
    encoding: RotaryEncoding, config: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(rope_parameters, other config fields) that make transformers compute this static or
    length-following schedule exactly.

    Rules: rope -> default; linear -> linear; ntk -> default with the NTK base as rope_theta
    (NTK is plain RoPE at base s^(d/(d-2)) b, schedules.ntk); dynamic-ntk -> dynamic, with
    max_position_embeddings set to the original length, because
    ``_compute_dynamic_ntk_parameters`` measures the stretch against it; yarn, llama3 and
    longrope map key for key.
    """
    _check_exportable_shape(encoding, config)
    c = encoding.config
    name = c.name
    if name == "mixed":
        raise ExportRefused(
            f"{encoding.spec!r} keeps the original RoPE within its window and switches beyond "
            "it; no rope_type does both (longrope switches its factors by length but applies "
            "its attention factor at every length): export the wrapped schedule, or longrope"
        )
    base = float(c.base)
    extra: dict[str, Any] = {}
    if name == "rope":
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": base}
    elif name == "linear":
        params = {"rope_type": "linear", "rope_theta": base, "factor": float(c.factor)}
    elif name == "ntk":
        ntk_base = schedules.ntk_base(encoding.rotary_dim, base, c.factor)
        params = {"rope_type": "default", "rope_theta": float(ntk_base)}
    elif name == "dynamic-ntk":
        params = {"rope_type": "dynamic", "rope_theta": base, "factor": float(c.factor)}
        extra["max_position_embeddings"] = int(c.original_length)
    elif name == "yarn":
        params = {
            "rope_type": "yarn",
            "rope_theta": base,
            "factor": float(c.factor),
            "original_max_position_embeddings": int(c.original_length),
            "beta_fast": float(c.beta_fast),
            "beta_slow": float(c.beta_slow),
            "truncate": bool(c.truncate),
        }
        optional = {
            "mscale": c.mscale,
            "mscale_all_dim": c.mscale_all_dim,
            "attention_factor": c.attention_factor,
        }
        params.update({key: float(v) for key, v in optional.items() if v is not None})
    elif name == "llama3":
        params = {
            "rope_type": "llama3",
            "rope_theta": base,
            "factor": float(c.factor),
            "original_max_position_embeddings": int(c.original_length),
            "low_freq_factor": float(c.low_freq_factor),
            "high_freq_factor": float(c.high_freq_factor),
        }
    elif name == "longrope":
        n = encoding.n_pairs
        params = {
            "rope_type": "longrope",
            "rope_theta": base,
            "short_factor": [float(x) for x in c.factors("short_factor", n)],
            "long_factor": [float(x) for x in c.factors("long_factor", n)],
            "original_max_position_embeddings": int(c.original_length),
            "factor": float(c.factor),
        }
        if c.attention_factor is not None:
            params["attention_factor"] = float(c.attention_factor)
    else:
        raise ExportRefused(f"{encoding.spec!r}: no transformers rope_type computes {name!r}")
    return params, extra
