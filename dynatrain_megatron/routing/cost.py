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
those bytes leave through H's links whatever the source choice; `planner._group_bounds`).
Finally the node cuts (`node_cut_seconds`): for every node and every set H of its
devices, what the node's devices need from holder sets whose on-node holders all lie in
H goes over H's NVLink sends or over the receivers' NICs, which first carry what no
node-mate holds. This is what binds when one device is the only on-node holder of what
its node-mates need (Qwen3-235B ep32 -> ep64 on 4096 GPUs: 1.12x the per-device bound;
the planner gets within 1.5% of it when allowed to cut set pairs twice as finely, so it
is close to the best achievable there). The bound lets a destination's share of a set
pair come from several holders (the planner can cut set pairs at region boundaries,
`planner.refined`).

Checkpoint baseline: write, then read, the full training state (every state kind, one
copy) at an aggregate storage bandwidth (default 100 GB/s), plus a restart cost
(default 60 s: process start, imports, communicator setup, model build).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Optional

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


_ALL_SUBSETS_RPN = 8  # nodes up to this size: every subset of a node's devices is a cut


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


def node_cut_seconds(byts: np.ndarray, dst: np.ndarray, mask: np.ndarray,
                     fixed: np.ndarray, rpn: int, bi: float, be: float, start: float = 0.0,
                     all_subsets: Optional[bool] = None) -> float:
    """The node-cut lower bound on the time of one round, at least `start`.

    Input: the network rows of a plan (any source choice: they do not depend on it):
    bytes, destination device, bit mask of the source holders on the destination's
    node (bit i: the node's i-th device), and whether every holder is on that node;
    link bandwidths `bi` (NVLink), `be` (NIC) in bytes per time unit.

    Why: when one device is the only holder on its node of what its node-mates need (an
    expert's weights, replicated on other nodes only), the choice is NVLink from that
    device or the receivers' NICs; with the NICs busy with what no node-mate holds, the
    holder's NVLink sends can exceed every per-device bound. For a time T, a node and a
    set H of its devices, the bytes each receiver r of the node needs from holder sets
    whose on-node holders all lie in H go over H's NVLink sends (at most |H| * bi * T
    in all) or over r's NIC, which has be * T - rmin_r left after the bytes r must take
    over it (no holder on its node, rmin_r); bytes with no holder off the node have no
    NIC route (F_H). So a plan of time T needs, for every node and H,
        F_H + sum_r max(0, flex_{H,r} + rmin_r - be * T) <= bi * |H| * T
    (the min-cut condition of a flow network whose NIC senders are unlimited: a
    relaxation of the real problem, so a valid bound). The left side is convex and
    decreasing in T; each (node, H) violated at `start` is solved by Newton steps from
    the left, each of which stays below its root (<= rpn + 1 steps: the set of receivers
    with max() > 0 only shrinks). H ranges over every subset of a node when
    `all_subsets` (default: nodes of up to `_ALL_SUBSETS_RPN` devices; a zeta transform
    sums the masks inside each H), else over single devices (rows with several on-node
    holders dropped: still valid, cheaper)."""
    if not len(byts):
        return start
    if all_subsets is None:
        all_subsets = rpn <= _ALL_SUBSETS_RPN
    dst = np.asarray(dst, np.int64)
    if all_subsets:
        nh = 1 << rpn
        hsize = np.array([bin(h).count("1") for h in range(nh)], np.float64)
        col_h = mask
    else:  # H = {h}: index 1 + h for a single on-node holder, dropped for several
        nh = rpn + 1
        hsize = np.r_[0.0, np.ones(rpn)]
        one = (mask > 0) & ((mask & (mask - 1)) == 0)
        col_h = np.where(mask == 0, 0, np.where(one, np.log2(np.maximum(mask, 1)).round()
                                               .astype(np.int64) + 1, -1))
    byts = np.asarray(byts, np.float64)
    col = np.where(fixed, rpn, dst % rpn)  # per receiver, and one column for fixed bytes
    # nodes whose cuts cannot reach `start` even with all their bytes behind one device
    # (H of size 1 holding every flexible and fixed byte) are left out: the table below
    # has 2^rpn rows per node
    node = dst // rpn
    nn = int(node.max()) + 1
    tot = np.bincount(node * (rpn + 1) + col, weights=byts, minlength=nn * (rpn + 1)
                      ).reshape(nn, rpn + 1)
    top = np.cumsum(np.c_[tot[:, rpn], -np.sort(-tot[:, :rpn], axis=1)], axis=1)
    ub = (top / (be * np.arange(rpn + 1) + bi)).max(axis=1)
    live = np.flatnonzero(ub > start)
    if not len(live):
        return start
    pos = np.full(nn, -1, np.int64)
    pos[live] = np.arange(len(live))
    nn = len(live)
    keep = (col_h >= 0) & (pos[node] >= 0)
    d = np.bincount(((pos[node] * nh + col_h) * (rpn + 1) + col)[keep], weights=byts[keep],
                    minlength=nn * nh * (rpn + 1)).reshape(nn, nh, rpn + 1)
    rmin = d[:, 0, :rpn].copy()
    d[:, 0, :rpn] = 0.0
    if all_subsets:  # d[H] = sum over masks S inside H of d[S]
        for k in range(rpn):
            v = d.reshape(nn, nh >> (k + 1), 2, 1 << k, rpn + 1)
            v[:, :, 1] += v[:, :, 0]
    a = d[:, 1:, :rpn] + rmin[:, None, :]
    fx = d[:, 1:, rpn]
    cap = bi * hsize[1:]
    viol = fx + np.maximum(a - be * start, 0.0).sum(axis=2) > cap * start
    if not viol.any():
        return start
    a, fx, cap = a[viol], fx[viol], np.broadcast_to(cap, viol.shape)[viol]
    t = np.full(len(fx), float(start))
    for _ in range(rpn + 1):
        on = a > be * t[:, None]
        t = (fx + (a * on).sum(axis=1)) / (be * on.sum(axis=1) + cap)
    return max(start, float(t.max()))


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
