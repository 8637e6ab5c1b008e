"""Where the elastic layer's work runs on a GPU job: the rank's device and a stream of its
own for the preparation thread, NCCL communicators created at a safe point, and a CPU
group for the small agreements made at every step.

On the CPU (gloo) every function here is a no-op or returns what the code used before:
gloo creates its communicators eagerly and has no device or streams.

Why each piece (NCCL; read against torch 2.13):
- The current CUDA device is per thread. A thread that never calls `torch.cuda.set_device`
  works on cuda:0, so the preparation thread would build layout B (and megatron's DDP
  buffers, placed at `torch.cuda.current_device()`) on GPU 0 of every node.
- Work launched by the preparation thread on the default stream is ordered with the
  training thread's, at a different point on each rank: two collectives of different
  communicators can then wait on each other in a cycle. It gets a stream of its own.
- A group's NCCL communicator is created at its first collective unless the group is
  created with a `device_id`: `build_groups` passes the rank's device (`group_device`),
  so B's communicators are made with B's groups, in the background, in the same order on
  every rank; `warm_up_groups` checks them with one collective each at a point every rank
  reaches in the same order. The default group is *not* bound to the device
  (`init_process_group(device_id=...)`): bound, torch makes every later group by
  `ncclCommSplit` of the default communicator, which is a collective over the whole
  world; ranks outside a new group (standby ranks, or any rank for a gloo group of a
  subset) call it at once, members only when their communicator is made, and the
  preparation thread would run it beside the training thread's use of the default
  communicator. Unbound, each group's communicator is made from the job's store by its
  members alone. The default communicator is warmed up at start instead
  (`warm_up_default`).
- The per-step agreements of the hook (is the preparation done everywhere?) run on a gloo
  group over the world (`control_group`): a CPU tensor, no device synchronisation per
  step, and the default NCCL communicator, from which the background thread splits B's
  communicators, is not used by the training thread meanwhile.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from ..transition.transport import CONTROL as _CONTROL
from ..transition.transport import collective_device, control_group, is_nccl, warm_up

log = logging.getLogger("dynatrain")

def rank_device() -> Optional[torch.device]:
    """This thread's CUDA device (the rank's, on the training thread), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def group_device() -> Optional[torch.device]:
    """The device to create new groups with (`new_group(device_id=...)`: their NCCL
    communicators are made at once, by their members), None under gloo."""
    if not dist.is_initialized() or not is_nccl():
        return None
    return rank_device()


def warm_up_default() -> None:
    """Create the default group's NCCL communicator now (at start, every rank, on the
    training thread): one all-reduce. Nothing to do under gloo."""
    if is_nccl():
        warm_up(dist.group.WORLD)


@contextlib.contextmanager
def device_context(device: Optional[torch.device]) -> Iterator[Optional[object]]:
    """Run the block on `device` with a CUDA stream of its own (yielded), then wait for
    that stream, so whatever the block built is complete when another thread reads it.
    A no-op for None or a CPU device."""
    if device is None or device.type != "cuda":
        yield None
        return
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device=device)
    try:
        with torch.cuda.stream(stream):
            yield stream
    finally:
        stream.synchronize()


def create_control_group() -> None:
    """The job's CPU group over the world (collective over the default group: every rank,
    right after the default group is made). Under gloo the default group itself.

    The world it belongs to is remembered by a weak reference only: after a death the
    survivors must let go of every reference to the old world's groups, or their gloo
    sockets stay open and a survivor blocked on them never notices (elastic.rejoin)."""
    default = weakref.ref(dist.distributed_c10d._get_default_group())
    if not is_nccl():
        _CONTROL.update(group=None, default=default)
        return
    _CONTROL.update(group=dist.new_group(backend="gloo"), default=default)


def ensure_control_group() -> None:
    """`create_control_group` unless this world has one (collective over the default
    group the first time: every rank calls it at the same point, e.g. when a host job's
    session starts)."""
    default = dist.distributed_c10d._get_default_group()
    if _CONTROL["default"] is None or _CONTROL["default"]() is not default:
        create_control_group()


def forget_control_group() -> None:
    """Drop this process's reference to the control group and to the CPU groups made
    for layouts (their world is gone)."""
    _CONTROL.update(group=None, default=None)
    _CPU_GROUPS.update(default=None, groups={})


# gloo groups over device sets (a layout's CPU twin under NCCL), made once per world
_CPU_GROUPS: dict = {"default": None, "groups": {}}


def cpu_group_for(devices) -> Optional[dist.ProcessGroup]:
    """A gloo group over `devices` (members in global-rank order), made once per device
    set and world: the control group itself where the devices are the whole world.
    Collective over the default group when it makes one: every rank calls it for the
    same device sets in the same order (the layouts' groups are built that way), so
    every rank finds the same ones already made. None under gloo (use the layout's own)."""
    if not is_nccl():
        return None
    key = tuple(sorted(devices))
    default = dist.distributed_c10d._get_default_group()
    if _CPU_GROUPS["default"] is None or _CPU_GROUPS["default"]() is not default:
        _CPU_GROUPS.update(default=weakref.ref(default), groups={})
    if key == tuple(range(dist.get_world_size())) and control_group() is not None:
        return control_group()
    groups = _CPU_GROUPS["groups"]
    if key not in groups:
        groups[key] = dist.new_group(list(key), backend="gloo")
    return groups[key]


def everyone_ok(ok: bool, group: Optional[dist.ProcessGroup] = None) -> bool:
    """Collective over `group` (None: the world): whether `ok` holds on every rank (one
    4-byte MIN all-reduce)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def agreed_max(values: list[int], group: Optional[dist.ProcessGroup] = None) -> list[int]:
    """Collective over `group` (None: the world): each of `values` as the largest any rank
    holds (one MAX all-reduce of int64s)."""
    t = torch.tensor(values, dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def warm_up_groups(groups) -> None:
    """Create the NCCL communicators of a layout's groups (`elastic.groups.ParallelGroups`)
    now, in their creation order, which is the same on every rank; each rank warms the
    groups it belongs to. Collective over the world; call it where every rank is at the
    same point of its collectives (a step boundary after the ready vote). Under gloo the
    groups exist already: nothing to do."""
    if groups is None or not is_nccl():
        return
    seen: set[int] = set()
    for g in list(groups.created) + [groups.transfer]:
        if g is None or g == dist.GroupMember.NON_GROUP_MEMBER or id(g) in seen:
            continue
        seen.add(id(g))
        if dist.get_backend(g) == "nccl":
            warm_up(g)


def warm_up_pipeline(groups, in_background: bool) -> bool:
    """One exchange of one element with the previous and the next stage (both directions)
    on a layout's pipeline group (`elastic.groups.ParallelGroups`), so that the first step
    at that layout does not pay for the first point-to-point traffic of the group: NCCL
    connects a pair of ranks at their first send/receive, gloo's first exchange on a fresh
    group costs more than the next ones.

    Collective over the pipeline group, and only that group: every member calls it at the
    same point, and nothing else may use the group meanwhile (B's, before the switch).
    Under gloo from the preparation thread (`in_background`), out of the pause; under
    NCCL at the safe point after the ready vote (`in_background=False`, the training
    thread, right after `warm_up_groups`), never beside the training thread's kernels
    (module doc). Returns whether this rank exchanged (False for the other call site,
    a rank outside the layout, or a single stage)."""
    if groups is None or in_background == is_nccl():
        return False
    pp = getattr(groups.pg_collection, "pp", None)
    if pp is None or pp == dist.GroupMember.NON_GROUP_MEMBER or dist.get_world_size(pp) < 2:
        return False
    size, me = dist.get_world_size(pp), dist.get_rank(pp)
    device = collective_device(pp)
    ops = []
    for peer in sorted({(me + 1) % size, (me - 1) % size}):
        there = dist.get_global_rank(pp, peer)
        ops += [dist.P2POp(dist.isend, torch.zeros(1, device=device), there, group=pp),
                dist.P2POp(dist.irecv, torch.empty(1, device=device), there, group=pp)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return True
