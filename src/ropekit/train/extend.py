"""Context extension: give a trained model a new positional encoding and train only what the
method needs, on a few long samples (the AdaRoPE protocol: 100 samples, backbone frozen).

Works on any model through its ``Backbone`` (ropekit ``Decoder`` checkpoints and patched
Hugging Face models alike): the backbone attaches the encoding, names the model an adapter
belongs to and knows what its training forward needs.

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

The method's factor and the target: a spec that needs a factor and names none gets
factor = target / training length (said in the log line and ``extend.json``); a spec whose
factor is smaller than that ratio is refused (it would not reach the target); a larger one is
the user's choice (YaRN is often run with s above the ratio) and is kept.

Continuing and resuming: a model that carries an adapter (``ropekit extend --adapter``)
continues from its parameters when ``method`` names the adapter's encoding, and is refused
otherwise (training would silently start again from the spec's init). ``resume=True`` continues
an interrupted run in ``out_dir`` from its newest intact checkpoint, refusing one made with
another model, spec, tokenizer, data or settings (the training loop checks its provenance); a
finished run is reported as it is, its adapter loaded.

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

Holds: ExtendConfig, VERSION, Trainable, ExtendRecord (extend.json, the ``extend`` kind),
ExtendResult, MODES, RECIPES, method_spec, resolve_method, select_trainable, trainable_summary,
extend, run_extension.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from ropekit.backbone import (
    Backbone,
    add_lora,
    as_backbone,
    load_adapter,
    save_lora,
    write_adapter,
)
from ropekit.data import PoseDataset, RetrievalConfig, make_train_dataset
from ropekit.distributed import processes
from ropekit.encodings import PositionEncoding, Spec
from ropekit.results import (
    check_replaceable,
    read_record,
    register,
    run_metadata,
    to_json,
    write_result,
)

from .config import TrainConfig
from .loop import train
from .loss import backbone_loss
from .sharding import plan_for

MODES = ("positional", "lora", "joint")
# recipe -> (stage-1 method family, stage-2 mode); the stage-1 spec comes from --method.
RECIPES = {
    "adarope->lora": ("adarope", "lora"),
    "adarope->joint": ("adarope", "joint"),
    "yarn->lora": ("yarn", "lora"),
    "tuned-yarn->lora": ("tuned-yarn", "lora"),
}
EXTEND_JSON = "extend.json"


@dataclasses.dataclass(frozen=True)
class ExtendConfig:
    """One extension run. Lengths in the model's tokens."""

    method: Spec  # encoding spec of the extended model, e.g. "adarope:init=yarn,factor=8"
    target_length: int  # context to extend to (tokens)
    mode: str = "positional"  # positional | lora | joint
    samples: int = 100  # training samples of target_length (the paper: first 100 of PG19)
    epochs: int = 1  # passes over the samples
    batch_size: int = 1  # samples per optimizer step
    lr: float = 1e-2  # positional parameters' learning rate (AdaRoPE has ~1e4 of them)
    lora_lr: float = 2e-4  # LoRA learning rate
    lora_rank: int = 8  # LoRA rank r
    lora_alpha: int = 16  # LoRA scale numerator (the update is alpha / r * B A)
    lora_targets: tuple[str, ...] | None = None  # module names; default: attention projections
    data: str | tuple[str, ...] = "shakespeare"  # training text, never the evaluation split
    retrieval_ratio: float = 0.0  # share of samples carrying passkey/key-value records
    warmup_steps: int = 5  # linear learning-rate warmup steps
    seed: int = 0  # picks the samples (and PoSE positions): equal seeds, equal samples
    bf16: bool = False  # bf16 autocast for the forward; parameters and loss stay float32
    # PoSE (Zhu et al. 2023): train on pose_window real tokens of each sample at positions
    # that jump to cover target_length (ropekit.data.pose); each epoch redraws the positions.
    pose: bool = False
    pose_window: int | None = None  # tokens per PoSE sample; None: the model's training length
    grad_checkpointing: bool = False  # recompute each layer in the backward (less memory)

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Spec.parse(self.method))  # the one parse
        if self.lora_targets is not None:
            object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if not isinstance(self.data, str):
            object.__setattr__(self, "data", tuple(self.data))
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
        for name in (
            "target_length", "samples", "epochs", "batch_size", "lora_rank", "lora_alpha",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 1")
        if self.batch_size > self.samples:  # a step would read some sample twice, silently
            raise ValueError(
                f"batch_size={self.batch_size} is not allowed with samples={self.samples}: a "
                f"step would hold a sample twice; allowed: batch_size <= samples ({self.samples})"
            )
        for name in ("warmup_steps", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 0")
        for name in ("lr", "lora_lr"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= 10):
                raise ValueError(f"{name}={value!r} is not allowed; it must lie in (0, 10]")
        if not (math.isfinite(self.retrieval_ratio) and 0 <= self.retrieval_ratio <= 1):
            raise ValueError(f"retrieval_ratio={self.retrieval_ratio!r} must lie in [0, 1]")

    @property
    def steps(self) -> int:
        return math.ceil(self.samples * self.epochs / self.batch_size)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; ``ExtendConfig(**that)`` rebuilds this config."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["method"] = str(self.method)
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}


@dataclasses.dataclass(frozen=True)
class Trainable:
    """Parameter counts a run trained (``select_trainable``)."""

    positional: int
    lora: int
    total: int


VERSION = 3  # 3: typed (2: the untyped layout, the same fields)


@register("extend", VERSION, {2: lambda data: data})
@dataclasses.dataclass(frozen=True)
class ExtendRecord:
    """extend.json: one finished extension stage (``extend`` writes it last)."""

    meta: dict[str, Any]  # run_metadata
    provenance: dict[str, Any]  # model and config: what a resumed run must match
    method: str  # the spec asked for (ExtendConfig.method)
    spec: str  # the extended model's encoding, as built (the adapter holds it)
    config: dict[str, Any]  # ExtendConfig.to_dict(); ``extend_config`` rebuilds it
    trained_at: int  # the model's training length (L0)
    trainable: Trainable
    final_loss: float | None  # the last step's loss; None: nothing was trained
    tokens: int  # input tokens trained on (PoSE: window tokens per sample)
    pose_window: int | None  # PoSE's window; None without PoSE
    elapsed_s: float
    adapter: str  # the adapter folder
    fingerprint: dict[str, Any]  # the base model's (Backbone.fingerprint)
    num_processes: int

    @property
    def extend_config(self) -> ExtendConfig:
        return ExtendConfig(**self.config)


@dataclasses.dataclass(frozen=True)
class ExtendResult:
    out_dir: Path
    spec: str  # the extended model's encoding
    trainable: dict[str, int]  # parameter counts: positional, lora, total
    final_loss: float | None
    elapsed_s: float
    summary: Path
    tokens: int = 0  # input tokens trained on (PoSE: window tokens per sample); 0: none


def select_trainable(model: Backbone | nn.Module, mode: str) -> dict[str, int]:
    """Freeze everything, then unfreeze what ``mode`` trains; returns parameter counts."""
    backbone = as_backbone(model)
    positional = {id(p) for p in backbone.positional_parameters().values()}
    lora = {id(p) for p in backbone.lora_parameters().values()}
    counts = {"positional": 0, "lora": 0}
    for p in backbone.model.parameters():
        if id(p) in positional:
            p.requires_grad_(mode in ("positional", "joint"))
            counts["positional"] += p.numel() if p.requires_grad else 0
        elif id(p) in lora:
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

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.packed[i]


# ----------------------------------------------------------------------------- stages
def method_spec(spec: Spec, target_length: int, trained_at: int) -> Spec:
    """``spec`` as extend builds it: a factor it omits, where its encoding takes one, is
    N / L0 (the one rule; ``compare`` records a method by this spec)."""
    if spec.takes("factor") and not spec.gives("factor"):
        return spec.with_options(factor=target_length / trained_at)
    return spec


def resolve_method(backbone: Backbone, config: ExtendConfig) -> tuple[PositionEncoding, str]:
    """The encoding ``config.method`` names for this model (not attached) and a note on its
    factor (module docstring: derived when missing, refused when too small)."""
    trained_at = backbone.training_length
    ratio = config.target_length / trained_at
    spec, note = method_spec(config.method, config.target_length, trained_at), ""
    if spec != config.method:
        note = f"factor={ratio:g} derived from {config.target_length} / {trained_at} tokens"
    encoding = backbone.build_encoding(spec)
    factor = encoding.factor
    if factor is not None and factor * trained_at < config.target_length * (1 - 1e-9):
        raise ValueError(
            f"--method {str(spec)!r} has factor={factor:g}, which reaches {factor * trained_at:g} "
            f"tokens; target_length={config.target_length} needs factor >= {ratio:g} "
            f"({config.target_length} / the model's training length {trained_at}), or omit "
            "factor to derive it"
        )
    return encoding, note


def _attach(backbone: Backbone, config: ExtendConfig, keep: bool, log: Any) -> PositionEncoding:
    """The encoding the run trains: the current one (``keep``, stage 2 of a recipe), the
    adapter's it continues, or the method's, attached now."""
    current = backbone.encoding
    if keep and current is not None:
        return current
    encoding, note = resolve_method(backbone, config)
    if backbone.adapter_sha256 is not None and current is not None:
        if encoding.spec != current.spec:
            raise ValueError(
                f"the model carries an adapter with {current.spec!r}; --method "
                f"{str(config.method)!r} would replace it and start from its init: pass --method "
                f"{current.spec!r} to continue training the adapter, or leave out --adapter"
            )
        return current  # continue from the adapter's parameters
    if note:
        log(f"{config.method}: {note}")
    return backbone.set_encoding(encoding)


def _dataset(backbone: Backbone, config: ExtendConfig, pose_window: int | None) -> Dataset:
    retrieval = RetrievalConfig(ratio=config.retrieval_ratio) if config.retrieval_ratio else None
    data = config.data if isinstance(config.data, str) else list(config.data)
    packed = make_train_dataset(
        data, backbone.require_tokenizer(), config.target_length, retrieval=retrieval,
        seed=config.seed,
    )  # fmt: skip
    samples: Dataset = _Samples(packed, config.samples)
    if pose_window is not None:
        # Fresh positions for every visit of a window (the paper redraws per example):
        # samples x epochs items, one pass of config.steps steps, as without PoSE.
        samples = PoseDataset(
            samples, pose_window, config.target_length, seed=config.seed, repeats=config.epochs
        )
    return samples


def _train_config(
    config: ExtendConfig, out_dir: Path, lora: bool, resume: bool, fsdp: bool
) -> TrainConfig:
    lr_scale = ((r"lora_", config.lora_lr / config.lr),) if lora else ()
    return TrainConfig(
        out_dir=out_dir / "train",
        steps=config.steps,
        batch_size=config.batch_size,
        lr=config.lr,
        lr_scale=lr_scale,
        weight_decay=0.0,  # a handful of samples; nothing to regularise towards
        warmup_steps=min(config.warmup_steps, config.steps),
        seed=config.seed,
        bf16=config.bf16,
        checkpoint_interval=max(1, min(config.steps, 25)),
        log_interval=max(1, min(10, config.steps // 5)),
        overwrite=not resume,
        resume=resume,
        fsdp=fsdp,
    )


def _train(
    backbone: Backbone,
    samples: Dataset,
    config: ExtendConfig,
    train_config: TrainConfig,
    provenance: dict[str, Any],
    command: str,
) -> tuple[float, int]:
    """Train what is trainable (final loss, tokens); checkpointing switched off after."""
    disable = backbone.enable_grad_checkpointing() if config.grad_checkpointing else None
    model = backbone.model
    was_training = model.training
    model.train()
    plan = plan_for(backbone) if train_config.fsdp else None
    try:
        result = train(
            model, samples, train_config, loss_fn=backbone_loss(backbone),
            provenance=provenance, plan=plan, command=command,
        )  # fmt: skip
    finally:
        model.train(was_training)
        if disable is not None:
            disable()
    return result.final_loss, result.tokens


def _claim(out_dir: Path, provenance: dict[str, Any], overwrite: bool, resume: bool) -> bool:
    """Check ``out_dir`` before any work; True when a finished run of this provenance is
    there (resume returns it)."""
    path = out_dir / EXTEND_JSON
    if overwrite:
        return False
    if not resume and path.exists():
        raise FileExistsError(
            f"{out_dir} already holds an extension run; pass --overwrite (overwrite=True) to "
            "replace it, or --resume (resume=True) to continue it"
        )
    return check_replaceable(path, "extend", provenance) if resume else False


# ----------------------------------------------------------------------------- extend
def extend(
    model: Backbone | nn.Module,
    config: ExtendConfig,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    overwrite: bool = False,
    resume: bool = False,
    command: str = "",
    log: Any = print,
    keep_encoding: bool = False,
    fsdp: bool = False,
) -> ExtendResult:
    """Extend ``model`` in place to ``config.target_length`` with ``config.method``.

    Writes ``out_dir/adapter`` (positional parameters, spec, fingerprint), ``lora.safetensors``
    and ``lora.json`` when LoRA trained, the training run in ``out_dir/train`` and
    ``out_dir/extend.json``. ``resume`` continues an interrupted run (module docstring).
    ``fsdp`` shards the backbone over the processes with FSDP2 while it trains (its decoder
    blocks one by one, positional parameters replicated; ``TrainConfig.fsdp``): the numbers
    are those of data-parallel training up to float rounding, and so are the files.
    """
    backbone, out_dir = as_backbone(model, tokenizer), Path(out_dir)
    trained_at = backbone.training_length
    if config.target_length < trained_at:
        raise ValueError(
            f"target_length={config.target_length} is below the model's training length "
            f"{trained_at}; extension needs a target >= {trained_at}"
        )
    if overwrite and resume:
        raise ValueError("overwrite=True with resume=True is not allowed: continue or replace")
    procs = processes()
    start = time.perf_counter()
    provenance = {"model": backbone.identity(), "config": config.to_dict()}
    finished = _claim(out_dir, provenance, overwrite, resume)
    procs.barrier()  # every process has looked before the main one writes
    if finished:
        return _finished(backbone, out_dir, config, log)
    fingerprint = backbone.fingerprint()  # before the encoding changes: adapters name it
    sample = backbone.weights_sample()  # before sharded training splits the weights
    encoding = _attach(backbone, config, keep_encoding, log)
    lora_targets = None
    if config.mode in ("lora", "joint") and not backbone.lora_parameters():
        lora_targets = add_lora(backbone, config.lora_rank, config.lora_alpha, config.lora_targets)
    counts = select_trainable(backbone, config.mode)
    if procs.is_main:
        log(trainable_summary(counts, config.mode))
    final_loss, tokens = None, 0
    pose_window = (config.pose_window or trained_at) if config.pose else None
    if counts["total"]:
        samples = _dataset(backbone, config, pose_window)
        train_config = _train_config(config, out_dir, bool(counts["lora"]), resume, fsdp)
        train_provenance = {**provenance, "data": samples_identity(samples)}
        final_loss, tokens = _train(
            backbone, samples, config, train_config, train_provenance, command
        )
    select_trainable(backbone, "none")  # leave the model frozen, as evaluation expects
    record = ExtendRecord(
        meta=run_metadata(command, spec=encoding.spec, seed=config.seed),
        provenance=json.loads(to_json(provenance)),  # as the file holds it
        method=str(config.method), spec=encoding.spec, config=config.to_dict(),
        trained_at=trained_at, trainable=Trainable(**counts), final_loss=final_loss,
        tokens=tokens, pose_window=pose_window, elapsed_s=time.perf_counter() - start,
        adapter=str(out_dir / "adapter"), fingerprint=json.loads(to_json(fingerprint)),
        num_processes=procs.world,
    )  # fmt: skip
    # Data-parallel training left the same parameters in every process (sharded training
    # gathered them back into it, whole): the main one writes them, and every process returns
    # only once it has, so the files are then safe to read.
    if procs.is_main:
        write_adapter(encoding, fingerprint, out_dir / "adapter", weights_sample=sample,
                      layers=backbone.encoded_layers())  # fmt: skip
        targets = lora_targets or config.lora_targets or backbone.lora_targets
        save_lora(backbone, out_dir, config.lora_rank, config.lora_alpha, tuple(targets))
        write_result(out_dir / EXTEND_JSON, "extend", record)
    procs.barrier()
    return ExtendResult(
        out_dir, encoding.spec, counts, final_loss, record.elapsed_s, out_dir / EXTEND_JSON,
        tokens,
    )  # fmt: skip


def samples_identity(samples: Dataset) -> dict[str, Any]:
    """The provenance of a run's training samples: the packed data's identity, how many
    samples, and PoSE's window, target, seed and repeats when it cuts them."""
    pose = samples if isinstance(samples, PoseDataset) else None
    inner = pose.base if pose is not None else samples
    identity = {**inner.packed.identity(), "samples": len(inner)}
    if pose is not None:
        identity["pose"] = {
            "window": pose.window, "target": pose.target, "seed": pose.seed,
            "repeats": pose.repeats,
        }  # fmt: skip
    return identity


def _finished(backbone: Backbone, out_dir: Path, config: ExtendConfig, log: Any) -> ExtendResult:
    """A finished run found by ``resume``: its adapter loaded, its summary returned."""
    found = read_record(out_dir / EXTEND_JSON, ExtendRecord)
    load_adapter(backbone, out_dir)
    log(f"{out_dir} holds this extension, finished: loaded its adapter")
    return ExtendResult(
        out_dir, found.spec, dataclasses.asdict(found.trainable), found.final_loss,
        found.elapsed_s, out_dir / EXTEND_JSON, found.tokens,
    )  # fmt: skip


def run_extension(
    model: Backbone | nn.Module,
    config: ExtendConfig,
    out_dir: str | Path,
    *,
    recipe: str | None = None,
    tokenizer: Any = None,
    overwrite: bool = False,
    resume: bool = False,
    command: str = "",
    log: Any = print,
    fsdp: bool = False,
) -> list[ExtendResult]:
    """``extend`` once, or a two-stage recipe: stage 1 trains ``config.method`` positionally
    on the samples (in ``out_dir/stage1``), stage 2 adds LoRA (``->lora``: encoding fixed;
    ``->joint``: encoding keeps training) on the same samples (``out_dir``). ``fsdp``: both
    stages train sharded (``extend``)."""
    out_dir = Path(out_dir)
    options = {
        "tokenizer": tokenizer, "overwrite": overwrite, "resume": resume,
        "command": command, "log": log, "fsdp": fsdp,
    }  # fmt: skip
    if recipe is None:
        return [extend(model, config, out_dir, **options)]
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is not allowed; use one of {', '.join(RECIPES)}")
    family, second = RECIPES[recipe]
    if config.method.name != family:
        raise ValueError(
            f"recipe {recipe!r} starts with {family}; --method {str(config.method)!r} is a "
            f"{config.method.name} spec"
        )
    first_config = dataclasses.replace(config, mode="positional")
    first = extend(model, first_config, out_dir / "stage1", **options)
    # Stage 2 keeps the learned encoding: reattaching it by spec would reset it to its init.
    stage2 = dataclasses.replace(config, mode=second)
    final = extend(model, stage2, out_dir, **options, keep_encoding=True)
    return [first, final]
