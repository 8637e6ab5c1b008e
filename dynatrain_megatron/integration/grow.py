"""Growing the world with accepted joiners (`elastic/join.py`) at a step boundary.

A process launched after the job (`pretrain_gpt.py ... --dynatrain-join`) proves it holds
the job's secret; once rank 0 accepts it at a poll, every process of the job and the
joiner re-form the default process group one rank larger, in the rendezvous store under
a fresh prefix. Megatron's objects hold the old communicators, so the training ranks bind
their tensors (`LiveState.detach_from_objects`), free the objects, and switch from the
current layout to *the same layout* on the new world: every piece is a local copy,
nothing crosses the network, the state is bit-identical. The joiner holds nothing and
waits on standby; a later scale-out request (`dynatrain request --world N`) puts it to
work like any standby rank.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Optional

import torch.distributed as dist

from ..adapters.live import LiveState
from ..elastic.join import JoinError
from ..elastic.rejoin import drop_default_group, start_default_group
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.placement import Placement
from .recovery import let_go_of_layout, switch_from_held
from .session import freeze_long_lived_objects
from .train_config import TrainConfig
from .training import Trainer

log = logging.getLogger(__name__)

PREFIX = "dynatrain/grow"


def ready(store: dist.Store, generation: int, rank: int) -> None:
    """The joiner, once accepted: it is a training process and enters the world now."""
    store.set(f"{PREFIX}{generation}/ready/{rank}", "1")


def all_ready(store: dist.Store, generation: int, ranks: list[int],
              wait_seconds: float = 10.0) -> bool:
    """Rank 0: whether every accepted joiner said `ready` (it does so right after reading
    its verdict, which this poll just wrote)."""
    keys = [f"{PREFIX}{generation}/ready/{r}" for r in ranks]
    deadline = time.monotonic() + wait_seconds
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def announce(store: dist.Store, generation: int, world: int, layout: Layout,
             placement: Placement) -> None:
    """Rank 0: what a joiner of `generation` needs to take part (plain data, no secret)."""
    store.set(f"{PREFIX}{generation}/world", str(world))
    store.set(f"{PREFIX}{generation}/layout", json.dumps(
        {"layout": str(layout), "world": layout.world_size, "devices": list(placement.devices)}))


def grow_world(trainer: Optional[Trainer], spec: ModelSpec, train: TrainConfig,
               store: dist.Store, generation: int, world: int, layout: Layout,
               placement: Placement, timeout: Optional[float] = None) -> Optional[Trainer]:
    """Every process of the job (standby ones with `trainer` None). Returns the trainer
    rebuilt on the grown world, or None on a standby process."""
    held, scalars = let_go_of_layout(trainer, spec, placement, broken=False)
    _reinit(store, generation, dist.get_rank(), world)
    return _rebuild(spec, train, layout, placement, held, scalars, timeout)


def join_world(spec: ModelSpec, train: TrainConfig, store: dist.Store, generation: int,
               rank: int, wait_seconds: float = 300.0,
               timeout: Optional[float] = None) -> tuple[Layout, Placement]:
    """The joiner, once accepted at `generation` as `rank`: enter the grown world and take
    part in the rebuild (holding nothing). Returns the job's layout and placement."""
    from ..elastic.join import wait_for

    world = int(wait_for(store, f"{PREFIX}{generation}/world", wait_seconds,
                          f"the job did not grow its world (generation {generation})"))
    info = json.loads(wait_for(store, f"{PREFIX}{generation}/layout", wait_seconds,
                                "the job did not publish its layout"))
    layout = Layout.parse(info["layout"], info["world"])
    placement = Placement(tuple(int(d) for d in info["devices"]))
    if not 0 <= rank < world:
        raise JoinError(f"accepted as rank {rank} of a world of {world}: inconsistent verdict")
    _reinit(store, generation, rank, world)
    _rebuild(spec, train, layout, placement, None, None, timeout)
    return layout, placement


def _reinit(store: dist.Store, generation: int, rank: int, world: int) -> None:
    drop_default_group()
    start_default_group(store, f"{PREFIX}{generation}/pg", rank, world)
    log.warning("world grown (generation %d): rank %d of %d", generation, rank, world)


def _rebuild(spec: ModelSpec, train: TrainConfig, layout: Layout, placement: Placement,
             held: Optional[LiveState], scalars, timeout: Optional[float]) -> Optional[Trainer]:
    """The switch from `layout` to itself on the new world: local copies only."""
    freeze_long_lived_objects()
    trainer, report = switch_from_held(spec, train, layout, placement, layout,
                                       placement.devices, held, scalars, timeout,
                                       f"rebuilding {layout} on the grown world")
    log.info("rebuilt %s on the grown world: %d bytes moved, %.3f s", layout,
             report.bytes_moved, report.pause_seconds)
    return trainer
