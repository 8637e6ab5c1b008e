"""The public Python API, for code that owns its training loop (an RL framework, a custom
trainer): switch the layout of a running job from its megatron-core objects and get back
the objects to use.

    from dynatrain_megatron import ElasticJob

    job = ElasticJob(model, optimizer, scheduler, config=config, groups=groups,
                     builder=builder)
    print(job.plan("tp1pp4dp1"))                # bytes and estimated time, nothing moves
    new = job.switch("tp1pp4dp1", iteration=it, consumed_samples=n)
    model, optimizer, scheduler = new.model, new.optimizer, new.scheduler

    gen = job.weights_to("tp4pp1dp1", optimizer="host")   # weights only: generate there
    ...                                                    # gen.model: bare GPTModels
    job.weights_back()                                     # training state as it was

Every call that moves state is collective: every rank of the world calls it, in the same
order, at a step boundary (after the optimizer step). `plan` and `current` are pure. A
switch is a transaction (`transition.switch`): if any rank fails, every rank raises
`SwitchAborted` and the job is at its old layout with its state untouched.

The signal file, the schedule and the automatic layouts (`loop.hook`) run the same switch,
rollback included: `loop.switching.switch_objects`, which this module calls for callers
that hold the objects themselves.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional, Union

import torch.distributed as dist

from .adapters.offload import ParkedState, park_optimizer_state
from .api_types import (OPTIMIZER_PLACES, ApiError, LayoutInfo, SwitchAborted, SwitchPlan,
                        Switched, WeightsSwitched)
from .elastic.device_manager import DeviceManager
from .elastic.groups import ParallelGroups, install
from .loop.switching import (RngSnapshot, discard_prepared, free_layout, prepared_switch_args,
                             start_preparation, switch_objects)
from .mcore.builders import MegatronBuilder, TrainingObjects, validator_options
from .mcore.session import release
from .routing.cost import estimate, state_bytes
from .routing.planner import build_plan
from .routing.schedule import build_schedule
from .transition.executor import PACK_ALIGN
from .transition.scalars import read_scalars
from .transition.switch import choose_dst_placement
from .transition.switch_types import SwitchOptions
from .vps.layout import Layout
from .vps.validate import validate_layout

log = logging.getLogger("dynatrain")

Target = Union[str, Layout]


@dataclasses.dataclass(frozen=True)
class _WeightsBuilder:
    """The switch's builder for a weights-only target: model chunks only (no DDP, no
    optimizer, so no optimizer state is created at the target). `kept`: the target's
    chunks kept from the last round (`weights_back(keep=True)`), reused as they are (the
    switch overwrites every weight and every replica of it)."""

    base: MegatronBuilder
    kept: Optional[TrainingObjects] = None

    @property
    def spec(self):
        return self.base.spec

    def bucket_size(self, layout: Layout) -> Optional[int]:
        return self.base.bucket_size(layout)

    def build_detached(self, layout: Layout, groups: ParallelGroups) -> TrainingObjects:
        if self.kept is not None and self.kept.layout == layout and self.kept.groups is groups:
            return self.kept
        return self.base.build_weights_detached(layout, groups)

    def activate(self, objs: TrainingObjects) -> None:
        self.base.activate(objs)


@dataclasses.dataclass
class _AtWeights:
    """A weights-only switch in progress (the job's private bookkeeping)."""

    objs: TrainingObjects
    rng: RngSnapshot
    parked: Optional[ParkedState]


class Preparation:
    """A switch being prepared in the background (`ElasticJob.prepare`): the target's
    groups and objects are built, bound, checked and planned in a thread while the job
    trains. Ask `ready()` at step boundaries (collective), then `ElasticJob.switch(...,
    preparation=p)`; or `cancel()` it."""

    def __init__(self, job: "ElasticJob", dst: Layout, manager: DeviceManager) -> None:
        self.job = job
        self.dst = dst
        self._manager: Optional[DeviceManager] = manager
        self._ready = False

    def ready(self) -> bool:
        """Collective over the world: True once every rank has finished preparing.

        Example::

            p = job.prepare("tp1pp4dp1")
            while not p.ready():
                train_one_step()
        """
        if self._manager is None:
            raise ApiError(f"the preparation of {self.dst} was used or cancelled")
        self._ready = self._ready or self._manager.ready()
        return self._ready

    def cancel(self) -> None:
        """Give the preparation up (every rank) and free what it built.

        Example::

            p = job.prepare("tp1pp4dp1")
            p.cancel()                  # the job trains on at its layout
        """
        if self._manager is None:
            return
        groups, prepared = self._manager.abandon(None)
        self._manager = None
        if prepared is not None:
            discard_prepared(prepared)
        else:
            free_layout(None, groups)

    def _take(self) -> dict:
        """`switch_layout`'s keyword arguments (waits, collectively, until ready)."""
        while not self.ready():
            time.sleep(0.005)
        manager, self._manager = self._manager, None
        return prepared_switch_args(manager)


class ElasticJob:
    """A running job's training objects on this rank, and how to build other layouts.

    `model`: the DDP-wrapped model chunks; `optimizer`: megatron-core's (Chained)
    DistributedOptimizer; `scheduler`: its `OptimizerParamScheduler`; `config`: the
    chunks' TransformerConfig; `groups`: the layout's `ParallelGroups`
    (`elastic.groups.build_groups` for a job started by us, `megatron_lm.adapter.
    wrap_megatron_groups` for Megatron-LM's own); `builder`: how another layout's objects
    are made (`MegatronBuilder`, or `megatron_lm.builder.MegatronLMBuilder`: Megatron-LM's
    own builders). `options`: how switches run (`SwitchOptions`).

    Example::

        job = ElasticJob(model, optimizer, scheduler, config=config, groups=groups,
                         builder=MegatronBuilder(spec, train))
    """

    def __init__(self, model: list, optimizer: Any, scheduler: Any, *, config: Any,
                 groups: ParallelGroups, builder: MegatronBuilder,
                 options: SwitchOptions = SwitchOptions()) -> None:
        if not model or optimizer is None or scheduler is None:
            raise ApiError("ElasticJob needs the model chunks, the optimizer and the scheduler "
                           "of a rank of the layout")
        if options.weights_only:
            raise ApiError("ElasticJob's options: weights_only is chosen per call "
                           "(weights_to), not for the job")
        self.builder = builder
        self.options = options
        self._objs = TrainingObjects(layout=groups.layout, groups=groups, config=config,
                                     model=list(model), optimizer=optimizer, scheduler=scheduler)
        self._weights: Optional[_AtWeights] = None
        self._kept: Optional[TrainingObjects] = None  # a weights-only target kept for reuse

    @classmethod
    def from_objects(cls, objs: TrainingObjects, builder: MegatronBuilder,
                     options: SwitchOptions = SwitchOptions()) -> "ElasticJob":
        """From a builder's `TrainingObjects` (our stand-in job's `trainer.objs`).

        Example::

            job = ElasticJob.from_objects(trainer.objs, MegatronBuilder(spec, train))
        """
        return cls(objs.model, objs.optimizer, objs.scheduler, config=objs.config,
                   groups=objs.groups, builder=builder, options=options)

    # ------------------------------------------------------------------ queries
    @property
    def objects(self) -> TrainingObjects:
        """The current training objects (those to train with)."""
        return self._objs

    def current(self) -> LayoutInfo:
        """Where the job is (pure).

        Example::

            info = job.current()
            info.layout, info.placement     # 'tp2pp2dp1', (0, 1, 2, 3)
        """
        g = self._objs.groups
        return LayoutInfo(str(self._objs.layout), self._objs.layout.world_size,
                          tuple(g.placement.devices), g.virtual_rank,
                          str(self._weights.objs.layout) if self._weights else None)

    def plan(self, target: Target, *, weights_only: bool = False) -> SwitchPlan:
        """What switching to `target` would move and cost, before anything moves (pure:
        the same answer on every rank, no communication). `weights_only`: the plan of
        `weights_to(target)`.

        Example::

            p = job.plan("tp1pp4dp1")
            p.bytes_moved, p.estimated_seconds
        """
        dst = self._target(target)
        options = dataclasses.replace(self.options, weights_only=weights_only)
        src, src_pl = self._objs.layout, self._objs.groups.placement
        spec = self.builder.spec
        kinds = options.kinds
        placement = choose_dst_placement(spec, self.builder, src, src_pl, dst,
                                         tuple(range(dst.world_size)), options.placement,
                                         options.ranks_per_node, kinds=kinds)
        plan = build_plan(spec, (src, src_pl), (dst, placement), kinds=kinds,
                          ranks_per_node=options.ranks_per_node,
                          bucket_size=(self.builder.bucket_size(src),
                                       self.builder.bucket_size(dst)))
        sched = build_schedule(plan, options.memory_budget, PACK_ALIGN)
        cost = estimate(sched, checksums=options.checksums)
        st = plan.stats
        return SwitchPlan(str(src), str(dst), tuple(placement.devices), tuple(kinds),
                          st.moved_bytes, st.lower_bound_bytes, st.local_bytes,
                          tuple(st.moved_per_kind), state_bytes(spec, kinds), sched.num_rounds,
                          cost.total_seconds)

    # ------------------------------------------------------------------ switches
    def prepare(self, target: Target) -> Preparation:
        """Start preparing a switch to `target` in the background (every rank): B's
        groups, objects, binding and plan, while the job trains on. The objects the job
        trains with must stay the same until the switch.

        Example::

            p = job.prepare("tp1pp4dp1")
            while not p.ready():
                train_one_step()
            new = job.switch("tp1pp4dp1", iteration=it, consumed_samples=n, preparation=p)
        """
        self._at_training("prepare")
        dst = self._target(target)
        self.release_kept_weights()
        o = self.options
        manager = start_preparation(DeviceManager(), self.builder, self._objs.layout,
                                    self._objs.groups.placement, dst, placement=o.placement,
                                    ranks_per_node=o.ranks_per_node,
                                    memory_budget=o.memory_budget, move_weights=o.move_weights,
                                    src_objs=self._objs)
        return Preparation(self, dst, manager)

    def switch(self, target: Target, *, iteration: int = 0, consumed_samples: int = 0,
               preparation: Optional[Preparation] = None) -> Switched:
        """Switch the whole training state to `target` (collective, at a step boundary) and
        return the objects to train with; the old ones are released: their weights,
        gradients and optimizer state are freed in place (empty tensors from then on, also
        where the caller still holds them), so the devices hold one layout. `iteration` and
        `consumed_samples` are carried with the other scalars (optimizer step, scheduler,
        grad scaler). `preparation`: from `prepare(target)`.

        Raises `SwitchAborted` when any rank failed (the job stays as it was).

        Example::

            new = job.switch("tp1pp4dp1", iteration=10, consumed_samples=80)
            model, optimizer, scheduler = new.model, new.optimizer, new.scheduler
        """
        self._at_training("switch")
        dst = self._target(target)
        if preparation is not None and (preparation.job is not self or preparation.dst != dst):
            raise ApiError(f"the preparation is for {preparation.dst} of another job or "
                           f"layout, not {dst}")
        self.release_kept_weights()
        old = self._objs
        kw = preparation._take() if preparation is not None else {}
        res = switch_objects(old, self.builder, old.layout, old.groups.placement, dst,
                             read_scalars(old, iteration, consumed_samples), self.options,
                             dst_devices=tuple(range(dst.world_size)), **kw)
        if res.aborted:
            raise SwitchAborted(res.aborted)
        release(old, free=True, keep=res.objs)  # its tensors emptied, whoever holds them
        self._objs = res.objs
        r = res.report
        return Switched(str(dst), tuple(res.placement.devices), res.objs.model,
                        res.objs.optimizer, res.objs.scheduler, res.objs.config,
                        res.scalars.iteration, res.scalars.consumed_samples, r.bytes_moved,
                        r.lower_bound_bytes, r.pause_seconds, bool(r.background),
                        tuple(r.phases.items()))

    def weights_to(self, target: Target, *, optimizer: str = "keep") -> WeightsSwitched:
        """Switch the weights alone to `target` (e.g. a generation layout: TP-heavy, no PP)
        and return its model chunks; the training state stays at the current layout until
        `weights_back()`. No optimizer exists at `target`. `optimizer`: "keep" leaves the
        optimizer state on the devices, "host" parks it in host memory meanwhile.

        Example::

            gen = job.weights_to("tp4pp1dp1", optimizer="host")
            logits = gen.model[0](tokens, position_ids, None)   # a bare GPTModel
            job.weights_back()
        """
        self._at_training("weights_to")
        if optimizer not in OPTIMIZER_PLACES:
            raise ApiError(f"optimizer must be one of {OPTIMIZER_PLACES}, got {optimizer!r}")
        dst = self._target(target)
        kept, self._kept = self._kept, None
        if kept is not None and kept.layout != dst:
            release(kept, free=True, keep=self._objs)
            kept = None
        a = self._objs
        rng = RngSnapshot.take()
        parked = park_optimizer_state(a.optimizer, a.model) if optimizer == "host" else None
        options = dataclasses.replace(self.options, weights_only=True)
        # A's weights are read; its optimizer is not even bound
        weights_of_a = dataclasses.replace(a, optimizer=None, scheduler=None)
        try:
            res = switch_objects(weights_of_a, _WeightsBuilder(self.builder, kept), a.layout,
                                 a.groups.placement, dst, None, options,
                                 dst_devices=tuple(range(dst.world_size)),
                                 new_groups=kept.groups if kept is not None else None)
        except Exception:
            if parked is not None:
                parked.restore()
            raise
        if res.aborted:
            if parked is not None:
                parked.restore()
            raise SwitchAborted(res.aborted)
        self._weights = _AtWeights(res.objs, rng, parked)
        r = res.report
        return WeightsSwitched(str(dst), tuple(res.placement.devices), res.objs.model,
                               res.objs.config, res.objs.groups.pg_collection, optimizer,
                               parked.nbytes if parked else 0, r.bytes_moved, r.pause_seconds,
                               tuple(r.phases.items()))

    def weights_back(self, *, keep: bool = False) -> LayoutInfo:
        """End a weights-only switch (collective): make the training layout current again
        with the RNG states it had and the parked optimizer state restored; the training
        state is bit for bit what it was. The target's model chunks and groups are freed
        (their weights in place: empty tensors from then on, also where the caller still
        holds `gen.model`), or with `keep` kept (their memory too) for the next `weights_to` the same target,
        which then only moves the weights: an RL loop that generates at the same layout
        every round builds it once. `release_kept_weights()` frees them.

        Example::

            for _ in range(rounds):
                train_steps()
                gen = job.weights_to("tp4pp1dp1")
                generate(gen.model)
                job.weights_back(keep=True)     # G's chunks stay for the next round
            job.release_kept_weights()
        """
        if self._weights is None:
            raise ApiError("weights_back: no weights-only switch in progress")
        at, self._weights = self._weights, None
        self._back_to_training(None if keep else at.objs, at.rng, at.parked)
        if keep:
            self._kept = at.objs
        return self.current()

    def release_kept_weights(self) -> None:
        """Free the weights-only target kept by `weights_back(keep=True)` (collective: its
        groups are destroyed); nothing to do without one.

        Example::

            job.weights_back(keep=True)
            job.release_kept_weights()
        """
        kept, self._kept = self._kept, None
        if kept is not None:
            release(kept, free=True, keep=self._objs)

    # ------------------------------------------------------------------ internals
    def _back_to_training(self, gen: Optional[TrainingObjects], rng: RngSnapshot,
                          parked: Optional[ParkedState]) -> None:
        if gen is not None:
            release(gen, free=True, keep=self._objs)
        install(self._objs.groups)
        if parked is not None:
            parked.restore()
        rng.restore()

    def _at_training(self, call: str) -> None:
        if self._weights is not None:
            raise ApiError(f"{call}: the weights are at {self._weights.objs.layout}; call "
                           f"weights_back() first")

    def _target(self, target: Target) -> Layout:
        """The target parsed and checked against the model, the world and the batch
        (`vps.validate`): a bad one raises LayoutError on every rank alike."""
        world = dist.get_world_size() if dist.is_initialized() else self._objs.layout.world_size
        dst = Layout.parse(target, world) if isinstance(target, str) else target
        if not isinstance(dst, Layout):
            raise ApiError(f"a target layout is a str or a Layout, got {type(target).__name__}")
        if dst.world_size != world:
            raise ApiError(f"layout {dst} has {dst.world_size} ranks, the world "
                           f"{world}: the API switches within the world (grow or shrink it "
                           f"with the signal file)")
        dst = self.builder.complete_layout(dst)  # the pipeline split the job's flags make
        validate_layout(self.builder.spec, dst,
                        **validator_options(self.builder.train, dst))
        return dst


__all__ = ["ElasticJob", "Preparation"]
