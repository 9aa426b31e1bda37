"""``ropekit inspect MODEL_DIR``: what transformers, vLLM and llama.cpp will each do with a
folder's rope config, and the config change that removes every disagreement.

transformers defines what a ``rope_parameters`` block means (ropekit's exports are exact
against it), so each other engine is compared with it at two lengths: inside the original
window and at the target (``ropekit_export.json``'s ``target_length``, else factor x L0 read
from the config). A disagreement is a per-pair frequency off by more than 1e-6 relative, an
attention factor off by more than 1e-6, a longest accepted length below the target, or a
refusal. The rules are ``ropekit.serve.engines`` (each cites the engine file and function).

Where ``rope_parameters`` nest by layer type (Gemma 3/4, OLMo 3), each type is inspected as
its own flat config (every engine applies a type's dict to that type's layers), and a family
stock vLLM serves through its Transformers backend, or not at all, is said so
(``ropekit.hf.archs.VLLM_SERVES``); llama.cpp is checked only through ropekit's GGUF writer's
families (another family's GGUF comes from llama.cpp's own converter).

Holds: inspect_folder, read_folder, layer_type_folders, lengths_checked, engine_views,
reference_view, rope_disagreements, check_rope_config, format_report, Disagreement.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from ropekit.hf.archs import nested_by_type

from .engines import ENGINES, EXPORT_RECORD, Engine, EngineRoPE, ServedFolder
from .gguf_file import GGUF_NAME, read_gguf

RTOL = 1e-6  # far above float64 schedule noise, far below any real schedule change


@dataclasses.dataclass(frozen=True)
class Disagreement:
    engine: str
    length: int
    what: str
    fix: str


def _target(config: dict[str, Any], folder: Path) -> int:
    record = folder / EXPORT_RECORD
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


def _compare(
    engine: Engine, ref: EngineRoPE, view: EngineRoPE, length: int, folder: ServedFolder
) -> list[Disagreement]:
    """How ``view`` (one engine at ``length``) departs from the reference ``ref``."""
    if view.error is not None:
        return [
            Disagreement(engine.name, length, f"refuses: {view.error}", engine.refusal_fix(folder))
        ]
    out = []
    if view.target_refused is not None:
        what = f"refuses {folder.target} tokens: {view.target_refused}"
        out.append(Disagreement(engine.name, length, what, engine.length_fix(folder)))
    if ref.per_head is not None:  # the reference is per head: this engine computes one schedule
        rel = (view.inv_freq / ref.per_head - 1).abs()  # (L, K, F)
        if float(rel.max()) > RTOL:
            layer, head, pair = (int(i) for i in torch.unravel_index(rel.argmax(), rel.shape))
            what = (
                f"one shared schedule (rope_parameters: the nearest), not the adapter's per-head "
                f"one: frequencies off by up to {float(rel.max()):.3g} relative (layer {layer}, "
                f"kv head {head}, pair {pair})"
            )
            out.append(Disagreement(engine.name, length, what, engine.per_head_fix(folder)))
        return out
    # relative to the reference; p-RoPE's zeroed pairs must stay zero (0/0 is agreement)
    rel = (view.inv_freq - ref.inv_freq).abs() / ref.inv_freq.abs().clamp_min(1e-300)
    if float(rel.max()) > RTOL:
        pair = int(rel.argmax())
        what = f"frequencies differ by up to {float(rel.max()):.3g} relative (pair {pair})"
        out.append(Disagreement(engine.name, length, what, engine.frequencies_fix(folder)))
    if abs(view.attention_factor - ref.attention_factor) > RTOL * max(1.0, ref.attention_factor):
        what = (
            f"attention factor {view.attention_factor:.6f} vs {_possessive(ref.engine)} "
            f"{ref.attention_factor:.6f}"
        )
        out.append(
            Disagreement(
                engine.name, length, what, engine.attention_fix(folder, ref.attention_factor)
            )
        )
    return out


def _possessive(name: str) -> str:
    return f"{name}'" if name.endswith("s") else f"{name}'s"


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


def read_folder(path: str | os.PathLike[str]) -> ServedFolder:
    """The HF folder at ``path`` as the engines read it; a ValueError or FileNotFoundError
    naming what is wrong with it."""
    from transformers import AutoConfig

    folder = Path(path)
    config_file = folder / "config.json"
    if folder.is_file() or (not config_file.is_file() and (folder / GGUF_NAME).is_file()):
        return _read_gguf_folder(folder)
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{folder} is neither a Hugging Face model folder (no config.json) nor a GGUF "
            f"export (no {GGUF_NAME})"
        )
    config = _json_object(config_file)
    if "rope_parameters" not in config and "rope_scaling" in config:
        raise ValueError(
            f"{config_file}: rope_scaling (transformers < 5) is not read here; load and save it "
            "with transformers 5 to get rope_parameters"
        )
    config.setdefault(
        "rope_parameters", {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    )
    for kind, params in _per_type(config["rope_parameters"]).items():
        where = config_file if kind is None else f"{config_file} (rope_parameters[{kind!r}])"
        check_rope_config({**config, "rope_parameters": params}, where)
    tokenizer_file = folder / "tokenizer_config.json"
    record_file = folder / EXPORT_RECORD
    return ServedFolder(
        path=folder,
        config=config,
        hf_config=AutoConfig.from_pretrained(folder, local_files_only=True),
        target=_target(config, folder),
        tokenizer_config=_json_object(tokenizer_file) if tokenizer_file.is_file() else None,
        record=_json_object(record_file) if record_file.is_file() else None,
        files=(config_file,),
    )


def _read_gguf_folder(path: Path) -> ServedFolder:
    """A GGUF file (``path``, or ``path/model.gguf``) as the engines read it: llama.cpp from
    the file; transformers' meaning of the rope_parameters it was converted from, where
    ropekit's record beside it says which."""
    file = path if path.is_file() else path / GGUF_NAME
    model = read_gguf(file)
    record_file = file.parent / EXPORT_RECORD
    record = _json_object(record_file) if record_file.is_file() else None
    rope = model.rope
    params = {"rope_type": "default", "rope_theta": rope.freq_base}  # no record: unused
    max_pos = rope.context_length
    if record is not None:
        params = record.get("rope_parameters")
        max_pos = (record.get("config_changes") or {}).get("max_position_embeddings", max_pos)
    config = {
        "hidden_size": model.n_heads * model.head_dim, "head_dim": model.head_dim,
        "num_attention_heads": model.n_heads, "num_key_value_heads": model.n_kv_heads,
        "num_hidden_layers": model.n_layers, "max_position_embeddings": max_pos,
        "rope_parameters": params,
    }  # fmt: skip
    if record is not None:
        check_rope_config(config, record_file)
    target = rope.context_length if record is None else _target(config, file.parent)
    return ServedFolder(
        path=file, config=config, hf_config=None, target=target, record=record, gguf=model,
        files=(file,) if record is None else (file, record_file),
    )  # fmt: skip


def _original_length(folder: ServedFolder) -> int:
    """L0 of the folder's schedule: the length its rope_parameters were trained at."""
    if folder.gguf is not None and folder.record is None:
        return int(folder.gguf.rope.original_length)
    recipe = (folder.record or {}).get("serve_with")
    if recipe is not None:  # a remap's L0: its base rope_parameters may not hold it
        return int(recipe["original_length"])
    if folder.rope_type in ("linear", "dynamic"):
        return int(folder.config["max_position_embeddings"])
    p = folder.rope_parameters
    return int(
        p.get("original_max_position_embeddings") or folder.config["max_position_embeddings"]
    )


def lengths_checked(folder: ServedFolder) -> list[int]:
    """Where inspect holds the engines to the reference: inside the original window (its
    first 1024 tokens, or all of it) and at the target."""
    return sorted({min(1024, _original_length(folder)), folder.target})


def engine_views(folder: ServedFolder, lengths: list[int]) -> dict[int, dict[str, EngineRoPE]]:
    """Every engine that applies to ``folder``, at each length: {length: {engine: view}}."""
    views = {}
    for n in lengths:
        row = {name: e.rope(folder, n) for name, e in ENGINES.items()}
        views[n] = {name: v for name, v in row.items() if v is not None}
    return views


def reference_view(row: dict[str, EngineRoPE]) -> EngineRoPE | None:
    """What the engines are held to: the per-head schedule where one serves it (the plugin),
    else transformers' meaning of rope_parameters; None for a GGUF file alone."""
    per_head = [v for v in row.values() if v.per_head is not None]
    return per_head[0] if per_head else row.get("transformers")


def rope_disagreements(
    folder: ServedFolder,
    lengths: list[int],
    views: dict[int, dict[str, EngineRoPE]] | None = None,
) -> list[Disagreement]:
    """Every way an engine departs from the reference at ``lengths``: frequencies, attention
    factor, refusals, the accepted length, and each engine's caveats."""
    views = engine_views(folder, lengths) if views is None else views
    out: list[Disagreement] = []
    for n in lengths:
        ref = reference_view(views[n])
        for name, view in views[n].items():
            if ref is not None and view is not ref:
                out += _compare(ENGINES[name], ref, view, n, folder)
    for name, view in views[folder.target].items():
        out += [Disagreement(name, folder.target, w, f) for w, f in ENGINES[name].caveats(folder)]
        limit = view.max_length
        if limit is not None and limit < folder.target and view.error is None:
            what = f"accepts {limit} tokens, below the target {folder.target}"
            out.append(Disagreement(name, folder.target, what, ENGINES[name].length_fix(folder)))
    return out


def _per_type(params: dict[str, Any]) -> dict[str | None, dict[str, Any]]:
    """rope_parameters by the layer type they rotate (None: one dict for every layer)."""
    if not isinstance(params, dict) or not nested_by_type(params):
        return {None: params}  # not a dict: check_rope_config names it
    return {kind: p for kind, p in params.items() if isinstance(p, dict)}


def layer_type_folders(folder: ServedFolder) -> dict[str | None, ServedFolder]:
    """The folder as the layers of each type read it: one flat view per type where
    rope_parameters nest by layer type (Gemma 3/4, OLMo 3: every engine applies a type's dict
    to that type's layers), else ``{None: folder}``."""
    if folder.gguf is not None:
        return {None: folder}
    out = {}
    for kind, params in _per_type(folder.rope_parameters).items():
        if kind is None:
            return {None: folder}
        by_type = [p for p in folder.rope_parameters.values() if isinstance(p, dict)]
        config = {**folder.config, "rope_parameters": dict(params), "ropekit_rope_by_type": by_type}
        # the export's target where ropekit wrote the folder, else what each type's params say
        target = folder.target if folder.record is not None else _target(config, folder.path)
        out[kind] = dataclasses.replace(folder, config=config, target=target)
    return out


def _section(folder: ServedFolder) -> dict[str, Any]:
    """What inspect says of one flat rope config: each engine's view at the lengths checked
    and their disagreements with the reference."""
    lengths = lengths_checked(folder)
    views = engine_views(folder, lengths)
    ref = reference_view(views[folder.target])
    return {
        "rope_parameters": folder.rope_parameters,
        "original_length": _original_length(folder),
        "target_length": folder.target,
        "lengths": lengths,
        "reference": None if ref is None else ref.engine,
        "views": {n: {name: _view_json(v) for name, v in row.items()} for n, row in views.items()},
        "disagreements": [
            dataclasses.asdict(d) for d in rope_disagreements(folder, lengths, views)
        ],
    }


def inspect_folder(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every engine's RoPE for the export at ``path`` and their disagreements with the
    reference: the adapter's per-head schedule where the folder is for ropekit's plugin,
    else transformers (the meaning of rope_parameters). Where rope_parameters nest by layer
    type, ``layer_types`` holds one such section per type and ``disagreements`` all of them,
    each naming its type."""
    folder = read_folder(path)
    report = {
        "folder": str(folder.path),
        "format": "gguf" if folder.gguf is not None else "hf",
        "files": [str(f) for f in folder.files],
        "notes": list((folder.record or {}).get("notes", [])),
        "serve_with": (folder.record or {}).get("serve_with"),
        "spec": (folder.record or {}).get("spec"),
    }
    by_type = layer_type_folders(folder)
    if None in by_type:
        return {**report, **_section(folder)}
    sections = {kind: _section(f) for kind, f in by_type.items()}
    return {
        **report,
        "rope_parameters": folder.rope_parameters,
        "layer_types": sections,
        "disagreements": [
            {**d, "layer_type": kind}
            for kind, sec in sections.items()
            for d in sec["disagreements"]
        ],
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
    """The lines ``ropekit inspect`` prints: one table per layer type where they differ."""
    if "layer_types" not in report:
        return _section_lines(report, report["folder"])
    lines = [
        f"{report['folder']}: rope_parameters per layer type "
        f"({', '.join(report['layer_types'])}); each type's layers rotate by its own"
    ]
    for kind, section in report["layer_types"].items():
        lines += _section_lines({**report, **section}, f"[{kind}]")
    return lines


def _section_lines(report: dict[str, Any], title: str) -> list[str]:
    p = report["rope_parameters"]
    lines = [
        f"{title}: rope_type={p.get('rope_type', 'default')} "
        f"L0={report['original_length']} target={report['target_length']}",
        _reference_line(report),
        *(f"  export record: {note}" for note in report["notes"]),
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
    recipe = report.get("serve_with")
    if recipe is not None:
        agreed = "" if report["disagreements"] else "no disagreements on the base schedule; "
        lines.append(
            f"{agreed}{recipe['engine']} serves {report['spec']} through {recipe['recipe']}: "
            f"{recipe['command']}"
        )
    elif not report["disagreements"] and report["reference"] is not None:
        lines.append(f"no disagreements: every engine computes what {report['reference']} computes")
    for d in report["disagreements"]:
        lines.append(f"DISAGREES {d['engine']} @{d['length']}: {d['what']}")
        lines.append(f"  fix: {d['fix']}")
    return lines


def _reference_line(report: dict[str, Any]) -> str:
    if report["reference"] is None:
        return (
            f"reference: none (a GGUF file without {EXPORT_RECORD}): what llama.cpp computes "
            "from its rope keys, with nothing to compare it to"
        )
    recipe = report.get("serve_with")
    if recipe is not None:
        how = (
            "llama.cpp computes it driven by the recipe named below"
            if recipe["engine"] == "llama.cpp"
            else f"{recipe['engine']} computes it in attention ({recipe['recipe']}); stock "
            "vLLM refuses the folder's architecture and transformers computes the base schedule "
            "alone"
        )
        return (
            f"reference: ropekit's {report['spec']} ({EXPORT_RECORD}): a distance remap whose "
            "rope keys are its base schedule (transformers' meaning of the rope_parameters "
            f"below); no engine's config holds the remap, {how}"
        )
    if report["format"] == "gguf":
        return (
            f"reference: transformers' meaning of the rope_parameters this GGUF was written "
            f"from ({EXPORT_RECORD}); llama.cpp reads the file's rope keys and rope_freqs"
        )
    if report["reference"] == "transformers":
        return "reference: transformers (the meaning of rope_parameters)"
    return (
        f"reference: {report['reference']} (the folder names ropekit's vLLM plugin, which "
        "serves its adapter per head); without the plugin stock vLLM refuses the folder's "
        "architecture and transformers computes rope_parameters, the adapter's nearest shared "
        "schedule (approximate)"
    )
