"""Megatron-core collectives on the *default* group, for a layout on part of the world.

megatron-core 0.16.1 assumes the layout spans every process: building the optimizer
(`optimizer._get_param_groups`) aligns param-group keys with an `all_gather_object` over
the default group. With standby ranks (a layout on a subset of the world, before a scale
-out or after a scale-in) only the layout's ranks build, and that call would wait forever
for the others. `default_group_as(group)` makes an `all_gather_object` without a group use
the layout's group for the duration of a build, filling megatron's world-sized output list
by repeating the gathered entries (it only takes the union of the keys).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch.distributed as dist


@contextlib.contextmanager
def default_group_as(group: Optional[dist.ProcessGroup]) -> Iterator[None]:
    """Within the block, `dist.all_gather_object(out, obj)` with no group runs on `group`.

    A no-op when `group` is None or spans the whole world."""
    if group is None or dist.get_world_size(group) == dist.get_world_size():
        yield
        return
    original = dist.all_gather_object

    def all_gather_object(object_list, obj, group=None):
        if group is not None:
            return original(object_list, obj, group=group)
        mine = [None] * dist.get_world_size(layout_group)
        original(mine, obj, group=layout_group)
        for i in range(len(object_list)):
            object_list[i] = mine[i % len(mine)]

    layout_group = group
    dist.all_gather_object = all_gather_object
    try:
        yield
    finally:
        dist.all_gather_object = original
