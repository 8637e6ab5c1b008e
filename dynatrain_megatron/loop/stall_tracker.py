"""The hook's bookkeeping of stalls (loop/stall.py): the parts timed at the current step
boundary, the switch being measured through B's first steps, and the report once known.

A step boundary opens a window (`boundary`); parts are added as they run (`lap`). When a
switch commits, `begin` turns the window into a `StallMeter`; at each later boundary
`step` counts B's steps, and once the first and the steady ones are known, or the job moves
on (another switch, growth, the end), `finish` shares every rank's breakdown over B's
ranks and reports it (`switch_log.share_and_report`). A's memory collection, deferred by
the switch, runs there too (a full collection holds the interpreter lock: no thread could
take it out of the training thread's way). Python's automatic collections wait as well,
from the start of the switch until then: one that started in B's first step would scan
A's remains and B's new objects there, in the stall, and that deferred collection does
their work anyway (a job that turned the collector off itself keeps it off).
"""
from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, Iterator, Optional

import torch.distributed as dist

from ..safe_files import OutputDir
from ..mcore.session import collect_released
from .gc_clock import gc_seconds
from .stall import StallMeter, minor_faults, stall_parts
from .switch_log import SwitchLog, SwitchRecord, share_and_report


class StallTracker:
    """One per hook. A host loop uses `switch_meter` (its own parts, `resume()` before B's
    first step), `on_return_from_standby` (called on a standby rank when the switch that
    brings it back starts: its iteration timer restarts) and `step_clock` (its training
    clock, which stops for evaluation and checkpoint saves: B's steps are timed on it)."""

    def __init__(self, outputs: Optional[OutputDir]) -> None:
        self.report = SwitchLog(outputs)
        self.stalls: list[dict] = []  # every finished switch's stall (all ranks')
        self.on_return_from_standby: list[Callable[[], None]] = []
        self.step_clock: Callable[[], float] = time.perf_counter
        self.collect_pending = False  # A's memory is to be collected (`finish`)
        # the rest of A's release that waits for B's measured steps (`defer`)
        self._deferred: list[Callable[[], None]] = []
        gc_seconds()  # the collector's clock runs from the start (B's first step vs steady)
        self._meter: Optional[StallMeter] = None
        self._measured: Optional[tuple[SwitchRecord, dict]] = None
        self._gc_paused = False  # automatic collections held off by this tracker
        self.boundary()

    @property
    def measuring(self) -> bool:
        return self._measured is not None

    @property
    def switch_meter(self) -> Optional[StallMeter]:
        """The meter of the switch just made (else None)."""
        return self._meter if self._meter is not None and not self._meter.steps else None

    def boundary(self) -> None:
        """A step boundary starts: the end of the last step, the start of a window."""
        self.entered, self.entered_wall, self.laps = time.perf_counter(), time.time(), {}

    def enter_from_standby(self) -> None:
        """A standby rank's switch starts now: so do its window and the host's timers."""
        self.boundary()
        for callback in self.on_return_from_standby:
            callback()

    def lap(self, name: str, since: float) -> float:
        """Add the time since `since` to this window's part `name`; returns now."""
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - since
        return now

    def next_step_boundary(self) -> None:
        """The hook is entered after a step: count B's step if a switch is being measured
        and report its stall once known (collective over B's ranks, at the same step),
        then open this boundary's window."""
        if self._meter is not None and self._meter.step():
            self.finish()
        self.boundary()

    def left(self) -> None:
        """The hook returns to the training loop: the next step starts."""
        if self._meter is not None:
            self._meter.left()
        self.attempt_ended()

    def attempt_ended(self) -> None:
        """A switch attempt returned: unless a committed switch is being measured on this
        rank, automatic collections go on (it rolled back, failed, or left this rank on
        standby, where a long wait must not grow memory)."""
        if self._measured is None:
            self._resume_gc()

    def _pause_gc(self) -> None:
        if gc.isenabled():
            gc.disable()
            self._gc_paused = True

    def _resume_gc(self) -> None:
        if self._gc_paused:
            self._gc_paused = False
            gc.enable()

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """Around a switch attempt: `before_switch` on entry, `attempt_ended` on every exit
        (automatic collections resume unless a committed switch is being measured)."""
        self.before_switch()
        try:
            yield
        finally:
            self.attempt_ended()

    def before_switch(self) -> None:
        """A switch starts before the last one was measured: report that one now, inside
        this window (A's deferred collection as `release_a`, the rest as `controller`)."""
        if self._measured is not None:
            t0 = time.perf_counter()
            self.laps["release_a"] = self.finish()
            self.lap("controller", t0 + self.laps["release_a"])
        self._pause_gc()  # until B's first steps are measured (module doc)

    def begin(self, rec: SwitchRecord, phases: dict, timings: dict, extra: dict) -> None:
        """The switch `rec` committed on this rank (which is in B): measure its stall from
        this window's start; `extra`: what its report needs (`share_and_report`)."""
        self._meter = StallMeter(rec.iteration, dist.get_rank(), rec.src, rec.dst,
                                 started=self.entered, wall_start=self.entered_wall,
                                 clock=self.step_clock, gc_clock=gc_seconds,
                                 fault_clock=minor_faults)
        self._meter.add_all(self.laps, stall_parts(phases, timings))
        self._meter.resume()
        self._measured = (rec, extra)

    def defer(self, release: Callable[[], None]) -> None:
        """Run `release`, a part of A's release that can wait, once the switch being
        measured is reported or dropped: not beside the switch's last agreement and B's
        first steps. At once when no switch is being measured."""
        if self._measured is None:
            release()
        else:
            self._deferred.append(release)

    def drop(self, broken: bool = False) -> None:
        """Forget the switch being measured (its ranks cannot share it any more) and run
        what was deferred to its end (`defer`). `broken`: a rank died; what A's release
        left to the deferred collection (its groups among it) is freed now, its
        communicators aborted."""
        self._meter = self._measured = None
        deferred, self._deferred = self._deferred, []
        for release in deferred:
            release()
        if broken and self.collect_pending:
            self.collect_pending = False
            collect_released(broken=True)
        self._resume_gc()

    def finish(self) -> float:
        """Report the switch being measured (collective over its B's ranks); returns the
        seconds of A's deferred collection, run here."""
        meter, measured = self._meter, self._measured
        self.drop()
        if meter is None or measured is None:
            return 0.0
        mine = meter.finish()
        t0 = time.perf_counter()
        if self.collect_pending:
            self.collect_pending = False
            collect_released()
        self._resume_gc()
        deferred = measured[1]["release_a_deferred_s"] = time.perf_counter() - t0
        self.stalls.append(share_and_report(self.report, measured[0], measured[1], mine))
        return deferred


__all__ = ["StallTracker"]
