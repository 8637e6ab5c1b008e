"""The link model of a device, and the node-cut bound that depends only on it.

Each device has an intra-node link (NVLink) and an inter-node link (its own NIC), full
duplex, working concurrently: a device's time for its bytes of a round is the slower of
its two links (`LinkModel.device_seconds`). `cost` builds the estimate of a schedule and
the bandwidth lower bound on it; `sources` weighs the source choice with the default
link model. `node_cut_seconds` is the bound from the cuts inside one node (see its doc).
GB = 1e9 bytes throughout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .regions import RoutingError

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


_ALL_SUBSETS_RPN = 8  # nodes up to this size: every subset of a node's devices is a cut


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


__all__ = ["GB", "LinkModel", "node_cut_seconds"]
