"""``ropekit inspect MODEL_DIR``: what transformers, vLLM and llama.cpp will each do with a
folder's rope config, and the config change that removes every disagreement.

transformers defines what a ``rope_parameters`` block means (ropekit's exports are exact
against it), so each other engine is compared with it at two lengths: inside the original
window and at the target (``ropekit_export.json``'s ``target_length``, else factor x L0 read
from the config). A disagreement is a per-pair frequency off by more than 1e-6 relative, an
attention factor off by more than 1e-6, a longest accepted length below the target, or a
refusal. The rules are ``ropekit.serve.engines`` (each cites the engine file and function).

Holds: inspect_folder, check_rope_config, format_report, Disagreement.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from .engines import EngineRoPE, llamacpp_from_config, transformers_rope, vllm_rope

RTOL = 1e-6  # far above float64 schedule noise, far below any real schedule change


@dataclasses.dataclass(frozen=True)
class Disagreement:
    engine: str
    length: int
    what: str
    fix: str


def _target(config: dict[str, Any], folder: Path) -> int:
    record = folder / "ropekit_export.json"
    if record.is_file():
        target = _json_object(record).get("target_length")
        if target is not None:
            if isinstance(target, bool) or not isinstance(target, int) or target < 1:
                raise ValueError(
                    f"{record}: target_length={target!r} is not allowed; it must be an integer >= 1"
                )
            return target
    p = config.get("rope_parameters") or {}
    kind = p.get("rope_type", "default")
    max_pos = int(config["max_position_embeddings"])
    if kind in ("linear", "dynamic"):
        return round(max_pos * float(p.get("factor") or 1.0))
    if kind in ("yarn", "llama3", "longrope") and p.get("factor"):
        return round(float(p["factor"]) * int(p.get("original_max_position_embeddings") or max_pos))
    return max_pos


def _fix_for_length(engine: str, config: dict[str, Any], limit: int, target: int) -> str:
    p = config.get("rope_parameters") or {}
    kind = p.get("rope_type", "default")
    if engine == "vllm":
        if kind in ("linear", "dynamic"):
            return (
                f"vLLM accepts max_position_embeddings x factor: set max_position_embeddings "
                f"so that it times factor {p.get('factor')} is >= {target}"
                + (
                    " (dynamic: transformers measures its stretch against it, so exact "
                    "dynamic serving in both is impossible)"
                    if kind == "dynamic"
                    else ""
                )
            )
        return (
            f"set max_position_embeddings = {target} (and a tokenizer model_max_length >= "
            f"{target}); vLLM takes {kind}'s length from it unscaled"
        )
    return f"set llama.context_length = {target} in the GGUF (or pass n_ctx={target})"


def _compare(
    ref: EngineRoPE, view: EngineRoPE, length: int, config: dict[str, Any]
) -> list[Disagreement]:
    out = []
    p = config.get("rope_parameters") or {}
    kind = p.get("rope_type", "default")
    if view.error is not None:
        return [
            Disagreement(view.engine, length, f"refuses: {view.error}", _fix_refusal(view, kind))
        ]
    rel = float(((view.inv_freq - ref.inv_freq).abs() / ref.inv_freq).max())
    if rel > RTOL:
        pair = int(((view.inv_freq - ref.inv_freq).abs() / ref.inv_freq).argmax())
        out.append(
            Disagreement(
                view.engine,
                length,
                f"frequencies differ by up to {rel:.3g} relative (pair {pair})",
                _fix_frequencies(view.engine, kind, p),
            )
        )
    if abs(view.attention_factor - ref.attention_factor) > RTOL * max(1.0, ref.attention_factor):
        out.append(
            Disagreement(
                view.engine,
                length,
                f"attention factor {view.attention_factor:.6f} vs transformers' "
                f"{ref.attention_factor:.6f}",
                _fix_attention(view.engine, kind, ref.attention_factor),
            )
        )
    return out


def _fix_refusal(view: EngineRoPE, kind: str) -> str:
    if view.engine == "llama.cpp" and kind == "longrope":
        # One rope_freqs tensor for every length (llama-model.cpp: get_rope_factors).
        return (
            "set short_factor = long_factor (llama.cpp applies one set of factors at every "
            "length; the GGUF export then writes them as rope_freqs)"
        )
    if view.engine == "llama.cpp":
        return "export a schedule llama.cpp has (linear, yarn with default betas, rope_freqs)"
    return "serve at a length the engine accepts, or change the length fields"


def _fix_frequencies(engine: str, kind: str, p: dict[str, Any]) -> str:
    if engine == "vllm" and kind == "dynamic":
        return (
            "none in the config: vLLM's dynamic NTK is one fixed base (plain RoPE unless "
            "max_trained_positions < max_position_embeddings); export a fixed schedule "
            "(yarn, or ntk at the target) or serve with transformers/ropekit"
        )
    if engine == "vllm" and kind == "longrope":
        return (
            "set short_factor = long_factor (vLLM picks one set for every length from "
            "max_model_len, transformers switches by sequence length), or serve with "
            "--max-model-len <= original_max_position_embeddings for short prompts"
        )
    return f"no rule here for {engine} {kind}; compare the engine's source"


def _fix_attention(engine: str, kind: str, value: float) -> str:
    if engine == "vllm" and kind == "longrope":
        return f"add short_mscale = long_mscale = {value:.6f} to rope_parameters"
    if engine == "llama.cpp" and kind == "yarn":
        return "write rope.scaling.attn_factor = transformers' factor / (1 + 0.1 ln s)"
    return f"make {engine}'s attention factor {value:.6f}"


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a file that is not one is a ValueError naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    return data


# The rope keys inspect reads, with what each must be: a nonsense value is an error, never a
# schedule the engines then "agree" on.
_POSITIVE = ("rope_theta", "factor", "attention_factor", "mscale", "mscale_all_dim")
_LENGTHS = ("max_position_embeddings", "original_max_position_embeddings")


def check_rope_config(config: dict[str, Any], where: Path | str) -> None:
    """Refuse a config whose rope keys no engine can mean: a ValueError naming the key, its
    value and what is allowed. ``config`` has ``rope_parameters`` (or its default)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    p = config["rope_parameters"]
    if not isinstance(p, dict):
        raise ValueError(f"{where}: rope_parameters must be a JSON object, not {p!r}")
    kinds = sorted({"default", *ROPE_INIT_FUNCTIONS})
    if p.get("rope_type", "default") not in kinds:
        raise ValueError(
            f"{where}: rope_type={p.get('rope_type')!r} is not allowed; allowed: {', '.join(kinds)}"
        )

    def number(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise ValueError(f"{where}: {name}={value!r} is not allowed; it must be a number")
        return float(value)

    for name in _POSITIVE:
        if p.get(name) is not None and not 0 < number(name, p[name]) < float("inf"):
            raise ValueError(f"{where}: {name}={p[name]!r} is not allowed; it must be > 0")
    for name in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"):
        if p.get(name) is not None:
            number(name, p[name])
    for name in _LENGTHS:
        value = p.get(name, config.get(name))
        if name == "max_position_embeddings" and value is None:
            raise ValueError(f"{where}: max_position_embeddings is missing")
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(
                f"{where}: {name}={value!r} is not allowed; it must be an integer >= 1"
            )
    for name in ("short_factor", "long_factor"):
        factors = p.get(name)
        if factors is not None and (
            not isinstance(factors, list)
            or not factors
            or any(not 0 < number(name, f) < float("inf") for f in factors)
        ):
            raise ValueError(f"{where}: {name} must be a list of numbers > 0")


def inspect_folder(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every engine's RoPE for the HF folder at ``path`` and their disagreements."""
    from transformers import AutoConfig

    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder (no config.json)")
    config = _json_object(config_file)
    if "rope_parameters" not in config and "rope_scaling" in config:
        raise ValueError(
            f"{config_file}: rope_scaling (transformers < 5) is not read here; load and save it "
            "with transformers 5 to get rope_parameters"
        )
    config.setdefault(
        "rope_parameters", {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    )
    check_rope_config(config, config_file)
    tokenizer_file = folder / "tokenizer_config.json"
    tokenizer_config = _json_object(tokenizer_file) if tokenizer_file.is_file() else None
    hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    p = config["rope_parameters"]
    l0 = int(p.get("original_max_position_embeddings") or config["max_position_embeddings"])
    if p.get("rope_type") in ("linear", "dynamic"):
        l0 = int(config["max_position_embeddings"])
    target = _target(config, folder)
    lengths = sorted({min(1024, l0), target})
    views: dict[int, dict[str, EngineRoPE]] = {}
    disagreements: list[Disagreement] = []
    for n in lengths:
        ref = transformers_rope(config, n)
        vllm = vllm_rope(config, n, tokenizer_config=tokenizer_config, max_model_len=target)
        if vllm.error is not None and vllm.max_length is not None:
            # What vLLM does when the target is not asked for: serve its derived length.
            disagreements.append(
                Disagreement(
                    "vllm",
                    n,
                    f"refuses {target} tokens: {vllm.error}",
                    _fix_for_length("vllm", config, vllm.max_length, target),
                )
            )
            vllm = vllm_rope(config, n, tokenizer_config=tokenizer_config)
        llama = llamacpp_from_config(hf_config, n, target)
        views[n] = {"transformers": ref, "vllm": vllm, "llama.cpp": llama}
        for view in (vllm, llama):
            disagreements += _compare(ref, view, n, config)
    for name in ("vllm", "llama.cpp"):
        limit = views[target][name].max_length
        if limit is not None and limit < target and views[target][name].error is None:
            disagreements.append(
                Disagreement(
                    name,
                    target,
                    f"accepts {limit} tokens, below the target {target}",
                    _fix_for_length(name, config, limit, target),
                )
            )
    return {
        "folder": str(folder),
        "rope_parameters": p,
        "original_length": l0,
        "target_length": target,
        "lengths": lengths,
        "views": {n: {name: _view_json(v) for name, v in row.items()} for n, row in views.items()},
        "disagreements": [dataclasses.asdict(d) for d in disagreements],
    }


def _view_json(v: EngineRoPE) -> dict[str, Any]:
    return {
        "source": v.source,
        "inv_freq": None if v.inv_freq is None else [float(x) for x in v.inv_freq],
        "attention_factor": v.attention_factor,
        "max_length": v.max_length,
        "error": v.error,
        "notes": list(v.notes),
    }


def format_report(report: dict[str, Any]) -> list[str]:
    """The lines ``ropekit inspect`` prints."""
    p = report["rope_parameters"]
    lines = [
        f"{report['folder']}: rope_type={p.get('rope_type', 'default')} "
        f"L0={report['original_length']} target={report['target_length']}",
        f"{'length':>7}  {'engine':<13}{'longest':>9}  {'attn':>9}  "
        f"{'theta_0':>10} {'theta_mid':>10} {'theta_last':>10}  source",
    ]
    for n, row in report["views"].items():
        for name, v in row.items():
            longest = "-" if v["max_length"] is None else str(v["max_length"])
            if v["error"]:
                lines.append(f"{n:>7}  {name:<13}{longest:>9}  refuses: {v['error']}")
                continue
            theta = v["inv_freq"]
            mid = theta[len(theta) // 2]
            lines.append(
                f"{n:>7}  {name:<13}{longest:>9}  {v['attention_factor']:>9.6f}  "
                f"{theta[0]:>10.4g} {mid:>10.4g} {theta[-1]:>10.4g}  {v['source']}"
            )
            lines += [f"{'':>9}{note}" for note in v["notes"]]
    if not report["disagreements"]:
        lines.append("no disagreements: every engine computes what transformers computes")
    for d in report["disagreements"]:
        lines.append(f"DISAGREES {d['engine']} @{d['length']}: {d['what']}")
        lines.append(f"  fix: {d['fix']}")
    return lines
