"""Translation between transformers' ``rope_parameters`` and ropekit spec strings.

transformers 5.24 keeps a model's RoPE in ``config.rope_parameters`` (``rope_type`` plus that
type's keys, ``modeling_rope_utils.ROPE_INIT_FUNCTIONS``). Both directions are explicit tables
keyed by the type's name:

- ``spec_from_config(config)``: the ropekit spec that computes what the model's own RoPE
  computes (the spec a patch must use to leave logits unchanged).
- ``rope_parameters_for(encoding, config)``: the ``rope_parameters`` (and any other config
  fields) that make plain transformers compute what a *static* ropekit encoding computes;
  learned schedules go through ``ropekit.serve.exporting.export_rope_parameters``.

Holds: spec_from_config, rope_parameters_for, model_rope_parameters, check_exportable_shape,
set_rotated_share, format_spec, ExportRefused.
"""

from __future__ import annotations

from typing import Any

from ropekit.encodings import PositionEncoding, RotaryEncoding, Spec, schedules

from .archs import covered_types, nested_by_type, rope_context, rope_parameters, rotating_types


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


def _pairing_words(pairing: str) -> str:
    return "with rotate_half" if pairing == "half" else "as interleaved pairs"


def check_exportable_shape(
    encoding: PositionEncoding, config: Any, kind: str | None = None
) -> None:
    """ExportRefused unless ``encoding`` rotates the channels the model's own attention
    rotates in layers of type ``kind`` (None: the first the encoding covers): the family's
    pairing, the config's rotated width
    (``partial_rotary_factor``: partial RoPE's share of channels, or p-RoPE's share of pairs).
    transformers' attention applies its own pairing and width to whatever cos and sin the
    rope_parameters give, so an export can change the frequencies and nothing else."""
    if encoding.rotary_dim == 0:
        raise ExportRefused(f"{encoding.spec!r} does not rotate; no rope_parameters express it")
    own = rope_context(config, kind or covered_types(config, encoding.layers)[0])
    where = f"{config.model_type} attention in transformers"
    if encoding.pairing != own["pairing"]:
        raise ExportRefused(
            f"{encoding.spec!r} pairs channels {encoding.pairing}; {where} rotates "
            f"{_pairing_words(own['pairing'])} (pairing={own['pairing']}), so its weights would "
            "need permuting q/k rows to serve this"
        )
    own_dim = int(encoding.head_dim * own["fraction"])
    if encoding.rotary_dim != own_dim:
        raise ExportRefused(
            f"{encoding.spec!r} rotates {encoding.rotary_dim} of {encoding.head_dim} channels; "
            f"{where} rotates {own_dim} (partial_rotary_factor={own['fraction']:g})"
        )
    proportion = float(getattr(encoding.config, "proportion", 1.0))
    if proportion != own["proportion"]:
        raise ExportRefused(
            f"{encoding.spec!r} keeps {proportion:g} of its pairs rotating (p-RoPE); {where} "
            f"keeps {own['proportion']:g} in these layers (rope_parameters have one share)"
        )


def set_rotated_share(
    encoding: PositionEncoding, config: Any, params: dict[str, Any], kind: str | None = None
) -> None:
    """Write the rotated share of layers of type ``kind`` (None: the first the encoding
    covers) into ``params`` as transformers reads it: partial RoPE's
    ``partial_rotary_factor`` for every rope type; p-RoPE's only in rope_type proportional
    (any other type reads the key as partial RoPE's width, which computes something else)."""
    kind = kind or covered_types(config, encoding.layers)[0]
    own = rope_context(config, kind)
    if own["proportion"] != 1.0:
        if params["rope_type"] != "proportional":
            raise ExportRefused(
                f"{encoding.spec!r} applies {encoding.config.name} to p-RoPE's "
                f"{own['proportion']:g} of pairs; transformers computes p-RoPE only as rope_type "
                "proportional (its other types read partial_rotary_factor as partial RoPE's "
                "width): export proportional or rope in these layers, or serve with ropekit.hf"
            )
        params["partial_rotary_factor"] = own["proportion"]
    elif own["fraction"] != 1.0 or "partial_rotary_factor" in rope_parameters(config, kind):
        params["partial_rotary_factor"] = own["fraction"]  # Phi-3 reads the key unconditionally


def model_rope_parameters(
    config: Any, layers: str | None, params: dict[str, Any]
) -> dict[str, Any]:
    """The whole model's ``rope_parameters`` when the layer types ``layers`` covers (a spec's
    ``layers=``; None: the family's recipe) rotate by ``params``: the config's nested dict with
    those types replaced and the others kept (Gemma 3's local layers keep their base), or
    ``params`` where the config's is flat and they cover every rotating layer. ExportRefused
    where a flat config would need two schedules."""
    own = getattr(config, "rope_parameters", None) or {}
    covered = covered_types(config, layers)
    if nested_by_type(own):
        return {k: dict(params) if k in covered else v for k, v in own.items()}
    rest = [k for k in rotating_types(config) if k not in covered]
    if rest:
        raise ExportRefused(
            f"this {config.model_type} config holds one rope_parameters for all its layers, so an "
            f"export cannot rotate {'+'.join(covered)} layers one way and {'+'.join(rest)} "
            "another: export with layers=all, or serve with ropekit.hf"
        )
    return dict(params)


def rope_parameters_for(
    encoding: RotaryEncoding, config: Any, kind: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(rope_parameters, other config fields) that make transformers compute this static or
    length-following schedule exactly in layers of type ``kind`` (None: the first the encoding
    covers; the whole model's
    rope_parameters: ``model_rope_parameters``).

    Rules: rope -> default (proportional where the layers keep a p-RoPE share); linear ->
    linear; ntk -> default with the NTK base as rope_theta (NTK is plain RoPE at base
    s^(d/(d-2)) b, schedules.ntk); dynamic-ntk -> dynamic, with max_position_embeddings set to
    the original length, because ``_compute_dynamic_ntk_parameters`` measures the stretch
    against it; proportional -> proportional; yarn, llama3 and longrope map key for key. The
    rotated share is the model's own (``check_exportable_shape``).
    """
    check_exportable_shape(encoding, config, kind)
    params, extra = _rope_type(encoding)
    if params["rope_type"] == "default" and getattr(encoding.config, "proportion", 1.0) != 1.0:
        params = {**params, "rope_type": "proportional"}
    set_rotated_share(encoding, config, params, kind)
    return params, extra


def _rope_type(encoding: RotaryEncoding) -> tuple[dict[str, Any], dict[str, Any]]:
    """(rope_parameters, other config fields) of the rope type that computes the schedule."""
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
    elif name == "proportional":
        params = {"rope_type": "proportional", "rope_theta": base, "factor": float(c.factor)}
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
