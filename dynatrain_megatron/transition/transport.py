"""Transport: one batched point-to-point exchange per round, over torch.distributed.

The executor posts every send and receive of a round at once (`start`), does its
rank-local work while the data is on the wire, then waits (`Pending.wait`). Because each
round is a single batched set of non-blocking operations that every participating rank
posts in the same round order, no rank waits on another's ordering: the schedule cannot
deadlock. Messages between a pair are matched in the order they are posted, which both
sides derive from the same plan. gloo on the CPU, NCCL on GPUs (tensors must then live on
the rank's CUDA device); the interface is the same.
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
import weakref
from abc import ABC, abstractmethod
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..compat.torch_features import abort_group_now, nccl_group_call

log = logging.getLogger("dynatrain")


# the job's CPU group over the world (gloo; None where the default group is gloo itself)
# and a weak reference to the default group it belongs to: `elastic.communicators` makes it
CONTROL: dict = {"group": None, "default": None}


def control_group() -> Optional[dist.ProcessGroup]:
    """The group for small host-side agreements (None: the default group). Falls back to
    the default group when the control group belongs to an earlier world."""
    if not dist.is_initialized() or CONTROL["default"] is None:
        return None
    if CONTROL["default"]() is not dist.distributed_c10d._get_default_group():
        return None
    return CONTROL["group"]


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where tensors of a collective on `group` must live: the current CUDA device under
    NCCL, the CPU under gloo. Small control collectives (votes, flags, losses) use it so
    the same code runs on both."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_nccl(group: Optional[dist.ProcessGroup] = None) -> bool:
    return dist.get_backend(group) == "nccl"


# groups whose communicator exists on this rank (warmed up): NCCL creates a group's
# communicator at its first collective unless told otherwise
_WARM: "weakref.WeakSet[dist.ProcessGroup]" = weakref.WeakSet()


def warm_up(group: Optional[dist.ProcessGroup]) -> None:
    """Create `group`'s communicator now: one 1-element all-reduce, waited for. Every
    member must call it at the same point of its sequence of collectives (the groups of a
    layout in creation order, on every rank). Once per group; a no-op after."""
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER or group in _WARM:
        return
    flag = torch.ones(1, dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, group=group)
    if flag.device.type == "cuda":
        torch.cuda.current_stream(flag.device).synchronize()
    _WARM.add(group)


def is_warm(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None and group in _WARM


def abort_group(group: Optional[dist.ProcessGroup]) -> bool:
    """Abort an NCCL group whose operations will never complete (a peer timed out or
    died): its kernels end, its communicator is freed, and a later `destroy` does not hang
    on it. Gloo needs none of this (a timed-out wait returns). True when aborted."""
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER or not is_nccl(group):
        return False
    try:
        abort_group_now(group)
    except Exception as e:  # noqa: BLE001 - best effort: the group is broken either way
        log.warning("aborting a broken NCCL group failed: %s", e)
        return False
    _WARM.discard(group)
    return True


def abort_groups(groups: Sequence) -> int:
    """Abort the NCCL groups among `groups` together, inside one NCCL group call: NCCL
    communicators aborted one at a time can wait on each other (torch aborts its whole
    world this way for that reason, pytorch#119797). Gloo groups are left alone. Returns
    how many were aborted."""
    nccl, seen = [], set()
    for g in groups:
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER and id(g) not in seen \
                and is_nccl(g):
            seen.add(id(g))
            nccl.append(g)
    if not nccl:
        return 0
    with nccl_group_call(nccl[0]):
        return sum(abort_group(g) for g in nccl)


class Pending:
    """Operations of one round in flight.

    `polled`: wait for a deadline by polling `Work.is_completed()` (NCCL: a blocking wait
    with a timeout would tie the CPU up and, past the deadline, leave the kernels running;
    instead the round is given up and `on_timeout` aborts its communicator). Without it,
    `Work.wait(timeout)` (gloo: the wait itself returns at the deadline)."""

    def __init__(self, works: Sequence, *, polled: bool = False,
                 on_timeout: Optional[Callable[[], object]] = None) -> None:
        self._works = list(works)
        self._polled = polled
        self._on_timeout = on_timeout

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for every operation; with `timeout` (seconds, for the whole round) raise
        `TimeoutError` when a peer does not show up in time."""
        if self._polled and timeout is not None:
            self._poll(timeout)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for w in self._works:
            if deadline is None:
                w.wait()
                continue
            left = max(0.001, deadline - time.monotonic())
            try:
                done = w.wait(timeout=datetime.timedelta(seconds=left))
            except RuntimeError as e:  # gloo reports a timed-out wait as an error
                raise TimeoutError(f"peer did not complete the exchange within {timeout:.1f} s: "
                                   f"{str(e).splitlines()[0]}") from e
            if done is False:
                raise TimeoutError(f"peer did not complete the exchange within {timeout:.1f} s")
        self._works = []

    def _poll(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pause = 1e-4
        while not all(w.is_completed() for w in self._works):
            if time.monotonic() >= deadline:
                if self._on_timeout is not None:
                    self._on_timeout()
                self._works = []
                raise TimeoutError(f"peer did not complete the exchange within {timeout:.1f} s "
                                   f"(communicator aborted)")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        for w in self._works:  # complete: orders the current stream after the transfer
            w.wait()
        self._works = []


class Transport(ABC):
    """Moves contiguous tensors between ranks; one `start` per round."""

    @abstractmethod
    def start(self, sends: Mapping[int, Sequence[torch.Tensor]],
              recvs: Mapping[int, Sequence[torch.Tensor]], tag: int = 0) -> Pending:
        """Post: send each tensor of `sends[peer]` to `peer`, in order, and fill each tensor
        of `recvs[peer]` from `peer`, in order. The tensors must stay alive until `wait`.
        `tag` keeps the messages of different switch attempts apart (a late message of an
        abandoned attempt must never land in a later one)."""

    def exchange(self, sends: Mapping[int, Sequence[torch.Tensor]],
                 recvs: Mapping[int, Sequence[torch.Tensor]], tag: int = 0) -> None:
        self.start(sends, recvs, tag).wait()


class TorchP2PTransport(Transport):
    """`batch_isend_irecv` on a group spanning old and new ranks (default: the world).

    On NCCL (`nccl`, default: the group's backend) a group's first `batch_isend_irecv`
    must include every rank of the group, and a rank with nothing to exchange would skip
    it; so every rank's first `start` warms the group up first (`warm_up`, a no-op where
    the device manager already did at its safe point), empty or not. Deadlines are polled
    and a round that misses one aborts the group (`Pending`)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *,
                 nccl: Optional[bool] = None) -> None:
        self.group = group
        self.nccl = is_nccl(group) if nccl is None else nccl

    def start(self, sends: Mapping[int, Sequence[torch.Tensor]],
              recvs: Mapping[int, Sequence[torch.Tensor]], tag: int = 0) -> Pending:
        if self.nccl:
            warm_up(self.group if self.group is not None else dist.group.WORLD)
        ops = []
        # a fixed order (by peer, then message) on every rank; NCCL requires matching order
        for peer in sorted(set(sends) | set(recvs)):
            for t in sends.get(peer, ()):
                ops.append(dist.P2POp(dist.isend, t, peer, group=self.group, tag=tag))
            for t in recvs.get(peer, ()):
                ops.append(dist.P2POp(dist.irecv, t, peer, group=self.group, tag=tag))
        if not ops:
            return Pending(())
        return Pending(dist.batch_isend_irecv(ops), polled=self.nccl,
                       on_timeout=lambda: abort_group(self.group))


def drop_in_background(holder: list) -> threading.Thread:
    """Let the references in `holder` go in a daemon thread. For process-group handles
    that are destroyed (deregistered) already: a released layout's groups
    (`mcore.session.release`) and a switch's transfer group. Their destructors join gloo's
    worker threads and close its connections, tens of milliseconds per group, and would
    run on the training thread right after a switch, wherever the last reference died.
    Nothing uses a deregistered group (if something still holds one, its destructor simply
    runs later, where that reference goes)."""
    t = threading.Thread(target=holder.clear, name="dynatrain-drop", daemon=True)
    t.start()
    return t
