"""Switch a running `Trainer` to another layout and rebind the training loop to it."""
from __future__ import annotations

import logging
from typing import Optional, Sequence


from ..elastic.groups import ParallelGroups, build_groups, install
from ..transition.switch import SwitchResult, read_scalars, switch_layout
from ..vps.layout import Layout
from ..vps.placement import Placement
from .builders import MegatronBuilder
from .session import freeze_long_lived_objects, release
from .training import Trainer

log = logging.getLogger(__name__)


def switch_trainer(trainer: Optional[Trainer], builder: MegatronBuilder, src: Layout,
                   src_placement: Placement, dst: Layout, *,
                   dst_devices: Optional[Sequence[int]] = None, placement: str = "best",
                   ranks_per_node: int = 8, memory_budget: Optional[int] = None,
                   move_weights: bool = False, new_groups: Optional[ParallelGroups] = None
                   ) -> tuple[Optional[Trainer], SwitchResult]:
    """Every rank of the world calls this at the same step boundary.

    Returns the trainer rebound to layout B (None on a rank that is not part of B) and the
    switch result. A's objects and process groups are released.
    """
    if trainer is None:
        freeze_long_lived_objects()  # a joining rank: as start_job does on the others
    old = trainer.objs if trainer is not None else None
    scalars = (read_scalars(old, trainer.iteration, trainer.consumed_samples)
               if trainer is not None else None)
    res = switch_layout(builder.spec, builder, old, src, src_placement, dst, build_groups,
                        scalars, dst_devices=dst_devices, placement=placement,
                        ranks_per_node=ranks_per_node, memory_budget=memory_budget,
                        move_weights=move_weights, new_groups=new_groups)
    if old is not None:
        release(old)
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
    return trainer, res
