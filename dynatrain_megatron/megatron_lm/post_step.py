"""A peer's death first seen after `train_step` returned, in the rest of one of Megatron-LM's
iterations: its log line (`training_log`: the model-parallel reductions, the timers' barrier
and gathers, report_memory), an evaluation (`evaluate_and_print_results`), the post-step
callbacks, or `checkpoint_and_decide_exit` (a `--save`, the exit checks' reductions).

Those calls come after the step completed on every survivor: no rank leaves the optimizer
step before every rank finished its update (the step guard's closing vote,
`step_guard.py`). The training state in memory is then the new iteration's on every
survivor, as at a step boundary. So the failure is held, not raised: the failed call returns
what it returns when it has nothing to do, the iteration's remaining calls are skipped (they
would fail on the broken world; a `--save` started there could not complete), and
`LoopSeam.at_step_end` recovers at the boundary (`rank_death.recover_at_boundary`), as from
a death seen by the boundary's poll: in memory, or from the last complete `--save`. Where
the survivors recovered in memory at that iteration, its evaluation and its
`checkpoint_and_decide_exit` (the `--save` and the exit decision), failed or skipped, run
again at the survivors' layout right after the recovery (`replays`; with the survivors'
objects, `call_objects.py`; a `--save` that had completed is not made twice). From an older
checkpoint they are not: those iterations are trained again and their evaluation and save
come as scheduled. Lost either way: that iteration's log line, named in a warning. The loop's own barriers between those calls are its
timers' (`timers('interval-time').start(barrier=True)` after an evaluation): while a failure
is held, Megatron-LM's timers start and stop without their barrier. Only those timers are
hooked (megatron-core's `Timer` class), not `torch.distributed.barrier`: every other barrier
of the process, ours included (background threads, the controller), is torch's own. A
failure that is not a dead peer's is Megatron-LM's own error, raised as without dynatrain.

The wrappers replace those names in `megatron.training.training` for the loop's life
(`train()` looks them up at each call; the same names in every supported release) and are
removed when it ends (`seam.finish`; a death in the final save, validation or test after
`train()` is `after_train.py`'s). They also hold the fault points of
this part of an iteration (`DYNATRAIN_FAULTS` phases "log", "eval", "save": the rank dies as
that call starts, in the iteration the plan names).
"""
from __future__ import annotations

import functools
import inspect
import logging
from types import ModuleType
from typing import Any, Callable, Optional

from .call_objects import drop_objects

log = logging.getLogger("dynatrain")

_WRAPPED = "_dynatrain_post_step"

# Megatron-LM's call -> what it returns when it has nothing to do (from its bound arguments)
_IDLE: dict[str, Callable[[dict], Any]] = {
    "training_log": lambda a: a.get("report_memory_flag"),
    "evaluate_and_print_results": lambda a: None,
    "post_training_step_callbacks":
        lambda a: a.get("num_floating_point_operations_since_last_log_event"),
    "checkpoint_and_decide_exit": lambda a: False,
}
# the calls made again after an in-memory recovery at the iteration (module doc)
_REPLAYED = ("evaluate_and_print_results", "checkpoint_and_decide_exit")
# the fault point at the start of each call (`save_checkpoint_and_time`: only a fault point;
# its failures reach `checkpoint_and_decide_exit`'s wrapper, which calls it)
_FAULTS = {"training_log": "log", "evaluate_and_print_results": "eval",
           "save_checkpoint_and_time": "save"}


class PostStepGuard:
    """The wrappers of one `train()` loop (module doc). `fault(phase, iteration)`: the step
    guard's fault points; `failure_of(error)`: a dead peer's failure as text (anything else
    re-raised, `rank_death.failure_of`)."""

    def __init__(self, fault: Callable[[str, int], None],
                 failure_of: Callable[[BaseException], str]) -> None:
        self._fault = fault
        self._failure_of = failure_of
        self.pending: Optional[str] = None  # the held failure
        self.skipped: list[str] = []  # the calls skipped since
        # the failed or skipped calls to make again (`replays`), objects dropped
        self._replays: list[tuple[str, Callable, inspect.BoundArguments]] = []
        self._saved: Optional[int] = None  # the iteration whose --save last completed
        self._module: Optional[ModuleType] = None
        self._originals: dict[str, Callable] = {}
        self._timer_class: Optional[type] = None  # megatron-core's Timer, while wrapped
        self._timer_methods: dict[str, Callable] = {}

    def install(self, module: ModuleType, timer_class: Optional[type] = None) -> None:
        """Wrap the calls in `module` (Megatron-LM's `megatron.training.training`), and the
        barrier of Megatron-LM's timers (`timer_class`, default megatron-core's `Timer`):
        the loop's timers synchronise between those calls, which on the broken world,
        while a failure is held, is skipped (module doc)."""
        self._module = module
        for name in sorted(set(_IDLE) | set(_FAULTS)):
            inner = getattr(module, name, None)
            if inner is None or getattr(inner, _WRAPPED, False):
                continue
            self._originals[name] = inner
            setattr(module, name, self._wrap(name, inner))
        if timer_class is None:
            from megatron.core.timers import Timer as timer_class  # noqa: N813
        self._timer_class = timer_class
        for method in ("start", "stop"):
            inner = vars(timer_class).get(method)
            if inner is None or getattr(inner, _WRAPPED, False):
                continue
            self._timer_methods[method] = inner
            setattr(timer_class, method, self._timer_method(method, inner))

    def remove(self) -> None:
        """Put Megatron-LM's own functions and timer methods back."""
        if self._module is not None:
            for name, inner in self._originals.items():
                setattr(self._module, name, inner)
        if self._timer_class is not None:
            for method, inner in self._timer_methods.items():
                setattr(self._timer_class, method, inner)
        self._originals.clear()
        self._timer_methods.clear()
        self._module = self._timer_class = None

    def _timer_method(self, method: str, inner: Callable) -> Callable:
        """A timer's `start`/`stop(barrier=...)`: without its barrier while a failure is
        held (the timing itself unchanged)."""

        @functools.wraps(inner)
        def call(timer: Any, barrier: bool = False) -> Any:
            if barrier and self.pending is not None:
                self.skipped.append(f"a timer's barrier ({method})")
                barrier = False
            return inner(timer, barrier=barrier)

        setattr(call, _WRAPPED, True)
        return call

    def take(self) -> Optional[str]:
        """The held failure (None if none), cleared; the skipped calls are logged."""
        failure, self.pending = self.pending, None
        if failure is not None and self.skipped:
            log.warning("dynatrain: skipped after the failure, on the broken world: %s",
                        ", ".join(self.skipped))
        self.skipped = []
        return failure

    def replays(self, iteration: int) -> list[tuple[str, Callable, inspect.BoundArguments]]:
        """The calls of iteration `iteration` to make again after an in-memory recovery at
        it (module doc): (name, Megatron-LM's function, its arguments without the broken
        layout's objects), in the loop's order; cleared. A `checkpoint_and_decide_exit`
        whose `--save` had completed is left out (the checkpoint exists)."""
        out, self._replays = self._replays, []
        return [(n, f, b) for n, f, b in out if b.arguments.get("iteration") == iteration
                and not (n == "checkpoint_and_decide_exit" and self._saved == iteration)]

    def _wrap(self, name: str, inner: Callable) -> Callable:
        signature = inspect.signature(inner)
        idle, phase = _IDLE.get(name), _FAULTS.get(name)

        @functools.wraps(inner)
        def call(*args: Any, **kwargs: Any) -> Any:
            full = signature.bind_partial(*args, **kwargs)
            bound = full.arguments
            if self.pending is not None and idle is not None:
                self.skipped.append(name)
                self._keep(name, inner, full)
                return idle(bound)
            if phase is not None and isinstance(bound.get("iteration"), int):
                self._fault(phase, bound["iteration"])
            if idle is None:
                out = inner(*args, **kwargs)
                if name == "save_checkpoint_and_time":
                    self._saved = bound.get("iteration")
                return out
            try:
                return inner(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - held or re-raised
                failure = self._failure_of(error)
            self.pending = failure
            log.warning("dynatrain: a peer died during Megatron-LM's %s (%s): the step "
                        "completed on every survivor; recovering at the step boundary",
                        name, failure[:200])
            self._keep(name, inner, full)
            return idle(bound)

        setattr(call, _WRAPPED, True)
        return call

    def _keep(self, name: str, inner: Callable, bound: inspect.BoundArguments) -> None:
        if name in _REPLAYED:
            drop_objects(bound)
            self._replays.append((name, inner, bound))


__all__ = ("PostStepGuard",)
