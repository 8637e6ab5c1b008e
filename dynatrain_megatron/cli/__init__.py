"""The `dynatrain` command: one subcommand per module of this package.

Each module in `SUBCOMMANDS` has `add_parser(subparsers)`, which adds its subcommand and
sets `func(args) -> exit code`. A module that cannot be imported is an error of the
whole command (it names the module), never a subcommand that silently disappears.
Registering a subcommand is one line in `SUBCOMMANDS`.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from ..vps.errors import DynatrainError
from .common import Parser, version_line

SUBCOMMANDS = (
    "dynatrain_megatron.cli.layout",
    "dynatrain_megatron.cli.lost",
    "dynatrain_megatron.cli.plan",
    "dynatrain_megatron.cli.request",
    "dynatrain_megatron.cli.join",
    "dynatrain_megatron.cli.launch",
    "dynatrain_megatron.cli.bench_switch",
    "dynatrain_megatron.cli.megatron_lm",
    "dynatrain_megatron.cli.suggest",
)


def build_parser(modules: Sequence[str] = SUBCOMMANDS) -> argparse.ArgumentParser:
    """The parser of every subcommand in `modules` (import errors propagate)."""
    p = Parser(prog="dynatrain",
               description="Switch the parallel layout of a running Megatron-LM job in "
                           "memory: patch Megatron-LM, ask a job to switch, plan and choose "
                           "layouts, launch a job whose survivors outlive a dead rank.",
               epilog="start here: dynatrain megatron-lm patch --help, dynatrain request "
                      "--help; every subcommand's --help ends with examples")
    p.add_argument("--version", action="version", version=version_line(),
                   help="print the version (and torch's, megatron-core's) and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in modules:
        importlib.import_module(name).add_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one subcommand; a `DynatrainError` becomes one line on stderr and exit code 2."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DynatrainError as e:
        print(f"dynatrain {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dynatrain {args.command}: interrupted", file=sys.stderr)
        return 130


def one_line(e: BaseException) -> str:
    """An error's message on one line (a multi-line message is joined with "; ")."""
    parts = [s.strip() for s in str(e).splitlines() if s.strip()]
    return "; ".join(parts) or type(e).__name__


__all__ = ["SUBCOMMANDS", "build_parser", "main"]
