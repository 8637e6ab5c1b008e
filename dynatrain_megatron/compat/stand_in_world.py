"""A thread's own default process group: the world Megatron-LM's code sees while some
processes of the job are on standby.

Megatron-LM takes the default group for "every rank of the job": its timers, the rerun
state machine, the data-iterator build, evaluation's exit check, `save_checkpoint` (the
barriers, rank 0's tracker file) and megatron-core's `dist_checkpointing` save
(torch.distributed.checkpoint's planning gathers, the sharding validation's
`all_gather_object`, shard placements numbered by `get_rank()`/`get_world_size()`).
After a scale-in the ranks on standby wait inside our hook and never reach those calls,
so on the layout's ranks every one of them must run over the layout alone, as if the job
had been launched on those ranks.

`use(group)` makes `group` the default group *of the calling thread*: torch's
`_World.default_pg`, through which every default-group lookup goes (`dist.group.WORLD`,
`_get_default_group()`, hence every call with `group=None`, `get_rank()`,
`get_world_size()`), answers `group` on that thread and the real world on every other
one (a switch being prepared in the background builds groups over the real world while
Megatron-LM trains). `group` must hold the global ranks 0..k-1 in that order, so that a
member's rank in it is its global rank: every other group's global-to-group numbering
stays right. Our own collectives (the controller's poll, the switch's votes) need the
real world, and so does creating or destroying process groups (a group made under a
stand-in would be known to the layout's ranks only): the caller lifts the stand-in
(`use(None)`) around them. Nothing Megatron-LM runs between two steps creates groups.
"""
from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Any, Iterator, Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..vps.errors import DynatrainError

_local = threading.local()  # .group: this thread's stand-in world (None: the real one)


class _ThreadWorld(c10d._World):
    """torch's `_World` whose default group is the calling thread's stand-in, if any."""

    @property
    def default_pg(self) -> Any:
        group = getattr(_local, "group", None)
        return group if group is not None else self._default_pg

    @default_pg.setter
    def default_pg(self, value: Any) -> None:
        self._default_pg = value


def _install() -> None:
    """Give torch's world object the thread-aware class (once; its state is untouched)."""
    world = c10d._world
    if not isinstance(world, _ThreadWorld):
        if type(world) is not c10d._World:
            raise DynatrainError(f"torch.distributed's world object is a {type(world)!r}, "
                                 "not torch's own _World: cannot give a thread its own world")
        world.__class__ = _ThreadWorld
        atexit.register(_tear_down)


def _tear_down() -> None:
    """At interpreter exit: the real world again, and every process group destroyed in
    order. A process that ran collectives on a stand-in and left its gloo groups to the
    interpreter's finalisation was seen to abort there ("terminate called without an
    active exception", 2 of 10 runs of a 4-rank script; 0 of 10 with this)."""
    _local.group = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_stand_in(group: Any) -> None:
    """DynatrainError unless `group` holds exactly the global ranks 0..k-1, in order."""
    ranks = dist.get_process_group_ranks(group)
    if ranks != list(range(len(ranks))):
        raise DynatrainError(f"a stand-in world must be the first ranks of the job in "
                             f"order (a member's rank must stay its global rank), got {ranks}")


def use(group: Optional[Any]) -> Optional[Any]:
    """From now on, on this thread, `group` is the default group (None: the real world
    again). Returns the stand-in that was in use before."""
    previous = getattr(_local, "group", None)
    if group is not None:
        check_stand_in(group)
        _install()
    _local.group = group
    return previous


@contextlib.contextmanager
def stand_in(group: Optional[Any]) -> Iterator[None]:
    """Within the block, this thread's default group is `group` (None: no change)."""
    if group is None:
        yield
        return
    previous = use(group)
    try:
        yield
    finally:
        use(previous)


@contextlib.contextmanager
def real_world() -> Iterator[None]:
    """Within the block, this thread sees the real world whatever stand-in it uses."""
    previous = use(None)
    try:
        yield
    finally:
        use(previous)
