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

Cheap long positions (for targets where a full-length backward is too slow or too big):
- ``pose``: positional skip-wise training (PoSE, Zhu et al. 2023, arXiv:2309.10400). Each
  sample is ``pose_window`` tokens (default: the model's training length) of the same
  full-length window, at positions that jump so relative distances cover the target length
  (``ropekit.data.pose``). Cost: window/target of the tokens, and attention quadratic in the
  window, not the target. Use it when the target is several times the training length and
  only positional parameters (or LoRA) train; it does not train attention over long spans of
  *real* text (nothing is read between the chunks), so retrieval across the whole target
  still needs some full-length samples.
- ``grad_checkpointing``: keep one hidden state per layer and recompute each layer in the
  backward: activation memory drops from every layer's intermediates to one (B, T, d) per
  layer, for about one extra forward per step. Use it when activations, not weights, exceed
  memory (long targets on a GPU, or a CPU that would swap); it changes no number.

Holds: ExtendConfig, ExtendResult, RECIPES, encoding_of, set_encoding, fingerprint,
trainable_summary, enable_grad_checkpointing, pose_loss, extend.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn
from torch.utils.data import Dataset

from ropekit.data import PoseDataset, RetrievalConfig, make_train_dataset
from ropekit.distributed import processes
from ropekit.encodings import PositionEncoding, build
from ropekit.encodings.adarope import AdaRoPEConfig
from ropekit.model import Decoder
from ropekit.utils import atomic_write_bytes, atomic_write_text, run_metadata

from .config import TrainConfig
from .loop import train
from .loss import cross_entropy_sum

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
    # PoSE (Zhu et al. 2023): train on pose_window real tokens of each sample at positions
    # that jump to cover target_length (ropekit.data.pose); each epoch redraws the positions.
    pose: bool = False
    pose_window: int | None = None  # tokens per PoSE sample; None: the model's training length
    grad_checkpointing: bool = False  # recompute each layer in the backward (less memory)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not allowed; use one of {', '.join(MODES)}")
        if self.pose_window is not None:
            if not self.pose:
                raise ValueError(
                    f"pose_window={self.pose_window!r} applies only with pose=True (--pose)"
                )
            if not isinstance(self.pose_window, int) or self.pose_window < 2:
                raise ValueError(
                    f"pose_window={self.pose_window!r} is not allowed; it must be an integer >= 2"
                )
            if isinstance(self.target_length, int) and self.pose_window > self.target_length:
                raise ValueError(
                    f"pose_window={self.pose_window} is not allowed; it must be <= "
                    f"target_length={self.target_length}"
                )
        if self.pose and self.retrieval_ratio:
            raise ValueError(
                f"pose=True with retrieval_ratio={self.retrieval_ratio} is not allowed: a PoSE "
                "sample skips text, which may hold the record an answer needs; use "
                "retrieval_ratio=0 with pose"
            )
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
    tokens: int = 0  # input tokens trained on (PoSE: window tokens per sample); 0: none


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


def enable_grad_checkpointing(model: nn.Module) -> Callable[[], None]:
    """Turn on activation checkpointing per layer; returns the function that turns it off.

    ropekit's ``Decoder``: ``gradient_checkpointing_enable``. Hugging Face models: transformers'
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before 5.x), both
    with ``use_reentrant=False``: the reentrant variant gives no gradient to parameters when
    no layer input requires grad, which is the case when only positional parameters train.
    """
    if isinstance(model, Decoder):
        model.gradient_checkpointing_enable()
        return model.gradient_checkpointing_disable
    from ropekit.hf.archs import unwrap

    hf = unwrap(model)
    kwargs = {"use_reentrant": False}
    had_hooks = bool(getattr(hf, "_require_grads_hooks", None))
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        turn_off = hf.activation_checkpointing_disable
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        turn_off = hf.gradient_checkpointing_disable

    def disable() -> None:
        turn_off()
        # Enabling also made the embedding output require grad (a forward hook, for PEFT);
        # disabling leaves it unless PEFT is loaded: remove it when we installed it.
        if not had_hooks and getattr(hf, "_require_grads_hooks", None):
            hf.disable_input_require_grads()

    return disable


def pose_loss(
    model: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_lm_loss`` for a Hugging Face model on PoSE batches (positions that jump).

    transformers (5.24) reads a jump in ``position_ids`` as the start of a new packed sequence
    when it gets neither an ``attention_mask`` nor a cache (``masking_utils.
    find_packed_sequence_indices``; activation checkpointing forces ``use_cache=False`` in
    training), so the second chunk would not attend to the first: an all-ones mask keeps one
    causal sequence. No KV cache is built: training never reads it.
    """
    ids = batch["input_ids"]  # (B, T)
    logits = model(
        input_ids=ids,
        position_ids=batch["position_ids"],
        attention_mask=torch.ones_like(ids),
        use_cache=False,
    ).logits  # (B, T, V)
    return cross_entropy_sum(logits, batch["labels"], batch.get("loss_weight"))


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
    With ``config.pose`` the samples are PoSE windows of the same full-length samples; with
    ``config.grad_checkpointing`` layers are recomputed in the backward (off again after).
    """
    out_dir = Path(out_dir)
    trained_at = training_length(model)
    if config.target_length < trained_at:
        raise ValueError(
            f"target_length={config.target_length} is below the model's training length "
            f"{trained_at}; extension needs a target >= {trained_at}"
        )
    procs = processes()
    if (out_dir / "extend.json").exists() and not overwrite:
        raise FileExistsError(
            f"{out_dir} already holds an extension run; pass overwrite to replace it"
        )
    # Every process has looked before the main one can write a new extend.json.
    procs.barrier()
    start = time.perf_counter()
    backbone = fingerprint(model)  # before the encoding changes: adapters name the backbone
    encoding = encoding_of(model) if keep_encoding else set_encoding(model, config.method)
    if config.mode in ("lora", "joint"):
        _add_lora(model, config)
    counts = select_trainable(model, config.mode)
    if procs.is_main:
        log(trainable_summary(counts, config.mode))

    final_loss, tokens = None, 0
    pose_window = (config.pose_window or trained_at) if config.pose else None
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
        samples: Dataset = _Samples(packed, config.samples)
        loss_fn = None  # the loop's default, causal_lm_loss
        if pose_window is not None:
            # Fresh positions for every visit of a window (the paper redraws per example):
            # samples x epochs items, one pass of config.steps steps, as without PoSE.
            samples = PoseDataset(
                samples,
                pose_window,
                config.target_length,
                seed=config.seed,
                repeats=config.epochs,
            )
            loss_fn = None if isinstance(model, Decoder) else pose_loss
        disable_checkpointing = (
            enable_grad_checkpointing(model) if config.grad_checkpointing else None
        )
        was_training = model.training
        model.train()
        try:
            result = train(model, samples, train_config, loss_fn=loss_fn)
        finally:
            model.train(was_training)
            if disable_checkpointing is not None:
                disable_checkpointing()
        final_loss, tokens = result.final_loss, result.tokens
    select_trainable(model, "none")  # leave the model frozen, as evaluation expects
    from ropekit.hf.adapter import write_adapter

    path = out_dir / "extend.json"
    elapsed = time.perf_counter() - start
    # Data-parallel training left the same parameters in every process: the main one writes
    # them, and every process returns only once it has, so the files are then safe to read.
    if procs.is_main:
        adapter_dir = write_adapter(encoding, backbone, out_dir / "adapter")
        save_lora(model, out_dir)
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
            "tokens": tokens,
            "pose_window": pose_window,
            "elapsed_s": elapsed,
            "adapter": str(adapter_dir),
            "fingerprint": backbone,
            "num_processes": procs.world,
            "meta": run_metadata(command),
        }
        atomic_write_text(path, json.dumps(summary, indent=2, default=str))
    procs.barrier()
    return ExtendResult(out_dir, encoding.spec, counts, final_loss, elapsed, path, tokens)


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
