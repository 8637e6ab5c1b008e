"""The memory check of a switch on a running job: A's and B's state, A's memory pool, the
NCCL buffers of B's new communicators and a reserve on every device
(`vps.memory.switch_memory_plan` does the arithmetic and the decision; this module
measures and agrees on its inputs). It runs when a request is accepted, before anything of
B is allocated: a switch that does not fit is refused, or prepared in a degraded mode.

On a GPU the check is on by default (`from_args`), fed by the device itself
(`CudaMemory`): `torch.cuda.mem_get_info` for the device's total and free memory, the
caching allocator's statistics for what torch has allocated and reserved, and their
peaks, kept per step (`step_boundary` at every step boundary, `forget_peaks` after a
switch), so the figure is the last step's, never a peak that holds a switch's A and B. The inputs:
  * A's pool: max(peak reserved in the last step, reserved now) - allocated now: A's
    activations *and* the cached blocks A keeps. B is built on a side stream, whose
    allocations the blocks cached for A's stream cannot serve, so they count as taken;
  * outside torch: total - free - reserved (the CUDA context, A's NCCL buffers, other
    processes), measured;
  * B's new NCCL communicators: `nccl_bytes_per_communicator` (an estimate, default
    256 MiB; `DYNATRAIN_NCCL_COMM_BYTES`) times the communicators of more than one member
    this rank joins;
  * the configured reserve (fragmentation).
Ranks measure different figures (pipeline stages differ), so they agree on the largest
(one all-reduce on the CPU control group) before deciding: the same decision everywhere.
On the CPU there is nothing to measure: `device_memory_bytes` (`--dynatrain-device-memory`)
and `activation_reserve_bytes` stand for the device, and the check is off without them.

The degraded mode `release_a_grads` frees A's gradient buffers at the step boundary (they
hold nothing a step needs from the previous one) with megatron-core's own
`offload_grad_buffers` (the storage shrinks to nothing, every view stays an object) and,
when the switch rolls back, gives them back zeroed (`restore_grad_buffers`), as the next
step's `zero_grad_buffer` would leave them.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from ..elastic.communicators import control_group
from ..transition.transport import collective_device
from ..vps.errors import LayoutError
from ..vps.layout import GROUP_AXES, Layout
from ..vps.memory import SwitchMemoryPlan, switch_memory_plan
from ..vps.model_spec import ModelSpec
from ..vps.placement import Placement

log = logging.getLogger("dynatrain")

MiB = 1 << 20
DEFAULT_NCCL_COMM_BYTES = 256 * MiB


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """One reading of a device (bytes). Peaks are since the last `reset_peaks`."""

    total: int
    free: int
    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int

    def __post_init__(self) -> None:
        if min(self.total, self.free, self.allocated, self.reserved, self.peak_allocated,
               self.peak_reserved) < 0 or self.free > self.total:
            raise LayoutError(f"impossible device memory reading {self}")

    @property
    def pool(self) -> int:
        """What A's allocator holds beyond its live tensors (activations and cache)."""
        return max(0, max(self.peak_reserved, self.reserved) - self.allocated)

    @property
    def outside_torch(self) -> int:
        """Used on the device but not by torch's allocator (context, NCCL, others)."""
        return max(0, self.total - self.free - self.reserved)


class DeviceMemory(Protocol):
    """Where the readings come from (a CUDA device, or a fake in tests). `read()`'s peaks
    cover the last completed step and the one running; `step_boundary()` closes a step,
    `forget_peaks()` starts afresh (after a switch, whose peak held A and B together)."""

    def read(self) -> MemoryInfo: ...

    def step_boundary(self) -> None: ...

    def forget_peaks(self) -> None: ...


class PeakWindow:
    """The step-window bookkeeping of a `DeviceMemory` over a raw reading with peaks
    since the allocator's last reset (`_raw`, `_reset`)."""

    def __init__(self) -> None:
        self._last: tuple[int, int] = (0, 0)  # the last completed step's peaks

    def _raw(self) -> MemoryInfo:
        raise NotImplementedError

    def _reset(self) -> None:
        raise NotImplementedError

    def read(self) -> MemoryInfo:
        r = self._raw()
        return MemoryInfo(r.total, r.free, r.allocated, r.reserved,
                          max(r.peak_allocated, self._last[0]),
                          max(r.peak_reserved, self._last[1]))

    def step_boundary(self) -> None:
        r = self._raw()
        self._last = (r.peak_allocated, r.peak_reserved)
        self._reset()

    def forget_peaks(self) -> None:
        self._last = (0, 0)
        self._reset()


class CudaMemory(PeakWindow):
    """This thread's current CUDA device (the training thread's: the rank's device)."""

    def __init__(self, device: Optional[int] = None) -> None:
        super().__init__()
        self.device = torch.cuda.current_device() if device is None else device

    def _raw(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(self.device)
        s = torch.cuda.memory_stats(self.device)
        return MemoryInfo(total=total, free=free,
                          allocated=s.get("allocated_bytes.all.current", 0),
                          reserved=s.get("reserved_bytes.all.current", 0),
                          peak_allocated=s.get("allocated_bytes.all.peak", 0),
                          peak_reserved=s.get("reserved_bytes.all.peak", 0))

    def _reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def agree_on_max(value: int) -> int:
    """The largest `value` over the world (collective, on the control group)."""
    group = control_group()
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def new_communicators(layout: Layout) -> int:
    """NCCL communicators of more than one member a rank joins when `layout`'s groups are
    built (`elastic.groups.build_groups`): one per group axis whose groups are larger than
    one (a rank is in one group per axis), the layout's own group and the transfer group."""
    n = sum(1 for axes in GROUP_AXES.values()
            if math.prod(getattr(layout, a) for a in axes) > 1)
    return n + (2 if layout.world_size > 1 else 1)


def nccl_comm_bytes() -> int:
    """Bytes one new NCCL communicator is assumed to take outside torch's allocator."""
    v = os.environ.get("DYNATRAIN_NCCL_COMM_BYTES")
    try:
        return DEFAULT_NCCL_COMM_BYTES if v is None else max(0, int(v))
    except ValueError as e:
        raise LayoutError(f"DYNATRAIN_NCCL_COMM_BYTES={v!r} is not a byte count") from e


@dataclass(frozen=True, slots=True)
class SwitchMemoryCheck:
    """`device_memory_bytes` per device (None: measured, `source` required);
    `activation_reserve_bytes`: A's activations where they cannot be measured (no
    `source`); `reserve_bytes`: kept free (fragmentation) on top of what is measured;
    `source`: the device's readings (GPU); `nccl_bytes_per_communicator`: B's NCCL
    buffers per new communicator (counted only with a `source`)."""

    device_memory_bytes: Optional[int] = None
    activation_reserve_bytes: int = 0
    reserve_bytes: int = 0
    source: Optional[DeviceMemory] = None
    nccl_bytes_per_communicator: int = DEFAULT_NCCL_COMM_BYTES

    def __post_init__(self) -> None:
        if (self.device_memory_bytes is None and self.source is None) or \
                (self.device_memory_bytes is not None and self.device_memory_bytes <= 0) or \
                self.activation_reserve_bytes < 0 or self.reserve_bytes < 0 or \
                self.nccl_bytes_per_communicator < 0:
            raise LayoutError(f"memory check {self}: device memory must be > 0 (or measured "
                              f"from a device) and the reserves >= 0")

    def step_boundary(self) -> None:
        """Call at every step boundary (before a request is decided): the figures are the
        last step's, never a peak since the job began."""
        if self.source is not None:
            self.source.step_boundary()

    def forget_peaks(self) -> None:
        """Call after a switch (applied or rolled back): its peak held A and B together."""
        if self.source is not None:
            self.source.forget_peaks()

    def inputs(self, dst: Layout) -> tuple[int, int, int]:
        """(device memory, A's pool, reserve) on this rank, before agreeing."""
        if self.source is None:
            return self.device_memory_bytes, self.activation_reserve_bytes, self.reserve_bytes
        m = self.source.read()
        total = self.device_memory_bytes if self.device_memory_bytes is not None else m.total
        nccl = new_communicators(dst) * self.nccl_bytes_per_communicator
        return total, m.pool, self.reserve_bytes + m.outside_torch + nccl

    def plan(self, spec: ModelSpec, builder, src: Layout, src_placement: Placement,
             dst: Layout, dst_placement: Placement) -> SwitchMemoryPlan:
        """Collective: measure, agree, decide (the same plan on every rank)."""
        total, pool, reserve = self.inputs(dst)
        total = -agree_on_max(-total)  # the smallest device decides
        act = agree_on_max(pool)
        reserve = agree_on_max(reserve)
        return switch_memory_plan(spec, src, src_placement.devices, dst, dst_placement.devices,
                                  device_memory_bytes=total, activation_bytes=act,
                                  reserve_bytes=reserve,
                                  bucket_sizes=(builder.bucket_size(src),
                                                builder.bucket_size(dst)))


def from_args(args, source: Optional[DeviceMemory] = None) -> Optional[SwitchMemoryCheck]:
    """The job's check: on a GPU always (the device measured; `--dynatrain-device-memory`
    caps it), on the CPU only with `--dynatrain-device-memory`."""
    if source is None and torch.cuda.is_available():
        source = CudaMemory()
    given = getattr(args, "dynatrain_device_memory", None)
    if not given and source is None:
        return None
    return SwitchMemoryCheck(given or None, getattr(args, "dynatrain_activation_reserve", 0) or 0,
                             getattr(args, "dynatrain_memory_reserve", 0) or 0, source,
                             nccl_comm_bytes())


def release_grad_buffers(objs) -> None:
    """Free A's DDP gradient buffers (every chunk); `restore_grad_buffers` undoes it."""
    cuda = torch.cuda.is_available()
    for m in objs.model:
        m.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)


def restore_grad_buffers(objs) -> None:
    """A's gradient buffers allocated again and zeroed (after a rolled-back switch)."""
    for m in objs.model:
        m.restore_grad_buffers(synchronize=torch.cuda.is_available())
