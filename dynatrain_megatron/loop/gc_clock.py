"""The seconds Python's cyclic garbage collector has run in this process.

A switch leaves many objects behind (A's model, optimizer and groups, held in reference
cycles) and creates as many (B's). A full automatic collection that starts in B's first
step scans all of them, and every object of torch and megatron-core too, holding the
interpreter lock; it shows as a slow first step. `gc_seconds()` lets the stall say how
much of B's first step (and of a steady one) went to the collector
(`stall.StallMeter`). The callback is installed once per process, at the first call.
"""
from __future__ import annotations

import gc
import threading
import time

_lock = threading.Lock()
_state = {"installed": False, "total": 0.0, "started": None}


def _callback(phase: str, info: dict) -> None:
    if phase == "start":
        _state["started"] = time.perf_counter()
    elif phase == "stop" and _state["started"] is not None:
        _state["total"] += time.perf_counter() - _state["started"]
        _state["started"] = None


def gc_seconds() -> float:
    """Seconds spent in garbage collections since the first call (collections run with
    the interpreter lock held, one at a time)."""
    if not _state["installed"]:
        with _lock:
            if not _state["installed"]:
                gc.callbacks.append(_callback)
                _state["installed"] = True
    return _state["total"]


__all__ = ("gc_seconds",)
