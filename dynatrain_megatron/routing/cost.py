"""Bandwidth cost model of a switch, its lower bound, and the checkpoint-based baseline.

Link model (stated, every parameter printed by `dynatrain plan`):
  * each device has an intra-node link (NVLink, default 450 GB/s per direction) and an
    inter-node link (its own NIC, default 50 GB/s per direction, i.e. 400 Gb/s IB);
  * links are full duplex and the two links work concurrently, so a device needs
        t_d = max( max(send_intra, recv_intra) / intra_bw,
                   max(send_inter, recv_inter) / inter_bw )
    for its bytes of a round (the *max* of the two links, not their sum);
  * a round takes its slowest device plus a fixed latency (launching one batched P2P
    exchange; default 50 us); rounds run one after the other;
  * local copies run while the first round is on the wire (the executor posts round 0,
    copies, then waits), at a device-memory copy bandwidth (default 1000 GB/s): a device's
    round-0 time is the max of its copies and its links;
  * every message is checksummed by its sender and its receiver (transactions): one
    read pass over each byte sent and received (default 3000 GB/s: a reduction reading
    HBM), added to the device's round time.
  GB = 1e9 bytes throughout.

Bandwidth lower bound: one round, no latency, no local copies, the same placement, any
source choice: a device must receive everything it lacks (over its NIC when no holder
sits on its node, else over both links at best), and must send what only it holds:
    lb = max over devices of max( recv_inter_min / inter_bw, recv / (intra_bw + inter_bw),
                                  forced_send_inter / inter_bw,
                                  forced_send_intra / intra_bw,
                                  forced_send / (intra_bw + inter_bw) ),
and, for every source holder set H, the bytes that must leave it over NICs (receivers
with no holder on their node) divided by its size and the NIC bandwidth, and all the
bytes that must leave it divided by its size and both bandwidths; "leave H" counts the
bytes of every holder set contained in H too (their holders are all members of H, so
those bytes leave through H's links whatever the source choice; `planner._group_bounds`).
The bound lets a destination's share of a set pair come from several holders (the
planner can cut set pairs at region boundaries, `planner.refined`).

Checkpoint baseline: write, then read, the full training state (every state kind, one
copy) at an aggregate storage bandwidth (default 100 GB/s), plus a restart cost
(default 60 s: process start, imports, communicator setup, model build).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..vps.fragment import KINDS
from ..vps.model_spec import ModelSpec
from .plan import Plan
from .regions import RoutingError, key_index
from .schedule import Schedule

GB = 1e9


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Per-device link bandwidths (GB/s), round latency (s), local copy bandwidth."""

    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    round_latency_s: float = 50e-6
    local_copy_gbps: float = 1000.0
    checksum_gbps: float = 3000.0  # a read-only reduction pass over device memory

    def __post_init__(self) -> None:
        for f in ("intra_node_gbps", "inter_node_gbps", "local_copy_gbps", "checksum_gbps"):
            if not getattr(self, f) > 0:
                raise RoutingError(f"link model: {f} must be positive, got {getattr(self, f)}")
        if self.round_latency_s < 0:
            raise RoutingError(f"link model: round_latency_s must be >= 0, got "
                               f"{self.round_latency_s}")

    def device_seconds(self, send_intra, send_inter, recv_intra, recv_inter) -> np.ndarray:
        """Time of every device for its bytes of one round (module doc)."""
        a = np.maximum(send_intra, recv_intra) / (self.intra_node_gbps * GB)
        b = np.maximum(send_inter, recv_inter) / (self.inter_node_gbps * GB)
        return np.maximum(a, b)

    def round_seconds(self, send_intra, send_inter, recv_intra, recv_inter) -> float:
        """A round's time: its slowest device, plus the round latency."""
        t = self.device_seconds(send_intra, send_inter, recv_intra, recv_inter)
        return float(t.max(initial=0.0)) + self.round_latency_s


@dataclass(frozen=True, slots=True)
class CostEstimate:
    total_seconds: float
    local_copy_seconds: float
    rounds_seconds: tuple[float, ...]
    bandwidth_lower_bound_seconds: float
    num_rounds: int
    peak_staging_bytes: int  # max over devices and rounds

    @property
    def network_seconds(self) -> float:
        """The rounds alone (what the bandwidth lower bound bounds)."""
        return sum(self.rounds_seconds)

    @property
    def ratio_to_lower_bound(self) -> float:
        """Total (local copies + rounds) over the network lower bound."""
        return _ratio(self.total_seconds, self.bandwidth_lower_bound_seconds)

    @property
    def network_ratio_to_lower_bound(self) -> float:
        return _ratio(self.network_seconds, self.bandwidth_lower_bound_seconds)


def _ratio(t: float, lb: float) -> float:
    if lb > 0:
        return t / lb
    return 1.0 if t == 0 else float("inf")


def bandwidth_lower_bound(plan: Plan, links: LinkModel = LinkModel()) -> float:
    """The bandwidth lower bound of `plan`'s placement (module doc), in seconds."""
    t = plan.traffic
    bi, be = links.intra_node_gbps * GB, links.inter_node_gbps * GB
    force = t.forced_send_intra + t.forced_send_inter
    lb = np.maximum.reduce([t.recv_inter_min / be, t.recv / (bi + be),
                            t.forced_send_inter / be, t.forced_send_intra / bi,
                            force / (bi + be)])
    return max(float(lb.max(initial=0.0)), plan.stats.group_send_inter_bound_bytes / be,
               plan.stats.group_send_bound_bytes / (bi + be))


def estimate(sched: Schedule, links: LinkModel = LinkModel(), checksums: bool = True
             ) -> CostEstimate:
    """Estimated time of a scheduled plan under the link model (module doc)."""
    mem = links.local_copy_gbps * GB
    local_dev = np.asarray(sched.plan.traffic.local, dtype=float) / mem
    rounds = []
    if sched.plan.stats.moved_bytes:
        for i, (si, se, ri, re) in enumerate(sched.round_traffic):
            t = links.device_seconds(si, se, ri, re)  # indexed like the plan's traffic
            if i == 0:
                t = np.maximum(t, local_dev)  # local copies overlap the first round
            if checksums:
                t = t + (np.asarray(si) + se + ri + re) / (links.checksum_gbps * GB)
            rounds.append(float(t.max(initial=0.0)) + links.round_latency_s)
    local = float(local_dev.max(initial=0.0))
    total = sum(rounds) if rounds else local
    return CostEstimate(total, local, tuple(rounds),
                        bandwidth_lower_bound(sched.plan, links), len(rounds),
                        sched.max_peak_staging)


@dataclass(frozen=True, slots=True)
class CheckpointModel:
    """Aggregate storage bandwidth (GB/s) and restart cost (s) of the checkpoint path."""

    storage_gbps: float = 100.0
    restart_seconds: float = 60.0

    def __post_init__(self) -> None:
        if not self.storage_gbps > 0 or self.restart_seconds < 0:
            raise RoutingError(f"checkpoint model: bad parameters {self}")


@dataclass(frozen=True, slots=True)
class CheckpointEstimate:
    state_bytes: int
    write_seconds: float
    read_seconds: float
    restart_seconds: float

    @property
    def total_seconds(self) -> float:
        return self.write_seconds + self.read_seconds + self.restart_seconds


def state_bytes(spec: ModelSpec, kinds=KINDS) -> int:
    """One copy of the training state of `kinds` (vocab padding excluded)."""
    from ..vps.analytic import OPT_DTYPE_BYTES
    from ..vps.naming import DTYPE_BYTES
    n = int(key_index(spec).numel.sum())
    return sum(n * (DTYPE_BYTES[spec.params_dtype] if k == "param" else OPT_DTYPE_BYTES)
               for k in kinds)


def checkpoint_estimate(spec: ModelSpec, model: CheckpointModel = CheckpointModel()
                        ) -> CheckpointEstimate:
    """Save + load of the full training state (all kinds) plus a restart (module doc)."""
    b = state_bytes(spec)
    t = b / (model.storage_gbps * GB)
    return CheckpointEstimate(b, t, t, model.restart_seconds)


def describe(links: LinkModel, ckpt: CheckpointModel) -> dict:
    """Every parameter of the models, for printing next to the figures."""
    return {**asdict(links), **{f"checkpoint_{k}": v for k, v in asdict(ckpt).items()}}


__all__ = ["GB", "LinkModel", "CostEstimate", "CheckpointModel", "CheckpointEstimate",
           "bandwidth_lower_bound", "estimate", "state_bytes", "checkpoint_estimate",
           "describe"]
