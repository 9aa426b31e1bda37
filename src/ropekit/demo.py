"""`ropekit demo`: the main job end to end on an embedded default, on a laptop CPU.

A small byte-level RoPE decoder is trained at a short context L (or reused from the user
cache), extended to 8L by every method (the unmodified `rope` baseline, `linear`, `ntk`,
`yarn`, `tuned-yarn`, `adarope`), evaluated at L..8L (bits per byte on held-out plays, passkey
and key-value retrieval), its AdaRoPE heads analysed, and a report written (Markdown +
self-contained HTML) from the run's JSON.

The base model learns to retrieve in two stages (`DemoConfig.base_stages`): first samples
that are all retrieval records (passkey or one key-value fact) at a context they nearly fill,
where the copy circuit forms in a few hundred steps, then Shakespeare with half the samples
carrying a record at L, with an answer-weighted loss throughout. Mixed into text from the
start, retrieval did not form within 2,000 steps in our runs.

Holds:
- `DemoConfig`: every setting, with the presets `PRESETS` (`full`, `quick`, and `tiny` for
  the test suite); `base_key` names the cached base model.
- `run_demo(out_dir, config)`: the pipeline; returns the content of ``demo.json``.
- `prepare_base_model`: the cached base model, trained first when missing; `base_model_dir`.
- `summary_table`: the terminal table; `check_data`, `claim_out_dir`.

Layout of ``out_dir`` (every file but the report is JSON or a PNG drawn from JSON):

    demo.json                   config, base model, per-method numbers, timings, notes
    report.md, report.html      `ropekit.report.build_report(out_dir)`
    bpb_vs_length.png, nll_vs_position.png, retrieval_vs_length.png
    base/pretrain.json          the base model's training summary (copied from the cache)
    methods/<name>/extend.json  extension (adapter/ beside it); none for `rope`
    methods/<name>/ppl/         ppl.json + ppl.png (`ropekit eval ppl`)
    methods/<name>/tasks/       summary.json + plots (`ropekit eval passkey|needle`)
    analysis/                   analysis.json + head figures of the AdaRoPE model
    schedules/                  schedules.json + schedules.png (the fixed schedules at init)

The base model lives in ``$ROPEKIT_CACHE/demo/<key>/`` (default ``~/.cache/ropekit``): the
key hashes every setting that shapes it, so a second run with the same settings reuses it and
any change trains a new one. It is trained in ``<key>.partial/`` (resumable) and renamed when
done, so an interrupted run never leaves a half-trained model that looks finished.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Bump when the base recipe changes in a way the settings below do not capture (data mixing,
# loss): cached base models of an older recipe are then retrained instead of reused.
BASE_RECIPE_VERSION = 1
METHODS: tuple[str, ...] = ("rope", "linear", "ntk", "yarn", "tuned-yarn", "adarope")
DEMO_JSON = "demo.json"
# What an earlier `make demo` (the schedule comparison) left in runs/demo: safe to replace.
_OLD_DEMO_FILES = {"schedules.json", "schedules.png"}
# Tasks the demo adds to the registry's (ropekit.evals.tasks.TASKS): the mixture's kv record
# with a single fact in held-out plays. The registered kv_shakespeare asks one of four facts,
# which needs about 190 bytes: more than L = 128 leaves.
DEMO_TASKS: dict[str, dict[str, Any]] = {
    "kv1_shakespeare": {
        "base": "niah",
        "args": {
            "haystack": "corpus:shakespeare",
            "key_type": "letters",
            "value_digits": 4,
            "n_keys": 1,
            "preamble": "",
        },
        "needle": True,
        "description": "the mixture's kv record, one fact (3-letter key, 4-digit value), "
        "held-out Shakespeare",
    }
}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Settings of one demo run. Lengths are in bytes (the byte tokenizer's tokens)."""

    # Base model: shape and its two-stage pretraining (these, and only these, key the cache).
    context: int = 128  # L, the base model's training length
    encoding: str = "rope"  # the base model's encoding (experiments train others this way)
    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 6
    lr: float = 1e-3  # peak learning rate of both stages (at 3e-3 retrieval never formed)
    warmup: int = 50  # linear warmup steps at the start of stage 1
    answer_weight: float = 20.0  # loss weight of recalled values (answer-weighted loss)
    retrieval_kinds: tuple[str, ...] = ("passkey", "kv")  # each record sample draws one
    retrieval_facts: int = 1  # kv facts per sample: one fact fits beside text in L = 128
    # Stage 1, recall: every sample carries a record, at a context where the record and its
    # question fill most of the sample. Mixed into long text from the start, the copy circuit
    # did not form within 2,000 steps in our runs; this way it forms in a few hundred.
    recall_context: int = 96
    recall_steps: int = 600  # 0 skips the stage
    recall_batch_size: int = 16
    # Stage 2, mixture: text at L, a share of samples carrying a record (keeps retrieval).
    base_steps: int = 600
    batch_size: int = 32
    retrieval_ratio: float = 0.5
    data: str = "shakespeare"
    seed: int = 0
    # Extension and evaluation.
    factor: int = 8  # extend to factor * L
    extend_samples: int = 100  # samples of factor * L (the paper's protocol: 100)
    extend_lr: float = 1e-2  # positional parameters' learning rate
    length_multiples: tuple[int, ...] = (1, 2, 4, 8)  # evaluation lengths, in units of L
    eval_windows: int = 16  # held-out windows of the longest length scored at every length
    tasks: tuple[str, ...] = ("passkey_shakespeare", "kv1_shakespeare")  # see DEMO_TASKS
    task_samples: int = 20  # samples per task and length, needle depths spread over 0..1
    analysis_windows: int = 4  # held-out windows for the head analysis
    influence_windows: int = 2  # of those, used for head influence (one pass per head)
    preset: str = "custom"  # which preset the settings came from (for the report)

    def __post_init__(self) -> None:
        object.__setattr__(self, "retrieval_kinds", tuple(self.retrieval_kinds))
        object.__setattr__(self, "length_multiples", tuple(self.length_multiples))
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if not isinstance(self.recall_steps, int) or self.recall_steps < 0:
            raise ValueError(f"recall_steps={self.recall_steps!r} must be an integer >= 0")
        for name in (
            "context",
            "recall_context",
            "recall_batch_size",
            "base_steps",
            "batch_size",
            "factor",
            "extend_samples",
            "eval_windows",
            "task_samples",
            "analysis_windows",
            "influence_windows",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 1")
        if self.factor < 2:
            raise ValueError(f"factor={self.factor} is not allowed; extension needs >= 2")
        if not self.length_multiples or any(m < 1 for m in self.length_multiples):
            raise ValueError(
                f"length_multiples={self.length_multiples!r} is not allowed; give integers >= 1"
            )
        if self.influence_windows > self.analysis_windows:
            raise ValueError(
                f"influence_windows={self.influence_windows} must be <= "
                f"analysis_windows={self.analysis_windows}"
            )

    @property
    def target_length(self) -> int:
        return self.factor * self.context

    @property
    def lengths(self) -> list[int]:
        return sorted({m * self.context for m in self.length_multiples} | {self.context})

    def model_config(self):
        from ropekit.model import DecoderConfig

        return DecoderConfig(
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            encoding=self.encoding,
            context_length=self.context,
        )

    def retrieval(self, ratio: float | None = None):
        """The retrieval mixture (``ratio`` of samples with a record; default: stage 2's)."""
        from ropekit.data import RetrievalConfig

        return RetrievalConfig(
            ratio=self.retrieval_ratio if ratio is None else ratio,
            kinds=self.retrieval_kinds,
            n_facts=self.retrieval_facts,
            answer_weight=self.answer_weight,
        )

    def base_stages(self) -> list[dict[str, Any]]:
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

    def base_settings(self) -> dict[str, Any]:
        """Everything that shapes the base model (what the cache is keyed on)."""
        return {
            "recipe": BASE_RECIPE_VERSION,
            "model": self.model_config().to_dict(),
            "stages": self.base_stages(),
            "lr": self.lr,
            "retrieval": dataclasses.asdict(self.retrieval()),
            "data": self.data,
            "seed": self.seed,
        }

    def base_key(self) -> str:
        digest = hashlib.blake2b(
            json.dumps(self.base_settings(), sort_keys=True).encode(), digest_size=6
        ).hexdigest()
        steps = self.recall_steps + self.base_steps
        return f"L{self.context}-d{self.d_model}x{self.n_layers}-{steps}steps-{digest}"

    def method_spec(self, method: str) -> str:
        """The extension spec of a method; the model supplies original_length and base."""
        if method == "rope":
            return "rope"
        if method == "adarope":
            return f"adarope:init=yarn,factor={self.factor}"
        return f"{method}:factor={self.factor}"


PRESETS: dict[str, DemoConfig] = {
    "full": DemoConfig(preset="full"),
    # Under 3 minutes on 2 cores: a shorter context (the shortest that holds a record and its
    # question), a smaller model, fewer of everything.
    "quick": DemoConfig(
        context=96,
        d_model=128,
        n_layers=4,
        n_heads=4,
        recall_steps=400,
        base_steps=100,
        extend_samples=32,
        length_multiples=(1, 2, 8),
        eval_windows=8,
        task_samples=10,
        analysis_windows=2,
        influence_windows=1,
        preset="quick",
    ),
    # The test suite's end-to-end run: every stage, as small as it goes (seconds).
    "tiny": DemoConfig(
        context=96,
        d_model=32,
        n_layers=2,
        n_heads=2,
        recall_steps=3,
        recall_batch_size=2,
        base_steps=3,
        batch_size=4,
        warmup=1,
        factor=2,
        extend_samples=3,
        length_multiples=(1, 2),
        eval_windows=1,
        tasks=("passkey_shakespeare",),
        task_samples=2,
        analysis_windows=1,
        influence_windows=1,
        preset="tiny",
    ),
}


# ----------------------------------------------------------------------------- preparation
def check_data(config: DemoConfig) -> None:
    """Raise FileNotFoundError naming `make setup` when the demo's corpus is not installed."""
    from ropekit.data import CorpusNotInstalledError, load_corpus

    try:
        load_corpus(config.data, "validation")
    except CorpusNotInstalledError as e:
        raise FileNotFoundError(
            f"the demo needs the {config.data!r} corpus, which is not installed. Run `make "
            f"setup` (it installs every corpus ropekit uses), then `make demo`. ({e})"
        ) from None


def _is_previous_demo(out: Path) -> bool:
    marker = out / DEMO_JSON
    if marker.is_file():
        try:
            return json.loads(marker.read_text()).get("kind") == "demo"
        except (json.JSONDecodeError, UnicodeDecodeError):
            return False
    return {p.name for p in out.iterdir()} <= _OLD_DEMO_FILES


def claim_out_dir(out: Path, overwrite: bool) -> bool:
    """Make ``out`` ready: create it, or replace a previous demo's folder (or any folder when
    ``overwrite``). Returns whether something was replaced."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        out.mkdir(parents=True, exist_ok=True)
        return False
    if not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; choose a folder")
    if not (overwrite or _is_previous_demo(out)):
        raise FileExistsError(
            f"{out} holds files that are not from a previous `ropekit demo`; choose another "
            "--out, or pass --overwrite to replace them"
        )
    resolved, here = out.resolve(), Path.cwd().resolve()
    if resolved == here or resolved in here.parents or resolved == Path.home().resolve():
        raise ValueError(f"refusing to replace {out}: it holds the current folder or home")
    shutil.rmtree(out)
    out.mkdir(parents=True)
    return True


def base_model_dir(config: DemoConfig) -> Path:
    """Where the base model for ``config`` is cached."""
    from ropekit.hf.models import cache_dir

    return cache_dir() / "demo" / config.base_key()


def _read_json(path: Path) -> dict[str, Any]:
    from ropekit.results import read_result

    return read_result(path)


# ----------------------------------------------------------------------------- stages
def prepare_base_model(
    config: DemoConfig, log: Callable[[str], None] = print
) -> tuple[Path, bool, float]:
    """The cached base model folder (training it first if needed); whether it was reused and
    the seconds spent training here.

    Training runs the stages of ``config.base_stages()`` on one decoder with the library's
    loop, each in its own resumable folder, then writes ``model/`` and a ``pretrain.json``
    that records every stage.
    """
    import torch

    from ropekit.data import make_train_dataset
    from ropekit.model import Decoder, count_parameters, flops_per_token, save_decoder
    from ropekit.results import run_metadata, write_result
    from ropekit.train import TrainConfig, train
    from ropekit.train.pretrain import measure_matmul_flops

    final = base_model_dir(config)
    if (final / "pretrain.json").is_file() and (final / "model").is_dir():
        log(f"reusing the cached base model {final}")
        return final, True, 0.0
    partial = final.with_name(final.name + ".partial")
    total = config.recall_steps + config.base_steps
    log(f"training the base model ({total} steps) in {partial}")
    start = time.perf_counter()
    model_config = config.model_config()
    torch.manual_seed(config.seed)
    decoder = Decoder(model_config)
    stages = []
    for stage in config.base_stages():
        log(
            f"  stage {stage['name']}: {stage['steps']} steps of {stage['batch_size']} x "
            f"{stage['context']} bytes, {stage['retrieval_ratio']:.0%} with a retrieval record"
        )
        dataset = make_train_dataset(
            config.data,
            "bytes",
            stage["context"],
            retrieval=config.retrieval(stage["retrieval_ratio"]),
            seed=config.seed,
        )
        train_config = TrainConfig(
            out_dir=partial / stage["name"],
            steps=stage["steps"],
            batch_size=stage["batch_size"],
            lr=config.lr,
            warmup_steps=stage["warmup_steps"],
            min_lr_ratio=stage["min_lr_ratio"],
            seed=config.seed,
            checkpoint_interval=max(50, stage["steps"] // 4),  # resumable if interrupted
            keep_last=1,
            resume=True,  # a finished stage only reloads its final weights
        )
        result = train(decoder, dataset, train_config)
        stages.append(
            {
                **stage,
                "final_loss": result.final_loss,
                "tokens": result.tokens,
                "elapsed_s": result.elapsed_s,
                "tokens_per_s": result.tokens_per_s,
                "train": train_config.to_dict(),
            }
        )
    save_decoder(decoder, partial / "model")
    tokens = sum(st["tokens"] for st in stages)
    elapsed = sum(st["elapsed_s"] for st in stages)
    peak, fpt = measure_matmul_flops(), flops_per_token(model_config)
    summary = {  # the fields of `ropekit pretrain`'s pretrain.json, plus the stages
        "encoding": decoder.encoding.spec,
        "model": model_config.to_dict(),
        "parameters": count_parameters(decoder),
        "steps": total,
        "train": stages[-1]["train"],
        "stages": stages,
        "data": config.data,
        "retrieval": dataclasses.asdict(config.retrieval()),
        "final_loss": stages[-1]["final_loss"],
        "tokens": tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "flops_per_token": fpt,
        "matmul_flops_per_s": peak,
        "mfu": tokens / elapsed * fpt / peak,
    }
    meta = run_metadata("ropekit demo (base model)", spec=decoder.encoding.spec, seed=config.seed)
    write_result(partial / "pretrain.json", "pretrain", summary, meta=meta)
    for stage in stages:  # the weights are all we reuse
        shutil.rmtree(partial / stage["name"] / "checkpoints", ignore_errors=True)
    if final.exists():  # another demo finished the same model meanwhile: keep that one
        shutil.rmtree(partial)
    else:
        partial.rename(final)
    return final, False, time.perf_counter() - start


def _evaluate(model: Any, config: DemoConfig, folder: Path, spec: str, command: str) -> None:
    """Bits per byte (``folder/ppl``) and retrieval accuracy (``folder/tasks``) at every
    length of ``config``."""
    from ropekit.evals import TaskSpec, run_perplexity, run_tasks

    run_perplexity(
        model,
        "bytes",
        folder / "ppl",
        lengths=config.lengths,
        data=config.data,
        n_tokens=config.eval_windows * max(config.lengths),
        seed=config.seed,
        spec=spec,
        command=command,
    )
    run_tasks(
        model,
        "bytes",
        [
            TaskSpec(name, **DEMO_TASKS[name]) if name in DEMO_TASKS else name
            for name in config.tasks
        ],
        folder / "tasks",
        lengths=config.lengths,
        samples=config.task_samples,
        seed=config.seed,
        batch_size=8,
        kind="retrieval",
        spec=spec,
        command=command,
    )


def _method_row(
    name: str, spec: str, folder: Path, out: Path, extend: dict[str, Any] | None
) -> dict[str, Any]:
    """One method's numbers, read back from the JSON its stages wrote."""
    ppl = _read_json(folder / "ppl" / "ppl.json")
    tasks = _read_json(folder / "tasks" / "summary.json")
    return {
        "name": name,
        "spec": spec,
        "trainable": 0 if extend is None else extend["trainable"]["total"],
        "extend_s": None if extend is None else extend["elapsed_s"],
        "final_loss": None if extend is None else extend["final_loss"],
        "bpb": {str(r["length"]): r["bits_per_byte"] for r in ppl["results"]},
        "tasks": {
            t: {str(s["length"]): s["score"] for s in entry["scores"]}
            for t, entry in tasks["tasks"].items()
        },
        "files": {
            "ppl": (folder / "ppl" / "ppl.json").relative_to(out).as_posix(),
            "tasks": (folder / "tasks" / "summary.json").relative_to(out).as_posix(),
            "extend": None
            if extend is None
            else (folder / "extend.json").relative_to(out).as_posix(),
        },
    }


def _figures(out: Path, config: DemoConfig, rows: list[dict[str, Any]]) -> dict[str, str]:
    """The comparison figures, drawn from the methods' JSON; returns file -> caption."""
    from ropekit.report.plots import plot_nll_vs_position, plot_tasks_vs_length, plot_vs_length

    L = config.context
    bpb = {r["name"]: {int(n): v for n, v in r["bpb"].items()} for r in rows}
    plot_vs_length(
        bpb,
        out / "bpb_vs_length.png",
        ylabel="bits per byte (held-out)",
        title=f"Trained at {L}, extended to {config.target_length}",
        train_length=L,
    )
    longest = max(config.lengths)
    curves = {}
    for r in rows:
        ppl = _read_json(out / r["files"]["ppl"])
        at = next(x for x in ppl["results"] if x["length"] == longest)
        if at["position_nll"] is not None:
            curves[r["name"]] = at["position_nll"]
    plot_nll_vs_position(curves, out / "nll_vs_position.png", length=longest, train_length=L)
    tasks = {
        t: {r["name"]: {int(n): v for n, v in r["tasks"].get(t, {}).items()} for r in rows}
        for t in config.tasks
    }
    plot_tasks_vs_length(tasks, out / "retrieval_vs_length.png", train_length=L)
    return {
        "bpb_vs_length.png": "Bits per byte vs evaluation length, one line per method.",
        "nll_vs_position.png": f"NLL vs token position in windows of {longest} bytes: a method "
        f"that generalises keeps falling (or stays flat) past position {L}.",
        "retrieval_vs_length.png": "Retrieval accuracy vs evaluation length, one panel per task.",
    }


def _notes(config: DemoConfig, rows: list[dict[str, Any]]) -> list[str]:
    """Plain-language readings of the numbers (computed here, never written by hand)."""
    L, longest = str(config.context), str(max(config.lengths))
    by_name = {r["name"]: r for r in rows}
    notes = []
    scored = [r for r in rows if r["bpb"].get(longest) is not None]
    if scored and "rope" in by_name:
        best = min(scored, key=lambda r: r["bpb"][longest])
        notes.append(
            f"At {longest} bytes the lowest bits per byte is {best['name']} "
            f"({best['bpb'][longest]:.3f}), against {by_name['rope']['bpb'][longest]:.3f} for "
            f"unmodified RoPE and {by_name['rope']['bpb'][L]:.3f} for RoPE at its training "
            f"length {L}."
        )
    base_scores = by_name.get("rope", {}).get("tasks", {})
    for task, by_length in base_scores.items():
        at_l = by_length.get(L)
        if at_l is None:
            notes.append(f"{task} does not fit in {L} bytes; it is scored at longer lengths only.")
        elif at_l < 0.5:
            notes.append(
                f"The base model scores {100 * at_l:.0f}% on {task} at its own training length "
                f"{L}: it has not learned this retrieval reliably, so {task} at longer lengths "
                "says little about the extension methods."
            )
        else:
            far = {r["name"]: r["tasks"].get(task, {}).get(longest) for r in rows}
            far = {name: v for name, v in far.items() if v is not None}
            if far:
                best = max(far.values())
                winners = ", ".join(name for name, v in far.items() if v == best)
                at_far = (
                    f"no method retrieves it at {longest} bytes"
                    if best == 0
                    else f"at {longest} bytes the best is {winners} with {100 * best:.0f}% "
                    f"(unmodified RoPE {100 * far.get('rope', 0):.0f}%)"
                )
                notes.append(
                    f"The base model retrieves on {task} at its training length ({100 * at_l:.0f}% "
                    f"at {L}); {at_far}."
                )
    return notes


# ----------------------------------------------------------------------------- the pipeline
def run_demo(
    out_dir: str | Path = "runs/demo",
    config: DemoConfig | None = None,
    *,
    overwrite: bool = False,
    command: str = "",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the whole demo into ``out_dir`` (see the module docstring) and return demo.json's
    content, with ``report`` (the report paths) added."""
    from ropekit.analysis import analyze
    from ropekit.backbone import as_backbone
    from ropekit.model import load_decoder
    from ropekit.report.build import build_report
    from ropekit.report.schedules import compare_schedules, write_schedules
    from ropekit.results import run_metadata, write_result
    from ropekit.train.extend import ExtendConfig, extend

    config = config or PRESETS["full"]
    out = Path(out_dir)
    started = time.perf_counter()
    check_data(config)
    replaced = claim_out_dir(out, overwrite)
    meta = run_metadata(command, seed=config.seed)
    state: dict[str, Any] = {"status": "running", "config": dataclasses.asdict(config)}
    # Marks the folder as a demo's from the start.
    write_result(out / DEMO_JSON, "demo", state, meta=meta)
    if replaced:
        log(f"replaced the previous demo in {out}")
    timings: dict[str, float] = {}
    n_stages = 5

    def stage(i: int, text: str) -> float:
        log(f"[{i}/{n_stages}] {text}")
        return time.perf_counter()

    # 1. The base model.
    t = stage(1, f"base model: byte-level RoPE decoder at L={config.context}")
    base_dir, reused, _ = prepare_base_model(config, log)
    base = _read_json(base_dir / "pretrain.json")
    (out / "base").mkdir()
    shutil.copy2(base_dir / "pretrain.json", out / "base" / "pretrain.json")
    timings["base model" + (" (reused)" if reused else "")] = time.perf_counter() - t

    # 2. Extend with every method, evaluate each.
    t = stage(2, f"extend to {config.target_length} and evaluate at {config.lengths}")
    rows = []
    adarope_model = None
    for i, name in enumerate(METHODS, 1):
        folder = out / "methods" / name
        model = load_decoder(base_dir / "model").eval()
        record = None
        if name != "rope":
            log(f"  ({i}/{len(METHODS)}) {name}: extending")
            result = extend(
                model,
                ExtendConfig(
                    method=config.method_spec(name),
                    target_length=config.target_length,
                    samples=config.extend_samples,
                    lr=config.extend_lr,
                    data=config.data,
                    seed=config.seed,
                ),
                folder,
                command=command,
                log=lambda line: log(f"      {line}"),
            )
            record = _read_json(result.summary)
        spec = as_backbone(model).encoding.spec
        log(f"  ({i}/{len(METHODS)}) {name}: evaluating `{spec}`")
        model.eval()
        _evaluate(model, config, folder, spec, command)
        rows.append(_method_row(name, spec, folder, out, record))
        if name == "adarope":
            adarope_model = model
    timings["extension + evaluation"] = time.perf_counter() - t

    # 3. Inside the AdaRoPE model.
    t = stage(3, "analyze the AdaRoPE heads (effective length, schedules, influence)")
    analysis = analyze(
        adarope_model,
        "bytes",
        lengths=config.lengths,
        out_dir=out / "analysis",
        n_windows=config.analysis_windows,
        influence_windows=config.influence_windows,
        target_length=config.target_length,
        data=config.data,
        seed=config.seed,
        command=command,
    )
    timings["analysis"] = time.perf_counter() - t

    # 4-5. Figures and the report.
    t = stage(4, "figures")
    model_config = config.model_config()
    write_schedules(
        compare_schedules(
            # tuned-yarn and adarope start from yarn; analysis/ shows what they learned.
            [m for m in METHODS if m not in ("tuned-yarn", "adarope")],
            head_dim=model_config.head_dim,
            factor=config.factor,
            original_length=config.context,
        ),
        out / "schedules",
        command=command,
    )
    figures = _figures(out, config, rows)
    timings["figures"] = time.perf_counter() - t

    t = stage(5, "report")
    timings["total (before the report)"] = time.perf_counter() - started
    state.update(
        status="done",
        context=config.context,
        target_length=config.target_length,
        lengths=config.lengths,
        data=config.data,
        extend_samples=config.extend_samples,
        task_samples=config.task_samples,
        tasks=list(config.tasks),
        base={
            "key": config.base_key(),
            "path": str(base_dir),
            "reused": reused,
            "encoding": base["encoding"],
            "parameters": base["parameters"],
            "steps": base["steps"],
            "stages": [
                {k: st[k] for k in ("name", "context", "steps", "batch_size", "retrieval_ratio")}
                for st in base["stages"]
            ],
            "final_loss": base["final_loss"],
            "elapsed_s": base["elapsed_s"],
            "tokens_per_s": base["tokens_per_s"],
            "settings": config.base_settings(),
        },
        methods=rows,
        analysis=Path(analysis["paths"]["json"]).relative_to(out).as_posix(),
        figures=figures,
        notes=_notes(config, rows),
        timings=timings,
    )
    write_result(out / DEMO_JSON, "demo", state, meta=meta)
    title = f"ropekit demo: a small byte-level model extended {config.factor}x"
    paths = build_report(out, title=title)
    return {"kind": "demo", "meta": meta, **state, "report": paths}


def summary_table(result: dict[str, Any]) -> list[str]:
    """The terminal summary: bits per byte and retrieval accuracy per method and length."""
    lengths = [str(n) for n in result["lengths"]]
    columns = [("bpb", None, n) for n in lengths]
    columns += [(t.removesuffix("_shakespeare"), t, n) for t in result["tasks"] for n in lengths]
    width = max(8, *(len(f"{name}@{n}") + 1 for name, _, n in columns))
    header = f"{'method':<11} {'trained':>7} " + "".join(
        f"{name + '@' + n:>{width}}" for name, _, n in columns
    )
    lines = [header, "-" * len(header)]
    for m in result["methods"]:
        cells = []
        for _, task, n in columns:
            value = m["bpb"].get(n) if task is None else m["tasks"].get(task, {}).get(n)
            text = "-" if value is None else f"{value:.3f}" if task is None else f"{value:.0%}"
            cells.append(f"{text:>{width}}")
        lines.append(f"{m['name']:<11} {m['trainable']:>7,} " + "".join(cells))
    return lines
