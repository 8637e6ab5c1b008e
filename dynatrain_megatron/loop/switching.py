"""Switch a running `Trainer` to another layout and rebind the training loop to it."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist

from ..elastic.communicators import warm_up_pipeline
from ..elastic.device_manager import DeviceManager
from ..elastic.groups import ParallelGroups, build_groups, install
from ..transition.faults import FaultPlan, start_preparation_delays
from ..transition.scalars import read_scalars
from ..transition.switch import choose_dst_placement, prepare_switch, switch_layout
from ..transition.switch_types import Prepared, SwitchOptions, SwitchResult
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.placement import Placement
from ..mcore.builders import MegatronBuilder, TrainingObjects
from ..mcore.session import release
from ..mcore.training import Trainer

log = logging.getLogger("dynatrain")


def switch_trainer(trainer: Optional[Trainer], builder: MegatronBuilder, src: Layout,
                   src_placement: Placement, dst: Layout, *,
                   dst_devices: Optional[Sequence[int]] = None, placement: str = "best",
                   ranks_per_node: int = 8, memory_budget: Optional[int] = None,
                   move_weights: bool = False, new_groups: Optional[ParallelGroups] = None,
                   timeout: Optional[float] = None, faults: Optional[FaultPlan] = None,
                   prepared: Optional[Prepared] = None, timings: Optional[dict] = None,
                   release_a_later: bool = False) -> tuple[Optional[Trainer], SwitchResult]:
    """Every rank of the world calls this at the same step boundary.

    `prepared`: B made ready in the background (`elastic.device_manager`), which leaves
    only the data movement to the pause.

    `timings`, when given, gets the seconds of what this adds around the switch itself:
    "scalars" (reading them), "release_a" (A's objects and groups freed), "rebind".
    `release_a_later`: A's objects are released, but the collection that frees their
    memory is left to the caller (`mcore.session.collect_released`), and so is the destroy
    of A's groups where B keeps every rank of A.

    Returns the trainer rebound to layout B (None on a rank that is not part of B) and the
    switch result; A's objects and process groups are released. If the switch aborted
    (`result.aborted`), B is discarded and the *same* trainer is returned, at A, with its
    groups and RNG states as before the attempt.
    """
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    old = trainer.objs if trainer is not None else None
    scalars = (read_scalars(old, trainer.iteration, trainer.consumed_samples)
               if trainer is not None else None)
    options = SwitchOptions(placement=placement, ranks_per_node=ranks_per_node,
                            memory_budget=memory_budget, move_weights=move_weights,
                            masters_are_weights=masters_are_weights(builder.spec),
                            timeout=timeout)
    timings["scalars"] = time.perf_counter() - t0
    res = switch_objects(old, builder, src, src_placement, dst, scalars, options,
                         dst_devices=dst_devices, new_groups=new_groups, faults=faults,
                         prepared=prepared)
    if res.aborted:
        return trainer, res
    t0 = time.perf_counter()
    if old is not None:
        # A's groups go with that collection where every rank of A is in B (a destroy may
        # be collective: mcore.session.release)
        release(old, collect_later=release_a_later,
                groups_later=release_a_later and set(src_placement.devices) <= set(
                    res.placement.devices), free=True, keep=res.objs)
    timings["release_a"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if res.objs is None:
        res.groups.destroy()
        return None, res
    install(res.groups)
    if trainer is None:
        trainer = Trainer(builder.spec, builder.train, res.objs)
    else:
        trainer.rebind(res.objs)
    trainer.iteration = res.scalars.iteration
    trainer.consumed_samples = res.scalars.consumed_samples
    timings["rebind"] = time.perf_counter() - t0
    return trainer, res


def switch_objects(old: Optional[TrainingObjects], builder: Any, src: Layout,
                   src_placement: Placement, dst: Layout, scalars: Any, options: SwitchOptions,
                   *, dst_devices: Optional[Sequence[int]] = None,
                   new_groups: Optional[ParallelGroups] = None,
                   faults: Optional[FaultPlan] = None,
                   prepared: Optional[Prepared] = None) -> SwitchResult:
    """`transition.switch.switch_layout` with its rollback on this process: the one switch
    of the training-step hook (signal file, schedule, automatic layouts: `switch_trainer`)
    and of the public API (`api.ElasticJob`). `old`: A's objects on this rank (None where
    it holds none); A's objects are not released here (the caller does, once committed).

    If the switch aborted (`result.aborted`), B is freed and megatron's globals and every
    RNG are A's again, as before the attempt. If its own collectives failed, the same, and
    `WorldBroken` is raised (a peer is gone: the caller recovers)."""
    rng = RngSnapshot.take()
    broken = None
    try:
        res = switch_layout(builder.spec, builder, old, src, src_placement, dst, build_groups,
                            scalars, options, dst_devices=dst_devices, new_groups=new_groups,
                            faults=faults, prepared=prepared)
    except Exception as e:  # noqa: BLE001 - the switch's own collectives (votes) failed
        broken = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    if broken is not None:
        # outside the handler, so that no traceback keeps B's objects (and their sockets)
        # alive; A was only read, so it is intact
        if prepared is not None:
            discard_prepared(prepared, broken=True)
        if old is not None:
            install(old.groups)
        rng.restore()
        log.error("switch %s -> %s broke the world (%s): recover from the survivors", src,
                  dst, broken)
        raise WorldBroken(f"switch {src} -> {dst}: {broken}")
    if res.aborted:
        # roll back: drop everything of B; A was only read, so it is exactly as it was
        free_layout(res.objs, res.groups)
        if old is not None:
            install(old.groups)  # B is only activated at the commit: a safety net
        rng.restore()
    return res


class WorldBroken(DynatrainError):
    """A collective of the switch itself failed: a rank died (or its link did). The
    trainer is still at A, untouched, but A's communicators may be broken: the caller
    recovers (`loop.death_recovery.recover_after_death`) instead of training on."""


def is_dead_peer(error: BaseException) -> bool:
    """Whether `error` is a failed communication (a peer died, or its link), never a bug of
    ours or of the model, which would repeat."""
    if isinstance(error, WorldBroken) or isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        m in text for m in ("Connection closed by peer", "Connection reset by peer",
                            "Broken pipe", "NCCL communicator was aborted", "NCCL error",
                            "Timed out"))


class RngSnapshot:
    """Every RNG a build touches (builders.seed_rngs): Python, numpy, torch, and megatron's
    model-parallel tracker. A rolled-back switch restores them, so training goes on as if
    the attempt had not happened."""

    def __init__(self, states: tuple) -> None:
        self.states = states

    @classmethod
    def take(cls) -> "RngSnapshot":
        import random

        import numpy as np
        import torch
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return cls((random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda,
                    {k: v.clone() for k, v in tracker.get_states().items()}))

    def restore(self) -> None:
        import random

        import numpy as np
        import torch
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        py, npy, th, cuda, tracker = self.states
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(th)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        get_cuda_rng_tracker().set_states(tracker)


def discard_prepared(prepared: Prepared, broken: bool = False) -> None:
    """Free a switch prepared in the background that will not run (its objects and its
    groups' communicators: after a death, a communicator's sockets close only with its
    last reference)."""
    free_layout(prepared.objs, prepared.groups, broken)
    prepared.objs = prepared.live = prepared.groups = None
    prepared.drop_source()  # A's binding holds A's objects (and, after a death, its sockets)


def free_layout(objs: Optional[TrainingObjects], groups: Optional[ParallelGroups],
                broken: bool = False) -> None:
    """Free a layout's objects (which destroys their groups), or only its groups on a rank
    that holds no objects of it."""
    if objs is not None:
        release(objs, broken=broken)
    elif groups is not None:
        groups.destroy(broken)


def start_preparation(manager: DeviceManager, builder: MegatronBuilder, src: Layout,
                      src_placement: Placement, dst: Layout, *,
                      dst_placement: Optional[Placement] = None, placement: str = "best",
                      choose_placement: Optional[Callable[[Layout], Placement]] = None,
                      ranks_per_node: int = 8, memory_budget: Optional[int] = None,
                      move_weights: bool = False, faults: Optional[FaultPlan] = None,
                      src_objs: Any = None) -> DeviceManager:
    """What happens when a request is accepted (every rank, same order), in `manager`'s
    background thread while A trains on: B's placement (unless given; by
    `choose_placement(dst)`, or the `placement` policy), B's groups and the switch's
    preparation (`prepare_switch`). At each step boundary the caller asks
    `manager.ready()` (collective) and, once true, switches with
    `**prepared_switch_args(manager)` (B's groups carry the placement chosen). `src_objs`:
    A's objects on this rank (None where it holds none), bound in the background too once
    A has taken a step."""
    def choose(layout: Layout) -> Placement:
        if choose_placement is not None:
            return choose_placement(layout)
        return choose_dst_placement(builder.spec, builder, src, src_placement, layout,
                                    tuple(range(layout.world_size)), placement,
                                    ranks_per_node, move_weights)

    def prepare(groups: ParallelGroups) -> Prepared:
        options = SwitchOptions(ranks_per_node=ranks_per_node, memory_budget=memory_budget,
                                move_weights=move_weights,
                                masters_are_weights=masters_are_weights(builder.spec))
        prepared = prepare_switch(builder.spec, builder, src, src_placement, dst, groups,
                                  options, background=True, faults=faults, src_objs=src_objs)
        warm_up_pipeline(groups, in_background=True)  # gloo: B's first P2P, out of the pause
        return prepared

    start_preparation_delays()
    manager.prepare(dst, dst_placement if dst_placement is not None else choose, background=True,
                    then=prepare)
    return manager


def moves_weights(spec: ModelSpec, dst: Layout) -> bool:
    """Whether a switch to `dst` moves the model weights with the optimizer state, rather
    than rebuilding them from the fp32 masters after the transfer.

    Where B's distributed optimizer shards its masters over more than one rank, the
    rebuild is an all-gather of the whole weight buffer over those ranks, after the
    transfer and in the pause: the same weights moved a second time, by a collective of
    its own. Moved with the transfer instead, they travel in its batched rounds, and the
    parts that already sit on their destination rank are copied locally. Elsewhere (a
    plain optimizer, or one rank per shard) the rebuild is a local copy or nothing, and
    the weights stay out of the transfer (they are replicated over DP: more bytes)."""
    if not spec.distributed_optimizer:
        return False
    return dst.dp * dst.cp > dst.doi or (bool(spec.num_moe_experts) and dst.edp > dst.doi)


def masters_are_weights(spec: ModelSpec) -> bool:
    """Whether the fp32 masters are views of the weights (fp32 weights under the
    distributed optimizer: megatron's main shard is a slice of the parameter buffer), so
    that a switch moving the weights moves them too (`SwitchOptions.masters_are_weights`;
    B's live state is checked for it before anything moves)."""
    return spec.distributed_optimizer and spec.params_dtype == "fp32"


def prepared_switch_args(manager: DeviceManager) -> dict:
    """`switch_trainer`'s keyword arguments for what `manager` prepared (after `ready()`)."""
    groups = manager.take()
    return dict(new_groups=groups, prepared=manager.take_prepared())


def vote_groups(layout: Optional[Layout], channel: Any, trainer: Optional[Trainer]) -> tuple:
    """(the layout's CPU group on a rank of it, the standby channel's group) where ranks
    are on standby and `channel` (`elastic.standby_channel.StandbyChannel`) belongs to this
    world; (None, None) otherwise: the controller and the votes then use the world (the
    same answer on every process)."""
    if layout is None or layout.world_size >= dist.get_world_size():
        return None, None
    standby = channel.group()
    if standby is None:
        return None, None
    if trainer is None:
        return None, standby
    g = trainer.objs.groups
    layout_group = g.layout_group_cpu or g.layout_group
    if layout_group is None:
        raise DynatrainError(f"rank {dist.get_rank()} of {layout} has no group of its "
                             f"layout to vote on")
    return layout_group, standby
