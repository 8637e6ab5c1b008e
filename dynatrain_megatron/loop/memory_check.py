"""The memory check of a switch on a running job: A's and B's state, A's activations and a
reserve on every device (`vps.memory.switch_memory_plan` does the arithmetic and the
decision; this module measures and agrees on its inputs).

A's activation peak is measured on a GPU at the step boundary: the allocator's peak since
the job started minus what is allocated at the boundary (the training state, all that is
left once a step ended). On the CPU there is nothing to measure: the configured
`activation_reserve_bytes` stands for it. Ranks measure different peaks (pipeline stages
differ), so they agree on the largest (one all-reduce on the CPU control group) before
deciding: the decision must be the same on every rank.

The degraded mode `release_a_grads` frees A's gradient buffers at the step boundary (they
hold nothing a step needs from the previous one) with megatron-core's own
`offload_grad_buffers` (the storage shrinks to nothing, every view stays an object) and,
when the switch rolls back, gives them back zeroed (`restore_grad_buffers`), as the next
step's `zero_grad_buffer` would leave them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..elastic.communicators import control_group
from ..transition.transport import collective_device
from ..vps.errors import LayoutError
from ..vps.layout import Layout
from ..vps.memory import SwitchMemoryPlan, switch_memory_plan
from ..vps.model_spec import ModelSpec
from ..vps.placement import Placement


def measured_activation_bytes(reserve_bytes: int) -> int:
    """A's activation peak on this rank's device (call at a step boundary); on the CPU
    `reserve_bytes`."""
    if not torch.cuda.is_available():
        return reserve_bytes
    dev = torch.cuda.current_device()
    return max(0, torch.cuda.max_memory_allocated(dev) - torch.cuda.memory_allocated(dev))


def agree_on_max(value: int) -> int:
    """The largest `value` over the world (collective, on the control group)."""
    group = control_group()
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


@dataclass(frozen=True, slots=True)
class SwitchMemoryCheck:
    """`device_memory_bytes` per device; `activation_reserve_bytes`: A's activations
    where they cannot be measured (CPU); `reserve_bytes`: kept free (NCCL buffers of both
    layouts, allocator fragmentation)."""

    device_memory_bytes: int
    activation_reserve_bytes: int = 0
    reserve_bytes: int = 0

    def __post_init__(self) -> None:
        if self.device_memory_bytes <= 0 or self.activation_reserve_bytes < 0 \
                or self.reserve_bytes < 0:
            raise LayoutError(f"memory check {self}: device memory must be > 0 and the "
                              f"reserves >= 0")

    def plan(self, spec: ModelSpec, builder, src: Layout, src_placement: Placement,
             dst: Layout, dst_placement: Placement) -> SwitchMemoryPlan:
        """Collective: measure, agree, decide (the same plan on every rank)."""
        act = agree_on_max(measured_activation_bytes(self.activation_reserve_bytes))
        return switch_memory_plan(spec, src, src_placement.devices, dst, dst_placement.devices,
                                  device_memory_bytes=self.device_memory_bytes,
                                  activation_bytes=act, reserve_bytes=self.reserve_bytes,
                                  bucket_sizes=(builder.bucket_size(src),
                                                builder.bucket_size(dst)))


def from_args(args) -> Optional[SwitchMemoryCheck]:
    """The check configured by `--dynatrain-device-memory` (None without it)."""
    if not getattr(args, "dynatrain_device_memory", None):
        return None
    return SwitchMemoryCheck(args.dynatrain_device_memory,
                             args.dynatrain_activation_reserve or 0,
                             args.dynatrain_memory_reserve or 0)


def release_grad_buffers(objs) -> None:
    """Free A's DDP gradient buffers (every chunk); `restore_grad_buffers` undoes it."""
    cuda = torch.cuda.is_available()
    for m in objs.model:
        m.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)


def restore_grad_buffers(objs) -> None:
    """A's gradient buffers allocated again and zeroed (after a rolled-back switch)."""
    for m in objs.model:
        m.restore_grad_buffers(synchronize=torch.cuda.is_available())
