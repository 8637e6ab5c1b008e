"""A peer that dies in Megatron-LM's start-up (after `--dynatrain` was parsed: while the
process groups, model, optimizer, checkpoint and data iterators are made, before the
training loop): there is no training state yet to recover from (the loop's start is the
first step boundary, `seam.LoopSeam.guard`), so every survivor ends, and says why in one
line instead of a traceback: the uncaught error, when it is a dead peer's, goes through
this `sys.excepthook` (status 1, as for any uncaught error); anything else is reported as
before.
"""
from __future__ import annotations

import sys
from typing import Any


class StartupDeath:
    """Installed once `--dynatrain` is parsed (`arguments.refuse_when_parsed`), removed
    when the training loop starts (`seam.LoopSeam`): module doc."""

    previous = None

    @classmethod
    def install(cls) -> None:
        if cls.previous is None:
            cls.previous = sys.excepthook
            sys.excepthook = cls.hook

    @classmethod
    def remove(cls) -> None:
        if cls.previous is not None:
            sys.excepthook, cls.previous = cls.previous, None

    @staticmethod
    def hook(kind: type, error: BaseException, tb: Any) -> None:
        from ..loop.switching import is_dead_peer

        previous = StartupDeath.previous or sys.__excepthook__
        if not isinstance(error, Exception) or not is_dead_peer(error):
            previous(kind, error, tb)
            return
        first = str(error).splitlines()[0][:200] if str(error) else kind.__name__
        print(f"dynatrain: a peer died during Megatron-LM's start-up, before the training "
              f"loop ({first}): there is no training state to recover yet; the job ends: "
              f"restart it", file=sys.stderr, flush=True)


__all__ = ("StartupDeath",)
