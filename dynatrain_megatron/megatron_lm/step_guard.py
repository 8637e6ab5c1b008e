"""What a rank death *inside* one of Megatron-LM's training steps leaves behind, and the
fault points to kill a rank there.

A peer that dies in the middle of `train_step` (its forward, backward, the data-parallel
gradient reduction, a pipeline send, the optimizer step) makes a collective fail on the
survivors wherever they are in that step. The recovery (`rank_death.py`) replaces the
model, optimizer and data iterators, but three things outlive them:

* megatron-core's `RerunStateMachine` (a global): the failed `forward_backward_func` left
  it in its initial run, so the next `train_step` would skip its forward-backward loop
  (`UnboundLocalError: losses_reduced`). `reset_after_failed_step` puts back the state and
  iteration count it had at the last step boundary; `resume_at` then sets the count to the
  iteration the recovery goes on from (an older `--save`'s, when it loads one).
* Megatron-LM's timers (a global): those the failed step started are still running, and
  starting them again asserts. Every timer that was not running at the last step boundary
  is reset (the interrupted step's partial times are dropped).
* The optimizer state, when the step failed inside the optimizer's update: a survivor
  whose own collectives did not involve the dead rank may already have updated its shards
  (with several distributed-optimizer instances the other instance even completes its
  whole step) while another has not; the survivors' memory then holds two iterations. So
  before the optimizer mutates anything, every rank of the layout agrees that all are
  alive (a 4-byte all-reduce on the layout's CPU group, only in jobs that can recover:
  `--dynatrain-rendezvous-dir`). A death before that vote: no rank has touched
  its state, the survivors recover in memory at the last step boundary. A death after it
  (the update itself, the parameter all-gather, the rest of that step): the survivors
  report it (`mid_update`) and the recovery resumes from the last checkpoint instead,
  never from state that is partly one iteration and partly the next. A second such vote
  ends the optimizer step: a rank whose update needs no collective with the dead one
  (the other instance's) would otherwise leave `train_step` with iteration K+1's state while
  others fail inside it with a part-updated one; it fails in that vote instead, inside the
  step, like every survivor. Conversely, a rank past that vote knows that every rank
  finished its update: a death first seen after `train_step` returned (`post_step.py`)
  recovers from the new iteration's state (`step_completed`).

Everything else the failed step held (gradient buffers, DDP's pending buckets, the
pipeline's pending sends and receives) belongs to the layout's objects, which the recovery
releases and builds anew.

Fault points (`DYNATRAIN_FAULTS`, `transition/faults.py`): with `fail_phase` one of
`STEP_PHASES` and `iteration` k, rank `fail_rank` fails during the training step after
iteration k (the survivors go on from k): "forward" before its first micro-batch's
forward, "backward" in its first backward, "pp_send" when it issues its first pipeline
send (megatron-core's batched p2p), "grad_sync" as the data-parallel gradient reduction
starts (`finalize_model_grads`), "optimizer" as the optimizer step starts (before the
vote), "optimizer_update" after the vote, as the update starts; and after the step of
iteration k, "log", "eval", "save" as its log line, evaluation or `--save` starts
(`post_step.py`, `fault_after_step`). A plan injects one failure in the world
of its generation (`FaultPlan.generation`: how many recoveries came before it); a job's
plans for later generations name ranks in the survivors' new numbering. Several plans of
one generation kill several ranks in the same step, each at its own point (one recovery).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional, Sequence

from ..transition.faults import STEP_PHASES, FaultPlan, plans_for

log = logging.getLogger("dynatrain")

_WRAPPED = "_dynatrain_step_guard"  # marks an object whose entry points are wrapped


class StepGuard:
    """One per process, for the session's life. `at_boundary` after every step boundary
    (and after a recovery) wraps the live objects' entry points once and records what the
    next step may leave behind; `reset_after_failed_step` undoes it after a failure."""

    def __init__(self, plans: Sequence[FaultPlan], vote: bool,
                 generation: Callable[[], int] = lambda: 0) -> None:
        self.plans = tuple(plans)  # the job's fault plans, one per world generation
        self._generation = generation  # the current world's (the hook's recoveries)
        self.vote = vote  # agree before the optimizer's update (jobs that can recover)
        self.iteration = 0  # the last step boundary
        self.mid_update = False  # the vote passed since the last boundary
        self._group: Any = None  # the layout's CPU group for the vote
        self._rerun: Optional[tuple[Any, int, Any]] = None  # (state, iteration, mode)
        self._running_timers: frozenset[str] = frozenset()
        self._fired: set[int] = set()  # the plans (by id) that fired on this process

    # ------------------------------------------------------------------ at a step boundary
    def at_boundary(self, iteration: int, objs: Any) -> None:
        """The step boundary after `iteration` (the step completed on this rank), on a rank
        of the layout whose objects are `objs` (`TrainingObjects`)."""
        self.iteration = iteration
        self.mid_update = False
        groups = objs.groups
        self._group = groups.layout_group_cpu or groups.layout_group
        self._rerun = _rerun_snapshot()
        self._running_timers = _running_timers()
        if self.vote or self._has_step_faults():
            self._wrap_optimizer(objs.optimizer)
        if self._has_step_faults():
            for chunk in objs.model:
                self._wrap_chunk(chunk)
            self._wrap_config(objs.config)
            self._wrap_p2p()

    def reset_after_failed_step(self) -> None:
        """After a failure inside a step, before the loop runs the next one (module doc).
        Lets go of the broken layout's group: a gloo group's sockets close only with its
        last reference, and a survivor blocked on this rank learns of the death then."""
        self._group = None
        if self._rerun is not None:
            _rerun_restore(*self._rerun)
        _reset_timers_except(self._running_timers)

    def step_completed(self) -> None:
        """A failure first seen after `train_step` returned (`post_step.py`): the step's
        optimizer update finished on every rank (the closing vote), so the survivors'
        memory holds one iteration again."""
        self.mid_update = False

    def fault_after_step(self, phase: str, iteration: int) -> None:
        """The fault points after the step of `iteration` ("log", "eval", "save")."""
        self._fault(phase, iteration)

    def resume_at(self, iteration: int) -> None:
        """After a recovery, before the loop's next step: the loop goes on after
        `iteration` (the last boundary's, or an older `--save`'s). megatron-core's rerun
        state machine counts the loop's iterations (Megatron-LM's `train()` sets its count
        to the iteration it starts from, and a checkpoint saved at a boundary does not
        restore it): it counts from there too, as after Megatron-LM's own restart."""
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        get_rerun_state_machine().current_iteration = iteration

    # ------------------------------------------------------------------ optimizer step
    def _wrap_optimizer(self, optimizer: Any) -> None:
        if optimizer is None or getattr(optimizer, _WRAPPED, False):
            return
        inner = optimizer.step

        @functools.wraps(inner)
        def step(*args: Any, **kwargs: Any) -> Any:
            self._fault("optimizer")
            from ..elastic.communicators import everyone_ok

            if self.vote:
                everyone_ok(True, self._group)  # raises on every survivor if a rank is dead
                self.mid_update = True
            self._fault("optimizer_update")
            out = inner(*args, **kwargs)
            if self.vote:
                # no rank leaves the step before all finished their update (module doc)
                everyone_ok(True, self._group)
            return out

        optimizer.step = step
        setattr(optimizer, _WRAPPED, True)

    # ------------------------------------------------------------------ fault points
    def _has_step_faults(self) -> bool:
        """Whether a plan of any generation fails inside a step (the wrappers go on every
        layout's objects: a later generation's plan fires on those of a later world)."""
        return any(p.fail_phase in STEP_PHASES for p in self.plans)

    def _fault(self, phase: str, iteration: Optional[int] = None) -> None:
        at = self.iteration if iteration is None else iteration
        plans = [p for p in plans_for(self.plans, self._generation())
                 if p.fail_phase == phase and p.iteration == at and id(p) not in self._fired]
        if not plans:
            return
        import torch.distributed as dist

        from ..compat import stand_in_world

        with stand_in_world.real_world():
            rank = dist.get_rank()
        for plan in plans:
            if plan.fail_rank == rank:
                self._fired.add(id(plan))  # a survivor renumbered to its rank: not again
                plan.fail(rank, phase, at)

    def _wrap_chunk(self, chunk: Any) -> None:
        if getattr(chunk, _WRAPPED, False):
            return
        import torch

        def before_forward(_module: Any, _inputs: Any) -> None:
            self._fault("forward")

        def after_forward(_module: Any, _inputs: Any, output: Any) -> None:
            if torch.is_tensor(output) and output.requires_grad:
                output.register_hook(lambda grad: (self._fault("backward"), grad)[1])

        chunk.register_forward_pre_hook(before_forward)
        chunk.register_forward_hook(after_forward)
        setattr(chunk, _WRAPPED, True)

    def _wrap_config(self, config: Any) -> None:
        fn = getattr(config, "finalize_model_grads_func", None)
        if fn is None or getattr(fn, _WRAPPED, False):
            return

        @functools.wraps(fn)
        def finalize(*args: Any, **kwargs: Any) -> Any:
            self._fault("grad_sync")
            return fn(*args, **kwargs)

        setattr(finalize, _WRAPPED, True)
        config.finalize_model_grads_func = finalize

    def _wrap_p2p(self) -> None:
        """megatron-core issues its pipeline sends and receives through
        `torch.distributed.batch_isend_irecv` (looked up at each call)."""
        import torch.distributed as dist

        inner = dist.batch_isend_irecv
        if getattr(inner, _WRAPPED, False):
            return

        @functools.wraps(inner)
        def batch_isend_irecv(ops: Any) -> Any:
            if any(getattr(op.op, "__name__", "") == "isend" for op in ops):
                self._fault("pp_send")
            return inner(ops)

        setattr(batch_isend_irecv, _WRAPPED, True)
        dist.batch_isend_irecv = batch_isend_irecv


# ---------------------------------------------------------------------- Megatron's globals
def _rerun_snapshot() -> Optional[tuple[Any, int, Any]]:
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    m = get_rerun_state_machine()
    return m.state, m.current_iteration, m.get_mode()


def _rerun_restore(state: Any, current_iteration: int, mode: Any) -> None:
    """megatron-core's rerun state machine as it was at the step boundary: its initial run
    of the failed step is forgotten, as are the requests that run made, and its mode is
    the boundary's (Megatron-LM's evaluation disables it until the evaluation ends)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    m = get_rerun_state_machine()
    if m.get_mode() != mode:
        m.set_mode(mode)
    if (m.state, m.current_iteration) != (state, current_iteration):
        log.info("dynatrain: megatron-core's rerun state machine reset from %s (iteration "
                 "%d) to %s (iteration %d) after the failed step", m.state.name,
                 m.current_iteration, state.name, current_iteration)
    m.state, m.current_iteration = state, current_iteration
    m.rerun_requested = m.checkpoint_requested = False
    m.restart_again_requested = m.continue_requested = False


def _timers() -> dict:
    """Megatron-LM's timers by name (its `Timers` keeps them in `_timers`, the one place
    they are listed)."""
    from megatron.training.global_vars import get_timers

    timers = get_timers()
    return dict(getattr(timers, "_timers", {})) if timers is not None else {}


def _running_timers() -> frozenset[str]:
    return frozenset(n for n, t in _timers().items() if getattr(t, "_started", False))


def _reset_timers_except(keep: frozenset[str]) -> None:
    """Timers as at the boundary: those the failure left running reset, those it left
    stopped (an evaluation stops the interval timer) started again."""
    stopped, started = [], []
    for name, timer in _timers().items():
        running = getattr(timer, "_started", False)
        if name not in keep and running:
            timer.reset()
            stopped.append(name)
        elif name in keep and not running:
            timer.start()
            started.append(name)
    if stopped or started:
        log.info("dynatrain: timers as at the step boundary: reset %s, started %s",
                 ", ".join(sorted(stopped)) or "none", ", ".join(sorted(started)) or "none")


__all__ = ("StepGuard",)
