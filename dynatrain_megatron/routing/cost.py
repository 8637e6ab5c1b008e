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
  * local copies are spread evenly over the rounds, each share running while its round is
    on the wire (the executor posts a round, copies its share, then waits), at a
    device-memory copy bandwidth (default 1000 GB/s): a device's round time is the max of
    its share of copies and its links;
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
those bytes leave through H's links whatever the source choice; `plan_stats.group_bounds`).
Finally the node cuts (`node_cut_seconds`): for every node and every set H of its
devices, what the node's devices need from holder sets whose on-node holders all lie in
H goes over H's NVLink sends or over the receivers' NICs, which first carry what no
node-mate holds. This is what binds when one device is the only on-node holder of what
its node-mates need (expert parallelism across nodes: docs/bench/notes.md). The bound lets a destination's share of a set
pair come from several holders (the planner can cut set pairs at region boundaries,
`geometry.refined`).

Checkpoint baseline: write, then read, the full training state (every state kind, one
copy) at an aggregate storage bandwidth (default 100 GB/s), plus a restart cost
(default 60 s: process start, imports, communicator setup, model build).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import numpy as np

from ..vps.analytic import OPT_DTYPE_BYTES
from ..vps.fragment import KINDS
from ..vps.model_spec import ModelSpec
from ..vps.naming import DTYPE_BYTES
from .links import GB, LinkModel, node_cut_seconds
from .plan import Plan
from .regions import RoutingError, key_index
from .schedule import Schedule

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
    """The bandwidth lower bound of `plan`'s placement (module doc), in seconds.

    Memoised per (plan, link bandwidths): `dynatrain plan` asks for it three times."""
    return _bound(plan, links.intra_node_gbps * GB, links.inter_node_gbps * GB)


@functools.lru_cache(maxsize=16)
def _bound(plan: Plan, bi: float, be: float) -> float:
    t = plan.traffic
    force = t.forced_send_intra + t.forced_send_inter
    lb = np.maximum.reduce([t.recv_inter_min / be, t.recv / (bi + be),
                            t.forced_send_inter / be, t.forced_send_intra / bi,
                            force / (bi + be)])
    lb = max(float(lb.max(initial=0.0)), plan.stats.group_send_inter_bound_bytes / be,
             plan.stats.group_send_bound_bytes / (bi + be))
    return max(lb, node_cut_bound(plan, bi, be, lb))


def node_cut_bound(plan: Plan, bi: float, be: float, start: float = 0.0) -> float:
    """Lower bound (seconds) from the cuts inside each node, at least `start`
    (`node_cut_seconds`, with bandwidths in bytes/s), for `plan`'s placement."""
    g = plan.geometry
    rpn = plan.ranks_per_node
    net = plan.rows_src != plan.rows_dst
    if not net.any():
        return start
    rp, dst = plan.rows_p[net], plan.rows_dst[net]
    byts = (g.p_numel * g.p_bytes_per_element()).astype(np.float64)[rp]
    # the holder sets of the rows (as devices), each once
    nsa = int(g.p_sa.max(initial=0)) + 1
    used, gid = np.unique((g.p_cls * nsa + g.p_sa)[rp], return_inverse=True)
    gid = gid.ravel()
    rep = np.empty(len(used), np.int64)
    rep[gid[::-1]] = rp[::-1]
    off, mem = g.members("src", rep)
    dev = np.asarray(plan.src_placement.devices, np.int64)[mem]
    size = np.diff(off)
    nn = int(max(dev.max(initial=0), dst.max(initial=0))) // rpn + 1
    key = np.repeat(np.arange(len(used)), size) * nn + dev // rpn
    uk, inv = np.unique(key, return_inverse=True)
    inv = inv.ravel()
    cnt = np.bincount(inv, minlength=len(uk))
    # bit mask of the on-node holders (distinct devices: the sum is the or)
    mask = np.bincount(inv, weights=np.ldexp(1.0, dev % rpn), minlength=len(uk))
    q = gid * nn + dst // rpn
    j = np.minimum(np.searchsorted(uk, q), len(uk) - 1)
    hit = uk[j] == q
    return node_cut_seconds(byts, dst, np.where(hit, mask[j], 0).astype(np.int64),
                            hit & (cnt[j] == size[gid]), rpn, bi, be, start)


def estimate(sched: Schedule, links: LinkModel = LinkModel(), checksums: bool = True
             ) -> CostEstimate:
    """Estimated time of a scheduled plan under the link model (module doc)."""
    mem = links.local_copy_gbps * GB
    local_dev = np.asarray(sched.plan.traffic.local, dtype=float) / mem
    rounds = []
    if sched.plan.stats.moved_bytes:
        for i, (si, se, ri, re) in enumerate(sched.round_traffic):
            t = links.device_seconds(si, se, ri, re)  # indexed like the plan's traffic
            # the executor's share of local copies for this round (transition.executor)
            t = np.maximum(t, local_dev / len(sched.round_traffic))
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


__all__ = ["CostEstimate", "CheckpointModel", "CheckpointEstimate",
           "bandwidth_lower_bound", "estimate", "state_bytes", "checkpoint_estimate",
           "describe", "node_cut_bound"]
