"""Byte sizes and durations as people write and read them (CLI arguments, reports)."""
from __future__ import annotations

import argparse
import re
from typing import Optional

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.I)


def parse_bytes(text: str) -> int:
    """`1073741824`, `512M`, `2GiB`, `1.5GB` (k/M/G/T: powers of 1000; with i: 1024).

    Raises `argparse.ArgumentTypeError`, so it serves as an argparse `type=`."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2GiB, 512M)")
    num, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit == "b":
        mult = 1
    else:
        mult = (1024 if "i" in unit else 1000) ** ("kmgt".index(unit[0]) + 1)
    return int(num * mult)


def format_bytes(b: Optional[float]) -> str:
    """Bytes in decimal units (GB = 1e9 B), sized to stay readable for tiny models;
    "-" for None (a figure that was not measured)."""
    if b is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale or unit == "kB" and b:
            return f"{b / scale:,.2f} {unit}"
    return f"{int(b)} B"


def format_seconds(t: Optional[float]) -> str:
    """A duration in us, ms or s; "-" for None."""
    if t is None:
        return "-"
    if t < 1e-3:
        return f"{t * 1e6:,.1f} us"
    return f"{t * 1e3:,.1f} ms" if t < 1 else f"{t:,.2f} s"


__all__ = ["parse_bytes", "format_bytes", "format_seconds"]
