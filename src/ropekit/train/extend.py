"""Context extension: give a trained model a new positional encoding and train only what the
method needs, on a few long samples (the AdaRoPE protocol: 100 samples, backbone frozen).

Works on ropekit ``Decoder`` checkpoints and on patched Hugging Face models alike: the two
differ only in how an encoding is attached (``set_encoding``) and in what identifies the model
(``fingerprint``).

Modes (which parameters train):
- ``positional``: only the encoding's parameters; every backbone weight has
  requires_grad=False, so no weight gradient or optimizer state exists for it;
- ``lora``: PEFT LoRA on the attention projections, the encoding fixed;
- ``joint``: both.
Fixed schedules (linear, ntk, dynamic-ntk, yarn...) have no parameters: in positional mode
they train nothing and are simply attached (the "untuned" baselines).

Recipes chain two stages on the same samples, e.g. ``adarope->lora``: stage 1 trains AdaRoPE
positionally, stage 2 trains LoRA on top with the learned encoding kept (``->joint``: keeps
training it).

Holds: ExtendConfig, ExtendResult, RECIPES, encoding_of, set_encoding, fingerprint,
trainable_summary, extend.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn
from torch.utils.data import Dataset

from ropekit.data import RetrievalConfig, make_train_dataset
from ropekit.encodings import PositionEncoding, build
from ropekit.encodings.adarope import AdaRoPEConfig
from ropekit.model import Decoder
from ropekit.utils import atomic_write_bytes, atomic_write_text, run_metadata

from .config import TrainConfig
from .loop import train

MODES = ("positional", "lora", "joint")
# recipe -> (stage-1 method family, stage-2 mode); the stage-1 spec comes from --method.
RECIPES = {
    "adarope->lora": ("adarope", "lora"),
    "adarope->joint": ("adarope", "joint"),
    "yarn->lora": ("yarn", "lora"),
    "tuned-yarn->lora": ("tuned-yarn", "lora"),
}
DECODER_LORA_TARGETS = ("qkv", "proj")
HF_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclasses.dataclass(frozen=True)
class ExtendConfig:
    """One extension run. Lengths in the model's tokens."""

    method: str  # encoding spec of the extended model, e.g. "adarope:init=yarn,factor=8"
    target_length: int  # context to extend to (tokens)
    mode: str = "positional"  # positional | lora | joint
    samples: int = 100  # training samples of target_length (the paper: first 100 of PG19)
    epochs: int = 1  # passes over the samples
    batch_size: int = 1  # samples per optimizer step
    lr: float = 1e-2  # positional parameters' learning rate (AdaRoPE has ~1e4 of them)
    lora_lr: float = 2e-4  # LoRA learning rate
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] | None = None  # module names; default: attention projections
    data: str | tuple[str, ...] = "shakespeare"  # training text, never the evaluation split
    retrieval_ratio: float = 0.0  # share of samples carrying passkey/key-value records
    warmup_steps: int = 5
    seed: int = 0
    bf16: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not allowed; use one of {', '.join(MODES)}")
        for name in ("target_length", "samples", "epochs", "batch_size", "lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 1")
        for name in ("lr", "lora_lr"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a finite number > 0")
        if not 0 <= self.retrieval_ratio <= 1:
            raise ValueError(f"retrieval_ratio={self.retrieval_ratio!r} must lie in [0, 1]")

    @property
    def steps(self) -> int:
        return math.ceil(self.samples * self.epochs / self.batch_size)


@dataclasses.dataclass(frozen=True)
class ExtendResult:
    out_dir: Path
    spec: str  # the extended model's encoding
    trainable: dict[str, int]  # parameter counts: positional, lora, total
    final_loss: float | None
    elapsed_s: float
    summary: Path


# ----------------------------------------------------------------------------- model kinds
def encoding_of(model: nn.Module) -> PositionEncoding | None:
    """The ropekit encoding a model uses (None for an unpatched Hugging Face model)."""
    if isinstance(model, Decoder):
        return model.encoding
    from ropekit.hf import encoding_of as hf_encoding_of

    return hf_encoding_of(model)


def training_length(model: nn.Module) -> int:
    """The context the model was trained at."""
    if isinstance(model, Decoder):
        return model.config.context_length
    from ropekit.hf.archs import original_length, unwrap

    return original_length(unwrap(model).config)


def set_encoding(model: nn.Module, spec: str) -> PositionEncoding:
    """Attach the encoding named by ``spec``; options it omits (base, original length) come
    from the model."""
    if isinstance(model, Decoder):
        c = model.config
        encoding = build(
            spec,
            n_heads=c.n_heads,
            n_kv_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            n_layers=c.n_layers,
            d_model=c.d_model,
            **_decoder_context(model),
        )
        model.encoding = encoding.to(next(model.parameters()).device)
        model.config = dataclasses.replace(c, encoding=encoding.spec)
        return encoding
    from ropekit.hf import patch

    return patch(model, spec)


def _base_of(encoding: PositionEncoding) -> float | None:
    """The RoPE base of a rotary encoding (AdaRoPE keeps it in its init schedule)."""
    config = encoding.config
    if isinstance(config, AdaRoPEConfig):
        config = config.schedule
    return getattr(config, "base", None)


def _decoder_context(model: Decoder) -> dict[str, Any]:
    context = model.config.encoding_context()
    base = _base_of(model.encoding)
    if base is not None:
        context["base"] = base
    return context


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """What identifies the model an adapter belongs to."""
    if isinstance(model, Decoder):
        c = model.config
        return {
            "architecture": "ropekit-decoder",
            "n_layers": c.n_layers,
            "n_heads": c.n_heads,
            "n_kv_heads": c.n_kv_heads,
            "head_dim": c.head_dim,
            "base": _base_of(model.encoding),
            "original_length": c.context_length,
        }
    from ropekit.hf import fingerprint as hf_fingerprint
    from ropekit.hf.archs import unwrap

    return hf_fingerprint(unwrap(model).config)


def _is_lora(name: str) -> bool:
    return "lora_" in name


def _add_lora(model: nn.Module, config: ExtendConfig) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    targets = config.lora_targets or (
        DECODER_LORA_TARGETS if isinstance(model, Decoder) else HF_LORA_TARGETS
    )
    lora = LoraConfig(
        r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=list(targets)
    )
    inject_adapter_in_model(lora, model)


def select_trainable(model: nn.Module, mode: str) -> dict[str, int]:
    """Freeze everything, then unfreeze what ``mode`` trains; returns parameter counts."""
    encoding = encoding_of(model)
    positional = {id(p) for p in encoding.parameters()} if encoding is not None else set()
    counts = {"positional": 0, "lora": 0}
    for name, p in model.named_parameters():
        if id(p) in positional:
            p.requires_grad_(mode in ("positional", "joint"))
            counts["positional"] += p.numel() if p.requires_grad else 0
        elif _is_lora(name):
            p.requires_grad_(mode in ("lora", "joint"))
            counts["lora"] += p.numel() if p.requires_grad else 0
        else:
            p.requires_grad_(False)
    counts["total"] = counts["positional"] + counts["lora"]
    return counts


def trainable_summary(counts: dict[str, int], mode: str) -> str:
    """The line users see first: what trains and what stays frozen."""
    if counts["total"] == 0:
        return "training nothing: the method is a fixed schedule; backbone frozen"
    if mode == "positional":
        return f"training {counts['positional']:,} positional parameters; backbone frozen"
    parts = [f"{counts['lora']:,} LoRA"]
    if counts["positional"]:
        parts.insert(0, f"{counts['positional']:,} positional")
    return f"training {' + '.join(parts)} parameters; backbone frozen"


class _Samples(Dataset):
    """The first ``n`` samples of a packed dataset in its seeded order: every method of one
    protocol trains on exactly these."""

    def __init__(self, packed: Any, n: int) -> None:
        if len(packed) < n:
            raise ValueError(
                f"samples={n} is not allowed: the training text holds only {len(packed)} samples "
                "of the target length; lower --samples or add data"
            )
        self.packed, self.n = packed, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.packed[i]


def _tokenizer_for(model: nn.Module, tokenizer: Any) -> Any:
    if tokenizer is not None:
        return tokenizer
    if isinstance(model, Decoder):
        return "bytes"
    raise ValueError("a Hugging Face model needs its tokenizer (pass tokenizer=)")


def save_lora(model: nn.Module, directory: Path) -> Path | None:
    tensors = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if _is_lora(n)}
    if not tensors:
        return None
    path = directory / "lora.safetensors"
    atomic_write_bytes(path, safetensors.torch.save(tensors))
    return path


def extend(
    model: nn.Module,
    config: ExtendConfig,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    overwrite: bool = False,
    command: str = "",
    log: Any = print,
    keep_encoding: bool = False,
) -> ExtendResult:
    """Extend ``model`` in place to ``config.target_length`` with ``config.method``.

    Writes ``out_dir/adapter`` (positional parameters, spec, fingerprint), ``lora.safetensors``
    when LoRA trained, the training run in ``out_dir/train`` and ``out_dir/extend.json``.
    """
    out_dir = Path(out_dir)
    trained_at = training_length(model)
    if config.target_length < trained_at:
        raise ValueError(
            f"target_length={config.target_length} is below the model's training length "
            f"{trained_at}; extension needs a target >= {trained_at}"
        )
    if (out_dir / "extend.json").exists() and not overwrite:
        raise FileExistsError(
            f"{out_dir} already holds an extension run; pass overwrite to replace it"
        )
    start = time.perf_counter()
    backbone = fingerprint(model)  # before the encoding changes: adapters name the backbone
    encoding = encoding_of(model) if keep_encoding else set_encoding(model, config.method)
    if config.mode in ("lora", "joint"):
        _add_lora(model, config)
    counts = select_trainable(model, config.mode)
    log(trainable_summary(counts, config.mode))

    final_loss = None
    if counts["total"]:
        tok = _tokenizer_for(model, tokenizer)
        retrieval = (
            RetrievalConfig(ratio=config.retrieval_ratio) if config.retrieval_ratio else None
        )
        data = config.data if isinstance(config.data, str) else list(config.data)
        packed = make_train_dataset(
            data, tok, config.target_length, retrieval=retrieval, seed=config.seed
        )
        lr_scale = ((r"lora_", config.lora_lr / config.lr),) if counts["lora"] else ()
        train_config = TrainConfig(
            out_dir=out_dir / "train",
            steps=config.steps,
            batch_size=config.batch_size,
            lr=config.lr,
            lr_scale=lr_scale,
            weight_decay=0.0,  # a handful of samples; nothing to regularise towards
            warmup_steps=min(config.warmup_steps, config.steps),
            seed=config.seed,
            bf16=config.bf16,
            checkpoint_interval=max(config.steps, 1),
            log_interval=max(1, min(10, config.steps // 5)),
            overwrite=True,
        )
        was_training = model.training
        model.train()
        result = train(model, _Samples(packed, config.samples), train_config)
        model.train(was_training)
        final_loss = result.final_loss
    select_trainable(model, "none")  # leave the model frozen, as evaluation expects
    from ropekit.hf.adapter import write_adapter

    adapter_dir = write_adapter(encoding, backbone, out_dir / "adapter")
    save_lora(model, out_dir)
    elapsed = time.perf_counter() - start
    summary = {
        "method": config.method,
        "spec": encoding.spec,
        "config": {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(config).items()
        },
        "trained_at": trained_at,
        "trainable": counts,
        "final_loss": final_loss,
        "elapsed_s": elapsed,
        "adapter": str(adapter_dir),
        "fingerprint": backbone,
        "meta": run_metadata(command),
    }
    path = out_dir / "extend.json"
    atomic_write_text(path, json.dumps(summary, indent=2, default=str))
    return ExtendResult(out_dir, encoding.spec, counts, final_loss, elapsed, path)


def run_extension(
    model: nn.Module,
    config: ExtendConfig,
    out_dir: str | Path,
    *,
    recipe: str | None = None,
    tokenizer: Any = None,
    overwrite: bool = False,
    command: str = "",
    log: Any = print,
) -> list[ExtendResult]:
    """``extend`` once, or a two-stage recipe: stage 1 trains ``config.method`` positionally
    on the samples (in ``out_dir/stage1``), stage 2 adds LoRA (``->lora``: encoding fixed;
    ``->joint``: encoding keeps training) on the same samples (``out_dir``)."""
    out_dir = Path(out_dir)
    if recipe is None:
        return [
            extend(
                model,
                config,
                out_dir,
                tokenizer=tokenizer,
                overwrite=overwrite,
                command=command,
                log=log,
            )
        ]
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is not allowed; use one of {', '.join(RECIPES)}")
    family, second = RECIPES[recipe]
    method_family = config.method.split(":", 1)[0]
    if method_family != family:
        raise ValueError(
            f"recipe {recipe!r} starts with {family}; --method {config.method!r} is a "
            f"{method_family} spec"
        )
    first = extend(
        model,
        dataclasses.replace(config, mode="positional"),
        out_dir / "stage1",
        tokenizer=tokenizer,
        overwrite=overwrite,
        command=command,
        log=log,
    )
    # Stage 2 keeps the learned encoding: reattaching it by spec would reset it to its init.
    stage2 = dataclasses.replace(config, mode=second)
    final = extend(
        model,
        stage2,
        out_dir,
        tokenizer=tokenizer,
        overwrite=overwrite,
        command=command,
        log=log,
        keep_encoding=True,
    )
    return [first, final]


def load_adapter(model: nn.Module, directory: str | Path) -> PositionEncoding:
    """Load a positional adapter into a Decoder or a Hugging Face model (patching it).

    ``directory`` is an adapter folder or an extension run folder (``ropekit extend --out``):
    then its ``adapter/`` loads, and its LoRA weights too when the run trained LoRA.
    """
    from ropekit.hf.adapter import ADAPTER_CONFIG, apply_adapter

    directory = Path(directory)
    run = directory if not (directory / ADAPTER_CONFIG).exists() else None
    adapter_dir = directory / "adapter" if run is not None else directory
    encoding = apply_adapter(
        adapter_dir, fingerprint(model), lambda spec: set_encoding(model, spec), encoding_of(model)
    )
    if run is not None and (run / "lora.safetensors").exists():
        summary = json.loads((run / "extend.json").read_text())
        lora = ExtendConfig(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in summary["config"].items()}
        )
        _add_lora(model, lora)
        tensors = safetensors.torch.load_file(run / "lora.safetensors")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in tensors.items():
                if name not in params:
                    raise ValueError(f"{run / 'lora.safetensors'}: {name} does not fit this model")
                params[name].copy_(t)
        select_trainable(model, "none")
    return encoding
