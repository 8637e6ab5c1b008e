"""The transfer of a switch simulated on a GPU cluster's fabric, flow by flow.

`cost.estimate` gives every device its own links at full speed. This module puts the same
rounds on a fabric and lets the flows share it: per round, every (sender, receiver) pair
is one flow carrying that pair's messages of the round (the executor posts them as one
batched exchange: `routing.schedule` cuts the rounds, `flows_of_round` sums the pieces
per pair, which is what the executor's messages to that peer add up to), and the flows
share the links max-min fairly (progressive filling), re-shared every time flows end.

Fabric (`Fabric`), a rail-optimised two-tier fat tree as DGX-class clusters are built:
  * inside a node, NVLink through NVSwitch: each GPU a port of `nvlink_gbps` per direction,
    the switch itself non-blocking;
  * `rails` NICs per node, GPU i on rail i % rails (`nic_gbps` each, per direction); each
    rail has its own leaf switches, `nodes_per_leaf` nodes per leaf; leaves reach the
    spine with `1 / oversubscription` of their down-link bandwidth;
  * a flow between GPUs of different rails crosses to the receiver's rail over NVLink on
    the sender's node first (NCCL's PXN), then stays on that rail;
  * every link delivers `efficiency` of its line rate.
A round's time: the data phase (until its last flow ends; the device's share of the local
copies runs meanwhile, at `local_copy_gbps`), then the checksum phase: the receivers'
pass over what arrived (`checksum_gbps`; the senders' pass runs while the data is on the
wire) and one batched exchange of the sums (`round_latency_s` plus `message_s` per
message posted on the busiest device). Every round also pays `round_latency_s` and the
busiest device's `message_s` per data message.
GB = 1e9 bytes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

from .links import GB
from .regions import RoutingError
from .schedule import Schedule


@dataclass(frozen=True, slots=True)
class Fabric:
    """A cluster's fabric (module doc). Defaults: an H100/H200 DGX-class SuperPOD."""

    ranks_per_node: int = 8
    nvlink_gbps: float = 450.0  # NVLink 4: 900 GB/s bidirectional per GPU
    nic_gbps: float = 50.0  # ConnectX-7, 400 Gb/s per GPU
    rails: int = 8
    nodes_per_leaf: int = 32  # a 64-port leaf: 32 down, 32 up at 1:1
    oversubscription: float = 1.0
    efficiency: float = 0.8
    round_latency_s: float = 50e-6
    message_s: float = 2e-6  # posting one message of a batched exchange
    local_copy_gbps: float = 1000.0
    checksum_gbps: float = 3000.0

    def __post_init__(self) -> None:
        errs = []
        for f in ("nvlink_gbps", "nic_gbps", "local_copy_gbps", "checksum_gbps"):
            if not getattr(self, f) > 0:
                errs.append(f"{f} must be positive, got {getattr(self, f)}")
        for f in ("ranks_per_node", "rails", "nodes_per_leaf"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                errs.append(f"{f} must be a positive int, got {getattr(self, f)!r}")
        if not 1.0 <= self.oversubscription:
            errs.append(f"oversubscription must be >= 1, got {self.oversubscription}")
        if not 0 < self.efficiency <= 1:
            errs.append(f"efficiency must be in (0, 1], got {self.efficiency}")
        if self.round_latency_s < 0 or self.message_s < 0:
            errs.append("latencies must be >= 0")
        if errs:
            raise RoutingError(f"fabric {self}: " + "; ".join(errs))

    def describe(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RoundSim:
    """One simulated round: its phases (seconds), flows and fabric events."""

    data_seconds: float
    checksum_seconds: float
    local_seconds: float
    latency_seconds: float
    flows: int
    events: int
    busiest_link: str

    @property
    def seconds(self) -> float:
        return max(self.data_seconds, self.local_seconds) + self.checksum_seconds \
            + self.latency_seconds


@dataclass(frozen=True, slots=True)
class TransferSim:
    """A simulated transfer: per round, and the totals."""

    rounds: tuple[RoundSim, ...]
    fabric: Fabric
    local_only_seconds: float  # a plan with nothing on the network: its local copies

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.rounds) if self.rounds else self.local_only_seconds

    @property
    def data_seconds(self) -> float:
        return sum(max(r.data_seconds, r.local_seconds) + r.latency_seconds
                   for r in self.rounds)

    @property
    def checksum_seconds(self) -> float:
        return sum(r.checksum_seconds for r in self.rounds)

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "data_seconds": self.data_seconds,
                "checksum_seconds": self.checksum_seconds, "rounds": len(self.rounds),
                "flows": sum(r.flows for r in self.rounds),
                "events": sum(r.events for r in self.rounds),
                "busiest_link": self.rounds[0].busiest_link if self.rounds else "",
                "fabric": self.fabric.describe()}


class _Links:
    """Link table of a fabric for `ndev` devices: name and capacity (bytes/s) of each."""

    def __init__(self, fab: Fabric, ndev: int) -> None:
        self.fab = fab
        rpn = fab.ranks_per_node
        self.nodes = (ndev + rpn - 1) // rpn
        self.leaves = (self.nodes + fab.nodes_per_leaf - 1) // fab.nodes_per_leaf
        eff = fab.efficiency
        nv, nic = fab.nvlink_gbps * GB * eff, fab.nic_gbps * GB * eff
        # per rail and leaf: the down-links of its nodes (one NIC each), over the
        # oversubscription; with fewer rails than GPUs, GPUs share their rail's NIC
        up = nic * fab.nodes_per_leaf / fab.oversubscription
        self.n_nv = ndev
        self.n_nic = self.nodes * fab.rails
        self.n_leaf = self.leaves * fab.rails
        self.off = np.cumsum([0, self.n_nv, self.n_nv, self.n_nic, self.n_nic,
                              self.n_leaf, self.n_leaf])
        self.cap = np.concatenate([np.full(self.n_nv, nv), np.full(self.n_nv, nv),
                                   np.full(self.n_nic, nic), np.full(self.n_nic, nic),
                                   np.full(self.n_leaf, up), np.full(self.n_leaf, up)])

    _KINDS = ("NVLink out", "NVLink in", "NIC out", "NIC in", "leaf up", "leaf down")

    def name(self, link: int) -> str:
        k = int(np.searchsorted(self.off, link, side="right") - 1)
        return f"{self._KINDS[k]} #{link - int(self.off[k])}"

    def routes(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(flow index, link index) of every link of every flow (module doc)."""
        fab, rpn, R = self.fab, self.fab.ranks_per_node, self.fab.rails
        o = self.off
        f = np.arange(len(src))
        ns, nd = src // rpn, dst // rpn
        same = ns == nd
        rs, rd = (src % rpn) % R, (dst % rpn) % R
        ls, ld = ns // fab.nodes_per_leaf, nd // fab.nodes_per_leaf
        fl, ln = [f[same], f[same]], [o[0] + src[same], o[1] + dst[same]]
        x = ~same
        # PXN: to the node-mate on the receiver's rail over NVLink, when the rails differ
        hop = x & (rs != rd)
        mate = ns * rpn + rd  # the node-mate whose NIC is on the receiver's rail
        fl += [f[hop], f[hop]]
        ln += [o[0] + src[hop], o[1] + mate[hop]]
        fl += [f[x], f[x]]
        ln += [o[2] + ns[x] * R + rd[x], o[3] + nd[x] * R + rd[x]]
        far = x & (ls != ld)
        fl += [f[far], f[far]]
        ln += [o[4] + ls[far] * R + rd[far], o[5] + ld[far] * R + rd[far]]
        return np.concatenate(fl), np.concatenate(ln).astype(np.int64)


def max_min_rates(fidx: np.ndarray, lidx: np.ndarray, cap: np.ndarray, nflows: int,
                  active: Optional[np.ndarray] = None, slack: float = 0.05) -> np.ndarray:
    """Max-min fair rates of flows over links (progressive filling): every active flow's
    rate rises together until a link fills; the flows through full links keep their rate;
    the rest go on. Links within `slack` of the fullest are frozen in the same step, so a
    flow's rate is within that fraction below its exact max-min share (thousands of rate
    levels at 4096 GPUs take tens of steps). `fidx`, `lidx`: the (flow, link) incidence.
    Returns bytes/s per flow (0 for inactive ones)."""
    rate = np.zeros(nflows)
    act = np.ones(nflows, bool) if active is None else active.copy()
    rem = cap.astype(np.float64).copy()
    nl = len(cap)
    while act.any():
        on = act[fidx]
        n = np.bincount(lidx[on], minlength=nl)
        used = n > 0
        share = np.full(nl, np.inf)
        share[used] = rem[used] / n[used]
        d = float(share.min())
        if not np.isfinite(d):
            break
        rate[act] += d
        rem -= d * n
        full = used & (share <= d * (1 + slack) + 1e-12 * d)
        stop = np.zeros(nflows, bool)
        stop[fidx[on & full[lidx]]] = True
        act &= ~stop
    return rate


def simulate_flows(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, fab: Fabric,
                   ndev: int, max_events: int = 24) -> tuple[float, int, str]:
    """Time until every flow (src -> dst, bytes) has arrived, the fabric re-shared max-min
    fairly as flows end. Re-sharing happens at most `max_events` times: each time at the
    end of the next tenth of the flows still running (or of the first to end, if later),
    and after the last one the rates stay as they are. Between re-sharings the flows that
    ended leave their bandwidth unused, so the time is an upper estimate of the fluid
    model's. Returns (seconds, re-sharings, the busiest link at the start)."""
    if not len(src):
        return 0.0, 0, ""
    links = _Links(fab, ndev)
    fidx, lidx = links.routes(np.asarray(src, np.int64), np.asarray(dst, np.int64))
    left = np.asarray(nbytes, np.float64).copy()
    act = left > 0
    t, events, busiest = 0.0, 0, ""
    while act.any():
        rate = max_min_rates(fidx, lidx, links.cap, len(left), act)
        if not events:
            load = np.bincount(lidx, weights=rate[fidx], minlength=len(links.cap))
            busiest = links.name(int(np.argmax(load / links.cap)))
        events += 1
        fin = left[act] / np.maximum(rate[act], 1e-300)
        if events >= max_events:
            t += float(fin.max())
            break
        k = max(1, len(fin) // 10)
        step = float(np.partition(fin, k - 1)[k - 1])
        left = np.where(act, left - rate * step, left)
        act &= left > 1e-9 * np.maximum(np.asarray(nbytes, np.float64), 1.0)
        t += step
    return t, events, busiest


def flows_of_round(sched: Schedule, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, bytes) per device pair of round `r`: the schedule's cut of every flow
    (`schedule._shares`) summed over kinds, network pairs only."""
    plan = sched.plan
    src, dst, kind, E = plan.flows()
    from ..vps.fragment import KINDS  # noqa: PLC0415 - pure module
    isz = np.array([plan.itemsize(k) for k in KINDS], np.int64)[kind]
    R = sched.num_rounds
    sh = ((E * (r + 1)) // R - (E * r) // R) * isz
    net = (src != dst) & (sh > 0)
    ndev = int(max(max(plan.src_devices), max(plan.dst_devices))) + 1
    key = src[net] * ndev + dst[net]
    uk, inv = np.unique(key, return_inverse=True)
    b = np.bincount(inv.ravel(), weights=sh[net]).astype(np.int64)
    return uk // ndev, uk % ndev, b


def simulate_transfer(sched: Schedule, fab: Fabric = Fabric(), *,
                      messages: Optional[Sequence[int]] = None,
                      max_events: int = 24) -> TransferSim:
    """The schedule's rounds on the fabric (module doc). `messages[r]`: the most data
    messages one device posts in round r (the executor's count: packed small pieces
    plus one per large piece, per peer); default: one per peer."""
    plan = sched.plan
    if fab.ranks_per_node != plan.ranks_per_node:
        raise RoutingError(f"fabric has {fab.ranks_per_node} GPUs per node, the plan "
                           f"{plan.ranks_per_node}")
    ndev = int(max(max(plan.src_devices), max(plan.dst_devices))) + 1
    local = np.asarray(plan.traffic.local, np.float64) / (fab.local_copy_gbps * GB)
    rounds = []
    if plan.stats.moved_bytes:
        R = sched.num_rounds
        for r in range(R):
            s, d, b = flows_of_round(sched, r)
            data, events, busiest = simulate_flows(s, d, b, fab, ndev, max_events)
            recv = np.bincount(d, weights=b, minlength=ndev)
            peers_out = np.bincount(s, minlength=ndev)
            peers_in = np.bincount(d, minlength=ndev)
            peers = int(np.max(peers_out + peers_in, initial=0))
            nmsg = messages[r] if messages is not None else peers
            rounds.append(RoundSim(
                data_seconds=data,
                checksum_seconds=float(recv.max(initial=0.0)) / (fab.checksum_gbps * GB)
                + fab.round_latency_s + peers * fab.message_s,
                local_seconds=float(local.max(initial=0.0)) / R,
                latency_seconds=fab.round_latency_s + nmsg * fab.message_s,
                flows=len(s), events=events, busiest_link=busiest))
    return TransferSim(tuple(rounds), fab, float(local.max(initial=0.0)))


__all__ = ["Fabric", "RoundSim", "TransferSim", "flows_of_round", "max_min_rates",
           "simulate_flows", "simulate_transfer"]
