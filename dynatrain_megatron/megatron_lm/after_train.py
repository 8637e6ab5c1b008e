"""A peer's death in what Megatron-LM's `pretrain()` runs after `train()` returned: its final
`--save` (`save_checkpoint_and_time`, when the last iteration is not a multiple of
`--save-interval`), its final validation and test (`evaluate_and_print_results`).

Those calls come after the last step completed on every rank (the step guard's closing
vote, `step_guard.py`): the survivors' memory holds the job's final state. So a dead peer's
failure there is recovered like one at a step boundary (`rank_death.recover_after_train`):
where every shard of the dead ranks has a replica (several distributed-optimizer
instances), the survivors re-form the world in memory at a layout that fits them, and the
failed call runs again at that layout, followed by the rest of `pretrain()`'s calls (each
given the survivors' model, optimizer, scheduler, config and data iterators instead of the
broken layout's, which `pretrain()`'s locals still name). A survivor the new layout does
not need leaves with status 0. Where the state had no replica, the final state is gone:
the survivors cannot redo the training since the last `--save` outside `train()`, so each
ends with one line naming the last complete checkpoint and status 1 (Megatron-LM's tracker
file still names it: the interrupted save is never loaded). A failure that is not a dead
peer's is Megatron-LM's own error. Each call the survivors complete after such a recovery
tells the launcher again that the job completed (`loop.launch`: a worker that reported
completion and then died does not fail a job its survivors finished).

Installed by `seam.finish` in `megatron.training.training` (`pretrain()` looks the names up
at each call); the fault points "save" and "eval" of the last iteration (`DYNATRAIN_FAULTS`)
fire in these calls.
"""
from __future__ import annotations

import functools
import inspect
import logging
import sys
from types import ModuleType
from typing import Any, Callable, Optional

from ..loop.launch import report_completed
from ..vps.errors import DynatrainError
from .call_objects import drop_objects, substitute

log = logging.getLogger("dynatrain")

_WRAPPED = "_dynatrain_after_train"
_PHASES = {"save_checkpoint_and_time": "save", "evaluate_and_print_results": "eval"}


class AfterTrain:
    """The wrappers of `pretrain()`'s calls after `train()` (module doc). `recover(iteration,
    failure, checkpointing_context)`: the survivors' objects (`LoopObjects`) after a dead
    peer's `failure` (the context: the failed call's, None when it has none);
    `failure_of(error)`: a dead peer's failure as text (anything else re-raised);
    `fault(phase, iteration)`: the fault points."""

    def __init__(self, recover: Callable[[int, str, Optional[dict]], Any],
                 failure_of: Callable[[BaseException], str],
                 fault: Callable[[str, int], None]) -> None:
        self._recover = recover
        self._failure_of = failure_of
        self._fault = fault
        self.objs: Any = None  # the survivors' LoopObjects after a recovery here
        self._module: Optional[ModuleType] = None
        self._originals: dict[str, Callable] = {}

    def install(self, module: ModuleType) -> None:
        self._module = module
        for name in _PHASES:
            inner = getattr(module, name, None)
            if inner is None or getattr(inner, _WRAPPED, False):
                continue
            self._originals[name] = inner
            setattr(module, name, self._wrap(name, inner))

    def remove(self) -> None:
        if self._module is not None:
            for name, inner in self._originals.items():
                setattr(self._module, name, inner)
        self._originals.clear()
        self._module = None

    def _wrap(self, name: str, inner: Callable) -> Callable:
        signature = inspect.signature(inner)

        @functools.wraps(inner)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            args = kwargs = None  # noqa: F841 - the broken layout's objects are let go
            iteration = bound.arguments.get("iteration")
            if isinstance(iteration, int):
                self._fault(_PHASES[name], iteration)
            while True:
                if self.objs is not None:
                    substitute(bound, self.objs)
                try:
                    out = inner(*bound.args, **bound.kwargs)
                except Exception as error:  # noqa: BLE001 - recovered or re-raised
                    failure = self._failure_of(error)
                else:
                    if self.objs is not None:  # the survivors did it: the job completes
                        report_completed()
                    return out
                log.warning("dynatrain: a peer died during Megatron-LM's %s after train() "
                            "(%s): recovering, then running it again", name, failure[:200])
                drop_objects(bound)
                try:
                    self.objs = self._recover(iteration, failure,
                                              bound.arguments.get("checkpointing_context"))
                except DynatrainError as e:
                    log.error("dynatrain: %s", e)
                    sys.stdout.flush()
                    raise SystemExit(1) from None
                if self.objs.stop:  # a survivor kept on standby: the layout's ranks go on
                    log.info("dynatrain: on standby after the recovery at the job's end: "
                             "this process ends")
                    sys.stdout.flush()
                    raise SystemExit(0)

        setattr(call, _WRAPPED, True)
        return call


__all__ = ("AfterTrain",)
