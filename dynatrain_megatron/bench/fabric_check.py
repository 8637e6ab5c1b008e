"""The fabric simulation checked against our measured gloo runs, and its sensitivity.

Validation: the three `bench-switch` runs of docs/bench/switch.md (4 gloo ranks on one
2-core machine, tp2pp2 -> tp1pp4, optimizer state moved, default placement) are
re-planned here and simulated on a one-node "fabric" whose links are what each run
measured (its pairwise link as the per-device link, its memcpy as the local-copy and
checksum bandwidth, its small-message round as the round latency, efficiency 1: the
measured figures are achieved rates). The simulation is then set beside the run's
measured transfer phase and the same bytes moved raw with checksums.

Sensitivity: one plan simulated over oversubscription 1-4x and link efficiency 0.5-0.9.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..configs import load_model
from ..routing.fabric import Fabric, simulate_transfer
from ..routing.placement_search import placement_choice
from ..routing.planner import build_plan
from ..routing.schedule import build_schedule
from ..transition.executor import PACK_ALIGN
from ..vps.fragment import OPT_KINDS
from ..vps.layout import Layout


@dataclass(frozen=True, slots=True)
class GlooRun:
    """One measured run of docs/bench/switch.md (2026-11-30 20:54-21:00)."""

    model: str
    link_gbps: float
    round_s: float
    memcpy_gbps: float
    budget: Optional[int]
    transfer_s: float  # the switch's transfer phase, median of 3
    raw_checksummed_s: float  # (e): the same bytes, one message per peer, with checksums
    max_send_bytes: float  # the run's max per-rank send, to check the re-plan


GLOO_RUNS = (
    GlooRun("tiny-gpt", 0.98, 1.9e-3, 2.29, None, 36.3e-3, 4.3e-3, 614.40e3),
    GlooRun("gpt-50m", 0.81, 1.4e-3, 1.86, None, 305.1e-3, 253.6e-3, 181.86e6),
    GlooRun("gpt-200m", 0.92, 0.697e-3, 2.26, 128 * 2**20, 1.07, 792.4e-3, 498.60e6),
)


def validate_on_gloo(runs=GLOO_RUNS) -> list[dict]:
    """Each run re-planned and simulated (module doc)."""
    out = []
    for run in runs:
        spec = load_model(run.model)
        src, dst = Layout.parse("tp2pp2", 4), Layout.parse("tp1pp4", 4)
        plan = build_plan(spec, src, dst, kinds=OPT_KINDS, ranks_per_node=8)
        sched = build_schedule(plan, run.budget, PACK_ALIGN)
        fab = Fabric(ranks_per_node=8, nvlink_gbps=run.link_gbps, nic_gbps=run.link_gbps,
                     efficiency=1.0, round_latency_s=run.round_s, message_s=0.0,
                     local_copy_gbps=run.memcpy_gbps, checksum_gbps=run.memcpy_gbps)
        sim = simulate_transfer(sched, fab)
        out.append(dict(model=run.model, rounds=sched.num_rounds,
                        max_send_bytes=plan.stats.max_send_bytes,
                        measured_max_send_bytes=run.max_send_bytes,
                        simulated_s=sim.seconds, measured_transfer_s=run.transfer_s,
                        measured_raw_checksummed_s=run.raw_checksummed_s,
                        measured_over_simulated=run.transfer_s / sim.seconds,
                        raw_over_simulated=run.raw_checksummed_s / sim.seconds))
    return out


def sensitivity(model: str, src: str, dst: str, world: int, kinds=OPT_KINDS,
                oversubscription=(1.0, 2.0, 4.0), efficiency=(0.5, 0.7, 0.9),
                base: Fabric = Fabric()) -> dict:
    """The transfer of one switch (chosen placement) simulated over a grid of
    oversubscription and link efficiency."""
    spec = load_model(model)
    a, b = Layout.parse(src, world), Layout.parse(dst, world)
    ch = placement_choice(spec, a, None, b, range(world), base.ranks_per_node, None, kinds)
    sched = build_schedule(ch.chosen_plan)
    grid = {}
    for o in oversubscription:
        for e in efficiency:
            sim = simulate_transfer(sched, replace(base, oversubscription=o, efficiency=e))
            grid[f"{o:g}x/{e:g}"] = dict(seconds=sim.seconds,
                                         busiest_link=sim.as_dict()["busiest_link"])
    return {"model": model, "from": src, "to": dst, "world": world, "grid": grid}


__all__ = ["GLOO_RUNS", "GlooRun", "validate_on_gloo", "sensitivity"]
