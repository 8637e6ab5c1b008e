"""How many iterations ahead a scheduled switch is decided, so that B is ready when due.

A scheduled switch must land exactly after its iteration; B is prepared in the background
from the moment the entry is decided. Decided one iteration ahead, a preparation that takes
longer than one step leaves the job waiting for B at the landing iteration (`wait_for_b`
in the stall). The lead here is the preparation's expected time over the job's step time,
with a margin:

* the preparation's time: the last one measured on this rank (placement, groups, B's
  objects, binding and plan), else, before any, this process's age at its first step
  boundary (imports, initialisation, building A and its data iterators: an upper bound of
  building B, which skips the imports and the initialisation);
* the step time: the median of the last steps' wall times between step boundaries.

Only rank 0 decides (the decision is broadcast with the entry), so ranks need not agree on
their figures. Deciding earlier holds B's memory longer while A trains (the memory check
counts B either way); the lead is capped at `max_lead` iterations.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from typing import Any, Optional

MARGIN = 1.5  # measured preparation time x this
MAX_LEAD = 50


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux `/proc`); None where unknown."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22: starttime, in clock ticks since boot
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class ScheduleLead:
    """Rank 0's estimate of the iterations a scheduled switch is decided ahead.

    `step_boundary()` at every step boundary (not across a switch: `switched()`),
    `prepared(seconds)` with each preparation's measured time; `lead()` the iterations."""

    def __init__(self, minimum: int = 1, max_lead: int = MAX_LEAD,
                 start_estimate_s: Optional[float] = None) -> None:
        if not 0 <= minimum <= max_lead:
            raise ValueError(f"schedule lead: need 0 <= minimum <= max_lead, got "
                             f"{minimum}, {max_lead}")
        self.minimum, self.max_lead = minimum, max_lead
        self._start_estimate = start_estimate_s
        self._prepare_s: Optional[float] = None
        self._steps: deque[float] = deque(maxlen=8)
        self._last: Optional[float] = None

    def step_boundary(self, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last is None and self._start_estimate is None:
            self._start_estimate = process_age_s()
        if self._last is not None:
            self._steps.append(now - self._last)
        self._last = now

    def switched(self, devices: Any = None) -> None:
        """A switch landed: the step across it is not a steady step (timing starts afresh);
        `devices`: the `DeviceManager` that prepared B in the background (None: B was
        built in the pause), whose placement, groups and preparation times it measured."""
        self._last = None
        if devices is not None:
            self.prepared(sum(getattr(devices, n, 0.0) for n in
                              ("placement_seconds", "build_seconds", "prepare_seconds")))

    def prepared(self, seconds: float) -> None:
        if seconds >= 0 and math.isfinite(seconds):
            self._prepare_s = seconds * MARGIN

    def lead(self) -> int:
        expected = self._prepare_s if self._prepare_s is not None else self._start_estimate
        if expected is None:
            return self.minimum
        if not self._steps:  # the job's first boundary: no step time yet, decide what is near
            return self.max_lead
        step = statistics.median(self._steps)
        if step <= 0:
            return self.max_lead
        return max(self.minimum, min(self.max_lead, math.ceil(expected / step)))


__all__ = ("ScheduleLead", "process_age_s", "MARGIN", "MAX_LEAD")
