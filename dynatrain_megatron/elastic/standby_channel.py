"""The group the ranks on standby wait on: the world, on the CPU (gloo), with no practical
deadline.

A rank on standby holds no training state; it waits, inside the training loop's hook, for
the layout's next decision (`Controller.follow`) or for the vote on a switch being prepared
(`DeviceManager.vote`). Between two polls the layout's ranks may evaluate, `--save`, or
poll only every `--dynatrain-poll-interval` steps: that can take longer than the job's
process-group timeout, and a standby rank waiting on a group with that timeout would fail
(`Timed out waiting ... for recv`) and take the job down. On this group it waits as long as
the job lives; it still learns at once when the layout's ranks die (a gloo peer that exits
closes its sockets) and when the job ends (the layout's ranks tell it: `Controller.stop`,
or a vote that says stop).

The layout's ranks keep their own deadline: they agree among themselves first, on their own
group with the job's timeout (a hung rank of the layout is still noticed), and only then
relay the result to the standby ranks on this group, where everyone else is already waiting.

The group belongs to one world: it is made again (a collective over the world) whenever the
world is made again (start, a recovery, a growth); one of an earlier world is never used.
"""
from __future__ import annotations

import datetime
import logging
import weakref
from typing import Any, Optional

import torch.distributed as dist

log = logging.getLogger("dynatrain")

# long enough to outlive any job; short enough for gloo's millisecond counters
NO_DEADLINE = datetime.timedelta(days=365)


class StandbyChannel:
    """One per process (the hook's)."""

    def __init__(self) -> None:
        self._group: Any = None
        self._world: Optional[weakref.ref] = None

    def renew(self) -> None:
        """Collective over the current world (every process, at the same point): make the
        channel of this world."""
        self._group = dist.new_group(backend="gloo", timeout=NO_DEADLINE)
        self._world = weakref.ref(dist.distributed_c10d._get_default_group())

    def group(self) -> Optional[Any]:
        """The channel of the current world; None before `renew` or when the world was
        made again since (the callers then use the world with its deadline)."""
        if self._world is None or not dist.is_initialized():
            return None
        if self._world() is not dist.distributed_c10d._get_default_group():
            self._group = self._world = None
            return None
        return self._group

    def forget(self) -> None:
        """Drop the reference (the world broke: its sockets must close with it)."""
        self._group = self._world = None


__all__ = ("NO_DEADLINE", "StandbyChannel")
