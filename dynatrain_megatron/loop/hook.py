"""The training-step hook: one call after the optimizer step and iteration accounting
(where Megatron-LM calls `checkpoint_and_decide_exit`).

It polls the controller, starts building the target layout's groups in the background,
and at a later step boundary, once every rank has them, switches the training state and
rebinds the trainer (model, optimizer, scheduler, data position, forward-backward function,
micro-batch count). Importing it needs megatron-core only, not Megatron-LM."""
from __future__ import annotations

import argparse
import logging
import time
from typing import Optional

import torch.distributed as dist

from ..elastic import job_presence
from ..elastic.controller import Controller, Decision
from ..elastic.schedule import load_schedule
from ..elastic.device_manager import DeviceManager
from ..elastic.standby_channel import StandbyChannel
from ..elastic.groups import build_groups
from ..elastic.join import open_reviewer
from ..safe_files import OutputDir
from ..transition.faults import FaultPlan, plan_for
from ..transition.switch import choose_dst_placement
from ..transition.switch_types import SwitchOptions
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.placement import Placement
from ..mcore.builders import MegatronBuilder, TrainingObjects, bucket_size_of, validator_options
from ..mcore.session import collect_released
from .logs import ONCE, configure as configure_logging
from .memory_check import (SwitchMemoryCheck, from_args as memory_check_from_args,
                           release_grad_buffers, restore_grad_buffers)
from .auto_layout import LayoutAdvisor
from .stall_tracker import StallTracker
from .schedule_lead import ScheduleLead
from .switch_log import SwitchRecord, landing_note, layout_scalars, summary
from .switching import (is_dead_peer, moves_weights, prepared_switch_args, start_preparation,
                        switch_trainer, vote_groups)
from ..mcore.train_config import TrainConfig
from ..mcore.training import Trainer

log = logging.getLogger("dynatrain")


class DynatrainHook:
    def __init__(self, spec: ModelSpec, train: TrainConfig, controller: Controller, *,
                 ranks_per_node: int = 8, memory_budget: Optional[int] = None,
                 placement: str = "best", log_dir: Optional[str] = None,
                 background_groups: bool = True, timeout: Optional[float] = None,
                 rendezvous_dir: Optional[str] = None,
                 recovery_checkpoint: Optional[str] = None, max_recoveries: int = 8,
                 memory: Optional[SwitchMemoryCheck] = None,
                 advisor: Optional[LayoutAdvisor] = None, auto_layout: bool = False,
                 builder: Optional[MegatronBuilder] = None) -> None:
        # the job's switch options, checked once at start (SwitchError names every bad one)
        SwitchOptions(placement=placement, ranks_per_node=ranks_per_node,
                      memory_budget=memory_budget, timeout=timeout)
        self.spec = spec
        # how B's objects are made (a Megatron-LM job's builder uses its own config)
        self.builder = builder or MegatronBuilder(spec, train)
        self.controller = controller
        self.ranks_per_node, self.memory_budget = ranks_per_node, memory_budget
        self.placement = placement
        self.log_dir = log_dir
        self.outputs = OutputDir(log_dir) if log_dir else None  # never raises
        self.background_groups = background_groups
        self.devices = DeviceManager()
        self.channel = StandbyChannel()  # where standby ranks wait (elastic/standby_channel.py)
        self.decision: Optional[Decision] = None
        self.layout: Optional[Layout] = None  # the current layout, known on every process
        self.layout_placement: Optional[Placement] = None  # and its devices
        self.stopped = False
        self.failed: list[str] = []  # reasons of switches that were rolled back
        self._sync_target: Optional[tuple[Layout, Placement]] = None
        self._waited_s = 0.0  # a scheduled switch: how long it waited for B at its iteration
        self.timeout = timeout
        self.history: list[SwitchRecord] = []
        self.rejected: list[str] = []  # reasons of refused requests
        # rank death (loop/death_recovery.py): where survivors meet, what they resume from
        self.rendezvous_dir, self.recovery_checkpoint = rendezvous_dir, recovery_checkpoint
        self.max_recoveries = max_recoveries
        self.recoveries: list[dict] = []
        self.host = None  # a host training loop's recovery hooks (death_recovery.HostLoop)
        self.admitted: list[dict] = []  # joiners that grew the world (loop/growth.py)
        # DYNATRAIN_FAULTS, e.g. a rank killed at a step; one plan per world generation
        self.fault_plans = FaultPlan.plans_from_env()
        self.memory = memory  # A and B together on the devices (loop/memory_check.py)
        self._release_a_grads = False  # the memory plan's degraded mode for the next switch
        # the advisor answers requests without a layout; auto_layout: moves (loop/auto_layout.py)
        self.advisor, self.auto_layout = advisor, auto_layout
        if advisor is not None:
            controller.advise = advisor.advise
            controller.auto_layout = auto_layout
        self.stall = StallTracker(self.outputs)  # loop/stall_tracker.py
        self.lead = ScheduleLead()  # a scheduled switch is decided this far ahead
        controller.lead_source = self.lead.lead

    @classmethod
    def from_args(cls, args: argparse.Namespace, spec: ModelSpec, train: TrainConfig,
                  builder: Optional[MegatronBuilder] = None) -> "DynatrainHook":
        configure_logging(dist.get_rank(), getattr(args, "dynatrain_log_all_ranks", False))
        schedule = (load_schedule(args.dynatrain_schedule, train.train_iters)
                    if args.dynatrain_schedule else None)
        ctl = Controller(spec, args.dynatrain_signal_file, args.dynatrain_poll_interval, schedule,
                         check_options=lambda lay: validator_options(
                             train, lay, args.dynatrain_device_memory))
        # join requests (elastic/join.py): reviewed on rank 0 at each poll when configured
        ctl.joins = open_reviewer(args.dynatrain_rendezvous_dir, args.dynatrain_secret_file)
        advisor = LayoutAdvisor(spec, train, device_memory_bytes=args.dynatrain_device_memory)
        return cls(spec, train, ctl, ranks_per_node=args.dynatrain_ranks_per_node,
                   advisor=advisor, auto_layout=getattr(args, "dynatrain_auto_layout", False),
                   memory_budget=args.dynatrain_memory_budget,
                   placement="default" if args.dynatrain_default_placement else "best",
                   log_dir=args.dynatrain_log_dir, timeout=args.dynatrain_timeout,
                   rendezvous_dir=args.dynatrain_rendezvous_dir,
                   recovery_checkpoint=args.dynatrain_recovery_checkpoint,
                   memory=memory_check_from_args(args), builder=builder)

    def start(self, trainer: Optional[Trainer], layout: Layout, placement: Placement) -> None:
        """Tell the hook the job's first layout; every process calls it (standby ranks,
        outside the layout, with `trainer=None`). Checks the schedule's layouts against
        the job's world (DynatrainError, on every rank alike, before the first step)."""
        self.controller.check_schedule(layout.world_size)
        self.layout, self.layout_placement = layout, placement
        if self.controller.signal_path and dist.get_rank() == 0:
            job_presence.announce(self.controller.signal_path)  # for `request --wait`
        if dist.is_initialized():
            self.channel.renew()  # collective: every process starts here

    def after_step(self, trainer: Trainer) -> Optional[Trainer]:
        """Call after every optimizer step, on every rank of the layout. Returns the
        (rebound) trainer, or None when this rank left the layout (scale-in): it is then on
        standby and calls `standby()`."""
        self.stall.next_step_boundary()  # may report the last switch's stall (collective)
        self.lead.step_boundary()
        try:
            return self._after_step(trainer)
        finally:
            self.stall.left()

    def _after_step(self, trainer: Trainer) -> Optional[Trainer]:
        if self.layout is None:
            self.start(trainer, trainer.objs.layout, trainer.objs.groups.placement)
        if self.faults is not None:
            self.faults.fail(dist.get_rank(), "step", trainer.iteration)
        self.stall.report.metrics(trainer.iteration, layout_scalars(self.layout))  # every step
        if self.memory is not None:
            self.memory.step_boundary()  # the memory figures are the last step's
        if trainer.iteration >= self.builder.train.train_iters and not (
                self.devices.pending and getattr(self.decision, "at", None) is not None):
            return trainer  # the last step: only a switch scheduled for it lands (`end_job`)
        if self.devices.pending:
            return self._switch_when_due(trainer)
        layout_group, standby = vote_groups(self.layout, self.channel, trainer)
        t0 = time.perf_counter()
        d = self.controller.poll(trainer.iteration, self.layout.world_size, layout_group,
                                 standby)
        self.stall.lap("controller", t0)
        trainer = self._admit(trainer, d)
        self._on_decision(d, trainer.iteration, trainer.objs)
        if self._sync_target is not None:
            return self._switch(trainer)
        if self.devices.pending and d.at is not None and trainer.iteration >= d.at:
            return self._switch_when_due(trainer)  # a schedule due now: no step to wait on
        return trainer

    def _switch_when_due(self, trainer: Trainer) -> Optional[Trainer]:
        """A switch prepared in the background: a requested one lands at the first step
        boundary where B is ready on every rank; a scheduled one lands exactly after its
        iteration, waiting there for whatever of the preparation is left."""
        at = self.decision.at if self.decision is not None else None
        groups = vote_groups(self.layout, self.channel, trainer)
        t0 = time.perf_counter()
        if at is None:
            ready = self.devices.ready(*groups)
            self.stall.lap("wait_for_b", t0)
            return self._switch(trainer) if ready else trainer
        if trainer.iteration < at:
            return trainer
        while not self.devices.ready(*groups):  # collective: every rank loops the same times
            time.sleep(0.005)
        self._waited_s = time.perf_counter() - t0
        self.stall.lap("wait_for_b", t0)
        return self._switch(trainer)

    def standby(self) -> Optional[Trainer]:
        """A process outside the current layout: take part in every collective of the
        controller and the device manager until a switch brings it in (returns its trainer)
        or the job ends (returns None, `self.stopped` is set). Holds no training state."""
        while True:
            standby = self.channel.group()  # None: the world, with its deadline
            if self.devices.pending:
                vote = self.devices.vote(None, standby)
                if vote == "stop":  # the job ended before the switch was ready
                    self._cancel_preparation("the job ended before the switch was ready")
                    self.stopped = True
                    return None
                if vote == "ready":
                    trainer = self._switch_from_standby()
                    if trainer is not None:
                        return trainer
                continue
            d = self.controller.follow(standby)
            if d.stop:
                self.stopped = True
                return None
            self._admit(None, d)
            self._on_decision(d, None)
            if self._sync_target is not None:
                trainer = self._switch_from_standby()
                if trainer is not None:
                    return trainer

    def _switch_from_standby(self) -> Optional[Trainer]:
        """The switch starts now on this standby rank: so does its window (and host timer)."""
        self.stall.enter_from_standby()
        return self._switch(None)

    def _on_decision(self, d: Decision, iteration: Optional[int],
                     objs: Optional[TrainingObjects] = None) -> None:
        if d.rejected:
            self.rejected.append(d.rejected)
            self._record_outcome("rejected", d, iteration, d.rejected)
        if d.target is None:
            return
        src = self.layout
        if d.target == str(src) and d.world == src.world_size:
            log.info("already at layout %s: nothing to do", src, extra=ONCE)
            self.controller.done(d, "applied", "already at this layout")
            return
        when = f"iteration {iteration}: " if iteration is not None else ""
        if d.note:
            log.info("%s%s", when, d.note, extra=ONCE)
        dst = Layout.parse(d.target, d.world)  # the controller validated it
        self.decision = d
        in_pause = not self.background_groups
        placement: Optional[Placement] = None
        if self.memory is not None or in_pause:
            # needed now (the memory plan, or B built in the pause); else chosen in the background
            t0 = time.perf_counter()
            try:  # the same pure computation on every rank: all refuse alike, A untouched
                placement = self._choose_placement(dst)
            except Exception as e:  # noqa: BLE001 - a request must never end training
                reason = f"no placement for {d.target} on {d.world} ranks: {type(e).__name__}: {e}"
                log.error("switch to %s rejected: %s; training continues at %s", d.target,
                          reason, src)
                self.rejected.append(reason)
                self.controller.done(d, "rejected", reason)
                self._record_outcome("rejected", d, iteration, reason)
                self.decision = None
                return
            t0 = self.stall.lap("placement", t0)
        if self.memory is not None:  # collective; the same decision on every rank
            mem = self.memory.plan(self.spec, self.builder, src, self.layout_placement, dst,
                                   placement)
            (log.info if mem.mode == "background" else log.warning)("%s", mem.describe(), extra=ONCE)
            self.stall.lap("memory_check", t0)
            if not mem.fits:
                self.rejected.append(mem.describe())
                self.controller.done(d, "failed", mem.describe())
                self._record_outcome("failed", d, iteration, mem.describe())
                self.decision = None
                return
            in_pause = in_pause or mem.mode in ("in_pause", "release_a_grads")
            self._release_a_grads = mem.mode == "release_a_grads"
        if in_pause:
            log.info("%sswitch %s (%d ranks) -> %s (%d ranks) requested; groups built inside "
                     "the switch", when, src, src.world_size, dst, dst.world_size, extra=ONCE)
            self._sync_target = (dst, placement)
            return
        log.info("%sswitch %s (%d ranks) -> %s (%d ranks) requested; choosing its placement, "
                 "building its groups and objects in the background while training goes on",
                 when, src, src.world_size, dst, dst.world_size, extra=ONCE)
        start_preparation(self.devices, self.builder, src, self.layout_placement, dst,
                          dst_placement=placement, choose_placement=self._choose_placement,
                          ranks_per_node=self.ranks_per_node,
                          move_weights=moves_weights(self.spec, dst),
                          memory_budget=self.memory_budget, faults=self.faults, src_objs=objs)

    def _choose_placement(self, dst: Layout) -> Placement:
        """B's placement from the current layout (pure: every rank alone gets the same)."""
        return choose_dst_placement(self.spec, self.builder, self.layout, self.layout_placement,
                                    dst, tuple(range(dst.world_size)), self.placement,
                                    self.ranks_per_node, moves_weights(self.spec, dst))

    def _record_outcome(self, outcome: str, d: Decision, it: Optional[int], reason: str) -> None:
        self.stall.report.outcome(outcome, d, it, self.layout, self.controller.last_request,
                                  reason)

    def _switch(self, trainer: Optional[Trainer]) -> Optional[Trainer]:
        with self.stall.attempt():  # the last switch's stall first; see StallTracker.attempt
            return self._switch_now(trainer)

    def _switch_now(self, trainer: Optional[Trainer]) -> Optional[Trainer]:
        src, src_placement = self.layout, self.layout_placement
        decision = self.decision
        # A's objects whose gradient buffers this switch frees (restored if it rolls back)
        released = trainer.objs if self._release_a_grads and trainer is not None else None
        self._release_a_grads = False
        t0 = time.perf_counter()
        if self._sync_target is not None:
            # the classic way, for comparison: the new groups are part of the pause
            (dst, dst_placement), self._sync_target = self._sync_target, None
            if released is not None:
                release_grad_buffers(released)  # room for B (the memory plan's degraded mode)
            t1 = time.perf_counter()
            kw = dict(new_groups=build_groups(dst, dst_placement))  # B built in the pause too
            groups_s = self.stall.lap("groups", t1) - t1
        else:
            dst, dst_placement = self.devices.target
            kw, error = {}, None
            t1 = time.perf_counter()
            try:  # raises on every rank alike or on none (DeviceManager.take)
                kw = prepared_switch_args(self.devices)
            except Exception as e:  # noqa: BLE001 - B's groups or preparation failed
                error = e
            self.stall.lap("warm_up", t1)
            if error is not None:  # every rank gives up alike, A untouched
                return self._preparation_failed(trainer, dst, kw, error)
            if kw.get("new_groups") is not None:
                dst_placement = kw["new_groups"].placement  # chosen in the background
            groups_s = self.devices.build_seconds
            t0 = time.perf_counter()
        timings: dict[str, float] = {}
        # A's memory is collected after B's first steps unless the memory plan needs it now
        defer = released is None and "groups" not in self.stall.laps and trainer is not None
        try:
            trainer, res = switch_trainer(
                trainer, self.builder, src, src_placement, dst,
                dst_devices=dst_placement.devices, ranks_per_node=self.ranks_per_node,
                memory_budget=self.memory_budget, move_weights=moves_weights(self.spec, dst),
                timeout=self.timeout, timings=timings, release_a_later=defer, **kw)
        except Exception:
            if released is not None:
                restore_grad_buffers(released)
            self.controller.done(self.decision, "failed", "switch raised; see the job log")
            self._record_outcome("failed", decision, None, "switch raised; see the job log")
            raise
        if released is not None and res.aborted:
            restore_grad_buffers(released)  # A trains on
        if self.memory is not None:
            self.memory.forget_peaks()  # this step's peak held A and B together
        if res.aborted:
            self.failed.append(res.aborted)
            self.controller.done(self.decision, "failed", res.aborted)
            self._record_outcome("failed", decision, trainer.iteration if trainer else None,
                                 res.aborted)
            log.error("switch rolled back; training continues at %s", src)
            return trainer
        self.layout, self.layout_placement = dst, res.placement
        self.lead.switched(None if "groups" in self.stall.laps else self.devices)
        self.stall.collect_pending = self.stall.collect_pending or (defer and trainer is not None)
        pause = time.perf_counter() - t0
        t1 = time.perf_counter()
        if decision is not None:
            self.controller.done(decision, "applied", f"switched at iteration {trainer.iteration}"
                                 if trainer is not None else "switched")
        self.stall.lap("controller", t1)
        if trainer is None:
            log.info("switched %s -> %s: this rank is not in the new layout; on standby",
                     src, dst)
            if defer:  # on standby: nothing to measure first
                collect_released()
            return None
        r = res.report
        phases = {k: round(v, 4) for k, v in r.phases.items()}
        if not self.background_groups:
            phases["groups"] = round(groups_s, 4)
        prepared = {k: round(v, 4) for k, v in r.background.items()} | (
            {"placement": round(self.devices.placement_seconds, 4)} if r.background else {})
        rec = SwitchRecord(trainer.iteration, str(src), str(dst), r.placement, r.bytes_moved,
                           r.lower_bound_bytes, pause, groups_s, phases,
                           groups_in_pause="groups" in self.stall.laps, prepared=prepared,
                           source=decision.source if decision else "signal",
                           reason=decision.note if decision else "")
        self.history.append(rec)
        when, self._waited_s = landing_note(decision.at if decision else None,
                                            trainer.iteration, self._waited_s), 0.0
        self.stall.begin(rec, r.phases, timings, dict(
            when=when, request=self.controller.last_request if decision else None,
            transfer_s=r.phases.get("transfer", 0.0), groups=trainer.objs.groups, dst=dst))
        return trainer

    def _admit(self, trainer: Optional[Trainer], d: Decision) -> Optional[Trainer]:
        """Grow the world with the joiners accepted at this poll (every process calls it
        with the same decision; loop/growth.py). Returns the trainer rebuilt on it."""
        accepted = [v for v in d.joins if v.accepted]
        if not accepted:
            return trainer
        if not self.rendezvous_dir:
            log.warning("%d joiner(s) accepted but not admitted: growing the world needs "
                        "--dynatrain-rendezvous-dir", len(accepted))
            return trainer
        from ..elastic.join import JoinError, join_store
        from . import growth

        generation = accepted[0].generation
        world = dist.get_world_size() + len(accepted)
        reviewer = self.controller.joins
        try:
            store = join_store(self.rendezvous_dir)  # the reviewer's and the joiner's
        except JoinError as e:
            # it became unsafe since the reviewer opened it: every rank sees the same
            # (shared) directory, so all give up alike
            log.error("accepted joiner(s) not admitted: %s", e)
            if reviewer is not None:
                reviewer.accepted.clear()
            return trainer
        # only a joiner that is a training process (`--dynatrain-join`) says it is ready (a
        # word tagged with the secret); an accepted `dynatrain join` (which only asks) never
        # does, and the world stays as is. Rank 0 (it holds the secret) sends the others the
        # secret meeting prefix over the job's own communicator.
        box = [None, None]
        if dist.get_rank() == 0 and reviewer is not None:
            ok = growth.all_ready(store, generation, accepted, reviewer.secret, reviewer.nonce)
            box = [ok, growth.meeting_prefix(reviewer.secret, reviewer.nonce, generation)]
        dist.broadcast_object_list(box, src=0)
        ok, prefix = box
        if not ok:
            log.warning("%d accepted joiner(s) did not come to enter the world: not admitted",
                        len(accepted))
            if reviewer is not None:
                reviewer.accepted.clear()
            return trainer
        if dist.get_rank() == 0:
            growth.announce(store, prefix, world, self.layout, self.layout_placement,
                            reviewer.secret)
        self._drop_preparation(broken=False)  # it belongs to the old world
        if trainer is not None:
            self.stall.finish()  # the last switch's, over the old world's layout
        self.channel.forget()
        t0 = time.perf_counter()
        trainer = growth.grow_world(trainer, self.spec, self.builder.train, store, prefix,
                                    world, self.layout, self.layout_placement, self.timeout,
                                    builder=self.builder)
        self.channel.renew()  # collective, as the joiners' `start`
        if reviewer is not None:  # rank 0: number the next joiners after these
            reviewer.world_size, reviewer.generation = world, generation + 1
            reviewer.accepted.clear()
        pause = time.perf_counter() - t0
        self.admitted.append(dict(iteration=trainer.iteration if trainer else None,
                                  joiners=[v.origin for v in accepted], world=world,
                                  pause_s=round(pause, 4)))
        log.info("admitted %d joiner(s): the world has %d processes (%.3f s)", len(accepted),
                 world, pause)
        return trainer

    def _preparation_failed(self, trainer: Optional[Trainer], dst: Layout, kw: dict,
                            error: Optional[BaseException]) -> Optional[Trainer]:
        """B's background build or preparation failed on some rank: free what was built,
        file the request as failed and train on at A."""
        from .switching import discard_prepared, free_layout

        if kw.get("prepared") is not None:
            discard_prepared(kw["prepared"])
        elif kw.get("new_groups") is not None:
            free_layout(None, kw["new_groups"])
        self._drop_preparation(broken=False)
        reason = (f"preparing {dst} failed: {type(error).__name__}: {str(error)[:500]}"
                  if error is not None else f"preparing {dst} failed on another rank")
        log.error("%s; training continues at %s", reason, self.layout)
        self.failed.append(reason)
        if self.decision is not None:
            self.controller.done(self.decision, "failed", reason)
        self.decision = None
        return trainer

    def _drop_preparation(self, broken: bool, wait: Optional[float] = 10.0) -> None:
        """Free a switch being prepared in the background (groups, B's objects) and start
        afresh: the world it was prepared for is changing, or the job ends. `wait`: how long
        to wait for the background work (None: until it ends)."""
        from .switching import discard_prepared, free_layout

        groups, prepared = self.devices.abandon(wait)
        if prepared is not None:
            discard_prepared(prepared, broken=broken)
        else:
            free_layout(None, groups, broken)
        self.devices = DeviceManager()

    @property
    def generation(self) -> int:
        """The world's generation: how many recoveries after a rank death re-formed it
        (each renumbers the survivors)."""
        return len(self.recoveries)

    @property
    def faults(self) -> Optional[FaultPlan]:
        """The fault plan of the current world (`transition/faults.py`), if any."""
        return plan_for(self.fault_plans, self.generation)

    def can_recover(self, error: BaseException) -> bool:
        """Whether `error` is a dead peer's (`is_dead_peer`) and this job can recover from
        it: a rendezvous directory is set and the recovery budget is not spent."""
        return (bool(self.rendezvous_dir) and len(self.recoveries) < self.max_recoveries
                and is_dead_peer(error))

    def recover(self, trainer: Optional[Trainer], error: str) -> tuple[str, Optional[Trainer]]:
        """Every survivor calls this after a failed communication (see `can_recover`).
        Returns ("train", trainer) on a rank of the new layout, ("standby", None) on a
        survivor the new world keeps without state, ("leave", None) on one it does not
        need (the process ends)."""
        from .death_recovery import recover_after_death

        log.error("communication failed (%s): a rank is gone; recovering", error[:200])
        self.stall.drop(broken=True)  # the last switch's ranks cannot share its stall now
        self._drop_preparation(broken=True)  # built for the old world: cannot finish
        self.channel.forget()  # the broken world's: its sockets must close
        self._sync_target = None
        if self.decision is not None and self.decision.target is not None:
            self.controller.done(self.decision, "failed", "a rank died; the job recovered")
            self.decision = None
        rec = recover_after_death(trainer, self.spec, self.builder.train, self.rendezvous_dir,
                                  self.recovery_checkpoint, generation=self.generation + 1,
                                  timeout=self.timeout, layout=self.layout,
                                  placement=self.layout_placement, choose=self._survivor_layout(),
                                  host=self.host, builder=self.builder)
        src = self.layout
        self.layout = rec.layout
        self.layout_placement = Placement(tuple(range(rec.layout.world_size)))
        entry = dict(kind="recovery", iteration=(rec.trainer.iteration if rec.trainer else None),
                     src=str(src), dst=str(rec.layout), mode=rec.mode, dead=list(rec.world.dead),
                     survivors=list(rec.world.survivors), lost=rec.lost,
                     pause_s=rec.switch.pause_seconds if rec.switch else None,
                     reason=rec.note)
        self.recoveries.append(entry)
        if rec.world.rank is None:
            return "leave", None
        self.channel.renew()  # collective: every member of the new world is here
        if dist.get_rank() == 0:
            self.stall.report.record("recovery", entry)
        if rec.trainer is None:
            return "standby", None
        return "train", rec.trainer

    def _survivor_layout(self):
        """With auto-layout, how recovery chooses the survivors' layout: the advisor's best
        of the most survivors it can serve, with the note saying why (None: recovery's
        own rule, the old layout's model parallelism with the largest DP that fits)."""
        if not self.auto_layout or self.advisor is None:
            return None
        advisor = self.advisor

        def choose(n: int) -> tuple[Layout, str]:
            c = advisor.best_at_most(n, f"auto-layout: {n} survivors after a rank death")
            return c.layout, c.note
        return choose

    def end_job(self, trainer: Optional[Trainer]) -> None:
        """Every rank of the layout, once, after its last step (collective with the ranks
        on standby, if any): a switch still being prepared is cancelled everywhere (its
        background work ends before this returns, so nothing of it outlives the world) and
        its request filed as not applied; the standby ranks leave `standby()`."""
        layout_group, standby = vote_groups(self.layout, self.channel, trainer)
        out = self.layout is not None and self.layout.world_size < dist.get_world_size()
        if self.devices.pending:
            if out:  # standby ranks wait in the preparation's vote: this one says stop
                self.devices.vote(layout_group, standby, stop=True)
            it = trainer.iteration if trainer is not None else "?"
            self._cancel_preparation(f"the job ended after iteration {it}, before the "
                                     f"switch was ready")
            return
        if out:
            self.controller.stop(standby)

    def _cancel_preparation(self, reason: str) -> None:
        """The job ends with a switch still being prepared: wait for its background work
        (its collectives run on B's groups, with peers doing the same), free it, and file
        the request as not applied, with `reason`."""
        target = self.devices.target[0] if self.devices.target else "?"
        # a healthy preparation ends within its deadline; one blocked on a dead peer is left
        self._drop_preparation(broken=False, wait=self.devices.deadline_s)
        reason = f"not applied: {reason} (switch to {target})"
        log.warning("%s", reason)
        if self.decision is not None:
            self.controller.done(self.decision, "not_applied", reason)
            self.decision = None

    def finish(self, trainer: Trainer, checkpoint_seconds: Optional[float] = None) -> str:
        """At the end of training, on every rank holding training state: tell the launcher
        this worker completed (`loop/launch.py`), then the summary table of all switches
        (logged on rank 0, returned). The last switch's stall is shared here if it was not."""
        from .launch import report_completed

        self.stall.finish()
        report_completed()
        if self.controller.signal_path and dist.get_rank() == 0:
            job_presence.withdraw(self.controller.signal_path)
        text = summary(self.history, self.stall.stalls, self.rejected, self.failed,
                       self.recoveries, checkpoint_seconds)
        log.info(text, extra=ONCE)
        return text

