"""Prepare a switch in the background while the job trains, as the hook does on a request
(shared by the multi-rank tests and the benchmark, which drive the switch themselves)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from ..elastic.device_manager import DeviceManager
from ..loop.switching import prepared_switch_args, start_preparation
from ..mcore.builders import MegatronBuilder
from ..mcore.training import Trainer
from ..transition.switch import choose_dst_placement
from ..vps.layout import Layout
from ..vps.placement import Placement


@dataclass(frozen=True, slots=True)
class PreparedWhileTraining:
    """B made ready while A trained; this rank's own figures (not reduced over ranks)."""

    switch_args: dict[str, Any]  # `switch_trainer`'s keyword arguments
    step_seconds: tuple[float, ...]  # the steps A trained meanwhile (at least one)
    placement_seconds: float  # choosing B's placement (before the thread starts)
    groups_seconds: float  # B's groups, in the thread
    work_seconds: float  # the switch's preparation after the groups, in the thread
    wall_seconds: float  # from the request to every rank ready


def prepare_while_training(trainer: Trainer, builder: MegatronBuilder, src: Layout,
                           src_placement: Placement, dst: Layout, *, placement: str,
                           ranks_per_node: int, memory_budget: Optional[int],
                           move_weights: bool) -> PreparedWhileTraining:
    """Every rank: choose B's placement, start B's groups and the switch's preparation in
    a `DeviceManager` thread, and train at A until every rank is ready (one collective per
    step boundary, as the hook asks)."""
    t0 = time.perf_counter()
    dst_placement = choose_dst_placement(builder.spec, builder, src, src_placement, dst,
                                         tuple(range(dst.world_size)), placement,
                                         ranks_per_node, move_weights)
    t_placement = time.perf_counter() - t0
    dm = start_preparation(DeviceManager(), builder, src, src_placement, dst,
                           dst_placement=dst_placement, ranks_per_node=ranks_per_node,
                           memory_budget=memory_budget, move_weights=move_weights,
                           src_objs=trainer.objs)
    steps = []
    while True:
        steps.append(trainer.step().seconds)
        if dm.ready():
            break
    return PreparedWhileTraining(prepared_switch_args(dm), tuple(steps), t_placement,
                                 dm.build_seconds, dm.prepare_seconds,
                                 time.perf_counter() - t0)
