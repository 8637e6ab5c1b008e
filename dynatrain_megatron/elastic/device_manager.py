"""Elastic Device Manager: builds the next layout's process groups while training goes on.

Creating gloo/NCCL communicators costs tens of milliseconds per group (seconds at scale)
and is independent of the training state, so it should not be part of the pause. Once all
ranks agree on a target (controller), each rank starts `build_groups` in a background
thread; training keeps stepping on the old groups; at a later step boundary the ranks agree
(one tiny all-reduce) that every rank's groups are ready, and only then the switch starts.
Group creation synchronises through the job's rendezvous store, not through collectives on
the training groups, which is what makes it safe to overlap.

The same thread then prepares the switch itself (`transition.switch.prepare_switch`):
B's model, DDP and optimizer built without weights and without touching the globals A
trains with, bound, checked against the analytic layout, planned and scheduled. Its
only collectives run on B's new groups (megatron's object gathers on their gloo twin under
NCCL). On a GPU the thread works on the rank's device, recorded when the manager is made,
and on a stream of its own; B's NCCL communicators are checked in creation order at
`take()`, where every rank is at the same point (`communicators.py`). So the pause at the
step boundary is A's binding, one vote, the data movement and the commit.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from ..compat import runtime_in_this_thread
from ..vps.layout import Layout
from ..vps.placement import Placement
from ..transition.faults import end_preparation_delays
from ..transition.switch_types import Prepared
from ..transition.transport import collective_device
from .communicators import (control_group, device_context, rank_device, warm_up_groups,
                             warm_up_pipeline)
from .groups import ParallelGroups, build_groups

log = logging.getLogger("dynatrain")

# the least vote wins: a rank whose preparation passed its deadline, or failed, makes every
# rank give up on it (unless the job stops anyway)
_STOP, _LATE, _FAILED, _WAIT, _READY = 0, 1, 2, 3, 4
_VOTES = {_STOP: "stop", _LATE: "late", _FAILED: "failed", _WAIT: "wait", _READY: "ready"}


def _least(value: int, group: Any) -> int:
    """Collective over `group` (None: the world): the least of every rank's `value`."""
    flag = torch.tensor([value], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return int(flag.item())


PREPARE_TIMEOUT_S = 900.0  # the background preparation's deadline by default


def prepare_deadline() -> float:
    """Seconds the background preparation may take (`DYNATRAIN_PREPARE_TIMEOUT`)."""
    return float(os.environ.get("DYNATRAIN_PREPARE_TIMEOUT", PREPARE_TIMEOUT_S))


class DeviceManager:
    """`device`: the rank's device, which the preparation thread sets for itself (the
    current CUDA device is per thread); by default the current one of the thread that
    creates the manager, the training thread (`communicators.rank_device`).

    `deadline_s`: how long the preparation may take on any rank. A rank whose thread
    failed, or is still working past the deadline (blocked in a communicator's set-up
    that a failed peer will never join), makes the ready vote give up on every rank
    alike; the thread is left behind (daemon) and the switch is not made."""

    def __init__(self, device: Optional[torch.device] = None,
                 deadline_s: Optional[float] = None) -> None:
        self.device = device if device is not None else rank_device()
        self.deadline_s = prepare_deadline() if deadline_s is None else deadline_s
        if not self.deadline_s > 0:
            raise ValueError(f"preparation deadline must be > 0 s, got {self.deadline_s}")
        self._started = 0.0
        self.given_up: Optional[str] = None  # the agreed reason, once the vote gave up
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[ParallelGroups] = None
        self._prepared: Any = None
        self._error: Optional[BaseException] = None
        self.build_seconds = 0.0
        self.prepare_seconds = 0.0
        self.placement_seconds = 0.0
        self.target: Optional[tuple[Layout, Placement]] = None

    @property
    def pending(self) -> bool:
        return self.target is not None

    def prepare(self, layout: Layout,
                placement: Union[Placement, Callable[[Layout], Placement]],
                background: bool = True,
                then: Optional[Callable[[ParallelGroups], Any]] = None) -> None:
        """Start building `layout`'s groups on `placement` (every rank, same order); then,
        in the same thread, `then(groups)` (the switch's preparation: B's objects built,
        bound and planned while A trains; it must not raise and must only communicate
        on B's new groups, which nothing else uses yet). `placement` may be a pure
        function of the layout, run first in the thread (the same answer on every rank):
        `target` holds the placement once it is chosen, the groups carry it."""
        chosen = placement if isinstance(placement, Placement) else None
        self.target = (layout, chosen)
        self._result, self._prepared, self._error = None, None, None
        self._started, self.given_up = time.monotonic(), None

        def work() -> None:
            # the rank's device and a stream of its own (communicators.device_context)
            with runtime_in_this_thread(), device_context(self.device):
                t0 = time.perf_counter()
                try:
                    where = chosen if chosen is not None else placement(layout)
                    self.target = (layout, where)
                    self.placement_seconds = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    self._result = build_groups(layout, where)
                except BaseException as e:  # surfaced by take()
                    self._error = e
                self.build_seconds = time.perf_counter() - t0
                if then is not None and self._result is not None:
                    t0 = time.perf_counter()
                    try:
                        self._prepared = then(self._result)
                    except BaseException as e:  # surfaced by take(); the groups are freed
                        self._error = e  # by abandon()
                    self.prepare_seconds = time.perf_counter() - t0

        if background:
            self._thread = threading.Thread(target=work, name="dynatrain-prepare", daemon=True)
            self._thread.start()
        else:
            work()

    def ready(self, layout_group: Any = None, standby: Any = None) -> bool:
        """Collective: True when the groups (and the preparation) are done on every rank,
        or when the preparation was given up on every rank (`vote`; `take()` then raises)."""
        return self.vote(layout_group, standby) == "ready"

    def vote(self, layout_group: Any = None, standby: Any = None, stop: bool = False) -> str:
        """Collective, at every step while a preparation is pending: "ready" when the
        groups (and the preparation) are done on every rank, "stop" when a rank of the
        layout says the job ends (the preparation is then cancelled everywhere), else
        "wait". Without `standby`, one vote over the world on the CPU control group (no
        device synchronisation: communicators.control_group). With ranks on standby, the
        layout's ranks vote among themselves on `layout_group` (a CPU group, with the job's
        deadline; None on a standby rank), then with the standby ranks on their channel,
        where those wait as long as the job lives (`standby_channel.py`)."""
        if self.given_up is not None:
            return "ready"  # agreed at an earlier vote; `take()` raises
        working = self._thread is not None and self._thread.is_alive()
        late = working and time.monotonic() - self._started > self.deadline_s
        if stop:
            mine = _STOP
        elif late:
            mine = _LATE
        elif not working and self._error is not None:
            mine = _FAILED
        else:
            mine = _WAIT if working else _READY
        if standby is None:
            agreed = _least(mine, control_group())
        else:
            if layout_group is not None:
                mine = _least(mine, layout_group)
            agreed = _least(mine, standby)
        if agreed in (_LATE, _FAILED):
            what = self.target[0] if self.target else "?"
            self.given_up = (f"preparing {what} passed its deadline of {self.deadline_s:.0f} s "
                             f"on some rank" if agreed == _LATE else
                             f"preparing {what} failed on some rank")
            if late:
                log.error("rank %d: the background preparation of %s is still running after "
                          "%.0f s; giving up (the thread is left behind)", dist.get_rank(),
                          what, self.deadline_s)
            return "ready"  # every rank goes to the switch, whose `take()` raises alike
        return _VOTES[agreed]

    def take(self) -> ParallelGroups:
        """The groups built; the preparation, if one was asked for, is `take_prepared()`.
        After a ready vote it raises on every rank alike (the vote gave up) or on none,
        where a preparation carries a failure of this rank (`Prepared.error`)."""
        if self.given_up is not None:  # agreed by the ready vote: do not wait on a thread
            reason, self.target = self.given_up, None
            if self._error is not None:
                reason += f" (here: {type(self._error).__name__}: {self._error})"
            raise RuntimeError(reason)
        if self._thread is not None:
            self._thread.join()
        self._thread = None
        if self._error is not None:
            err, self._error, self.target = self._error, None, None
            raise RuntimeError(f"building or preparing the new layout failed: "
                               f"{type(err).__name__}: {err}") from err
        res, self._result, self.target = self._result, None, None
        assert res is not None
        # every rank is here at the same point (after the ready vote): B's communicators
        # are created now, before the pause, in the same order everywhere (NCCL only). A
        # failure there may be this rank's alone: with a preparation, the switch's first
        # vote carries it (every rank then gives up together); without one, it is raised
        try:
            warm_up_groups(res)
            warm_up_pipeline(res, in_background=False)  # NCCL: its pairs connect here
        except Exception as e:  # noqa: BLE001 - voted on at the switch
            if not isinstance(self._prepared, Prepared):
                raise
            log.error("rank %d: warming up the communicators of %s failed: %s",
                      dist.get_rank(), res.layout, e)
            self._prepared.error = self._prepared.error or (
                f"rank {dist.get_rank()}: warming up B's communicators: {type(e).__name__}: {e}")
        return res

    def take_prepared(self) -> Any:
        """What `then` returned (None without one); after `take()`."""
        prepared, self._prepared = self._prepared, None
        return prepared

    def abandon(self, timeout: Optional[float] = 10.0) -> tuple[Optional[ParallelGroups], Any]:
        """Give up the pending target (the world changed under it, or the job ends): wait
        up to `timeout` s (None: until it ends) for the background work, then hand back what
        it built, (groups, prepared), for the caller to free. A thread still blocked on a
        dead peer is left behind (daemon)."""
        end_preparation_delays()  # a test's injected slowness ends with the preparation
        if self._thread is not None:
            self._thread.join(0 if self.given_up is not None else timeout)
            if self._thread.is_alive():
                log.warning("the background preparation of %s did not end within %.0f s; "
                            "left behind", self.target[0] if self.target else "?", timeout)
                self._thread, self.target = None, None
                return None, None
        self._thread, self.target = None, None
        if self.given_up is not None and self._result is not None:
            # some peer never finished its communicators: abort ours, do not destroy them
            self._result.destroy(broken=True)
        out = (self._result, self._prepared)
        self._result, self._prepared, self._error = None, None, None
        return out
