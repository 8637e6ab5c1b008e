"""How the job's dynatrain lines look and who prints them.

One logger, "dynatrain", for the whole package. A line about the job as a whole (a request,
a switch with its stall, the end-of-run summary) is marked `extra=ONCE` and printed by rank
0 alone: one line per switch, not one per rank; every rank prints its own state (standby,
recovery) and its warnings and errors. `--dynatrain-log-all-ranks` (debugging) makes every
rank print the ONCE lines too. Lines go to
stdout beside the host's own, as `[time rank] dynatrain: message`, once: the logger does
not propagate to the root logger a host may have configured too.
"""
from __future__ import annotations

import logging
import sys

NAME = "dynatrain"
_PREFIX = f"{NAME}: "
ONCE = {"dynatrain_once": True}  # `log.info(..., extra=ONCE)`: rank 0 prints it


class _OnceFilter(logging.Filter):
    """Drops the lines marked ONCE below WARNING on a rank other than 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not getattr(record, "dynatrain_once", False)


class _Formatter(logging.Formatter):
    """`[time rN] dynatrain: message`, without doubling a prefix a message already has."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"[%(asctime)s r{rank}] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")

    def formatMessage(self, record: logging.LogRecord) -> str:
        msg = record.message
        if not msg.startswith(_PREFIX):
            record.message = _PREFIX + msg
        try:
            return super().formatMessage(record)
        finally:
            record.message = msg


def configure(rank: int, all_ranks: bool = False) -> logging.Logger:
    """Set up the "dynatrain" logger for this process (idempotent)."""
    logger = logging.getLogger(NAME)
    logger.setLevel(logging.INFO)
    for h in list(logger.handlers):
        if getattr(h, "_dynatrain", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout)
    handler._dynatrain = True  # type: ignore[attr-defined]
    handler.setFormatter(_Formatter(rank))
    if rank != 0 and not all_ranks:
        handler.addFilter(_OnceFilter())
    logger.addHandler(handler)
    logger.propagate = False
    return logger


__all__ = ["NAME", "ONCE", "configure"]
