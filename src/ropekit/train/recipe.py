"""The base-model recipe: a small byte-level decoder that learns to retrieve, trained once and
cached (what `ropekit demo` and the experiments extend or compare).

Why a recipe: retrieval does not appear by itself at this scale and budget (DESIGN.md, "Known
figures": 0% after 8-14 minutes of text mixed with records). The model learns it in two stages
(``BaseRecipe.stages``): first samples that are all retrieval records (passkey or one key-value
fact) at a context they nearly fill, where the copy circuit forms in a few hundred steps, then
text with a share of samples carrying a record at L, with an answer-weighted loss throughout.
Mixed into text from the start, retrieval did not form within 2,000 steps in our runs
(docs/decisions.md, "The two-stage retrieval recipe").

The cache: ``$ROPEKIT_CACHE/demo/<key>/`` (default ``~/.cache/ropekit``), where the key
hashes every setting that shapes the model (``BaseRecipe.settings``), so equal settings reuse
one model and any change trains a new one. It is trained in ``<key>.partial/`` (resumable,
one folder per stage) and renamed when done, so an interrupted run never leaves a
half-trained model that looks finished.

Holds: RECIPE_VERSION, BaseRecipe, base_model_dir, prepare_base_model.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ropekit.data import RetrievalConfig, make_train_dataset
from ropekit.model import Decoder, DecoderConfig, count_parameters, flops_per_token, save_decoder
from ropekit.results import digest, run_metadata, write_result
from ropekit.utils import cache_dir

from .config import TrainConfig
from .loop import train
from .pretrain import measure_matmul_flops

# Bump when the recipe changes in a way the settings do not capture (data mixing, loss):
# cached models of an older recipe are then retrained instead of reused.
RECIPE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class BaseRecipe:
    """Shape and two-stage pretraining of the base model (these, and only these, key the
    cache). Lengths are in bytes (the byte tokenizer's tokens)."""

    context: int = 128  # L, the base model's training length
    encoding: str = "rope"  # the base model's encoding (experiments train others this way)
    d_model: int = 192  # model width
    n_layers: int = 4  # decoder blocks
    n_heads: int = 6  # attention heads
    lr: float = 1e-3  # peak learning rate of both stages (at 3e-3 retrieval never formed)
    warmup: int = 50  # linear warmup steps at the start of stage 1
    answer_weight: float = 20.0  # loss weight of recalled values (answer-weighted loss)
    retrieval_kinds: tuple[str, ...] = ("passkey", "kv")  # each record sample draws one
    retrieval_facts: int = 1  # kv facts per sample: one fact fits beside text in L = 128
    # Stage 1, recall: every sample carries a record, at a context where the record and its
    # question fill most of the sample.
    recall_context: int = 96  # bytes per recall sample
    recall_steps: int = 600  # 0 skips the stage
    recall_batch_size: int = 16  # samples per recall step
    # Stage 2, mixture: text at L, a share of samples carrying a record (keeps retrieval).
    base_steps: int = 600  # mixture steps
    batch_size: int = 32  # samples per mixture step
    retrieval_ratio: float = 0.5  # share of mixture samples that carry a record
    data: str = "shakespeare"  # training text (its training split)
    seed: int = 0  # initialisation, data order and records

    def __post_init__(self) -> None:
        object.__setattr__(self, "retrieval_kinds", tuple(self.retrieval_kinds))
        if not isinstance(self.recall_steps, int) or self.recall_steps < 0:
            raise ValueError(f"recall_steps={self.recall_steps!r} must be an integer >= 0")
        for name in ("context", "recall_context", "recall_batch_size", "base_steps", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 1")
        self.model_config()  # validates shape and encoding
        self.retrieval()  # validates the mixture

    def model_config(self) -> DecoderConfig:
        return DecoderConfig(
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            encoding=self.encoding,
            context_length=self.context,
        )

    def retrieval(self, ratio: float | None = None) -> RetrievalConfig:
        """The retrieval mixture (``ratio`` of samples with a record; default: stage 2's)."""
        return RetrievalConfig(
            ratio=self.retrieval_ratio if ratio is None else ratio,
            kinds=self.retrieval_kinds,
            n_facts=self.retrieval_facts,
            answer_weight=self.answer_weight,
        )

    def stages(self) -> list[dict[str, Any]]:
        """The pretraining stages: name, context, steps, batch size, retrieval ratio, and the
        learning-rate shape (one warmup, constant through recall, cosine through the mixture)."""
        stages = []
        if self.recall_steps:
            stages.append(
                {
                    "name": "recall",
                    "context": self.recall_context,
                    "steps": self.recall_steps,
                    "batch_size": self.recall_batch_size,
                    "retrieval_ratio": 1.0,
                    "warmup_steps": min(self.warmup, self.recall_steps),
                    "min_lr_ratio": 1.0,
                }
            )
        stages.append(
            {
                "name": "mixture",
                "context": self.context,
                "steps": self.base_steps,
                "batch_size": self.batch_size,
                "retrieval_ratio": self.retrieval_ratio,
                "warmup_steps": 0 if self.recall_steps else min(self.warmup, self.base_steps),
                "min_lr_ratio": 0.1,
            }
        )
        return stages

    def settings(self) -> dict[str, Any]:
        """Everything that shapes the base model (what the cache is keyed on)."""
        return {
            "recipe": RECIPE_VERSION,
            "model": self.model_config().to_dict(),
            "stages": self.stages(),
            "lr": self.lr,
            "retrieval": dataclasses.asdict(self.retrieval()),
            "data": self.data,
            "seed": self.seed,
        }

    def key(self) -> str:
        steps = self.recall_steps + self.base_steps
        name = f"L{self.context}-d{self.d_model}x{self.n_layers}-{steps}steps"
        return f"{name}-{digest(self.settings(), size=6)}"


def base_model_dir(recipe: BaseRecipe) -> Path:
    """Where the base model of ``recipe`` is cached."""
    return cache_dir() / "demo" / recipe.key()


def _train_stage(
    decoder: Decoder, recipe: BaseRecipe, stage: dict[str, Any], folder: Path
) -> dict[str, Any]:
    """One stage of the recipe on ``decoder``, resumable in ``folder``; its record."""
    dataset = make_train_dataset(
        recipe.data, "bytes", stage["context"],
        retrieval=recipe.retrieval(stage["retrieval_ratio"]), seed=recipe.seed,
    )  # fmt: skip
    config = TrainConfig(
        out_dir=folder,
        steps=stage["steps"],
        batch_size=stage["batch_size"],
        lr=recipe.lr,
        warmup_steps=stage["warmup_steps"],
        min_lr_ratio=stage["min_lr_ratio"],
        seed=recipe.seed,
        checkpoint_interval=max(50, stage["steps"] // 4),  # resumable if interrupted
        keep_last=1,
        resume=True,  # a finished stage only reloads its final weights
    )
    provenance = {"recipe": recipe.settings(), "stage": stage["name"]}
    result = train(decoder, dataset, config, provenance=provenance, command="ropekit base recipe")
    return {
        **stage,
        "final_loss": result.final_loss,
        "tokens": result.tokens,
        "elapsed_s": result.elapsed_s,
        "tokens_per_s": result.tokens_per_s,
        "train": config.to_dict(),
    }


def prepare_base_model(
    recipe: BaseRecipe, log: Callable[[str], None] = print
) -> tuple[Path, bool, float]:
    """The cached base model folder (training it first if needed); whether it was reused and
    the seconds spent training here. Writes ``model/`` and a ``pretrain.json`` recording
    every stage."""
    final = base_model_dir(recipe)
    if (final / "pretrain.json").is_file() and (final / "model").is_dir():
        log(f"reusing the cached base model {final}")
        return final, True, 0.0
    partial = final.with_name(final.name + ".partial")
    total = recipe.recall_steps + recipe.base_steps
    log(f"training the base model ({total} steps) in {partial}")
    start = time.perf_counter()
    model_config = recipe.model_config()
    torch.manual_seed(recipe.seed)
    decoder = Decoder(model_config)
    stages = []
    for stage in recipe.stages():
        log(
            f"  stage {stage['name']}: {stage['steps']} steps of {stage['batch_size']} x "
            f"{stage['context']} bytes, {stage['retrieval_ratio']:.0%} with a retrieval record"
        )
        stages.append(_train_stage(decoder, recipe, stage, partial / stage["name"]))
    save_decoder(decoder, partial / "model")
    tokens = sum(st["tokens"] for st in stages)
    elapsed = sum(st["elapsed_s"] for st in stages)
    peak, fpt = measure_matmul_flops(), flops_per_token(model_config)
    summary = {  # the fields of `ropekit pretrain`'s pretrain.json, plus the stages
        "encoding": decoder.encoding.spec, "model": model_config.to_dict(),
        "parameters": count_parameters(decoder), "steps": total,
        "train": stages[-1]["train"], "stages": stages, "data": recipe.data,
        "retrieval": dataclasses.asdict(recipe.retrieval()),
        "final_loss": stages[-1]["final_loss"], "tokens": tokens, "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed, "flops_per_token": fpt, "matmul_flops_per_s": peak,
        "mfu": tokens / elapsed * fpt / peak,
    }  # fmt: skip
    meta = run_metadata("ropekit base recipe", spec=decoder.encoding.spec, seed=recipe.seed)
    provenance = {"recipe": recipe.settings()}
    write_result(partial / "pretrain.json", "pretrain", summary, meta=meta, provenance=provenance)
    for stage in stages:  # the weights are all we reuse
        shutil.rmtree(partial / stage["name"] / "checkpoints", ignore_errors=True)
    if final.exists():  # another run finished the same model meanwhile: keep that one
        shutil.rmtree(partial)
    else:
        partial.rename(final)
    return final, False, time.perf_counter() - start
