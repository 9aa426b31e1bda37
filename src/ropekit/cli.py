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


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_encodings, add_schedules]


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
    except (ValueError, FileNotFoundError) as e:
        print(f"ropekit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
