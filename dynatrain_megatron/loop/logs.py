"""How the job's dynatrain lines look and who prints them.

One logger, "dynatrain", for the whole package. Rank 0 prints its INFO lines (one line per
switch, request or recovery) and warnings; the other ranks print only errors, unless the
job asks for every rank's lines (`--dynatrain-log-all-ranks`, for debugging). Lines go to
stdout beside the host's own, as `[time rank] dynatrain: message`, once: the logger does
not propagate to the root logger a host may have configured too.
"""
from __future__ import annotations

import logging
import sys

NAME = "dynatrain"
_PREFIX = f"{NAME}: "


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
    logger.setLevel(logging.INFO if rank == 0 or all_ranks else logging.ERROR)
    for h in list(logger.handlers):
        if getattr(h, "_dynatrain", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout)
    handler._dynatrain = True  # type: ignore[attr-defined]
    handler.setFormatter(_Formatter(rank))
    logger.addHandler(handler)
    logger.propagate = False
    return logger


__all__ = ["NAME", "configure"]
