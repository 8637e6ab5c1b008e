"""The stall of a switch: the wall time the job loses to it, and where every part went.

On one rank the stall is the wall time from the end of its last step at layout A (the step
hook is entered) to the start of its first step at layout B (the training loop has its
objects back), plus the extra time of that first step over a steady step at B (cold
communicators, kernels, data workers starting). It is what the iteration-time line of the
switching iteration shows over the steady ones at B. The job's stall is the slowest
rank's: every rank waits for it at B's first collective.

`StallMeter` records the parts as the switch runs (`add`), the moment training resumes
(`resume`) and the step times that follow (`step`); once enough steady steps are seen it
gives a frozen `StallBreakdown`. Every part is timed on its own; what the parts leave of
the measured window is `unaccounted_s`, which stays a few percent of the stall when the
accounting is complete (tests assert it).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..vps.errors import DynatrainError

# every part a stall can have, in the order the switch runs them
PART_NAMES = (
    "controller",      # the poll's broadcast, filing the outcome, the last switch's report
    "memory_check",    # a switch whose memory plan runs at the decision step
    "wait_for_b",      # a scheduled switch waiting for B's background preparation (one vote)
    "placement",       # choosing B's placement (background unless B is built in the pause)
    "groups",          # B's process groups (background unless built in the pause)
    "build",           # B's objects (background unless built in the pause)
    "plan",            # the transition plan and this rank's views (same)
    "warm_up",         # collecting the background work and B's communicators (NCCL)
    "bind",            # binding and checking A's live state
    "votes",           # the switch's agreements (prepared everywhere, arrived everywhere)
    "transfer",        # the data movement, checksums included
    "objects",         # sharded objects (`_extra_state`) read at A, exchanged, set on B
    "scalars",         # optimizer step, scheduler, scaler, iteration, consumed samples
    "rebuild",         # B made current, weights rebuilt from the fp32 masters
    "release_a",       # A's objects and groups freed
    "rebind",          # the training loop takes B's objects (args, callbacks, groups)
    "data_iterators",  # B's data iterators at the consumed-sample count
    "first_step",      # the first step at B over a steady one
)
STEADY_STEPS = 3  # steady steps at B whose median is the reference for the first one


class StallError(DynatrainError, ValueError):
    """A stall breakdown that does not add up (bad part names or times)."""


@dataclass(frozen=True, slots=True)
class StallBreakdown:
    """One rank's stall for one switch.

    `window_s`: end of the last step at A to the start of the first step at B;
    `parts`: (name, seconds) in `PART_NAMES` order, the window's parts and `first_step`;
    `first_step_s` / `steady_step_s`: the first step at B and the median of the steady
    ones after it (None when the job ended or switched again before they were seen)."""

    iteration: int
    rank: int
    src: str
    dst: str
    window_s: float
    parts: tuple[tuple[str, float], ...]
    first_step_s: Optional[float] = None
    steady_step_s: Optional[float] = None
    wall_start: float = 0.0  # time.time() when the window began
    # seconds Python's garbage collector ran in the first step at B / in a steady one
    first_step_gc_s: Optional[float] = None
    steady_step_gc_s: Optional[float] = None
    # minor page faults of the process in the first step at B / in a steady one (memory
    # the first step touches for the first time: on the CPU, the activations B needs beyond
    # what A's steps left in the allocator)
    first_step_faults: Optional[int] = None
    steady_step_faults: Optional[int] = None

    def __post_init__(self) -> None:
        errs = []
        names = [n for n, _ in self.parts]
        unknown = [n for n in names if n not in PART_NAMES]
        if unknown:
            errs.append(f"unknown parts {unknown} (known: {PART_NAMES})")
        elif names != sorted(set(names), key=PART_NAMES.index):
            errs.append(f"parts must be unique and in PART_NAMES order, got {names}")
        bad = [(n, v) for n, v in self.parts if not (isinstance(v, float) and math.isfinite(v)
                                                     and v >= 0)]
        if bad:
            errs.append(f"part times must be finite non-negative floats, got {bad}")
        for what, v in (("window_s", self.window_s), ("first_step_s", self.first_step_s),
                        ("steady_step_s", self.steady_step_s),
                        ("first_step_gc_s", self.first_step_gc_s),
                        ("steady_step_gc_s", self.steady_step_gc_s)):
            if v is not None and not (math.isfinite(v) and v >= 0):
                errs.append(f"{what} must be finite and non-negative, got {v!r}")
        for what, n in (("first_step_faults", self.first_step_faults),
                        ("steady_step_faults", self.steady_step_faults)):
            if n is not None and not (isinstance(n, int) and n >= 0):
                errs.append(f"{what} must be a non-negative int, got {n!r}")
        if self.iteration < 0 or self.rank < 0:
            errs.append(f"iteration and rank must be non-negative, got {self.iteration}, "
                        f"{self.rank}")
        if errs:
            raise StallError(f"stall breakdown of rank {self.rank} at iteration "
                             f"{self.iteration}: " + "; ".join(errs))

    @property
    def first_step_extra_s(self) -> float:
        """The first step at B over a steady step (0 when unknown or faster)."""
        if self.first_step_s is None or self.steady_step_s is None:
            return 0.0
        return max(0.0, self.first_step_s - self.steady_step_s)

    @property
    def stall_s(self) -> float:
        return self.window_s + self.first_step_extra_s

    @property
    def accounted_s(self) -> float:
        return sum(v for _, v in self.parts)

    @property
    def unaccounted_s(self) -> float:
        """The stall no part explains (timer overheads, logging; small when complete)."""
        return self.stall_s - self.accounted_s

    def part(self, name: str) -> float:
        return dict(self.parts).get(name, 0.0)

    def as_dict(self) -> dict:
        return dict(iteration=self.iteration, rank=self.rank, src=self.src, dst=self.dst,
                    stall_s=round(self.stall_s, 6), window_s=round(self.window_s, 6),
                    parts={n: round(v, 6) for n, v in self.parts},
                    unaccounted_s=round(self.unaccounted_s, 6),
                    first_step_s=_r(self.first_step_s), steady_step_s=_r(self.steady_step_s),
                    first_step_gc_s=_r(self.first_step_gc_s),
                    steady_step_gc_s=_r(self.steady_step_gc_s),
                    first_step_faults=self.first_step_faults,
                    steady_step_faults=self.steady_step_faults, wall_start=self.wall_start)

    def __str__(self) -> str:
        shown = ", ".join(f"{n} {v:.3f}" for n, v in self.parts if v >= 0.0005)
        return f"stall {self.stall_s:.3f} s [{shown}; other {self.unaccounted_s:.3f}]"


def _r(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v, 6)


def slowest(breakdowns: list[StallBreakdown]) -> StallBreakdown:
    """The rank whose stall the job paid (every rank waits for it at B's first step)."""
    if not breakdowns:
        raise StallError("no stall breakdowns to choose the slowest of")
    return max(breakdowns, key=lambda b: (b.stall_s, -b.rank))


@dataclass
class StallMeter:
    """Collects one rank's stall while the switch runs and the steps after it.

    `add(name, seconds)` adds to a part (repeatable); `resume()` marks the start of the
    first step at B (the training loop has its objects); `step()` is called at each later
    step boundary and returns True once the first step and `STEADY_STEPS` steady ones are
    known; `left()` when the hook returns to the loop. Steps are timed on `clock`, the
    host's training clock (Megatron-LM's iteration timer, which stops for evaluation and
    checkpoint saves); the window on `time.perf_counter`."""

    iteration: int
    rank: int
    src: str
    dst: str
    started: float  # time.perf_counter() at the end of the last step at A
    wall_start: float = field(default_factory=time.time)
    parts: dict[str, float] = field(default_factory=dict)
    resumed: Optional[float] = None
    steps: list[float] = field(default_factory=list)
    clock: Callable[[], float] = time.perf_counter
    # cumulative seconds in garbage collection (gc_clock.gc_seconds); per step in `gc`
    gc_clock: Optional[Callable[[], float]] = None
    gc: list[float] = field(default_factory=list)
    # cumulative minor page faults (`minor_faults`); per step in `faults`
    fault_clock: Optional[Callable[[], int]] = None
    faults: list[int] = field(default_factory=list)
    _last: Optional[float] = None
    _last_gc: Optional[float] = None
    _last_faults: Optional[int] = None

    def add(self, name: str, seconds: float) -> None:
        if name not in PART_NAMES:
            raise StallError(f"unknown stall part {name!r} (known: {PART_NAMES})")
        self.parts[name] = self.parts.get(name, 0.0) + max(0.0, float(seconds))

    def add_all(self, *parts: dict) -> None:
        for p in parts:
            for name, seconds in p.items():
                self.add(name, seconds)

    def resume(self, now: Optional[float] = None) -> None:
        """Training goes on at B from now (called again by a host loop that does more
        before its first step: the latest call counts)."""
        self.resumed = time.perf_counter() if now is None else now
        self._mark(now)

    def _mark(self, now: Optional[float]) -> None:
        self._last = self.clock() if now is None else now
        self._last_gc = self.gc_clock() if self.gc_clock is not None else None
        self._last_faults = self.fault_clock() if self.fault_clock is not None else None

    def step(self, now: Optional[float] = None) -> bool:
        """A step boundary after the switch: the step lasted from the previous boundary's
        return (`left`) to now, on the training clock."""
        now = self.clock() if now is None else now
        if self._last is not None:
            self.steps.append(max(0.0, now - self._last))
            if self._last_gc is not None and self.gc_clock is not None:
                self.gc.append(max(0.0, self.gc_clock() - self._last_gc))
            if self._last_faults is not None and self.fault_clock is not None:
                self.faults.append(max(0, self.fault_clock() - self._last_faults))
        return len(self.steps) > STEADY_STEPS

    def left(self, now: Optional[float] = None) -> None:
        """The hook returns to the training loop (the next step starts)."""
        self._mark(now)

    def finish(self) -> StallBreakdown:
        resumed = self.resumed if self.resumed is not None else time.perf_counter()
        first = self.steps[0] if self.steps else None
        steady = statistics.median(self.steps[1:1 + STEADY_STEPS]) if len(self.steps) > 1 \
            else None
        extra = (max(0.0, first - steady) if first is not None and steady is not None
                 else None)
        parts = {**self.parts, **({"first_step": extra} if extra is not None else {})}
        return StallBreakdown(
            iteration=self.iteration, rank=self.rank, src=self.src, dst=self.dst,
            window_s=max(0.0, resumed - self.started),
            parts=tuple((n, float(parts[n])) for n in PART_NAMES if n in parts),
            first_step_s=first, steady_step_s=steady, wall_start=self.wall_start,
            first_step_gc_s=self.gc[0] if self.gc else None,
            steady_step_gc_s=statistics.median(self.gc[1:1 + STEADY_STEPS])
            if len(self.gc) > 1 else None,
            first_step_faults=self.faults[0] if self.faults else None,
            steady_step_faults=int(statistics.median_low(self.faults[1:1 + STEADY_STEPS]))
            if len(self.faults) > 1 else None)


def minor_faults() -> int:
    """This process's minor page faults so far (first touches of memory, copy-on-write)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


# the switch's phases (transition.switch) and switch_trainer's timings, as stall parts
_PHASE_PARTS = {"placement": "placement", "groups": "groups", "build": "build",
                "bind": "bind", "verify": "bind", "bind_src": "bind", "plan": "plan",
                "views": "plan", "vote": "votes", "transfer": "transfer", "objects": "objects",
                "sync": "scalars", "rebuild": "rebuild", "scalars": "scalars",
                "release_a": "release_a", "rebind": "rebind"}


def stall_parts(*timings: dict) -> dict[str, float]:
    """Sum timings by the stall part they belong to (unknown names: a bug of ours)."""
    out: dict[str, float] = {}
    for t in timings:
        for name, v in t.items():
            part = _PHASE_PARTS[name]
            out[part] = out.get(part, 0.0) + v
    return out


__all__ = ["PART_NAMES", "STEADY_STEPS", "StallBreakdown", "StallError", "StallMeter",
           "slowest", "stall_parts"]
