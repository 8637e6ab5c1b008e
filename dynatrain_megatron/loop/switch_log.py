"""Where a job's switches are reported: `switches.jsonl` in the log directory (one record
per event: applied switches with their stall, rejected and failed requests, recoveries,
each with wall-clock timestamps), and the metric sinks a host registers (Megatron-LM's
TensorBoard and W&B writers: `megatron_lm/metrics.py`).

Records are written by rank 0 only, through the job's `safe_files.OutputDir` (no link
followed, the file checked, each line appended whole).
"""
from __future__ import annotations

import datetime
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch.distributed as dist

from ..safe_files import OutputDir
from .stall import StallBreakdown, slowest

log = logging.getLogger("dynatrain")

RECORD_FILE = "switches.jsonl"
# (iteration, scalars by tag) -> None; a host's metric writer
MetricSink = Callable[[int, dict], None]


@dataclass
class SwitchRecord:
    """One applied switch, as this rank saw it (a row of the end-of-run summary)."""

    iteration: int
    src: str
    dst: str
    placement: str
    bytes_moved: int
    lower_bound_bytes: int
    pause_s: float
    groups_s: float  # building the new layout's groups
    phases: dict = field(default_factory=dict)
    groups_in_pause: bool = False  # True only with background_groups=False (comparison)
    # B's build, binding, check and plan, done in the background while A trained
    prepared: dict = field(default_factory=dict)
    source: str = "signal"  # who asked: "signal", "schedule", "auto"
    reason: str = ""  # when the job chose the layout: why, and the advisor's top rows



def landing_note(at: Optional[int], iteration: int, waited: float) -> str:
    """How a switch landed against its schedule (`at`: the iteration it was due after)."""
    if at is None:
        return ""
    if iteration == at:
        return f" as scheduled (waited {waited:.3f} s for B)"
    return f", {iteration - at} iteration(s) late (scheduled after iteration {at})"


def wall_clock(epoch: Optional[float] = None) -> dict:
    """A record's timestamps: epoch seconds and the same instant in UTC, ISO 8601."""
    t = time.time() if epoch is None else epoch
    return dict(time=round(t, 6), time_utc=datetime.datetime.fromtimestamp(
        t, datetime.timezone.utc).isoformat(timespec="milliseconds"))


class SwitchLog:
    """Appends records to `switches.jsonl` in the job's log directory (rank 0; a no-op
    without one; a write that fails is logged once and training goes on:
    `safe_files.OutputDir`) and hands metrics to the registered sinks."""

    def __init__(self, outputs: Optional[OutputDir]) -> None:
        self.outputs = outputs
        self.sinks: list[MetricSink] = []
        if outputs is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            outputs.check()  # an unusable log directory is named at start-up, once

    def record(self, kind: str, entry: dict, epoch: Optional[float] = None) -> Optional[dict]:
        """Write one record `{"kind": kind, "time": ..., "time_utc": ..., **entry}` (the
        caller is rank 0). Returns it, or None when nothing was written."""
        if self.outputs is None:
            return None
        rec = json.loads(json.dumps({"kind": kind, **wall_clock(epoch), **entry}, default=str))
        return rec if self.outputs.append_json_line(RECORD_FILE, rec) else None

    def outcome(self, kind: str, d, iteration: Optional[int], layout, request: Optional[str],
                reason: str) -> None:
        """A request's outcome other than a measured switch (`d`: the controller's
        Decision; the caller's rank 0 writes it)."""
        if dist.get_rank() == 0:
            self.record(kind, dict(iteration=iteration, src=str(layout), dst=d.target,
                                   world=d.world, source=d.source, request=request,
                                   reason=reason))

    def metrics(self, iteration: int, scalars: dict) -> None:
        """Hand `scalars` (tag -> number or text) to every sink; a failing sink is dropped
        with a warning (metrics never end training)."""
        for sink in list(self.sinks):
            try:
                sink(iteration, scalars)
            except Exception as e:  # noqa: BLE001
                log.warning("metric writer %r failed and is dropped: %s", sink, e)
                self.sinks.remove(sink)


def share_and_report(report: SwitchLog, rec: SwitchRecord, extra: dict,
                     mine: StallBreakdown) -> dict:
    """Every rank of B shares its stall breakdown, pause and transfer (one object
    all-gather over B's ranks, `extra["groups"]`); rank 0 logs the switch's one line and
    writes its record; every rank hands the metrics to its sinks (Megatron-LM's writers
    live on its last rank). Returns the switch's stall: the slowest rank's breakdown and
    every rank's figures."""
    groups = extra["groups"]
    group = getattr(groups, "layout_group_cpu", None) or getattr(groups, "layout_group", None)
    me = dict(b=mine, pause_s=rec.pause_s, transfer_s=extra["transfer_s"],
              deferred_s=extra.get("release_a_deferred_s", 0.0))
    if group is None:
        everyone = [me]
    else:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, me, group=group)
    worst = slowest([e["b"] for e in everyone])
    pause = max(e["pause_s"] for e in everyone)
    stall = dict(slowest=worst.as_dict(), ranks=[
        dict(rank=e["b"].rank, stall_s=round(e["b"].stall_s, 6),
             pause_s=round(e["pause_s"], 6), transfer_s=round(e["transfer_s"], 6),
             parts={n: round(v, 6) for n, v in e["b"].parts},
             unaccounted_s=round(e["b"].unaccounted_s, 6),
             first_step_faults=e["b"].first_step_faults,
             steady_step_faults=e["b"].steady_step_faults,
             # A's memory collected after B's first steps were measured (not in the stall)
             release_a_deferred_s=round(e["deferred_s"], 6)) for e in everyone])
    r = rec
    if dist.get_rank() == 0:
        first = ("first step at B not measured" if worst.first_step_s is None
                 or worst.steady_step_s is None else
                 f"first step at B {worst.first_step_s:.3f} s, steady {worst.steady_step_s:.3f} s"
                 + ("" if worst.first_step_gc_s is None else
                    f" (garbage collection {worst.first_step_gc_s:.3f} s / "
                    f"{worst.steady_step_gc_s or 0.0:.3f} s)"))
        where = ("inside the pause" if r.groups_in_pause else "in the background (%s)" % (
            ", ".join(f"{k} {v:.3f}" for k, v in r.prepared.items())))
        log.info("iteration %d: switched %s -> %s (placement %s)%s: %s on the slowest rank "
                 "(r%d; %s); pause %.3f s (slowest rank); %.2f MB moved (lower bound %.2f "
                 "MB); B prepared %s", r.iteration, r.src, r.dst, r.placement, extra["when"],
                 worst, worst.rank, first, pause, r.bytes_moved / 1e6,
                 r.lower_bound_bytes / 1e6, where)
        report.record("switch", dict(asdict(r), request=extra["request"], stall=stall),
                      epoch=worst.wall_start)
    report.metrics(r.iteration, {
        "dynatrain/stall_s": worst.stall_s, "dynatrain/pause_s": pause,
        "dynatrain/transfer_s": worst.part("transfer"), "dynatrain/bytes_moved": r.bytes_moved,
        "dynatrain/placement": r.placement, **layout_scalars(extra["dst"])})
    return stall


def summary(history: list[SwitchRecord], stalls: list[dict], rejected: list[str],
            failed: list[str], recoveries: list[dict],
            checkpoint_seconds: Optional[float] = None) -> str:
    """The end-of-run table of every switch (stall of the slowest rank, its pause,
    transfer, groups built in the background), rejected and rolled-back requests, and
    recoveries."""
    lines = ["", "dynatrain switches:",
             f"{'iter':>5} {'from':>18} {'to':>18} {'moved MB':>9} {'stall s':>8} "
             f"{'pause s':>8} {'transfer s':>10} {'groups s (bg)':>13}"
             + (f" {'ckpt path s':>11} {'speedup':>8}" if checkpoint_seconds else "")]
    by_switch = {(s["slowest"]["iteration"], s["slowest"]["dst"]): s["slowest"]["stall_s"]
                 for s in stalls}
    for h in history:
        stall = by_switch.get((h.iteration, h.dst))
        row = (f"{h.iteration:>5} {h.src:>18} {h.dst:>18} {h.bytes_moved / 1e6:>9.2f} "
               f"{'-' if stall is None else f'{stall:.3f}':>8} "
               f"{h.pause_s:>8.3f} {h.phases.get('transfer', 0):>10.3f} {h.groups_s:>13.3f}")
        if checkpoint_seconds:
            row += f" {checkpoint_seconds:>11.2f} {checkpoint_seconds / h.pause_s:>7.1f}x"
        lines.append(row)
    if rejected:
        lines.append(f"rejected requests: {len(rejected)}")
        lines += [f"  - {r}" for r in rejected]
    if failed:
        lines.append(f"switches rolled back: {len(failed)}")
        lines += [f"  - {r}" for r in failed]
    for r in recoveries:
        lines.append(f"recovered from the death of ranks {r['dead']}: {r['src']} -> "
                     f"{r['dst']} ({'in memory' if r['mode'] == 'memory' else 'from the checkpoint'})"
                     + (f", pause {r['pause_s']:.3f} s" if r['pause_s'] else ""))
    return "\n".join(lines)


def layout_scalars(layout) -> dict:
    """The layout as scalars (one series per axis), for a chart of the layout over time."""
    return {f"dynatrain/layout/{axis}": getattr(layout, axis)
            for axis in ("tp", "pp", "vpp", "cp", "ep", "etp", "dp", "world_size")}


__all__ = ["RECORD_FILE", "MetricSink", "SwitchLog", "SwitchRecord", "layout_scalars",
           "share_and_report", "summary", "wall_clock"]
