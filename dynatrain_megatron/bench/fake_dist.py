"""A recording stand-in for `torch.distributed`, for one emulated rank of a large job.

The control plane of a switch (B's groups, the preparation, the votes, the switch's own
collectives and the release of A) is run as it is written, with `dist` in those modules
replaced by a `RecordingDist` bound to one rank of an emulated world of thousands of
ranks (`bench.control_plane`). No data moves and nothing connects: each call is counted
with what the real backend would do for it at that rank, so that what grows with the
world shows up in the counts.

What a call costs at this rank, as counted (read against torch 2.13, NCCL 2.2x, gloo):
  * `new_group`: every rank of the world calls it for every group (torch names groups by
    a global counter; `use_local_synchronization` names them by a hash of the members,
    which two live layouts sharing a member list would collide on). A non-member gets
    `NON_GROUP_MEMBER` with no store operation (`non_member_calls`). A member of an NCCL
    group created with a device (`device_id`) makes its communicator at once
    (`communicators`): the group's rank 0 writes the NCCL unique id to the store, the
    others read it (ProcessGroupNCCL's store broadcast of the id: 1 set or 1 get). A
    member of a gloo group rendezvouses through the store: it writes its address and,
    connecting the full mesh eagerly, reads every other member's and opens a connection
    to each (`gloo_connections`, n - 1); with `TORCH_GLOO_LAZY_INIT` set when the group
    is made, a pair connects at its first use instead (none at creation).
  * collectives: the call, its group size and the bytes this rank receives. An
    `all_gather_object` over n ranks moves n copies of the largest pickled object to every
    rank (torch pads every object to the largest before the tensor all-gather), which is
    what makes it grow with the world; `object_bytes` lets the caller state an object's
    real size where the emulation has none (the vocab-padding rows).
"""
from __future__ import annotations

import os
import pickle
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as _real

ReduceOp = _real.ReduceOp
ProcessGroup = _real.ProcessGroup


class _NonMember:
    def __repr__(self) -> str:
        return "NON_GROUP_MEMBER"


class GroupMember:
    NON_GROUP_MEMBER = _NonMember()
    WORLD = None


@dataclass(eq=False)
class FakeGroup:
    """A process group of the emulated world (identity-compared, like torch's)."""

    ranks: tuple[int, ...]
    backend: str
    name: str
    lazy: bool = False

    def size(self) -> int:
        return len(self.ranks)

    def rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


@dataclass
class Counts:
    """What one emulated rank did, by kind of work (module doc)."""

    new_group_calls: int = 0
    non_member_calls: int = 0
    member_groups: int = 0
    communicators: int = 0  # NCCL communicators created (eagerly, with the group)
    gloo_groups: int = 0
    gloo_connections: int = 0  # pairs connected at creation (eager full mesh)
    store_sets: int = 0
    store_gets: int = 0
    destroyed: int = 0
    collectives: Counter = field(default_factory=Counter)  # name -> calls
    collective_bytes: Counter = field(default_factory=Counter)  # name -> bytes received
    # (name, group size, bytes received) of every collective whose group is the world
    world_collectives: list = field(default_factory=list)
    largest_group: int = 0

    def as_dict(self) -> dict:
        return {"new_group_calls": self.new_group_calls,
                "non_member_calls": self.non_member_calls,
                "member_groups": self.member_groups, "communicators": self.communicators,
                "gloo_groups": self.gloo_groups, "gloo_connections": self.gloo_connections,
                "store_sets": self.store_sets, "store_gets": self.store_gets,
                "destroyed": self.destroyed, "largest_group": self.largest_group,
                "collectives": dict(self.collectives),
                "collective_bytes": dict(self.collective_bytes),
                "world_collectives": list(self.world_collectives)}


class _Done:
    """The work handle of a collective that has completed."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Config:
    use_torchcomms = False


class _C10d:
    def __init__(self, owner: "RecordingDist") -> None:
        self._owner = owner

    def _get_default_group(self):
        return self._owner.world


class RecordingDist:
    """`torch.distributed` as one rank of a world of `world_size` ranks sees it (module
    doc). `backend`: the default group's ("nccl" for a GPU job). `object_bytes(obj)`:
    the size to count for an object of `all_gather_object` (default: its pickle)."""

    GroupMember = GroupMember
    ReduceOp = ReduceOp
    ProcessGroup = ProcessGroup
    config = _Config()

    def __init__(self, rank: int, world_size: int, backend: str = "nccl",
                 object_bytes: Optional[Callable[[Any], int]] = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, got {backend!r}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.world = FakeGroup(tuple(range(world_size)), backend, "0")
        self.group = type("group", (), {"WORLD": self.world})
        self.distributed_c10d = _C10d(self)
        self.object_bytes = object_bytes or (lambda o: len(pickle.dumps(o)))
        self.counts = Counts()
        self._next = 1

    # -- the world
    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group=None) -> int:
        g = self._group(group)
        return g.rank(self.rank) if g is not self.world else self.rank

    def get_world_size(self, group=None) -> int:
        return self._group(group).size()

    def get_backend(self, group=None) -> str:
        return self._group(group).backend

    def _group(self, group) -> FakeGroup:
        if group is None:
            return self.world
        if group is GroupMember.NON_GROUP_MEMBER:
            raise RuntimeError(f"rank {self.rank}: a collective on a group it is not in")
        return group

    # -- groups
    def new_group(self, ranks: Optional[Sequence[int]] = None, timeout=None, backend=None,
                  pg_options=None, use_local_synchronization: bool = False,
                  group_desc=None, device_id=None, sort_ranks: bool = True):
        c = self.counts
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        if sort_ranks:
            ranks = sorted(ranks)
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"bad rank list {ranks[:8]}...")
        if use_local_synchronization and self.rank not in ranks:
            return None  # torch: non-members do not call at all
        c.new_group_calls += 1
        name = str(self._next)
        self._next += 1
        if self.rank not in ranks:
            c.non_member_calls += 1
            return GroupMember.NON_GROUP_MEMBER
        backend = str(backend or self.backend)
        lazy = os.environ.get("TORCH_GLOO_LAZY_INIT") == "1" and backend == "gloo"
        g = FakeGroup(tuple(ranks), backend, name, lazy)
        n = len(ranks)
        c.member_groups += 1
        c.largest_group = max(c.largest_group, n)
        if backend == "nccl":
            if device_id is not None and n > 1:
                c.communicators += 1
                if ranks.index(self.rank) == 0:
                    c.store_sets += 1
                else:
                    c.store_gets += 1
        else:
            c.gloo_groups += 1
            c.store_sets += 1
            if not lazy:
                c.store_gets += n - 1
                c.gloo_connections += n - 1
        return g

    def destroy_process_group(self, group=None) -> None:
        self.counts.destroyed += 1

    # -- collectives (nothing moves; results are what every rank agreeing would give)
    def _record(self, name: str, group, nbytes: int) -> None:
        g = self._group(group)
        c = self.counts
        c.collectives[name] += 1
        c.collective_bytes[name] += int(nbytes)
        if g.size() == self.world_size and self.world_size > 1:
            c.world_collectives.append((name, g.size(), int(nbytes)))

    def all_reduce(self, tensor: torch.Tensor, op=None, group=None, async_op: bool = False):
        self._record("all_reduce", group, tensor.numel() * tensor.element_size())
        return _Done() if async_op else None

    def all_gather(self, tensor_list: list, tensor: torch.Tensor, group=None,
                   async_op: bool = False):
        self._record("all_gather", group,
                     len(tensor_list) * tensor.numel() * tensor.element_size())
        for t in tensor_list:
            t.copy_(tensor)
        return _Done() if async_op else None

    def barrier(self, group=None, async_op: bool = False, device_ids=None):
        self._record("barrier", group, 0)

    def all_gather_object(self, object_list: list, obj: Any, group=None) -> None:
        g = self._group(group)
        n = g.size()
        self._record("all_gather_object", group, n * int(self.object_bytes(obj)))
        for i in range(n):
            object_list[i] = obj

    def broadcast_object_list(self, object_list: list, src: int = 0, group=None,
                              device=None) -> None:
        self._record("broadcast_object_list", group,
                     sum(len(pickle.dumps(o)) for o in object_list))


__all__ = ["RecordingDist", "Counts", "FakeGroup", "GroupMember"]
