"""Export a patched model to a folder that serves without ropekit: a plain Hugging Face
folder (transformers, vLLM) or a GGUF file (llama.cpp).

The HF folder holds the backbone weights (the encoding's parameters left out), the tokenizer
when one is known, a ``config.json`` whose ``rope_parameters`` make transformers compute what
the ropekit encoding computes and whose length fields make every engine accept the target
length, and ``ropekit_export.json`` recording the spec, the rule applied and what, if
anything, the export approximates. ``format="gguf"`` writes ``model.gguf`` instead
(``ropekit.serve.gguf_file``), with the same record.

Rules, by encoding:

- Fixed schedules map to transformers' own rope types (``rope_config.rope_parameters_for``):
  rope -> default, linear -> linear, ntk -> default at the NTK base, dynamic-ntk -> dynamic
  (max_position_embeddings = original length), yarn, llama3, longrope -> the same type.
- A learned schedule (AdaRoPE, tuned-yarn) whose frequencies are one set for every layer and
  key/value head exports as ``longrope`` with per-pair factors
  lambda_f = theta_rope_f / theta_learned_f (``_compute_longrope_parameters`` computes
  inv_freq = theta_rope / lambda) and short_factor = long_factor, so no switch happens at the
  original length; ``attention_factor`` carries the init schedule's cos/sin scale (YaRN's
  mscale) or tuned-yarn's learned one.
- AdaScale multiplies each query by lambda_h(L) = (1/tau) ln(1 + max(L, L_ref)/L_ref)^gamma.
  When it is one constant c for every head, layer and length (gamma = 0 everywhere, tau
  shared, including the identity at init) it folds exactly into the attention factor, which
  scales both q and k: af' = af * sqrt(c) gives logits * af^2 * c. With gamma != 0 the
  temperature grows with the query's position, and no rope type has a position-dependent query
  scale: export refuses, or with ``temperature_at=L`` freezes lambda at length L (exact for
  queries at L, and for all queries whose L <= L_ref when L <= L_ref; recorded as approximate).
- Distance remaps rotate q and k per pair, which no rope config expresses: with
  ``format="vllm"`` every remap is served by ropekit's vLLM plugin (banded attention over
  vLLM's KV cache): the folder holds the base schedule, the record's ``serve_with`` names the
  plugin, and the target is ``max_length`` or the remap's reach
  (``engines.vllm_ropekit.remap_reach``; refused for remaps without one). Otherwise refused,
  except Self-Extend in llama.cpp's blocks (``self-extend:mode=llama.cpp``) with
  ``format="gguf"``: the file holds the base schedule, the record's ``serve_with`` names the
  recipe that drives llama.cpp's group attention (``ropekit.serve.llamacpp_self_extend``), and
  the target is Self-Extend's reach (``engines.llamacpp.self_extend_reach``).
- Frequencies or temperatures that differ across heads or layers are refused: rope_parameters
  holds one frequency per rotary pair for the whole model. ``nearest=True`` exports the
  closest shared schedule instead (``ropekit.serve.nearest``), recorded as approximate.

Length fields (``length_fields``), by rope type, from the engines' own rules
(``ropekit.serve.engines`` cites them). The target length is ``factor x L0`` of the schedule
(or ``max_length``):

- vLLM 0.32 (``vllm/config/model.py: _get_and_verify_max_len``) accepts
  ``max_position_embeddings`` for yarn, llama3 and longrope, and
  ``max_position_embeddings x factor`` for every other type; it also caps the length at the
  tokenizer's ``model_max_length``. Its llama3 and longrope cos/sin caches hold
  ``max_position_embeddings`` positions.
- transformers reads ``max_position_embeddings`` only for dynamic (the length the stretch is
  measured against, so it must stay L0) and, as a consistency check, for yarn and longrope.

So yarn, llama3, longrope and ntk (plain RoPE at a larger base) set
``max_position_embeddings`` to the target; linear and dynamic keep L0 (vLLM multiplies by the
factor); longrope also writes ``short_mscale = long_mscale = attention_factor`` because vLLM's
longrope ignores ``attention_factor``; a finite tokenizer ``model_max_length`` below the target
is raised to it.

Holds: export, export_rope_parameters, target_length, length_fields (and, from ``engines``,
EXPORT_RECORD and FORMATS).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ropekit import __version__
from ropekit.backbone import is_decoder_dir, load_adapter, save_adapter
from ropekit.encodings import PositionEncoding, schedules
from ropekit.hf.archs import base_model, covered_types, original_length, unwrap
from ropekit.hf.models import load_model, load_tokenizer, resolve_model
from ropekit.hf.rope_config import (
    ExportRefused,
    check_exportable_shape,
    model_rope_parameters,
    rope_parameters_for,
    set_rotated_share,
)
from ropekit.outdir import OutputError, writing

from .engines import EXPORT_RECORD, FORMATS
from .engines.llamacpp import llamacpp_recipe, recipe_notes, self_extend_reach
from .engines.vllm_ropekit import plugin_notes, plugin_recipe, remap_reach
from .gguf_file import check_writable
from .nearest import head_frequencies, nearest_shared

# Learned frequencies count as shared when every row equals the first to this relative
# precision: rows computed from identical parameters agree exactly; trained rows differ by far
# more (float32 parameters move theta by at least ~1e-7 relative per step).
_SHARED_RTOL = 1e-9


def _learned_frequencies(encoding: PositionEncoding) -> tuple[torch.Tensor, float]:
    """The one theta (F,) float64 shared by all layers and kv heads, and the cos/sin factor;
    ExportRefused naming the first layer/head that differs."""
    theta, factors = head_frequencies(encoding)  # (L, K, F)
    ref = theta[0, 0]
    spread = (theta / ref - 1).abs().amax(dim=-1)  # (L, K)
    if spread.max() > _SHARED_RTOL:
        layer, head = divmod(int(spread.argmax()), encoding.n_kv_heads)
        raise ExportRefused(
            f"{encoding.spec!r}: learned frequencies differ across "
            f"{'kv heads' if layer == 0 else 'layers or kv heads'} (layer {layer}, kv head "
            f"{head} vs layer 0, head 0: max |dtheta/theta| = {float(spread.max()):.2e}). "
            "rope_parameters holds one frequency per rotary pair for the whole model, so "
            "transformers, vLLM and llama.cpp cannot serve a per-head or per-layer schedule. "
            "Serving it needs attention code with per-(layer, kv head) inv_freq: ropekit.hf "
            "(load_model + load_adapter), or custom modeling code loaded with "
            "trust_remote_code that does the same; or retrain with "
            "share_heads=true,share_layers=true."
        )
    if max(factors) != min(factors):
        raise ExportRefused(f"{encoding.spec!r}: the attention factor differs across layers")
    return ref, factors[0]


def _has_temperature(encoding: PositionEncoding) -> bool:
    """Whether the encoding multiplies queries by a temperature (AdaScale on)."""
    probe = torch.zeros(1, 1, dtype=torch.long, device=next(encoding.parameters()).device)
    return encoding.query_temperature(probe) is not None


def _temperature(encoding: PositionEncoding, temperature_at: int | None) -> tuple[float, list[str]]:
    """AdaScale's query multiplier as one constant, if it is one (see the module docstring)."""
    l_ref = int(encoding.l_ref)
    # Lengths L = position + 1 that probe both regimes: below L_ref the log-log term is
    # constant (ln ln 2), above it grows with L.
    lengths = sorted({1, l_ref, l_ref + 1, 2 * l_ref, 16 * l_ref, 256 * l_ref})
    if temperature_at is not None:
        lengths = sorted({*lengths, int(temperature_at)})
    device = next(encoding.parameters()).device
    positions = (torch.tensor([lengths]) - 1).to(device)  # (1, T)
    with torch.no_grad():
        temps = torch.stack(
            [
                encoding.query_temperature(positions, layer)[0, ..., 0]
                .double()
                .cpu()
                .expand(encoding.n_heads, -1)
                for layer in range(encoding.n_layers)
            ]
        )  # (L, H, T)
    per_length = temps[0, 0]  # (T,)
    if ((temps / per_length - 1).abs() > 1e-6).any():
        raise ExportRefused(
            f"{encoding.spec!r}: AdaScale temperatures differ across heads or layers; "
            "rope_parameters has one attention factor for the whole model. Serving it needs "
            "per-head query scales (ropekit.hf, or folding 1/tau_h into each head's q_proj "
            "rows when gamma = 0, which this export does not do)."
        )
    notes: list[str] = []
    if ((per_length / per_length[0] - 1).abs() > 1e-6).any():
        if temperature_at is None:
            raise ExportRefused(
                f"{encoding.spec!r}: AdaScale's temperature grows with the query position "
                f"(gamma != 0: lambda(L) = {float(per_length[0]):.4f} at L <= {l_ref}, "
                f"{float(per_length[-1]):.4f} at L = {lengths[-1]}); no rope type scales "
                "queries by position, so the export would lose this length-dependence. Pass "
                "temperature_at=L to freeze lambda at length L (an approximation), or serve "
                "with ropekit.hf."
            )
        value = float(per_length[lengths.index(int(temperature_at))])
        notes.append(
            f"approximate: AdaScale's length-dependent temperature frozen at L={temperature_at} "
            f"(lambda = {value:.6f}); queries at other lengths above L_ref={l_ref} differ"
        )
        return value, notes
    value = float(per_length[0])
    if value != 1.0:
        notes.append(
            f"AdaScale's constant temperature {value:.6f} folded into attention_factor "
            "(exact: af' = af * sqrt(lambda))"
        )
    return value, notes


def _learned_rope_parameters(
    encoding: PositionEncoding,
    config: Any,
    temperature_at: int | None,
    nearest: bool = False,
    kind: str | None = None,
) -> tuple[dict[str, Any], list[str]]:
    check_exportable_shape(encoding, config, kind)
    base = float(encoding.base)
    notes: list[str] = []
    temperature = 1.0
    try:
        theta, factor = _learned_frequencies(encoding)
        if _has_temperature(encoding):  # AdaScale: a length-aware query temperature
            temperature, notes = _temperature(encoding, temperature_at)
    except ExportRefused:
        if not (nearest and encoding.head_rows("freq") is not None):
            raise
        fit = nearest_shared(encoding, length=temperature_at or target_length(encoding, config))
        theta, factor, temperature = fit.theta, fit.attention_factor, fit.temperature
        notes = list(fit.notes)
    rope_theta, _ = schedules.rope(encoding.rotary_dim, base)
    lam = (rope_theta / theta).tolist()
    params = {
        "rope_type": "longrope",
        "rope_theta": base,
        "short_factor": lam,
        "long_factor": lam,
        "original_max_position_embeddings": int(
            encoding.original_length or original_length(config)
        ),
        # Only feeds transformers' default attention factor, which is set explicitly below.
        "factor": float(encoding.factor or 1.0),
        "attention_factor": factor * math.sqrt(temperature),
    }
    set_rotated_share(encoding, config, params, kind)
    return params, notes


def export_rope_parameters(
    encoding: PositionEncoding,
    config: Any,
    *,
    temperature_at: int | None = None,
    nearest: bool = False,
    kind: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(rope_parameters, other config fields, notes) expressing ``encoding`` for plain
    transformers in layers of type ``kind`` (None: the first it covers; the whole model's are
    ``model_rope_parameters``); ExportRefused (a ValueError) says why when none can.
    ``nearest``: a per-head AdaRoPE exports as its closest shared schedule (an approximation,
    in the notes)."""
    if encoding.remaps_distance:
        raise ExportRefused(
            f"{encoding.spec!r} remaps query-key distances in attention; no serving engine's "
            "rope config can express it (transformers, vLLM and llama.cpp rotate q and k once)"
        )
    if encoding.rotary_dim > 0 and not encoding.learned_frequencies:
        if encoding.query_temperature(torch.zeros(1, 1, dtype=torch.long)) is not None:
            raise ExportRefused(
                f"{encoding.spec!r} scales each query by a factor that follows its position; no "
                "rope type does (rope_parameters scale cos and sin alike everywhere): serve it "
                "with ropekit.hf"
            )
        params, extra = rope_parameters_for(encoding, config, kind)
        return params, extra, []
    if encoding.learned_frequencies:
        if encoding.dynamic:
            raise ExportRefused(
                f"{encoding.spec!r} follows the sequence length and learned its frequencies; "
                "no rope type expresses both"
            )
        params, notes = _learned_rope_parameters(encoding, config, temperature_at, nearest, kind)
        return params, {}, notes
    raise ExportRefused(
        f"{encoding.spec!r}: only rotary encodings export to rope_parameters; "
        f"{type(encoding).__name__} has no rope type in transformers"
    )


def target_length(encoding: PositionEncoding, config: Any) -> int:
    """The length the encoding is made for: round(factor x L0) of its schedule (an AdaRoPE's
    init schedule), L0 when it has no factor (plain RoPE)."""
    factor = encoding.factor or 1.0
    l0 = encoding.original_length or original_length(config)
    return round(float(factor) * int(l0))


# rope types whose accepted length vLLM takes from max_position_embeddings as it is (no
# factor): vllm/config/model.py, _get_and_verify_max_len.
_UNSCALED_BY_VLLM = ("yarn", "llama3", "longrope")


def length_fields(
    params: dict[str, Any], config: Any, target: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config fields, extra rope_parameters) that make transformers keep computing ``params``
    and make vLLM accept ``target`` tokens (the rules are in the module docstring)."""
    kind = params.get("rope_type", "default")
    l0 = int(params.get("original_max_position_embeddings") or original_length(config))
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if kind in _UNSCALED_BY_VLLM or kind == "default":
        fields["max_position_embeddings"] = max(int(target), l0)
    elif kind == "linear":
        # vLLM accepts max_position_embeddings x factor (transformers' linear ignores it).
        # dynamic is left as rope_parameters_for set it: L0, which transformers measures its
        # stretch against (and vLLM again multiplies by the factor).
        fields["max_position_embeddings"] = l0
    if kind == "longrope" and params.get("attention_factor") is not None:
        # vllm/model_executor/layers/rotary_embedding/__init__.py (get_rope) passes only
        # short_mscale/long_mscale to Phi3LongRoPEScaledRotaryEmbedding, never
        # attention_factor; without them it scales cos/sin by sqrt(1 + ln(max/L0)/ln L0).
        extra["short_mscale"] = float(params["attention_factor"])
        extra["long_mscale"] = float(params["attention_factor"])
    return fields, extra


def _backbone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from ropekit.hf.patching import ENCODING_ATTR  # imports transformers (ropekit.hf's doc)

    marker = f"{ENCODING_ATTR}."
    return {
        k: v
        for k, v in model.state_dict().items()
        if not (k.startswith(marker) or f".{marker}" in k)
    }


def _raise_model_max_length(tokenizer: Any, target: int) -> None:
    # vLLM caps its accepted length at the tokenizer's model_max_length
    # (_get_and_verify_max_len); transformers' "no limit" is a huge sentinel (1e30).
    current = getattr(tokenizer, "model_max_length", None)
    if current is not None and current < target:
        tokenizer.model_max_length = target


def export(
    model_or_path: nn.Module | str | os.PathLike[str],
    adapter: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
    *,
    spec: str | None = None,
    tokenizer: Any = None,
    temperature_at: int | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    format: str = "hf",
    max_length: int | None = None,
    nearest: bool = False,
) -> Path:
    """Write a folder that serves the model with its ropekit encoding; returns it.

    ``format``: ``"hf"`` (a plain Hugging Face folder: transformers, vLLM), ``"gguf"``
    (``model.gguf`` for llama.cpp) or ``"vllm"`` (an HF folder for vLLM with ropekit's plugin,
    ``ropekit.serve.vllm_plugin``: the adapter travels in ``ropekit_adapter/`` and is applied
    exactly, per head; ``rope_parameters`` hold the nearest shared schedule, which is what an
    engine without the plugin would compute). ``max_length``: the length engines must accept
    (default: ``target_length``, factor x L0). ``nearest``: export a per-head AdaRoPE as the closest
    shared schedule (approximate; the record's notes say by how much it moved).

    ``model_or_path``: a model (patched or not) or what ``load_model`` opens (a folder or an
    installed model name; its tokenizer is copied too). The encoding is, in order: the
    ``adapter`` folder (loaded into the model, which is patched in place), else ``spec`` (the
    model is patched with it), else the one the model is already patched with. Refused
    encodings raise ExportRefused before anything is written. The folder is assembled under a
    temporary name and renamed into place; an existing ``out_dir`` is replaced only with
    ``overwrite``.
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not allowed; allowed: {', '.join(FORMATS)}")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length={max_length} is not allowed; give a positive length")
    out = Path(out_dir)
    with writing(out):  # a file on the way (--out under a file) is one line naming it
        if out.exists() and not out.is_dir():
            raise OutputError(f"cannot write {out}: it is a file, not a folder", path=out)
        blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise OutputError(f"cannot write {out}: {blocker} is a file, not a folder", path=out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True to replace it")
    model, tokenizer = _open(model_or_path, tokenizer, trust_remote_code)
    encoding = _encoding(model, adapter, spec)
    config, record = served_config(
        model.config, encoding, format, temperature_at=temperature_at, max_length=max_length,
        nearest=nearest,
    )  # fmt: skip
    base_model(model)  # fails early on models ropekit cannot patch
    with writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
        try:
            _write(tmp, model, config, tokenizer, record, model_or_path)
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _open(
    model_or_path: nn.Module | str | os.PathLike[str], tokenizer: Any, trust_remote_code: bool
) -> tuple[nn.Module, Any]:
    """The model to export and the tokenizer copied beside it (a folder's own, if any)."""
    if isinstance(model_or_path, nn.Module):
        if unwrap(model_or_path) is not model_or_path:
            raise ValueError(
                "the model is wrapped by PEFT; merge its LoRA weights first "
                "(model = model.merge_and_unload()), then export the merged model"
            )
        return model_or_path, tokenizer
    path = Path(model_or_path)
    if any(is_decoder_dir(folder) for folder in (path, path / "model")):
        raise ExportRefused(
            f"{path} is a ropekit decoder run: its architecture is ropekit's own, which no "
            "serving engine knows, so decoder runs cannot be exported; allowed: --model a "
            "Hugging Face folder or an installed model (e.g. smollm2-135m); evaluate a decoder "
            "run with `ropekit eval` instead"
        )
    model = load_model(model_or_path, trust_remote_code=trust_remote_code)
    if tokenizer is None and any(
        (resolve_model(model_or_path) / f).is_file()
        for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        tokenizer = load_tokenizer(model_or_path, trust_remote_code=trust_remote_code)
    return model, tokenizer


def _encoding(model: nn.Module, adapter: Any, spec: str | None) -> PositionEncoding:
    """The encoding exported: the adapter's, else the spec's, else the model's own patch."""
    from ropekit.hf.patching import encoding_of, patch  # imports transformers (ropekit.hf's doc)

    if adapter is not None and spec is not None:
        raise ValueError("give an adapter or a spec, not both")
    if adapter is not None:
        return load_adapter(model, adapter)
    if spec is not None:
        return patch(model, spec)
    found = encoding_of(model)
    if found is None:
        raise ValueError("the model is not patched; give an adapter folder or a spec")
    return found


def _refuse_remaps_with_own_queries(encoding: PositionEncoding) -> None:
    """ExportRefused for a remap whose queries carry learned frequencies or a temperature of
    their own (adarope-remap, a fixed temperature over a remap): no engine serves them."""
    if encoding.remaps_distance and (
        encoding.learned_frequencies
        or encoding.query_temperature(torch.zeros(1, 1, dtype=torch.long)) is not None
    ):
        raise ExportRefused(
            f"{encoding.spec!r} rotates or scales queries of its own inside a remap's bands; "
            "no engine serves that (ropekit's vLLM plugin is tested on fixed remaps and on "
            "learned rotations apart, not together): serve it with ropekit.hf "
            "(load_model + load_adapter)"
        )


def _check_servable(model_config: Any, encoding: PositionEncoding, format: str) -> None:
    """ExportRefused for what no engine of ``format`` serves, whatever its rope_parameters."""
    if format == "vllm" and encoding.dynamic and not encoding.remaps_distance:
        raise ExportRefused(
            f"{encoding.spec!r} follows the sequence length; the vLLM plugin rotates by token "
            "position only (vLLM gives the rotary no sequence lengths)"
        )
    _refuse_remaps_with_own_queries(encoding)
    if format == "gguf":
        check_writable(model_config)


def served_config(
    model_config: Any,
    encoding: PositionEncoding,
    format: str,
    *,
    temperature_at: int | None = None,
    max_length: int | None = None,
    nearest: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """The config the engines read from an export of ``encoding`` on a model of
    ``model_config`` in ``format`` (rope_parameters and every length field) and the export
    record (ropekit_export.json); nothing is written. ExportRefused says why there is none."""
    _check_servable(model_config, encoding, format)
    recipe = None
    rope_encoding = encoding
    if encoding.remaps_distance:
        # vLLM with ropekit's plugin computes every remap in its attention (the folder holds
        # the base schedule, engines.vllm_ropekit). Self-Extend in llama.cpp's blocks: the
        # GGUF holds the base schedule and the record names the recipe that makes llama.cpp
        # group its KV cache (engines.llamacpp); every other remap, format or base is refused
        # there, saying why.
        recipe = plugin_recipe(encoding) if format == "vllm" else llamacpp_recipe(encoding, format)
        rope_encoding = encoding.inner
    # The layers the encoding covers (a remap's inner schedule covers the remap's layers).
    kind = covered_types(model_config, encoding.layers)[0]
    params, extra, notes = export_rope_parameters(
        rope_encoding, model_config, temperature_at=temperature_at,
        nearest=nearest or format == "vllm", kind=kind,
    )  # fmt: skip
    if format == "vllm":
        from .vllm_plugin import ARCHITECTURE

        extra = {**extra, "architectures": [ARCHITECTURE]}
        what = (
            "rope_parameters hold its base schedule"
            if encoding.remaps_distance
            else "rope_parameters (what transformers computes without the plugin; stock vLLM "
            "refuses the architecture):"
        )
        notes = [
            f"served by vLLM with ropekit's plugin within its tolerance ({ARCHITECTURE}, "
            f"adapter in ropekit_adapter/); {what}",
            *notes,
        ]
    target = int(max_length or target_length(encoding, model_config))
    if recipe is not None:
        l0 = int(encoding.original_length or original_length(model_config))
        if recipe["engine"] == "llama.cpp":
            notes = [*notes, *recipe_notes(recipe)]
            if max_length is None:  # Self-Extend's reach, not the base schedule's factor x L0
                target = self_extend_reach(recipe["group"], recipe["window"], l0)
        else:
            notes = [*notes, *plugin_notes(recipe, encoding.spec, encoding.dynamic)]
            if max_length is None:
                target = _remap_target(encoding, l0)
        recipe = {**recipe, "original_length": l0}  # inspect's L0: the base params lack it
    fields, engine_keys = length_fields(params, model_config, target)
    params = {**params, **engine_keys}
    extra = {**extra, **fields}
    if "short_mscale" in engine_keys:
        notes = [*notes, _MSCALE_WARNING]
    params = model_rope_parameters(model_config, encoding.layers, params)
    config = copy.deepcopy(model_config)
    config.rope_parameters = params
    for key, value in extra.items():
        setattr(config, key, value)
    _check_read_back(config)
    record = {
        "spec": encoding.spec, "format": format, "target_length": target,
        "rope_parameters": params, "config_changes": extra, "notes": notes,
        "ropekit": __version__,
    }  # fmt: skip
    if recipe is not None:
        record["serve_with"] = recipe
    return config, record


def _check_read_back(config: Any) -> None:
    """ExportRefused unless the family's config class reads the exported rope_parameters back
    as written: some validate (Phi-3 takes default and longrope only) or rewrite them (Phi-3
    reads yarn as longrope), which would serve another schedule than the one exported."""
    from huggingface_hub.errors import StrictDataclassClassValidationError

    written = copy.deepcopy(config.rope_parameters)
    try:
        read = type(config).from_dict(config.to_dict()).rope_parameters
    except (KeyError, ValueError, TypeError, StrictDataclassClassValidationError) as e:
        cause = e.__cause__ or e  # the validator's own error, under huggingface_hub's
        reason = str(cause.args[0] if isinstance(cause, KeyError) else cause).strip()
        raise ExportRefused(
            f"transformers' {type(config).__name__} refuses the exported rope_parameters "
            f"({reason}); export a rope type this family takes, or serve with ropekit.hf"
        ) from None
    if read != written:
        raise ExportRefused(
            f"transformers' {type(config).__name__} reads the exported rope_parameters {written} "
            f"as {read}, another schedule; export a rope type this family takes as written"
        )


def _remap_target(encoding: PositionEncoding, l0: int) -> int:
    """The length a remap's plugin export accepts when none is given: its reach
    (``remap_reach``); ExportRefused where the remap has none."""
    reach = remap_reach(encoding, l0)
    if reach is None:
        raise ExportRefused(
            f"{encoding.spec!r} keeps every distance it sees below L0 = {l0} at any length "
            "(or a fixed fraction of it), so it has no longest length of its own: give the "
            "length vLLM must accept (--max-length N, export(..., max_length=N))"
        )
    return reach


# Where the user sees transformers' warning on loading a longrope export, its explanation.
_MSCALE_WARNING = (
    "transformers warns \"Unrecognized keys in `rope_parameters` for 'rope_type'='longrope': "
    "{'short_mscale', 'long_mscale'}\" on loading this folder: the keys are vLLM's (its "
    "longrope scales cos/sin by them and never reads attention_factor); transformers ignores "
    "them and computes the schedule from attention_factor, the same value"
)


def folder_readme(record: dict[str, Any]) -> str:
    """The README.md of an export: what it is, which engine serves it, and what it
    approximates (the record's notes)."""
    from .engines import FORMATS

    engines = ", ".join(FORMATS[record["format"]])
    lines = [
        f"# ropekit export: `{record['spec']}`",
        "",
        f"Written by ropekit {record['ropekit']} with `--format {record['format']}` for "
        f"{engines}; engines accept {record['target_length']} tokens.",
    ]
    if record["format"] == "vllm":
        from .vllm_plugin import ARCHITECTURE

        remap = record.get("serve_with") is not None
        computed = (
            "the base schedule without the remap, far from it beyond L0"
            if remap
            else "the adapter's nearest shared schedule, an approximation (how far it moved is "
            "below)"
        )
        stock = (
            "No stock engine computes the remap."
            if remap
            else "For a stock engine, export again with `--nearest` (`--format hf` for "
            "transformers and vLLM, `--format gguf` for llama.cpp)."
        )
        lines += [
            "",
            "Served exactly (per layer and kv head, within vLLM's tolerance: 5x its own float32 "
            "noise floor) only by vLLM with ropekit's plugin: install ropekit into vLLM's "
            f"environment (`pip install --no-deps ropekit`); `config.json` names its "
            f"architecture, {ARCHITECTURE}. **Without the plugin** stock vLLM refuses this "
            "folder: the architecture is unknown to it "
            "(`vllm/model_executor/models/registry.py: _raise_for_unsupported`). transformers "
            f"loads it as a Llama (its `model_type`) and computes `rope_parameters`: {computed}. "
            f"{stock}",
        ]
    lines += ["", "Notes (also in ropekit_export.json; `ropekit inspect` on this folder):", ""]
    lines += [f"- {note}" for note in record["notes"]]
    return "\n".join(lines) + "\n"


def _write(
    tmp: Path, model: nn.Module, config: Any, tokenizer: Any, record: dict, source: Any
) -> None:
    """The export's files in ``tmp`` (renamed into place by the caller), every one fsynced."""
    if record["format"] == "gguf":
        from .gguf_file import GGUF_NAME, write_gguf

        notes = write_gguf(model, config, tmp / GGUF_NAME, tokenizer=tokenizer, source=source)
        record = {**record, "notes": record["notes"] + notes}
    else:
        if record["format"] == "vllm":
            from .vllm_plugin import ADAPTER_DIR

            save_adapter(model, tmp / ADAPTER_DIR)
        model.save_pretrained(tmp, state_dict=_backbone_state(model))
        config.save_pretrained(tmp)  # replaces the config save_pretrained wrote
        if tokenizer is not None:
            _raise_model_max_length(tokenizer, record["target_length"])
            tokenizer.save_pretrained(tmp)
    (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    (tmp / "README.md").write_text(folder_readme(record), encoding="utf-8")
    for path in tmp.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
