"""`ropekit <command>`: the command line. Thin by design: each command parses its arguments,
calls one library function, prints where its outputs went. Bad input is one line on stderr
and exit code 2.

Adding a command: write ``add_<name>(subparsers)`` that registers the parser and sets
``func`` to a ``cmd_<name>(args) -> int`` handler; list it in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path


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


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_encodings,
    add_schedules,
    add_pretrain,
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


def main(argv: list[str] | None = None) -> int:
    _offline()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"ropekit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
