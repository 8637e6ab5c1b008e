"""Layout B's data iterators, built by Megatron-LM in the background while A trains.

After a switch the training loop needs the iterators a restart at B would build:
Megatron-LM's own `build_train_valid_test_data_iterators`, with B's data-parallel
coordinates, at the consumed-sample count of the switch. Built at the switch they are part
of the stall (the datasets, the samplers, and the DataLoader workers forked by a large
process, whose first batches then hold up B's first step). Nothing in them depends on the
last step's values: only on B's groups and on the number of samples consumed when the
switch lands. For a scheduled switch that number is fixed when the preparation starts
(`--dynatrain-schedule` lands exactly after its iteration, waiting for B if need be): the
count noted at the last step boundary plus one global batch per step until the switch.
A requested switch lands at the first step boundary where B is ready everywhere, so its
count is not known in advance: its iterators are built at the count noted when the build
starts (the largest any rank of B noted: a rank back from standby noted its own before it
left) and, at the switch, advanced by the samples A consumed since (`advance`). That is
exact for Megatron-LM's sequential sampler (`--dataloader-type single`, its default): it
hands data-parallel rank r the micro-batch `[c + r*mbs, c + (r+1)*mbs)` of every `mbs*dp`
samples from the count `c` it starts at, so a loader started at `c0` and advanced by
`(c1 - c0) / (mbs*dp)` micro-batches yields what one started at `c1` yields. The other
samplers (`cyclic`: shuffled per epoch, `external`) are built at the switch.

So `DataAhead.build` runs in the preparation's background thread, right before B's objects
are built (`builder.MegatronLMBuilder.build_detached` says why before), inside:
* a view of megatron-core's `parallel_state` set to B's groups and Megatron-LM's `args` set
  to B at that count (`compat.parallel_state_view`), which the data builders read;
* B's preparation group (`elastic.groups.ParallelGroups.background`) as the thread's
  default group (`compat.stand_in_world`, `_stand_in_of`): the dataset builder's barrier,
  the loader's flag broadcast and the build's votes run over B's ranks on a group of
  their own. Not B's CPU twin: under NCCL that is the control group where B spans the
  world and A's twin where A is on the same devices, both used by the training thread's
  votes meanwhile, and two threads' collectives on one gloo group can pair mismatched
  operations across ranks.
The iterators are handed to the loop at the switch (`take`) only if they were built for
exactly what the switch needs (B's groups, the consumed train and validation samples);
otherwise they are dropped (their workers end) and the loop builds them as before, inside
the stall. Not built ahead: a requested switch with a sampler other than `single`, B built
in the pause, B on ranks other than the job's first ones (a stand-in world must be those),
and jobs with `--phase-transition-iterations` (the count per phase follows other rules).
Built ahead or at the switch, every DataLoader worker of B must be seen to start on every
rank of B, or the iterators are built again (`worker_start`: a fork beside running
threads can leave a worker that never starts, and B's first step would wait for it).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..mcore.train_config import running_batch
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from .arguments import arg_value, args_for_layout
from .worker_start import FAILED, started_build, stop_workers, worker_iterators

log = logging.getLogger("dynatrain")

# what Megatron-LM's loader build sets on `args` (and the loop reads): carried over at `take`
_SET_BY_BUILD = ("do_train", "do_valid", "do_test", "eval_iters")


@dataclass(frozen=True)
class StepNote:
    """Where the loop was at its last step boundary: the iteration done and the samples
    consumed by then (train and validation)."""

    iteration: int
    consumed_train: int
    consumed_valid: int

    def __post_init__(self) -> None:
        if min(self.iteration, self.consumed_train, self.consumed_valid) < 0:
            raise ValueError(f"a step note needs non-negative counts, got {self}")


@dataclass(frozen=True, eq=False)
class BuiltAhead:
    """Iterators built in the background for one switch: `groups` (B's ParallelGroups, by
    identity), the consumed samples they start at, Megatron-LM's (train, valid, test)
    iterators, the args values the build set, how long it took, and the samples one
    micro-batch of every data-parallel rank covers at B (`stride`, micro-batch size x B's
    data-parallel size) when the train iterators may be advanced to a later count (a
    requested switch with the sequential sampler), else 0."""

    groups: Any
    consumed_train: int
    consumed_valid: int
    iterators: tuple
    set_by_build: dict
    seconds: float
    stride: int = 0

    def __post_init__(self) -> None:
        if min(self.consumed_train, self.consumed_valid, self.stride) < 0:
            raise ValueError(f"iterators built ahead need non-negative counts, got "
                             f"{self.consumed_train}/{self.consumed_valid}, stride "
                             f"{self.stride}")

    def micro_batches_to(self, consumed_train: int) -> Optional[int]:
        """How many micro-batches each train iterator must skip to start at
        `consumed_train` (0: as built), or None when it cannot get there."""
        delta = consumed_train - self.consumed_train
        if delta == 0:
            return 0
        if delta < 0 or not self.stride or delta % self.stride:
            return None
        return delta // self.stride


class DataAhead:
    """One job's iterators built ahead of a switch (module doc). `args`: Megatron-LM's
    live args (copied, never written in the background); `decision`: the hook's current
    decision (its `at` is a scheduled switch's iteration); `rebuild(args, num_chunks)`:
    Megatron-LM's (train, valid, test) iterators for the args and parallel state in force
    (`adapter._rebuild_data_iterators`, the loop's own)."""

    def __init__(self, args: Any, spec: ModelSpec, sequence_parallel: bool,
                 decision: Callable[[], Any], rebuild: Callable[[Any, int], tuple]) -> None:
        self.args = args
        self.rebuild = rebuild
        self.spec = spec
        self.sequence_parallel = sequence_parallel
        self.decision = decision
        self._note: Optional[StepNote] = None
        self._built: Optional[BuiltAhead] = None
        self._for: Any = None  # B's groups the last build was agreed for
        self._lock = threading.Lock()
        self.last_seconds: Optional[float] = None  # the last build's, for the switch record

    def note_step(self, iteration: int) -> None:
        """The loop's step boundary (main thread, before the hook): the counts now."""
        self._note = StepNote(iteration, int(arg_value(self.args, "consumed_train_samples", 0)),
                              int(arg_value(self.args, "consumed_valid_samples", 0) or 0))

    def target(self, layout: Layout, groups: Any, note: Optional[StepNote] = None,
               decision: Any = None) -> tuple[int, str]:
        """(consumed train samples at the switch, "") when B's iterators can be built ahead
        for it, else (-1, why not). `note`: the step boundary counted from (the last);
        `decision`: the switch's (the hook's current one)."""
        d, note = decision or self.decision(), note or self._note
        at = getattr(d, "at", None)
        if threading.current_thread() is threading.main_thread():
            return -1, "B is built in the pause"
        if note is None:
            return -1, "this rank has taken no step yet"
        # what every switch needs, requested or scheduled: B's build group, and a stand-in
        # world of B's ranks (without one the build's collectives would run on the world)
        if arg_value(self.args, "phase_transition_iterations", None):
            return -1, "--phase-transition-iterations"
        if _group_of(groups) is None:
            return -1, "this rank is not in B"
        if _stand_in_of(groups, layout) is None:
            return -1, "B's ranks are not the job's first ranks"
        if at is None and not _sequential(self.args):
            return -1, (f"a requested switch's iteration is not known in advance and "
                        f"--dataloader-type {arg_value(self.args, 'dataloader_type', None)} "
                        f"cannot be advanced to it")
        if at is None:  # requested: built at the count now, advanced at the switch
            return note.consumed_train, ""
        if at < note.iteration:
            return -1, f"the switch iteration {at} is behind the loop ({note.iteration})"
        gbs = running_batch(int(arg_value(self.args, "global_batch_size")),  # at A's DP
                            int(arg_value(self.args, "micro_batch_size", 1)),
                            int(arg_value(self.args, "data_parallel_size", 1)),
                            bool(arg_value(self.args, "decrease_batch_size_if_needed", False)))
        return note.consumed_train + (at - note.iteration) * gbs, ""

    def build(self, layout: Layout, groups: Any, num_chunks: int) -> None:
        """In the preparation's thread, before B's objects: Megatron-LM's iterators for B at
        the switch's consumed samples, kept for `take`. A failure of Megatron-LM's build
        leaves it to the switch, as without this (logged, not raised)."""
        self.drop()
        note, decision = self._note, self.decision()
        consumed, why = self.target(layout, groups, note, decision)
        group = _group_of(groups)
        if group is None:
            return
        from ..elastic.communicators import agreed_max, everyone_ok

        # B's ranks build together or not at all (the build's collectives run over B)
        if not everyone_ok(consumed >= 0, group):
            log.debug("B's data iterators are built at the switch: %s", why or "so says "
                      "another rank")
            return
        # a rank back from standby noted its counts at its last step before it left: every
        # rank of B builds at the counts of the ranks that trained on (the largest), so
        # none has more micro-batches to skip at the switch than the others
        consumed, valid = agreed_max([consumed, note.consumed_valid], group)
        note = dataclasses.replace(note, consumed_train=consumed, consumed_valid=valid)
        self._for = groups  # every rank of B: `take` votes on these groups
        t0 = time.perf_counter()
        try:  # every DataLoader worker started on every rank of B, or built again
            built, outcome = started_build(
                lambda: self._build(layout, groups, num_chunks, consumed, note),
                lambda b: b[0], lambda code: agreed_max([code], group)[0],
                "B's data iterators built in the background",
                stick_first=_stuck_worker_fault())
        except Exception as e:  # noqa: BLE001 - the switch builds them itself then
            log.warning("building B's data iterators in the background failed (%s: %s); "
                        "they are built at the switch", type(e).__name__, e)
            return
        if built is None:
            log.info("B's data iterators are built at the switch (%s on another rank)",
                     "the build failed" if outcome == FAILED else "workers never started")
            return
        self.last_seconds = time.perf_counter() - t0
        requested = getattr(decision, "at", None) is None
        stride = (int(arg_value(self.args, "micro_batch_size")) * layout.dp) if requested else 0
        with self._lock:
            self._built = BuiltAhead(groups, consumed, note.consumed_valid, built[0],
                                     built[1], self.last_seconds, stride)

    def _build(self, layout: Layout, groups: Any, num_chunks: int, consumed: int,
               note: StepNote) -> tuple[tuple, dict]:
        from ..compat import parallel_state_view as psv
        from ..compat import stand_in_world
        from ..elastic.groups import install

        args = copy.copy(self.args)
        for k, v in args_for_layout(layout, self.spec, like=self.args,
                                    sequence_parallel=self.sequence_parallel).items():
            setattr(args, k, v)
        args.world_size = layout.world_size
        args.consumed_train_samples = consumed
        args.consumed_valid_samples = note.consumed_valid
        view = psv.ParallelStateView(lambda target: install(groups, target=target))
        world = _stand_in_of(groups, layout)
        if world is None:  # `target` refuses it first, on every rank of B alike
            raise ValueError("B's ranks are not the job's first ranks: no stand-in world")
        with psv.in_view(view), psv.thread_args(args), stand_in_world.stand_in(world):
            iterators = tuple(self.rebuild(args, num_chunks))
        return iterators, {k: getattr(args, k) for k in _SET_BY_BUILD if hasattr(args, k)}

    def take(self, groups: Any, consumed_train: int,
             counters: dict[str, int]) -> tuple[Optional[tuple], dict[str, int]]:
        """At the switch (main thread, once the preparation has been collected; collective
        over B's ranks, one all-reduce): `counters`, Megatron-LM's sample counters that only
        a layout's ranks advance (`consumed_valid_samples` among them), as the largest any
        rank of B holds (a rank back from standby holds its last step's); and the iterators
        built ahead where every rank of B built them for these groups, `consumed_train` and
        the agreed validation count (the args values their build set are then applied to
        the live args), else None (any built ahead are dropped)."""
        from ..elastic.communicators import agreed_max

        with self._lock:
            built, self._built = self._built, None
        attempted, self._for = self._for is groups, None
        skip = (built.micro_batches_to(consumed_train)
                if attempted and built is not None and built.groups is groups else None)
        valid = built.consumed_valid if skip is not None else -1
        names = list(counters)
        # MAX of [counters, v, -v]: v's largest and smallest, equal where every rank built
        *values, top, neg_bottom = agreed_max([int(counters[n]) for n in names] +
                                              [valid, -valid], switch_group(groups))
        agreed = dict(zip(names, values))
        # every rank of B takes its own or none does (else one would build alone)
        if not top == -neg_bottom == agreed["consumed_valid_samples"]:
            if built is not None:
                log.info("B's data iterators built ahead are for %d/%d consumed samples, the "
                         "switch is at %d/%d (train/valid) here or on another rank: built "
                         "again at the switch", built.consumed_train, built.consumed_valid,
                         consumed_train, agreed["consumed_valid_samples"])
            return None, agreed
        for k, v in built.set_by_build.items():
            setattr(self.args, k, v)
        if skip:
            advance(built.iterators[0], skip)
            log.info("B's data iterators built ahead at %d consumed samples, advanced by %d "
                     "micro-batches to %d", built.consumed_train, skip, consumed_train)
        return built.iterators, agreed

    def drop(self) -> None:
        """Forget iterators built ahead (their DataLoader workers end with them)."""
        with self._lock:
            self._built = None
            self._for = None


def _sequential(args: Any) -> bool:
    """Whether the job's train loader is Megatron-LM's sequential sampler (`single`, the
    default), without the samplers that read whole global batches (hybrid CP)."""
    return (arg_value(args, "dataloader_type", None) in (None, "single")
            and not arg_value(args, "hybrid_context_parallel", False))


def advance(train: Any, micro_batches: int) -> None:
    """Skip `micro_batches` micro-batches of Megatron-LM's train iterator(s) (one per
    virtual stage, or one; None where this rank reads no data). Megatron's replay wrapper
    is stepped underneath, so it saves nothing of the skipped batches."""
    for it in (train if isinstance(train, (list, tuple)) else [train]):
        if it is None:
            continue
        inner = it.iterable if hasattr(it, "saved_microbatches") else it
        for _ in range(micro_batches):
            next(inner)


def retire_in_background(*iterators: Any) -> Optional[threading.Thread]:
    """Stop the DataLoader workers of iterators the loop no longer uses (A's, after a
    switch) in a thread of their own: dropped by the training loop at B's first step,
    they would stop there, each worker process joined in turn. The thread holds them
    until their workers are stopped; returns it (None when there were none)."""
    found: list = []
    for it in iterators:
        worker_iterators(it, found)
    if not found:
        return None
    for it in found:  # their exit (the workers' own) yields to the training processes
        lower_priority(getattr(it, "_workers", ()))

    def stop(its: list) -> None:
        stop_workers(its)
        its.clear()

    t = threading.Thread(target=stop, args=(found,), name="dynatrain-retire-data",
                         daemon=True)
    t.start()
    return t


def lower_priority(processes: Any) -> None:
    """Give `processes` (a DataLoader's worker processes, retired) the lowest CPU priority
    (nice 19): their shutdown, each worker interpreter's exit, then takes only the CPU time
    the training processes leave. Where the system refuses, they keep theirs."""
    for w in processes:
        pid = getattr(w, "pid", None)
        if pid is None:
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, pid, 19)
        except (OSError, AttributeError) as e:  # gone already, or no setpriority here
            log.debug("lowering the priority of data-loader worker %s: %s", pid, e)


def build_now(groups: Any, build: Callable[[], tuple]) -> tuple:
    """B's (train, valid, test) iterators built at the switch by `build` (Megatron-LM's, on
    every rank of B: `groups`), their DataLoader workers all started (`worker_start`);
    raises where that cannot be had (the build failed on some rank, or workers never
    started in any attempt): the loop would otherwise wait for a batch forever."""
    from ..elastic.communicators import agreed_max

    group = switch_group(groups)
    built, outcome = started_build(build, lambda b: b,
                                   lambda code: agreed_max([code], group)[0],
                                   "B's data iterators built at the switch")
    if built is None:
        raise DynatrainError("B's data iterators could not be built at the switch: " + (
            "the build failed on another rank" if outcome == FAILED
            else "their DataLoader workers never started"))
    return built


def _stuck_worker_fault() -> bool:
    """Whether `DYNATRAIN_FAULTS` makes this rank's first worker of B never start."""
    import torch.distributed as dist

    from ..transition.faults import FaultPlan, plans_for

    return any(p.fail_phase == "worker_start" and p.fail_rank == dist.get_rank()
               for p in plans_for(FaultPlan.plans_from_env(), 0))


def _stand_in_of(groups: Any, layout: Layout) -> Any:
    """The group that stands in for the world during the build: B's preparation group
    (`ParallelGroups.background`, B's ranks in global-rank order) where those are the
    job's first ranks, as a stand-in world must be (`compat.stand_in_world`); else None."""
    import torch.distributed as dist

    g = _group_of(groups)
    if g is None or dist.get_process_group_ranks(g) != list(range(layout.world_size)):
        return None
    return g


def _group_of(groups: Any) -> Any:
    """The group of B's ranks the build and its votes run on: B's preparation group, which
    nothing on the training thread uses meanwhile (`ParallelGroups.background`; B's CPU
    twin is the control group where B spans the world under NCCL, and A's twin where A is
    on the same devices). None on a rank outside B."""
    return getattr(groups, "background", None)


def switch_group(groups: Any) -> Any:
    """B's group over its ranks for the agreement at the switch (the main thread, nothing
    else running): its CPU twin under NCCL, else its own."""
    return getattr(groups, "layout_group_cpu", None) or getattr(groups, "layout_group", None)


__all__ = ("BuiltAhead", "DataAhead", "StepNote", "build_now", "retire_in_background",
           "switch_group")
