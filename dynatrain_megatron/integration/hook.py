"""The training-step hook: one call after the optimizer step and iteration accounting
(where Megatron-LM calls `checkpoint_and_decide_exit`).

It polls the controller, starts building the target layout's groups in the background,
and at a later step boundary, once every rank has them, switches the training state and
rebinds the trainer (model, optimizer, scheduler, data position, forward-backward function,
micro-batch count). Importing it needs megatron-core only, not Megatron-LM.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch.distributed as dist

from ..elastic.controller import Controller, Decision, load_schedule
from ..elastic.device_manager import DeviceManager
from ..elastic.groups import build_groups
from ..elastic.join import open_reviewer
from ..transition.faults import FaultPlan
from ..transition.switch import choose_dst_placement
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.memory import check_memory_fit
from ..vps.placement import Placement
from .auto_layout import LayoutAdvisor
from .builders import MegatronBuilder, TrainingObjects, bucket_size_of
from .switching import WorldBroken, prepared_switch_args, start_preparation, switch_trainer
from .train_config import TrainConfig
from .training import Trainer

log = logging.getLogger("dynatrain")


@dataclass
class SwitchRecord:
    """One row of the end-of-run summary."""

    iteration: int
    src: str
    dst: str
    placement: str
    bytes_moved: int
    lower_bound_bytes: int
    pause_s: float
    groups_s: float  # building the new layout's groups
    phases: dict = field(default_factory=dict)
    groups_in_pause: bool = False  # True only with background_groups=False (comparison)
    # B's build, binding, check and plan, done in the background while A trained
    prepared: dict = field(default_factory=dict)
    source: str = "signal"  # who asked: "signal", "schedule", "auto"
    reason: str = ""  # when the job chose the layout: why, and the advisor's top rows


class DynatrainHook:
    def __init__(self, spec: ModelSpec, train: TrainConfig, controller: Controller, *,
                 ranks_per_node: int = 8, memory_budget: Optional[int] = None,
                 placement: str = "best", log_dir: Optional[str] = None,
                 background_groups: bool = True, timeout: Optional[float] = None,
                 rendezvous_dir: Optional[str] = None,
                 recovery_checkpoint: Optional[str] = None, max_recoveries: int = 8,
                 advisor: Optional[LayoutAdvisor] = None, auto_layout: bool = False) -> None:
        self.spec = spec
        self.builder = MegatronBuilder(spec, train)
        self.controller = controller
        self.ranks_per_node = ranks_per_node
        self.memory_budget = memory_budget
        self.placement = placement
        self.log_dir = log_dir
        self.background_groups = background_groups
        self.devices = DeviceManager()
        self.decision: Optional[Decision] = None
        self.layout: Optional[Layout] = None  # the current layout, known on every process
        self.layout_placement: Optional[Placement] = None
        self.stopped = False
        self.failed: list[str] = []  # reasons of switches that were rolled back
        self._sync_target: Optional[tuple[Layout, Placement]] = None
        self.timeout = timeout
        self.history: list[SwitchRecord] = []
        self.rejected: list[str] = []
        # rank death (integration/recovery.py): where survivors meet, what they resume from
        self.rendezvous_dir = rendezvous_dir
        self.recovery_checkpoint = recovery_checkpoint
        self.max_recoveries = max_recoveries
        self.recoveries: list[dict] = []
        self.admitted: list[dict] = []  # joiners that grew the world (integration/grow.py)
        self.faults = FaultPlan.from_env()  # DYNATRAIN_FAULTS, e.g. a rank killed at a step
        # the layout advisor: answers requests without a layout; with auto_layout the job
        # also moves to its choice when the device count changes (integration/auto_layout.py)
        self.advisor = advisor
        self.auto_layout = auto_layout
        if advisor is not None:
            controller.advise = advisor.advise
            controller.auto_layout = auto_layout

    @classmethod
    def from_args(cls, args: argparse.Namespace, spec: ModelSpec, train: TrainConfig) -> "DynatrainHook":
        schedule = load_schedule(args.dynatrain_schedule) if args.dynatrain_schedule else None
        def check(lay: Layout) -> None:
            _check_batch(train, lay)
            if args.dynatrain_device_memory:
                check_memory_fit(spec, lay, args.dynatrain_device_memory,
                                 bucket_size=bucket_size_of(train, lay))

        ctl = Controller(spec, args.dynatrain_signal_file, args.dynatrain_poll_interval, schedule,
                         extra_check=check)
        # join requests (elastic/join.py): reviewed on rank 0 at each poll when configured
        ctl.joins = open_reviewer(args.dynatrain_rendezvous_dir, args.dynatrain_secret_file)
        advisor = LayoutAdvisor(spec, train, device_memory_bytes=args.dynatrain_device_memory)
        return cls(spec, train, ctl, ranks_per_node=args.dynatrain_ranks_per_node,
                   advisor=advisor, auto_layout=getattr(args, "dynatrain_auto_layout", False),
                   memory_budget=args.dynatrain_memory_budget,
                   placement="default" if args.dynatrain_default_placement else "best",
                   log_dir=args.dynatrain_log_dir, timeout=args.dynatrain_timeout,
                   rendezvous_dir=args.dynatrain_rendezvous_dir,
                   recovery_checkpoint=args.dynatrain_recovery_checkpoint)

    def start(self, trainer: Optional[Trainer], layout: Layout, placement: Placement) -> None:
        """Tell the hook the job's first layout; every process calls it (standby ranks,
        outside the layout, with `trainer=None`)."""
        self.layout, self.layout_placement = layout, placement

    def after_step(self, trainer: Trainer) -> Optional[Trainer]:
        """Call after every optimizer step, on every rank of the layout. Returns the
        (rebound) trainer, or None when this rank left the layout (scale-in): it is then on
        standby and calls `standby()`."""
        if self.layout is None:
            self.start(trainer, trainer.objs.layout, trainer.objs.groups.placement)
        if self.faults is not None:
            self.faults.fail(dist.get_rank(), "step", trainer.iteration)
        if self.devices.pending:
            if self.devices.ready():
                return self._switch(trainer)
            return trainer
        d = self.controller.poll(trainer.iteration, self.layout.world_size)
        trainer = self._admit(trainer, d)
        self._on_decision(d, trainer.iteration, trainer.objs)
        if self._sync_target is not None:
            return self._switch(trainer)
        return trainer

    def standby(self) -> Optional[Trainer]:
        """A process outside the current layout: take part in every collective of the
        controller and the device manager until a switch brings it in (returns its trainer)
        or the job ends (returns None, `self.stopped` is set). Holds no training state."""
        while True:
            if self.devices.pending:
                if self.devices.ready():
                    trainer = self._switch(None)
                    if trainer is not None:
                        return trainer
                continue
            d = self.controller.follow()
            if d.stop:
                self.stopped = True
                return None
            self._admit(None, d)
            self._on_decision(d, None)
            if self._sync_target is not None:
                trainer = self._switch(None)
                if trainer is not None:
                    return trainer

    def _on_decision(self, d: Decision, iteration: Optional[int],
                     objs: Optional[TrainingObjects] = None) -> None:
        if d.rejected:
            self.rejected.append(d.rejected)
        if d.target is None:
            return
        src = self.layout
        if d.target == str(src) and d.world == src.world_size:
            log.info("already at layout %s: nothing to do", src)
            self.controller.done(d, "applied", "already at this layout")
            return
        dst = Layout.parse(d.target, d.world)
        if d.note:
            log.info("iteration %s: %s", iteration, d.note)
        placement = choose_dst_placement(self.spec, self.builder, src, self.layout_placement,
                                         dst, tuple(range(dst.world_size)), self.placement,
                                         self.ranks_per_node)
        self.decision = d
        if not self.background_groups:
            log.info("iteration %s: switch %s (%d ranks) -> %s (%d ranks) requested; groups "
                     "built inside the switch", iteration, src, src.world_size, dst,
                     dst.world_size)
            self._sync_target = (dst, placement)
            return
        log.info("iteration %s: switch %s (%d ranks) -> %s (%d ranks) requested; building "
                 "its groups and objects in the background while training goes on",
                 iteration, src, src.world_size, dst, dst.world_size)
        start_preparation(self.devices, self.builder, src, self.layout_placement, dst,
                          dst_placement=placement, ranks_per_node=self.ranks_per_node,
                          memory_budget=self.memory_budget, faults=self.faults, src_objs=objs)

    def _switch(self, trainer: Optional[Trainer]) -> Optional[Trainer]:
        src, src_placement = self.layout, self.layout_placement
        t0 = time.perf_counter()
        if self._sync_target is not None:
            # the classic way, for comparison: the new groups are part of the pause
            (dst, dst_placement), self._sync_target = self._sync_target, None
            kw = dict(new_groups=build_groups(dst, dst_placement))  # B built in the pause too
            groups_s = time.perf_counter() - t0
        else:
            dst, dst_placement = self.devices.target
            kw = prepared_switch_args(self.devices)
            groups_s = self.devices.build_seconds
            t0 = time.perf_counter()
        try:
            trainer, res = switch_trainer(trainer, self.builder, src, src_placement,
                                          dst, dst_devices=dst_placement.devices,
                                          ranks_per_node=self.ranks_per_node,
                                          memory_budget=self.memory_budget,
                                          timeout=self.timeout, **kw)
        except Exception:
            self.controller.done(self.decision, "failed", "switch raised; see the job log")
            raise
        if res.aborted:
            self.failed.append(res.aborted)
            self.controller.done(self.decision, "failed", res.aborted)
            log.error("switch rolled back; training continues at %s", src)
            return trainer
        self.layout, self.layout_placement = dst, res.placement
        pause = time.perf_counter() - t0
        if trainer is None:
            log.info("switched %s -> %s: this rank is not in the new layout; on standby",
                     src, dst)
            return None
        r = res.report
        phases = {k: round(v, 4) for k, v in r.phases.items()}
        if not self.background_groups:
            phases["groups"] = round(groups_s, 4)
        rec = SwitchRecord(trainer.iteration, str(src), str(dst), r.placement, r.bytes_moved,
                           r.lower_bound_bytes, pause, groups_s, phases,
                           groups_in_pause=not self.background_groups,
                           prepared={k: round(v, 4) for k, v in r.background.items()},
                           source=self.decision.source if self.decision else "signal",
                           reason=self.decision.note if self.decision else "")
        self.history.append(rec)
        self.controller.done(self.decision, "applied", f"switched at iteration {trainer.iteration}")
        log.info("iteration %d: switched %s -> %s (placement %s): %.2f MB moved (lower bound "
                 "%.2f MB), pause %.3f s [bind %.3f, plan %.3f, transfer %.3f, rebuild %.3f], "
                 "groups %.3f s %s%s", trainer.iteration, src, dst, r.placement,
                 r.bytes_moved / 1e6, r.lower_bound_bytes / 1e6, pause, r.phases.get("bind", 0),
                 r.phases.get("plan", 0), r.phases.get("transfer", 0), r.phases.get("rebuild", 0),
                 groups_s, "inside the pause" if rec.groups_in_pause else "in the background",
                 "; B built %.3f s, bound %.3f s, planned %.3f s in the background" % (
                     r.background.get("build", 0), r.background.get("bind", 0),
                     r.background.get("plan", 0)) if r.background else "")
        self._log_event(asdict(rec))
        return trainer

    def _log_event(self, entry: dict) -> None:
        """One line of `switches.jsonl` in the log directory (rank 0)."""
        if self.log_dir and dist.get_rank() == 0:
            os.makedirs(self.log_dir, exist_ok=True)
            with open(os.path.join(self.log_dir, "switches.jsonl"), "a") as f:
                f.write(json.dumps(entry) + "\n")

    def _admit(self, trainer: Optional[Trainer], d: Decision) -> Optional[Trainer]:
        """Grow the world with the joiners accepted at this poll (every process calls it
        with the same decision; integration/grow.py). Returns the trainer rebuilt on it."""
        accepted = [v for v in d.joins if v.accepted]
        if not accepted:
            return trainer
        if not self.rendezvous_dir:
            log.warning("%d joiner(s) accepted but not admitted: growing the world needs "
                        "--dynatrain-rendezvous-dir", len(accepted))
            return trainer
        from ..elastic.rejoin import rendezvous_store
        from . import grow

        generation = accepted[0].generation
        world = dist.get_world_size() + len(accepted)
        store = rendezvous_store(self.rendezvous_dir)
        # only a joiner that is a training process (`--dynatrain-join`) says it is ready; an
        # accepted `dynatrain join` (which only asks) never does, and the world stays as is
        box = [grow.all_ready(store, generation, [v.rank for v in accepted])
               if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        reviewer = self.controller.joins
        if not box[0]:
            log.warning("%d accepted joiner(s) did not come to enter the world: not admitted",
                        len(accepted))
            if reviewer is not None:
                reviewer.accepted.clear()
            return trainer
        if dist.get_rank() == 0:
            grow.announce(store, generation, world, self.layout, self.layout_placement)
        self._drop_preparation(broken=False)  # it belongs to the old world
        t0 = time.perf_counter()
        trainer = grow.grow_world(trainer, self.spec, self.builder.train, store, generation,
                                  world, self.layout, self.layout_placement, self.timeout)
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

    def _drop_preparation(self, broken: bool) -> None:
        """Free a switch being prepared in the background (groups, B's objects) and start
        afresh: the world it was prepared for is changing."""
        from .switching import discard_prepared, free_layout

        groups, prepared = self.devices.abandon()
        if prepared is not None:
            discard_prepared(prepared, broken=broken)
        else:
            free_layout(None, groups, broken)
        self.devices = DeviceManager()

    def can_recover(self, error: BaseException) -> bool:
        """Whether `error` looks like a dead peer and this job can recover from it: a
        rendezvous directory is set, the recovery budget is not spent, and the error is
        a failed communication (never a bug of ours or of the model, which would repeat)."""
        if not self.rendezvous_dir or len(self.recoveries) >= self.max_recoveries:
            return False
        if isinstance(error, WorldBroken) or isinstance(error, getattr(dist, "DistError", ())):
            return True
        text = str(error)
        return isinstance(error, RuntimeError) and any(
            m in text for m in ("Connection closed by peer", "Connection reset by peer",
                                "Broken pipe", "NCCL communicator was aborted",
                                "NCCL error", "Timed out"))

    def recover(self, trainer: Optional[Trainer], error: str) -> tuple[str, Optional[Trainer]]:
        """Every survivor calls this after a failed communication (see `can_recover`).
        Returns ("train", trainer) on a rank of the new layout, ("standby", None) on a
        survivor the new world keeps without state, ("leave", None) on one it does not
        need (the process ends)."""
        from .recovery import recover_after_death

        log.error("communication failed (%s): a rank is gone; recovering", error[:200])
        self._drop_preparation(broken=True)  # built for the old world: cannot finish
        self._sync_target = None
        if self.decision is not None and self.decision.target is not None:
            self.controller.done(self.decision, "failed", "a rank died; the job recovered")
            self.decision = None
        rec = recover_after_death(trainer, self.spec, self.builder.train, self.rendezvous_dir,
                                  self.recovery_checkpoint, generation=len(self.recoveries) + 1,
                                  timeout=self.timeout, layout=self.layout,
                                  placement=self.layout_placement, choose=self._survivor_layout())
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
        self._log_event(entry)
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

    def stop_standby(self) -> None:
        """Collective with the standby ranks waiting in `standby()`: the job is over.
        Every rank of the layout calls it once, after its last step."""
        self.controller.stop()

    def finish(self, trainer: Trainer, checkpoint_seconds: Optional[float] = None) -> str:
        """The summary table of all switches (logged on rank 0, returned)."""
        lines = ["", "dynatrain switches:",
                 f"{'iter':>5} {'from':>18} {'to':>18} {'moved MB':>9} {'pause s':>8} "
                 f"{'transfer s':>10} {'groups s (bg)':>13}"
                 + (f" {'ckpt path s':>11} {'speedup':>8}" if checkpoint_seconds else "")]
        for h in self.history:
            row = (f"{h.iteration:>5} {h.src:>18} {h.dst:>18} {h.bytes_moved / 1e6:>9.2f} "
                   f"{h.pause_s:>8.3f} {h.phases.get('transfer', 0):>10.3f} {h.groups_s:>13.3f}")
            if checkpoint_seconds:
                row += f" {checkpoint_seconds:>11.2f} {checkpoint_seconds / h.pause_s:>7.1f}x"
            lines.append(row)
        if self.rejected:
            lines.append(f"rejected requests: {len(self.rejected)}")
            lines += [f"  - {r}" for r in self.rejected]
        if self.failed:
            lines.append(f"switches rolled back: {len(self.failed)}")
            lines += [f"  - {r}" for r in self.failed]
        for r in self.recoveries:
            lines.append(f"recovered from the death of ranks {r['dead']}: {r['src']} -> "
                         f"{r['dst']} ({'in memory' if r['mode'] == 'memory' else 'from the checkpoint'})"
                         + (f", pause {r['pause_s']:.3f} s" if r['pause_s'] else ""))
        text = "\n".join(lines)
        log.info(text)
        return text


def _check_batch(train: TrainConfig, layout: Layout) -> None:
    if train.global_batch_size % (train.micro_batch_size * layout.dp):
        raise DynatrainError(f"global batch {train.global_batch_size} is not divisible by "
                             f"micro batch {train.micro_batch_size} * dp {layout.dp} of {layout}")
    m = train.global_batch_size // (train.micro_batch_size * layout.dp)
    if layout.vpp > 1 and m % layout.pp:
        # megatron-core's interleaved schedule raises at the first step otherwise
        raise DynatrainError(f"{layout}: the interleaved schedule (vpp{layout.vpp}) needs a "
                             f"multiple of pp {layout.pp} micro-batches, the batch gives {m}")
