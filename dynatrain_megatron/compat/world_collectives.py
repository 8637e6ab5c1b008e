"""Megatron-core collectives on the *default* group, routed to a layout's own group.

megatron-core 0.16.1 assumes the layout spans every process: building the optimizer
(`optimizer._get_param_groups`) aligns param-group keys with an `all_gather_object` over
the default group. Two situations make that call wrong:
  - standby ranks (a layout on a subset of the world, before a scale-out or after a
    scale-in): only the layout's ranks build, and the call would wait forever for the
    others;
  - a build in the background while training runs on the main thread (the switch's
    preparation): the main thread's collectives on the default group (the hook's per-step
    agreement) would interleave with the build's, in a different order on each rank.
`default_group_as(group)` makes an `all_gather_object` without a group, called *by this
thread* inside the block, run on `group` (a group of B's own that nothing else uses),
filling megatron's world-sized output list by repeating the gathered entries (it only
takes the union of the keys). Other threads' calls are untouched.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch.distributed as dist

from .parallel_state_view import thread_value

_route = threading.local()  # .group: where this thread's default-group gathers go
_lock = threading.Lock()
_state = {"users": 0, "original": None}


def _routed_all_gather_object(object_list, obj, group=None):
    original = _state["original"]
    layout_group = getattr(_route, "group", None)
    if group is not None or layout_group is None:
        return original(object_list, obj, group=group)
    mine = [None] * dist.get_world_size(layout_group)
    original(mine, obj, group=layout_group)
    for i in range(len(object_list)):
        object_list[i] = mine[i % len(mine)]


@contextlib.contextmanager
def default_group_as(group: Optional[dist.ProcessGroup]) -> Iterator[None]:
    """Within the block, this thread's `dist.all_gather_object(out, obj)` with no group
    runs on `group`. A no-op when `group` is None."""
    if group is None:
        yield
        return
    with _lock:
        if _state["users"] == 0:
            _state["original"] = dist.all_gather_object
            dist.all_gather_object = _routed_all_gather_object
        _state["users"] += 1
    try:
        with thread_value(_route, "group", group):
            yield
    finally:
        with _lock:
            _state["users"] -= 1
            if _state["users"] == 0:
                dist.all_gather_object = _state["original"]
                _state["original"] = None
