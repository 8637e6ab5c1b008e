"""Rank the layouts of N devices for a model: `dynatrain suggest` and automatic layouts.

Steps (each a pure function of its inputs, identical on every rank of a job):
  1. enumerate every layout of N devices the one validator accepts (enumerate.py);
  2. drop those megatron-core cannot run the batch on (`schedulable_microbatches`);
  3. estimate every layout's step time (step_time.py) and sort, fastest first;
  4. walk that order and keep the layouts whose peak memory per device (memory.py: exact
     state + modelled activations, plus the calibration's reserve) fits the device; a
     cheap lower bound on the state skips most layouts that cannot fit before the exact
     state is computed; stop after `top` rows;
  5. with a current layout, add to each row the switch cost from it (the planner's
     placement, plan and schedule, routing/cost.py's estimate) and the steps after which
     the faster step pays the switch back.
When nothing fits, the error names the smallest peak any layout needs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from ..routing.cost import estimate
from ..routing.links import LinkModel
from ..routing.placement_search import placement_choice
from ..routing.schedule import build_schedule
from ..vps.errors import LayoutError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from .calibration import Calibration, Measurement, Workload
from .enumerate import SearchSpace, enumerate_layouts
from .errors import AdvisorError, NoLayoutFits
from .memory import (activation_bytes_by_stage, memory_estimate, state_bytes_by_stage,
                     state_lower_bound)
from .step_time import StepEstimate, step_estimate

GB = 1e9


@dataclass(frozen=True, slots=True)
class SwitchCost:
    """The switch from the current layout to a row's layout (planner and cost model)."""

    bytes_moved: int
    seconds: float
    payback_steps: Optional[float]  # None: the row's step is not faster than the current

    def __post_init__(self) -> None:
        if self.bytes_moved < 0 or self.seconds < 0:
            raise AdvisorError(f"bad switch cost {self!r}")


@dataclass(frozen=True, slots=True)
class SuggestedLayout:
    """One row of the ranking."""

    layout: Layout
    memory_bytes_per_device: int  # peak state + activations + reserve
    state_bytes_per_device: int
    activation_bytes_per_device: int
    step: StepEstimate
    switch: Optional[SwitchCost] = None

    @property
    def step_seconds(self) -> float:
        return self.step.step_seconds

    def to_dict(self) -> dict:
        d = {"layout": str(self.layout), "world": self.layout.world_size,
             "memory_bytes_per_device": self.memory_bytes_per_device,
             "state_bytes_per_device": self.state_bytes_per_device,
             "activation_bytes_per_device": self.activation_bytes_per_device,
             "step_seconds": self.step.step_seconds,
             "step_parts": {k: getattr(self.step, k) for k in (
                 "compute_seconds", "tp_seconds", "cp_seconds", "ep_seconds", "pp_seconds",
                 "bubble_seconds", "dp_seconds")},
             "num_microbatches": self.step.num_microbatches}
        if self.switch is not None:
            d.update(switch_bytes=self.switch.bytes_moved, switch_seconds=self.switch.seconds,
                     payback_steps=self.switch.payback_steps)
        return d


@dataclass(frozen=True, slots=True)
class Suggestion:
    """The ranking (best first) and what it was computed from."""

    model: str
    world: int
    rows: tuple[SuggestedLayout, ...]
    valid_layouts: int  # accepted by the validator
    ranked_layouts: int  # ... whose DP size divides the global batch
    device_memory_bytes: Optional[int]
    current: Optional[str]
    current_step_seconds: Optional[float]
    seconds: float  # time the ranking took

    @property
    def best(self) -> Layout:
        return self.rows[0].layout


def schedulable_microbatches(work: Workload, layout: Layout) -> Optional[int]:
    """Micro-batches per step of `layout`, None when megatron-core cannot run the workload
    on it: the global batch must split over the data-parallel replicas, and the
    interleaved schedule (vpp > 1) runs groups of pp contiguous micro-batches per virtual
    stage (its default), so it needs at least pp of them and a remainder of 0 or >= pp,
    i.e. a multiple of pp (megatron-core's forward_backward_pipelining_with_interleaving
    refuses the rest)."""
    m = work.num_microbatches(layout.dp)
    if m is None or (layout.vpp > 1 and (m < layout.pp or m % layout.pp)):
        return None
    return m


def fit_step_scale(spec: ModelSpec, measured: Sequence[Measurement], work: Workload,
                   cal: Calibration) -> float:
    """The factor (geometric mean of measured / modelled) that makes the model match step
    times measured on the user's cluster."""
    logs = []
    base = cal.replace(step_scale=1.0)
    for m in measured:
        try:
            lay = Layout.parse(m.layout)
        except LayoutError as e:
            raise AdvisorError(f"measured step {m.layout!r}: {e}") from None
        if "dp" not in m.layout.lower():
            raise AdvisorError(f"measured step {m.layout!r}: give the dp axis (the layout's "
                               f"world size is part of the measurement)")
        n = work.num_microbatches(lay.dp)
        if n is None:
            raise AdvisorError(f"measured step {m.layout!r}: dp{lay.dp} does not divide the "
                               f"global batch {work.global_batch_size} / micro-batch "
                               f"{work.micro_batch_size}")
        est = step_estimate(spec, lay, work, base, n)
        logs.append(math.log(m.step_seconds / est.step_seconds))
    return math.exp(sum(logs) / len(logs)) if logs else cal.step_scale


def switch_cost(spec: ModelSpec, src: Layout, dst: Layout, cal: Calibration,
                src_step: Optional[float], dst_step: float,
                bucket_size: Optional[int] = None) -> SwitchCost:
    """Bytes and estimated seconds of switching `src` -> `dst` (the planner's chosen
    placement, one round), and the steps after which it pays for itself."""
    links = LinkModel(intra_node_gbps=cal.intra_node_gbps, inter_node_gbps=cal.inter_node_gbps)
    cand = range(max(src.world_size, dst.world_size))
    ch = placement_choice(spec, src, None, dst, cand, cal.ranks_per_node, bucket_size)
    est = estimate(build_schedule(ch.chosen_plan), links)
    gain = None if src_step is None else src_step - dst_step
    pay = est.total_seconds / gain if gain is not None and gain > 0 else None
    return SwitchCost(int(ch.chosen_plan.stats.moved_bytes), est.total_seconds, pay)


def suggest(spec: ModelSpec, world: int, work: Workload, cal: Calibration = Calibration(), *,
            device_memory_bytes: Optional[int] = None, top: int = 10,
            space: SearchSpace = SearchSpace(), transformer_engine: bool = False,
            bucket_size: Optional[int] = None, current: Optional[Layout] = None,
            measured: Sequence[Measurement] = ()) -> Suggestion:
    """The `top` fastest layouts of `world` devices that fit `device_memory_bytes` (None:
    no memory limit), best first (module doc). Raises NoLayoutFits / AdvisorError."""
    t0 = time.perf_counter()
    if not isinstance(top, int) or top < 1:
        raise AdvisorError(f"top must be a positive int, got {top!r}")
    if device_memory_bytes is not None and device_memory_bytes <= 0:
        raise AdvisorError(f"device memory must be positive, got {device_memory_bytes}")
    if measured:
        cal = cal.replace(step_scale=fit_step_scale(spec, measured, work, cal))
    valid = enumerate_layouts(spec, world, space, transformer_engine=transformer_engine)
    if not valid:
        raise NoLayoutFits(f"no layout of {world} devices fits: none is valid for model "
                           f"{spec.name!r} (every split of {world} devices violates a "
                           f"divisibility constraint of its heads, groups, layers or experts)")
    ranked = []
    for lay in valid:
        m = schedulable_microbatches(work, lay)
        if m is not None:
            ranked.append((step_estimate(spec, lay, work, cal, m), lay, m))
    if not ranked:
        raise NoLayoutFits(f"no layout of {world} devices fits: no valid layout's data-parallel "
                           f"size divides the global batch {work.global_batch_size} / "
                           f"micro-batch {work.micro_batch_size} (into a multiple of pp "
                           f"micro-batches for an interleaved schedule)")
    ranked.sort(key=lambda x: (x[0].step_seconds, str(x[1])))
    rows: list[SuggestedLayout] = []
    for est, lay, m in ranked:
        if device_memory_bytes is not None:
            act = activation_bytes_by_stage(spec, lay, work, cal, m)
            lb = float((state_lower_bound(spec, lay, cal.grad_bytes) + act).max())
            if lb + cal.reserve_bytes > device_memory_bytes:
                continue
        try:
            mem = memory_estimate(spec, lay, work, cal, m, bucket_size)
        except LayoutError:  # the analytic layout refuses what megatron-core cannot shard
            continue
        need = mem.peak_bytes + cal.reserve_bytes
        if device_memory_bytes is not None and need > device_memory_bytes:
            continue
        rows.append(SuggestedLayout(lay, need, mem.state_bytes, mem.activation_bytes, est))
        if len(rows) == top:
            break
    if not rows:
        raise _no_fit(spec, world, work, cal, ranked, device_memory_bytes, bucket_size)
    cur_step = None
    if current is not None:
        m = work.num_microbatches(current.dp)
        cur_step = step_estimate(spec, current, work, cal, m).step_seconds if m else None
        rows = [SuggestedLayout(r.layout, r.memory_bytes_per_device, r.state_bytes_per_device,
                                r.activation_bytes_per_device, r.step,
                                switch_cost(spec, current, r.layout, cal, cur_step,
                                            r.step_seconds, bucket_size))
                for r in rows]
    return Suggestion(spec.name, world, tuple(rows), len(valid), len(ranked),
                      device_memory_bytes, None if current is None else str(current),
                      cur_step, time.perf_counter() - t0)


def _no_fit(spec, world, work, cal, ranked, device_memory_bytes, bucket_size) -> NoLayoutFits:
    """The error naming the smallest peak memory of any layout (exact, found by walking
    the layouts in order of their lower bound and stopping once it exceeds the best)."""
    cands = []
    for _, lay, m in ranked:
        act = activation_bytes_by_stage(spec, lay, work, cal, m)
        cands.append((float((state_lower_bound(spec, lay, cal.grad_bytes) + act).max()),
                      lay, m))
    cands.sort(key=lambda x: x[0])
    best, best_lay = math.inf, None
    for lb, lay, m in cands:
        if lb >= best:
            break
        try:
            st = state_bytes_by_stage(spec, lay, bucket_size, cal.grad_bytes)
        except LayoutError:
            continue
        peak = float((st + activation_bytes_by_stage(spec, lay, work, cal, m)).max())
        if peak < best:
            best, best_lay = peak, lay
    need = best + cal.reserve_bytes
    return NoLayoutFits(
        f"no layout of {world} devices fits: the smallest needs {need / GB:.1f} GB per device "
        f"({best_lay}: {best / GB:.1f} GB of state and activations + {cal.reserve_bytes / GB:.1f}"
        f" GB reserve; the device has {device_memory_bytes / GB:.1f} GB)")


__all__ = ["SwitchCost", "SuggestedLayout", "Suggestion", "suggest", "switch_cost",
           "fit_step_scale"]
