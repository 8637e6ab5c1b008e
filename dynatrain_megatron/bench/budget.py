"""The end-to-end budget of a switch: every term a real switch pays, each marked as
measured (where), modelled (formula and constants), or hidden in the background (with
the background's time and the steps of A it overlaps).

Inputs: the plan report of `dynatrain plan` (bytes, per-rank traffic), the emulated
control plane (`bench.control_plane`: per-rank counts), the transfer simulated on a
fabric (`routing.fabric`), and `BudgetConstants`, whose every field says where its value
comes from. "stall" terms are what training waits for (the extra wall time of the
switching iteration); "background" terms run while A trains.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ..advisor.calibration import Calibration, Workload
from ..advisor.step_time import step_estimate
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec

GB = 1e9

# where a constant comes from (printed with the budget)
SOURCES = {
    "non_member_new_group_s": "measured: torch 2.13 new_group as a non-member, 'fake' backend "
                              "at world 4096, this 2-core machine under load (67-193 us/call)",
    "nccl_comm_init_s": "assumed: ncclCommInitRank with its group, order of 0.1-1 s at "
                        "thousands of GPUs (NCCL 2.2x release notes on init at scale); "
                        "to measure on GPUs",
    "store_op_s": "assumed: one TCPStore round trip (~100 us) and a single-threaded "
                  "store server serving every rank's operations one after the other",
    "small_collective_s": "assumed: a 4-byte NCCL all-reduce, 2 log2(n) steps of 8 us "
                          "(tree latency)",
    "release_rebind_s": "measured on CPU: bench-switch gpt-50m, pause minus the switch "
                        "(releasing A and rebinding the trainer), docs/bench/switch.md",
    "data_iterator_s": "assumed: Megatron-LM's build_train_valid_test_data_iterators on "
                       "cached dataset indices (mmap) and a broadcast; seconds for large "
                       "blends; runs in the pause today (megatron_lm/adapter.rebind_loop)",
    "first_step_extra_s": "assumed: the first step at B pays cold kernels, autotuning and "
                          "allocator growth (B's communicators are warm); to measure on GPUs",
    "step_skew_fraction": "assumed: after the optimizer step's collectives ranks reach the "
                          "boundary within 0.1% of a step of each other",
    "storage_gbps": "the checkpoint model of `dynatrain plan` (routing/cost.py)",
}


@dataclass(frozen=True, slots=True)
class BudgetConstants:
    """Constants of the modelled terms (`SOURCES` says where each comes from)."""

    non_member_new_group_s: float = 100e-6
    nccl_comm_init_s: float = 0.3
    store_op_s: float = 100e-6
    store_server_ops_per_s: float = 50_000.0
    small_collective_step_s: float = 8e-6
    release_rebind_s: float = 0.055
    data_iterator_s: float = 2.0
    first_step_extra_s: float = 2.0
    step_skew_fraction: float = 0.001
    nic_gbps: float = 50.0
    nvlink_gbps: float = 450.0
    efficiency: float = 0.8
    workload: Workload = field(default_factory=lambda: Workload(1, 1024, 4096))

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if k != "workload" and not v >= 0:
                raise ValueError(f"budget constant {k} must be >= 0, got {v}")

    def small_collective_s(self, n: int) -> float:
        return 2 * math.log2(max(n, 2)) * self.small_collective_step_s


@dataclass(frozen=True, slots=True)
class Term:
    """One line of the budget."""

    name: str
    seconds: float
    where: str  # "stall" or "background"
    how: str  # "measured", "modelled", "simulated"
    basis: str  # where measured, or the formula with its constants

    def as_dict(self) -> dict:
        return asdict(self)


def _steps(spec: ModelSpec, layout: Layout, c: BudgetConstants) -> float:
    """A step of `layout` (advisor.step_time) for the budget's workload."""
    w = c.workload
    m = max(1, w.global_batch_size // (w.micro_batch_size * layout.dp))
    cal = Calibration(intra_node_gbps=c.nvlink_gbps, inter_node_gbps=c.nic_gbps)
    return step_estimate(spec, layout, w, cal, m).step_seconds


def switch_budget(spec: ModelSpec, src: Layout, dst: Layout, report: dict[str, Any],
                  counts: Optional[dict[str, Any]], transfer: Optional[dict[str, Any]],
                  c: BudgetConstants = BudgetConstants()) -> dict[str, Any]:
    """The budget of the switch `report` describes (module doc). `counts`: the emulated
    control plane's summary (`Emulation.summary()`), `transfer`: the simulated transfer
    (`TransferSim.as_dict()`); without them those terms fall back to the ideal-link
    estimate and the analytic group counts."""
    W = max(src.world_size, dst.world_size)
    nic = c.nic_gbps * GB * c.efficiency
    step_a, step_b = _steps(spec, src, c), _steps(spec, dst, c)
    t: list[Term] = []
    k = counts or {}
    # -- background: B's groups, the preparation
    calls = k.get("switch_non_member_calls", 0)
    t.append(Term("new_group calls (non-member)", calls * c.non_member_new_group_s,
                  "background", "modelled",
                  f"{calls} calls x {c.non_member_new_group_s * 1e6:.0f} us (emulated count; "
                  f"per-call cost measured on CPU)"))
    comms = k.get("switch_communicators", 0)
    t.append(Term("communicators created", comms * c.nccl_comm_init_s, "background",
                  "modelled", f"{comms} NCCL communicators x {c.nccl_comm_init_s:g} s, one "
                  f"after the other (emulated count)"))
    ops = k.get("switch_store_sets", 0) + k.get("switch_store_gets", 0)
    server = ops * W / c.store_server_ops_per_s
    t.append(Term("store operations", max(ops * c.store_op_s, server), "background",
                  "modelled", f"{ops} per rank x {W} ranks through one store server at "
                  f"{c.store_server_ops_per_s:,.0f} ops/s, or {ops} x "
                  f"{c.store_op_s * 1e6:.0f} us per rank, whichever is longer"))
    conns = k.get("switch_gloo_connections", 0)
    t.append(Term("gloo mesh set-up", conns * c.store_op_s, "background", "modelled",
                  f"{conns} eager connections per rank (the world-sized twin connects "
                  f"lazily) x {c.store_op_s * 1e6:.0f} us"))
    plan_s = report.get("plan_seconds", 0.0)
    t.append(Term("plan + schedule (preparation)", 0.0, "background", "measured",
                  "memoised: made with the placement choice, found made by the preparation"))
    # -- stall: on the training thread
    t.append(Term("placement choice (with its plans)", plan_s, "stall", "measured",
                  "choose_dst_placement on the training thread when the request is "
                  "accepted; cold, one core of this machine (dynatrain plan's planning time)"))
    t.append(Term("step skew", c.step_skew_fraction * step_a, "stall", "modelled",
                  f"{c.step_skew_fraction:g} x step of A ({step_a:.2f} s, advisor.step_time)"))
    votes = k.get("switch_collectives", {}).get("all_reduce", 4)
    warm = max(0, votes - 4)
    t.append(Term("votes (ready, preparation, prepare, commit)",
                  4 * c.small_collective_s(W), "stall", "modelled",
                  f"4 world all-reduces of 4 B x {c.small_collective_s(W) * 1e6:.0f} us"))
    t.append(Term("communicator warm-up", warm * c.small_collective_s(W), "stall",
                  "modelled", f"{warm} group all-reduces (emulated) x "
                  f"{c.small_collective_s(W) * 1e6:.0f} us (communicators made in the "
                  f"background)"))
    if transfer is not None:
        t.append(Term("transfer (data)", transfer["data_seconds"], "stall", "simulated",
                      f"max-min fair flows on a rail-optimised fat tree "
                      f"(oversubscription {transfer['fabric']['oversubscription']:g}, "
                      f"efficiency {transfer['fabric']['efficiency']:g}), "
                      f"{transfer['rounds']} round(s)"))
        t.append(Term("transfer (checksum phase)", transfer["checksum_seconds"], "stall",
                      "simulated", "receivers' pass + one exchange of the sums per round"))
    else:
        t.append(Term("transfer", report["estimated_seconds"], "stall", "modelled",
                      "ideal links (routing.cost.estimate)"))
    gather = k.get("switch_world_collective_bytes", {}).get("all_gather_object", 0)
    p2p = k.get("p2p_padding_bytes", 0)
    t.append(Term("vocab-padding exchange", max(gather, p2p) / nic
                  + (c.small_collective_s(2) if p2p else 0.0), "stall", "modelled",
                  (f"{gather / 1e9:.2f} GB received per rank by a world all_gather_object"
                   if gather else f"{p2p / 1e6:.2f} MB sent + received point to point by the "
                   f"busiest sampled rank (emulated)") + f" / NIC {nic / 1e9:.0f} GB/s"))
    t.append(Term("scalars broadcast", c.small_collective_s(W), "stall", "modelled",
                  "one small world broadcast"))
    # rebuild from masters: each rank gathers its model-parallel shard of the weights
    # over DP ((dp-1)/dp of it arrives), bf16
    from ..routing.cost import state_bytes
    wbytes = state_bytes(spec, ("param",)) / (dst.tp * dst.pp * dst.cp)
    dp = dst.dp * dst.cp
    if "param" in report.get("kinds", ()):
        t.append(Term("DP all-gather of weights (rebuild from masters)", 0.0, "stall",
                      "modelled", "none: the weights are moved by the transfer"))
    else:
        ag = wbytes * (dp - 1) / dp / nic if dp > 1 else 0.0
        t.append(Term("DP all-gather of weights (rebuild from masters)", ag, "stall",
                      "modelled", f"{wbytes / 1e9:.2f} GB weight shard x (dp-1)/dp over NIC "
                      f"{nic / 1e9:.0f} GB/s"))
    t.append(Term("release of A + rebind", c.release_rebind_s, "stall", "measured",
                  SOURCES["release_rebind_s"]))
    t.append(Term("data-iterator rebuild", c.data_iterator_s, "stall", "modelled",
                  SOURCES["data_iterator_s"]))
    t.append(Term("first step at B (extra)", c.first_step_extra_s, "stall", "modelled",
                  SOURCES["first_step_extra_s"]))
    stall = sum(x.seconds for x in t if x.where == "stall")
    bg = sum(x.seconds for x in t if x.where == "background")
    steps = bg / step_a if step_a > 0 else float("inf")
    ck = {"write_seconds": report["checkpoint_write_seconds"],
          "read_seconds": report["checkpoint_read_seconds"],
          "restart_seconds": report["checkpoint_restart_seconds"],
          "total_seconds": report["checkpoint_estimate_seconds"], "how": "modelled",
          "basis": "write + read of the full state at the storage bandwidth + restart "
                   "(routing/cost.py CheckpointModel)"}
    return {"terms": [x.as_dict() for x in t], "stall_seconds": stall,
            "background_seconds": bg, "step_a_seconds": step_a, "step_b_seconds": step_b,
            "background_steps_of_a": steps,
            "background_fits": "yes: the switch waits for the ready vote; the background "
                               f"spans {math.ceil(steps) if math.isfinite(steps) else '?'} "
                               "step(s) of A",
            "checkpoint_path": ck, "constants": asdict(c),
            "sources": SOURCES}


__all__ = ["BudgetConstants", "Term", "switch_budget", "SOURCES"]
