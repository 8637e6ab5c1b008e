"""What a patched Megatron-LM calls, the same for every supported release.

Each release's patch (`patches/megatron-lm-<release>/`) only calls into this module, so
that the logic lives here once and a new release needs a new patch of a few lines, not a
port:

* `pretrain_gpt.py`, first lines: `compat.megatron_lm.prepare_megatron_lm()`; its argument
  parsing: `arguments.chain_extra_args_providers(...)` (our `--dynatrain*` flags).
* `pretrain()`, before `train()`: `start(provider)`, the start-up registration (the job is
  refused here, before its first step, when we could not switch it).
* `train()`, before its loop: `LoopSeam(args, checkpointing_context, ...)`; around its
  `train_step` call: `seam.guard(train_step)`, which hands a dead peer's failure to
  `rank_death` (anything else is re-raised) and recovers outside the exception handler;
  then, when `seam.recovered`, `seam.after_recovery(*LOOP_VALUES)` and `continue`; a death
  first seen in the rest of the iteration (its log line, evaluation, `--save`) is held by
  `post_step.py` (wrappers of those calls, no patch line) and recovered at the boundary;
  at the step boundary (after `checkpoint_and_decide_exit`): `seam.at_step_end(should_exit,
  *LOOP_VALUES)`, and `break` when `seam.stop`. Both return `LOOP_VALUES` rebound to the
  layout the job now runs at (the same objects when nothing changed).
* `pretrain()`, right after `train()` returns: `finish(...)` (the objects the loop ended with,
  for the final save, validation and test) and `left_out()` (a rank on standby at the end
  returns before them).

`LOOP_VALUES` is the same tuple in every release's `train()`: `iteration`,
`num_floating_point_operations_so_far`, `model`, `optimizer`, `opt_param_scheduler`,
`train_data_iterator`, `valid_data_iterator`, `config`, `forward_backward_func`,
`num_microbatches`, `model_pg_collection`.
"""
from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Any, Callable, NamedTuple, Optional

from ..vps.errors import DynatrainError
from . import adapter
from .adapter import LoopObjects
from .startup_death import StartupDeath

log = logging.getLogger("dynatrain")


class LoopValues(NamedTuple):
    """The locals of Megatron-LM's `train()` that a switch or a recovery replaces."""

    iteration: int
    num_floating_point_operations_so_far: float
    model: list
    optimizer: Any
    opt_param_scheduler: Any
    train_data_iterator: Any
    valid_data_iterator: Any
    config: Any
    forward_backward_func: Callable
    num_microbatches: int
    model_pg_collection: Any


def start(provider: Callable) -> None:
    """`pretrain()`, before `train()`: remember how the data iterators are built (a switch
    rebuilds them at the consumed sample) and refuse a job we could not switch, naming
    every flag, before its first step."""
    from ..compat.megatron_lm import release_refusals
    from megatron.training import get_args

    args = get_args()
    problems = release_refusals(args)
    if problems:
        raise DynatrainError("--dynatrain cannot switch this Megatron-LM job: "
                             + "; ".join(problems))
    adapter.register_dataset_provider(provider, args)
    StartupDeath.install()
    _fault_at_startup()


def _fault_at_startup() -> None:
    """The fault point "startup" (`DYNATRAIN_FAULTS`, world generation 0)."""
    from ..transition.faults import FaultPlan

    plans = [p for p in FaultPlan.plans_from_env()
             if p.fail_phase == "startup" and p.generation == 0]
    if plans:
        import torch.distributed as dist

        for plan in plans:
            plan.fail(dist.get_rank(), "startup")


class LoopSeam:
    """The patched `train()`'s one object (module doc)."""

    def __init__(self, args: Any, checkpointing_context: Optional[dict], *,
                 pg_collection: Any = None, p2p_communicator: Any = None,
                 training_module: Optional[ModuleType] = None,
                 timer_class: Optional[type] = None) -> None:
        """`training_module`: the module whose `train()` runs this loop (default
        Megatron-LM's `megatron.training.training`, when imported: it is the caller);
        `timer_class`: its timers' class (default megatron-core's `Timer`)."""
        if pg_collection is not None or p2p_communicator is not None:
            raise DynatrainError("--dynatrain: pretrain() was given its own process-group "
                                 "collection or P2P communicator; a switch rebuilds the "
                                 "layout's groups and would leave those behind")
        from . import rank_death
        from .post_step import PostStepGuard

        StartupDeath.remove()  # from here on, deaths are recovered
        self.args = args
        self.checkpointing_context = checkpointing_context
        global _CONTEXT
        _CONTEXT = checkpointing_context  # pretrain()'s own: its final save uses it too
        self.stop = False  # leave the loop (on standby when the job ended)
        self.recovered: Optional[LoopObjects] = None
        self._results = 0  # how many values train_step returns (seen on its first success)
        # a death first seen in the rest of an iteration, held until its boundary
        global _POST_STEP
        if _POST_STEP is not None:
            _POST_STEP.remove()
        _POST_STEP = self.post_step = PostStepGuard(_fault_after_step, rank_death.failure_of)
        module = training_module or sys.modules.get("megatron.training.training")
        if module is not None:
            self.post_step.install(module, timer_class)

    # ------------------------------------------------------------------ train_step
    def guard(self, train_step: Callable) -> Callable:
        """`train_step` with a dead peer's failure recovered from: on such a failure the
        survivors re-form the world (`rank_death.recover`), `recovered` is set and the
        call returns a tuple of Nones the loop unpacks and does not use (it rebinds with
        `after_recovery` and starts the step again). Anything else is re-raised."""
        from . import rank_death

        def guarded(*a: Any, **k: Any) -> Any:
            self.recovered = None
            iteration = k.get("iteration", getattr(self.args, "curr_iteration", 0))
            if adapter.current_session() is None:  # the loop's start: its first boundary
                self._begin(train_step, iteration, a, k)
            try:
                out = train_step(*a, **k)
            except Exception as error:  # noqa: BLE001 - handed on or re-raised
                failure = rank_death.failure_of(error)
            else:
                self._results = len(out)
                return out
            # outside the handler: its traceback holds the broken communicators
            a = k = None  # noqa: F841 - nor may this frame keep the old layout's objects
            self.recovered = rank_death.recover(self.args, iteration, failure,
                                                self.checkpointing_context)
            return (None,) * (self._results or _train_step_results(train_step))

        guarded.__wrapped__ = train_step  # type: ignore[attr-defined]
        return guarded

    def _begin(self, train_step: Callable, iteration: int, a: tuple, k: dict) -> None:
        """The session starts on the objects the first `train_step` is given (its
        arguments by name: `model`, `optimizer`, `opt_param_scheduler`, `config`; a call
        without them starts none: the first `dynatrain_step` does)."""
        import inspect

        try:
            bound = inspect.signature(train_step).bind_partial(*a, **k).arguments
        except (TypeError, ValueError):
            return
        names = ("model", "optimizer", "opt_param_scheduler", "config")
        if all(n in bound for n in names):
            adapter.begin_session(self.args, iteration, *(bound[n] for n in names))

    def after_recovery(self, *values: Any) -> LoopValues:
        """After `guard` recovered: what the loop continues with."""
        dt, self.recovered = self.recovered, None
        if dt is None:
            raise DynatrainError("after_recovery() without a recovery")
        return self._rebind(dt, LoopValues(*values))

    # ------------------------------------------------------------------ step boundary
    def at_step_end(self, should_exit: bool, *values: Any) -> LoopValues:
        """The step boundary, on every rank: poll for a switch (none when Megatron-LM
        exits after this step: ranks on standby are told to leave), recover from a peer
        that died meanwhile, and return what the loop continues with."""
        from . import rank_death

        v = LoopValues(*values)
        failure = self.post_step.take()
        if failure is not None:  # seen after train_step: its step completed everywhere
            replays = self.post_step.replays(v.iteration)
            dt = rank_death.recover_at_boundary(self.args, v.iteration, failure,
                                                self.checkpointing_context)
            out = self._rebind(dt, v)
            if not dt.stop and dt.iteration == v.iteration:  # in memory, at the iteration
                self._replay(replays, dt)
            return out
        try:
            dt = adapter.dynatrain_step(self.args, v.iteration, v.model, v.optimizer,
                                        v.opt_param_scheduler, v.train_data_iterator,
                                        v.valid_data_iterator, v.config, ending=should_exit)
        except Exception as error:  # noqa: BLE001 - handed on or re-raised
            failure = rank_death.failure_of(error)
        if failure is not None:
            dt = rank_death.recover(self.args, v.iteration, failure, self.checkpointing_context)
        if dt.changed and not dt.stop and self.checkpointing_context is not None:
            # the cached save strategy holds the old layout's data-parallel group
            self.checkpointing_context.pop("save_strategy", None)
        return self._rebind(dt, v)

    def _replay(self, replays: list, dt: LoopObjects) -> None:
        """The iteration's evaluation and `checkpoint_and_decide_exit`, failed or skipped
        on the broken world, made again at the survivors' layout with their objects
        (`post_step.py`); an exit it decides ends the loop (`stop`)."""
        from .call_objects import substitute

        for name, inner, bound in replays:
            substitute(bound, dt)
            log.warning("dynatrain: running iteration %d's %s again at the survivors' layout",
                        dt.iteration, name)
            out = inner(*bound.args, **bound.kwargs)
            if name == "checkpoint_and_decide_exit" and out:
                self.stop = True  # Megatron-LM decided to exit after this iteration

    def _rebind(self, dt: LoopObjects, v: LoopValues) -> LoopValues:
        if dt.stop:  # this rank was on standby (outside the layout) when the job ended
            self.stop = True
            return v._replace(iteration=dt.iteration)
        if not dt.changed:
            return v
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.utils import get_attr_wrapped_model

        return LoopValues(
            iteration=dt.iteration,
            num_floating_point_operations_so_far=(v.num_floating_point_operations_so_far
                                                  if dt.flops is None else dt.flops),
            model=dt.model, optimizer=dt.optimizer, opt_param_scheduler=dt.opt_param_scheduler,
            train_data_iterator=dt.train_data_iterator,
            valid_data_iterator=dt.valid_data_iterator, config=dt.config,
            forward_backward_func=get_forward_backward_func(),
            num_microbatches=get_num_microbatches(),
            model_pg_collection=get_attr_wrapped_model(dt.model[0], "pg_collection"))


def _train_step_results(train_step: Callable) -> int:
    """How many values `train_step` returns, read from its source (a failure in the very
    first step comes before any result was seen): the length of its returned tuples."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(train_step)))
    sizes = {len(n.value.elts) for n in ast.walk(tree)
             if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)}
    if len(sizes) != 1:
        raise DynatrainError(f"cannot tell how many values Megatron-LM's train_step returns "
                             f"(its return tuples have {sorted(sizes)} values)")
    return sizes.pop()


_POST_STEP = None  # the last loop's PostStepGuard (its wrappers live while the loop runs)


def _fault_after_step(phase: str, iteration: int) -> None:
    s = adapter.current_session()
    if s is not None:
        s.guard.fault_after_step(phase, iteration)


def finish(model: list, optimizer: Any, opt_param_scheduler: Any, train_data_iterator: Any,
           valid_data_iterator: Any, test_data_iterator: Any, config: Any) -> tuple:
    """`pretrain()`, right after `train()`: the objects the loop ended with (`pretrain()`'s
    own point at a layout a switch released) and the switch summary. Megatron-LM's calls
    after the step are its own again (`post_step.py`); a peer's death in its final save,
    validation or test is recovered from (`after_train.py`)."""
    global _POST_STEP, _AFTER_TRAIN
    if _POST_STEP is not None:
        _POST_STEP.remove()
        _POST_STEP = None
    out = adapter.finish_training(model, optimizer, opt_param_scheduler, train_data_iterator,
                                  valid_data_iterator, test_data_iterator, config)
    module = sys.modules.get("megatron.training.training")
    if module is not None and not adapter.left_out():
        from . import rank_death
        from .after_train import AfterTrain

        if _AFTER_TRAIN is not None:
            _AFTER_TRAIN.remove()
        args = adapter.current_session().args if adapter.current_session() else None
        _AFTER_TRAIN = AfterTrain(
            lambda iteration, failure, context: rank_death.recover_after_train(
                args, iteration, failure, context if context is not None else _CONTEXT),
            rank_death.failure_of, _fault_after_step)
        _AFTER_TRAIN.install(module)
    return out


_AFTER_TRAIN = None  # pretrain()'s calls after train() (after_train.py)
_CONTEXT: Optional[dict] = None  # the checkpointing context train() was given


def left_out() -> bool:
    """True on a rank that was on standby when the job ended: `pretrain()` returns before
    its final save, validation and test, which the layout's ranks run."""
    return adapter.left_out()


__all__ = ("LoopSeam", "LoopValues", "finish", "left_out", "start")
