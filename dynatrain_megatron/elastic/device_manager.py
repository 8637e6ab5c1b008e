"""Elastic Device Manager: builds the next layout's process groups while training goes on.

Creating gloo/NCCL communicators costs tens of milliseconds per group (seconds at scale)
and is independent of the training state, so it should not be part of the pause. Once all
ranks agree on a target (controller), each rank starts `build_groups` in a background
thread; training keeps stepping on the old groups; at a later step boundary the ranks agree
(one tiny all-reduce) that every rank's groups are ready, and only then the switch starts.
Group creation synchronises through the job's rendezvous store, not through collectives on
the training groups, which is what makes it safe to overlap.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..transition.transport import collective_device
from ..vps.layout import Layout
from ..vps.placement import Placement
from .groups import ParallelGroups, build_groups

log = logging.getLogger(__name__)


class DeviceManager:
    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[ParallelGroups] = None
        self._error: Optional[BaseException] = None
        self.build_seconds = 0.0
        self.target: Optional[tuple[Layout, Placement]] = None

    @property
    def pending(self) -> bool:
        return self.target is not None

    def prepare(self, layout: Layout, placement: Placement, background: bool = True) -> None:
        """Start building `layout`'s groups on `placement` (every rank, same order)."""
        self.target = (layout, placement)
        self._result, self._error = None, None

        def work() -> None:
            t0 = time.perf_counter()
            try:
                self._result = build_groups(layout, placement)
            except BaseException as e:  # surfaced by ready()
                self._error = e
            self.build_seconds = time.perf_counter() - t0

        if background:
            self._thread = threading.Thread(target=work, name="dynatrain-groups", daemon=True)
            self._thread.start()
        else:
            work()

    def ready(self) -> bool:
        """Collective: True when the groups are built on every rank."""
        done = self._thread is None or not self._thread.is_alive()
        flag = torch.tensor([1 if done else 0], dtype=torch.int32, device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def take(self) -> ParallelGroups:
        if self._thread is not None:
            self._thread.join()
        self._thread = None
        if self._error is not None:
            err, self._error, self.target = self._error, None, None
            raise RuntimeError(f"building the new layout's groups failed: {err}") from err
        res, self._result, self.target = self._result, None, None
        assert res is not None
        return res
