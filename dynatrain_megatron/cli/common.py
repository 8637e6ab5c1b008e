"""What every `dynatrain` subcommand shares: the parser class (one-line errors), argument
types that refuse what would fail later (zero, NaN, a port out of range), examples in the
help, and flags that were renamed (refused with the new name)."""
from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, NoReturn, Sequence


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line on stderr, exit status 2.

    argparse's own error prints the usage first; the one line names the flag and points at
    `--help`, which holds the usage and an example."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def subcommand(sub, name: str, *, help: str, examples: Sequence[str],
               description: str | None = None) -> argparse.ArgumentParser:
    """Add subcommand `name` with its one-line `help` and `examples` (shown by `--help`)."""
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    return sub.add_parser(name, help=help, description=description or help, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


# the most devices a command takes (a world, ranks per node): 2^20, as the signal file
MAX_DEVICES = 1 << 20
# any other count: what numpy's int64 arithmetic holds without overflow
MAX_INT = 1 << 62


def int_at_least(low: int, high: int = MAX_INT) -> Callable[[str], int]:
    """An argparse type: an integer in `low..high`."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        if v > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:,}, got {text[:24]}")
        return v

    parse.__name__ = f"integer >= {low}"  # argparse names the type in its message
    return parse


def finite_float(low: float = 0.0, *, inclusive: bool = False,
                 high: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite number above `low` (or equal, when `inclusive`), at most
    `high`. NaN and infinity are refused: they pass every comparison's check silently."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if v < low or (v == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low:g}, "
                                             f"got {text}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text}")
        return v

    parse.__name__ = "number"
    return parse


def renamed(parser: argparse.ArgumentParser, old: str, new: str, why: str = "") -> None:
    """Refuse the old spelling `old` of flag `new` with one line naming the new one.

    Hidden from `--help`; it takes the old flag's value so that the error, not argparse's
    "unrecognized arguments", is what the user reads."""

    class Refuse(argparse.Action):
        def __call__(self, p, namespace, values, option_string=None) -> NoReturn:
            p.error(f"{old} was renamed {new}" + (f" ({why})" if why else ""))

    parser.add_argument(old, action=Refuse, nargs="?", help=argparse.SUPPRESS)


def version_line() -> str:
    """`dynatrain X.Y.Z (torch A, megatron-core B, Python C)`: what a bug report needs."""
    from importlib import metadata

    from .. import __version__

    def ver(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    py = ".".join(map(str, sys.version_info[:3]))
    return (f"dynatrain {__version__} (torch {ver('torch')}, megatron-core "
            f"{ver('megatron-core')}, Python {py})")


def devices(low: int = 1) -> Callable[[str], int]:
    """An argparse type: a number of devices (ranks), `low..MAX_DEVICES`."""
    return int_at_least(low, MAX_DEVICES)


__all__ = ["MAX_DEVICES", "Parser", "devices", "finite_float", "int_at_least", "renamed", "subcommand", "version_line"]
