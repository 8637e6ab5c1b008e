"""Memory a layout needs on each rank, from the analytic layout (validation before a switch).

Per rank: the weights (params dtype), the fp32 main copy when the weights are not fp32
(for fp32 weights the distributed optimizer's main shard is a view of the weight), the two
Adam moments, and the fp32 gradient buffer (megatron keeps `main_grad` for every local
weight element). Activations are not modelled: `headroom_bytes` is the caller's margin.

`switch_memory_plan` checks the moment of a switch, when layout A and layout B live on
the same devices together: A's state and gradient buffers, A's activations (if B is
built while A trains: measured on a GPU, a configured reserve on the CPU, the same value
on every rank), B's whole state, and a reserve (NCCL buffers, fragmentation). It picks the
first way of preparing B that fits every device, in order of how little it costs:
  background  B built, bound and planned while A trains (the normal way);
  in_pause    B built at the step boundary, where A's activations are freed: the build
              moves into the pause, the memory of A's activations is not needed twice;
  release_a_grads  as in_pause, and A's gradient buffers (dead at a step boundary) are
              freed before B is built (restored, zeroed, if the switch rolls back);
and otherwise says by how much it does not fit (no switch is started).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .analytic import analytic_layout
from .errors import LayoutError
from .layout import Layout
from .model_spec import ModelSpec
from .naming import DTYPE_BYTES


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    layout: str
    max_bytes: int
    worst_rank: int
    mean_bytes: float


def estimate_state_memory(spec: ModelSpec, layout: Layout,
                          bucket_size: Optional[int] = None) -> MemoryEstimate:
    b = analytic_layout(spec, layout, bucket_size).bytes_per_rank()
    params = b["param"]
    grads = params // DTYPE_BYTES[spec.params_dtype] * 4
    main = b["main_param"] if spec.params_dtype != "fp32" else np.zeros_like(params)
    total = params + grads + main + b["exp_avg"] + b["exp_avg_sq"]
    worst = int(np.argmax(total))
    return MemoryEstimate(str(layout), int(total[worst]), worst, float(total.mean()))


def check_memory_fit(spec: ModelSpec, layout: Layout, device_memory_bytes: int,
                     headroom_bytes: int = 0, bucket_size: Optional[int] = None) -> MemoryEstimate:
    """Raise LayoutError when the layout's state does not fit a device's memory."""
    est = estimate_state_memory(spec, layout, bucket_size)
    if est.max_bytes + headroom_bytes > device_memory_bytes:
        raise LayoutError(
            f"layout {layout} does not fit: rank {est.worst_rank} needs {est.max_bytes / 2**30:.2f} "
            f"GiB of weights, grads and optimizer state (+ {headroom_bytes / 2**30:.2f} GiB "
            f"headroom) > {device_memory_bytes / 2**30:.2f} GiB per device")
    return est


SWITCH_MODES = ("background", "in_pause", "release_a_grads")
_GiB = float(1 << 30)


def _per_device(spec: ModelSpec, layout: Layout, devices: Sequence[int], n: int,
                bucket_size: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
    """(state, gradient buffers) bytes of `layout` on each of `n` devices, rank r of the
    layout on `devices[r]`; zero on devices outside it."""
    b = analytic_layout(spec, layout, bucket_size).bytes_per_rank()
    params = b["param"]
    grads = params // DTYPE_BYTES[spec.params_dtype] * 4
    main = b["main_param"] if spec.params_dtype != "fp32" else np.zeros_like(params)
    state = params + main + b["exp_avg"] + b["exp_avg_sq"]
    out_s, out_g = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    idx = np.asarray(devices, dtype=np.int64)
    out_s[idx] = state
    out_g[idx] = grads
    return out_s, out_g


@dataclass(frozen=True, slots=True)
class SwitchMemoryPlan:
    """How B is prepared so that A and B fit together (`mode`, or None: they never do),
    and the bytes behind the decision, on the device that needs the most."""

    src: str
    dst: str
    mode: Optional[str]
    device_memory_bytes: int
    need_bytes: tuple[tuple[str, int, int], ...]  # (mode, bytes on its worst device, device)
    a_state: int
    a_grads: int
    activations: int
    b_state: int
    reserve: int

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in SWITCH_MODES:
            raise LayoutError(f"switch memory plan: unknown mode {self.mode!r}")

    @property
    def fits(self) -> bool:
        return self.mode is not None

    def describe(self) -> str:
        needs = ", ".join(f"{m} {b / _GiB:.2f} GiB (device {d})" for m, b, d in self.need_bytes)
        head = (f"switch {self.src} -> {self.dst}: A state {self.a_state / _GiB:.2f} + A grads "
                f"{self.a_grads / _GiB:.2f} + A activations {self.activations / _GiB:.2f} + B "
                f"{self.b_state / _GiB:.2f} + reserve {self.reserve / _GiB:.2f} GiB (worst "
                f"device); needs {needs} of {self.device_memory_bytes / _GiB:.2f} GiB")
        if self.mode == "background":
            return head + ": B prepared in the background"
        if self.mode == "in_pause":
            return head + (": degraded: B is built at the step boundary, after A's activations "
                           "are freed (not in the background; the pause grows by B's build)")
        if self.mode == "release_a_grads":
            return head + (": degraded: A's gradient buffers are released at the step boundary "
                           "and B is built there (restored if the switch rolls back)")
        return head + ": A and B do not fit together; no switch"


def switch_memory_plan(spec: ModelSpec, src: Layout, src_devices: Sequence[int], dst: Layout,
                       dst_devices: Sequence[int], *, device_memory_bytes: int,
                       activation_bytes: int, reserve_bytes: int = 0,
                       bucket_sizes: tuple[Optional[int], Optional[int]] = (None, None)
                       ) -> SwitchMemoryPlan:
    """Decide how to prepare the switch `src` -> `dst` within `device_memory_bytes` per
    device (module doc). `activation_bytes`: A's activation peak per device (the same on
    every rank: agree on the maximum first). Pure: every rank decides the same."""
    for name, v in (("device_memory_bytes", device_memory_bytes),
                    ("activation_bytes", activation_bytes), ("reserve_bytes", reserve_bytes)):
        if v < 0:
            raise LayoutError(f"switch memory plan: {name} must be >= 0, got {v}")
    n = max(max(src_devices), max(dst_devices)) + 1
    a_s, a_g = _per_device(spec, src, src_devices, n, bucket_sizes[0])
    b_s, b_g = _per_device(spec, dst, dst_devices, n, bucket_sizes[1])
    in_a = np.zeros(n, dtype=bool)
    in_a[np.asarray(src_devices)] = True
    act = np.where(in_a, activation_bytes, 0)
    totals = {"background": a_s + a_g + act + b_s + b_g + reserve_bytes,
              "in_pause": a_s + a_g + b_s + b_g + reserve_bytes,
              "release_a_grads": a_s + b_s + b_g + reserve_bytes}
    need = tuple((m, int(t.max()), int(t.argmax())) for m, t in totals.items())
    mode = next((m for m, b, _ in need if b <= device_memory_bytes), None)
    worst = int(totals["background"].argmax())
    return SwitchMemoryPlan(str(src), str(dst), mode, device_memory_bytes, need,
                            int(a_s[worst]), int(a_g[worst]), int(act[worst]),
                            int(b_s[worst] + b_g[worst]), reserve_bytes)
