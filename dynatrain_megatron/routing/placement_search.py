"""Placement: which device takes which virtual rank of the new layout.

Megatron's default rank order (virtual rank v of layout B on the v-th device) is one
choice among many, and often the worst: for Llama-3-70B tp8pp4dp4 -> tp8pp8dp2 on 128
GPUs it moves every byte of the distributed-optimizer state. `choose_placement` treats
it as an assignment problem:

* **units**: groups of B's virtual ranks that must stay together, by default a TP x CP
  group (`tp*cp` consecutive virtual ranks, so TP groups stay inside a node);
* **slots**: groups of `unit_size` devices, cut node by node from the candidate devices
  (in ascending order; a slot's devices are ordered by their virtual rank in layout A,
  so a unit keeps the TP order its devices had);
* **score[u, s]**: bytes of unit u's layout-B state the devices of slot s already hold
  in layout A, member by member. It is computed from the planner's set pairs (no loop
  over rank pairs): each set pair adds its bytes to the (unit, slot) pairs whose members
  are a destination and a source holder at the same position. Large holder sets (state
  replicated over data-parallel ranks) go through one indicator-matrix product.
* **assignment**: greedy by proposals, vectorised: every free unit proposes to its best
  free slot, every slot keeps its best proposer, repeat. Ties go to the slot nearest the
  unit's default slot, so zero-score units keep Megatron's order and the result is
  deterministic. Greedy is not optimal in general; on the issue's scenarios it finds the
  placements that keep ~97% (pp4 -> pp8) and ~67% (dp4 -> dp3 on 3/4 of the devices)
  of the optimizer state in place.
* **refinement**: the slot order fixed a unit's members to its devices in the order of
  their old virtual ranks, which is wrong when TP (or EP) changes (B's tp rank j of tp4
  wants the device holding old tp block 2j of tp8, not j). So, within each node, its
  virtual ranks are re-assigned to its devices by the same greedy on a (ranks x devices)
  matrix of held bytes; any permutation inside a node keeps TP groups inside it.

Finally the greedy placement and the default one are both planned, and the one that
moves fewer bytes (then: smaller largest per-device traffic; then: the default) wins.
When there are more candidate devices than B needs (scale-in), the chooser also picks
which devices leave: unused slots are the ones that would have kept the least.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..vps.fragment import KINDS
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.placement import Placement, is_rank_ordered, rank_ordered
from .plan import Plan, PlanStats
from .geometry import BucketSize, Geometry, geometry, norm_kinds, split_bucket
from .planner import build_plan, plan_for
from .regions import RoutingError

_DENSE_PRODUCT = 50_000  # holder-set products above this use the indicator matmul


@dataclass(frozen=True, eq=False)
class PlacementChoice:
    """The chosen placement, the default one, and the plans of both."""

    chosen: Placement
    default: Placement
    chosen_plan: Plan
    default_plan: Plan
    unit_size: int
    seconds: float

    @property
    def chosen_stats(self) -> PlanStats:
        return self.chosen_plan.stats

    @property
    def default_stats(self) -> PlanStats:
        return self.default_plan.stats


def _slots(devices: Sequence[int], K: int, rpn: int) -> list[list[int]]:
    """Groups of K devices: inside nodes first, the leftovers of all nodes pooled."""
    by_node: dict[int, list[int]] = {}
    for d in devices:
        by_node.setdefault(d // rpn, []).append(d)
    slots, pool = [], []
    for n in sorted(by_node):
        ds = by_node[n]
        full = len(ds) // K * K
        slots += [ds[i:i + K] for i in range(0, full, K)]
        pool += ds[full:]
    slots += [pool[i:i + K] for i in range(0, len(pool) // K * K, K)]
    slots.sort(key=lambda s: s[0])
    return slots


def _score(geom: Geometry, src_pl: Placement, slots: np.ndarray, K: int, U: int) -> np.ndarray:
    """score[u, s]: bytes of unit u's B state held by slot s's devices (module doc)."""
    nS = len(slots)
    ndev = int(max(int(slots.max()), max(src_pl.devices))) + 1
    slot_of = np.full(ndev, -1, np.int64)
    pos_of = np.full(ndev, -1, np.int64)
    slot_of[slots.ravel()] = np.repeat(np.arange(nS), K)
    pos_of[slots.ravel()] = np.tile(np.arange(K), nS)
    dev_a = np.asarray(src_pl.devices, np.int64)
    nP = geom.num_set_pairs
    ps = np.arange(nP)
    s_off, s_mem = geom.all_members("src")
    d_off, d_mem = geom.all_members("dst")
    s_n, d_n = np.diff(s_off), np.diff(d_off)
    val = (geom.p_numel * geom.p_bytes_per_element()).astype(np.float64)
    score = np.zeros((U, nS), np.float64)
    big = s_n * d_n > _DENSE_PRODUCT
    # --- dense path: one indicator-matrix product over all big set pairs
    bigp = np.flatnonzero(big)
    if len(bigp):
        IB = np.zeros((U, len(bigp) * K), np.float64)
        IA = np.zeros((nS, len(bigp) * K), np.float64)
        for j, p in enumerate(bigp):
            v = d_mem[d_off[p]:d_off[p + 1]]
            IB[v // K, j * K + v % K] = val[p]
            dv = dev_a[s_mem[s_off[p]:s_off[p + 1]]]
            sl, po = slot_of[dv], pos_of[dv]
            m = sl >= 0
            IA[sl[m], j * K + po[m]] = 1.0
        score += IB @ IA.T
    # --- sparse path: join destination and source members on (set pair, position)
    small = np.flatnonzero(~big)
    if len(small):
        sel_d = np.repeat(~big, d_n)
        sel_s = np.repeat(~big, s_n)
        dp = np.repeat(ps, d_n)[sel_d]
        dv = d_mem[sel_d]
        sp = np.repeat(ps, s_n)[sel_s]
        sdev = dev_a[s_mem[sel_s]]
        ssl, spo = slot_of[sdev], pos_of[sdev]
        m = ssl >= 0
        sp, ssl, spo = sp[m], ssl[m], spo[m]
        kd = dp * K + dv % K
        ks = sp * K + spo
        o = np.argsort(ks, kind="stable")
        ks, ssl = ks[o], ssl[o]
        lo = np.searchsorted(ks, kd, "left")
        hi = np.searchsorted(ks, kd, "right")
        n = hi - lo
        rows = np.repeat(dv // K, n)
        idx = np.repeat(lo, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        score += np.bincount(rows * nS + ssl[idx], weights=np.repeat(val[dp], n),
                             minlength=U * nS).reshape(U, nS)
    return score


def _greedy(score: np.ndarray, default_slot: np.ndarray) -> np.ndarray:
    """Slot of every unit: proposals to the best free slot, each slot keeps its best."""
    U, nS = score.shape
    dist = (np.arange(nS)[None, :] - default_slot[:, None]) % nS
    key = np.rint(score).astype(np.int64) * nS + (nS - 1 - dist)
    out = np.full(U, -1, np.int64)
    free_u, free_s = np.arange(U), np.arange(nS)
    while len(free_u):
        sub = key[np.ix_(free_u, free_s)]
        best = sub.argmax(axis=1)
        bk = sub[np.arange(len(free_u)), best]
        order = np.lexsort((-bk, best))
        first = np.r_[True, best[order][1:] != best[order][:-1]]
        wu, ws = free_u[order[first]], free_s[best[order[first]]]
        out[wu] = ws
        free_u = np.setdiff1d(free_u, wu, assume_unique=True)
        free_s = np.setdiff1d(free_s, ws, assume_unique=True)
    return out


_MIN = np.iinfo(np.int64).min


def _greedy_batched(score: np.ndarray, default: np.ndarray) -> np.ndarray:
    """`_greedy` on G independent n x n problems at once: score [G, n, n], default [G, n]
    -> slot of every unit [G, n]."""
    G, n, _ = score.shape
    ar = np.arange(n)
    dist = (ar[None, None, :] - default[:, :, None]) % n
    key = np.rint(score).astype(np.int64) * n + (n - 1 - dist)
    out = np.full((G, n), -1, np.int64)
    free_u = np.ones((G, n), bool)
    free_s = np.ones((G, n), bool)
    while free_u.any():
        k = np.where(free_u[:, :, None] & free_s[:, None, :], key, _MIN)
        best = k.argmax(axis=2)
        bk = np.take_along_axis(k, best[:, :, None], 2)[:, :, 0]
        prop = np.where(free_u, best, -1)
        M = np.where(prop[:, None, :] == ar[None, :, None], bk[:, None, :], _MIN)
        win = M.argmax(axis=2)  # [G, slot] -> unit
        has = M.max(axis=2) > _MIN
        g, sl = np.nonzero(has)
        u = win[g, sl]
        out[g, u] = sl
        free_u[g, u] = False
        free_s[g, sl] = False
    return out


def _groups(slots: np.ndarray, pick: np.ndarray, rpn: int) -> list[np.ndarray]:
    """Device groups a refinement may permute freely: the used slots of one node together
    (TP groups stay inside the node whatever the permutation), a cross-node slot alone."""
    by: dict[tuple, list[int]] = {}
    for s in pick:
        nodes = {int(d) // rpn for d in slots[s]}
        k = ("node", nodes.pop()) if len(nodes) == 1 else ("slot", int(s))
        by.setdefault(k, []).extend(int(d) for d in slots[s])
    return [np.array(sorted(v), np.int64) for _, v in sorted(by.items())]


def _refine(geom: Geometry, src_pl: Placement, dst_devices: np.ndarray, rpn: int,
            groups: list[np.ndarray]) -> np.ndarray:
    """Within each group, re-assign its virtual ranks to its devices to keep more state
    (greedy on the group's small held-bytes matrix; a group changes only if it gains).
    `dst_devices[v]` is the device of virtual rank v; returns the new array."""
    W = len(dst_devices)
    n = max(len(g) for g in groups)
    ndev = int(max(int(dst_devices.max()), max(src_pl.devices))) + 1
    group_of = np.full(ndev, -1, np.int64)
    pos_of = np.full(ndev, -1, np.int64)
    for i, g in enumerate(groups):
        group_of[g], pos_of[g] = i, np.arange(len(g))
    dev_a = np.asarray(src_pl.devices, np.int64)
    ps = np.arange(geom.num_set_pairs)
    s_off, s_mem = geom.all_members("src")
    d_off, d_mem = geom.all_members("dst")
    val = (geom.p_numel * geom.p_bytes_per_element()).astype(np.float64)
    G = len(groups)
    dp = np.repeat(ps, np.diff(d_off))
    kd = dp * G + group_of[dst_devices[d_mem]]
    sp = np.repeat(ps, np.diff(s_off))
    sdev = dev_a[s_mem]
    m = group_of[sdev] >= 0
    ks = sp[m] * G + group_of[sdev[m]]
    spos = pos_of[sdev[m]]
    o = np.argsort(ks, kind="stable")
    ks, spos = ks[o], spos[o]
    lo = np.searchsorted(ks, kd, "left")
    cnt = np.searchsorted(ks, kd, "right") - lo
    rows = np.repeat(d_mem, cnt)
    idx = np.repeat(lo, cnt) + np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    held = np.bincount(rows * n + spos[idx], weights=np.repeat(val[dp], cnt),
                       minlength=W * n).reshape(W, n)
    out = dst_devices.copy()
    vgroup = group_of[dst_devices]
    order = np.argsort(vgroup, kind="stable")
    bounds = np.searchsorted(vgroup[order], np.arange(G + 1))
    sizes = np.array([len(g) for g in groups])
    for size in np.unique(sizes):
        gs = np.flatnonzero(sizes == size)
        if size < 2:
            continue
        vs = np.stack([order[bounds[i]:bounds[i + 1]] for i in gs])  # [g, size] vranks
        sub = held[vs][:, :, :size]
        cur = pos_of[dst_devices[vs]]
        new = _greedy_batched(sub, cur)
        gain = (np.take_along_axis(sub, new[:, :, None], 2)[:, :, 0].sum(1)
                > np.take_along_axis(sub, cur[:, :, None], 2)[:, :, 0].sum(1))
        devs = np.stack([groups[i] for i in gs])
        for j in np.flatnonzero(gain):
            out[vs[j]] = devs[j][new[j]]
    return out


def placement_choice(spec: ModelSpec, src_layout: Layout, src_placement: Optional[Placement],
                     dst_layout: Layout, dst_devices: Optional[Sequence[int]] = None,
                     ranks_per_node: int = 8, bucket_size: BucketSize = None,
                     kinds: Sequence[str] = KINDS,
                     unit_size: Optional[int] = None) -> PlacementChoice:
    """The chosen and the default placement of `dst_layout` on `dst_devices`, with the
    plans of both (module doc). `dst_devices` (default: `range(world size of B)`) may
    list more devices than B needs: the chooser then also picks which ones are used."""
    t0 = time.perf_counter()
    if src_placement is None:
        src_placement = Placement.default(src_layout.world_size)
    if len(src_placement.devices) != src_layout.world_size:
        raise RoutingError(f"src placement has {len(src_placement.devices)} devices, layout "
                           f"{src_layout} needs {src_layout.world_size}")
    W = dst_layout.world_size
    devices = sorted(set(int(d) for d in (range(W) if dst_devices is None else dst_devices)))
    if len(devices) < W or (devices and devices[0] < 0):
        raise RoutingError(f"layout {dst_layout} needs {W} devices, {len(devices)} distinct "
                           f"non-negative devices given")
    K = unit_size or dst_layout.tp * dst_layout.cp
    if K < 1 or W % K:
        raise RoutingError(f"unit size {K} must divide the world size {W} of {dst_layout}")
    kinds = norm_kinds(kinds)
    bs, bd = split_bucket(bucket_size)
    geom = geometry(spec, src_layout, dst_layout, kinds, bs, bd)
    default = Placement(tuple(devices[:W]))
    # through build_plan's memo: the switch's preparation asks for the chosen plan again
    # (`transition.switch.prepare_switch`), and then finds it made
    side_a = (src_layout, src_placement)
    default_plan = build_plan(spec, side_a, (dst_layout, default), kinds, ranks_per_node, (bs, bd))
    U = W // K
    slots = _slots(devices, K, ranks_per_node)
    if len(slots) < U:
        raise RoutingError(f"{len(devices)} devices give {len(slots)} slots of {K} devices "
                           f"({ranks_per_node} per node), layout {dst_layout} needs {U}")
    inv_a = {d: v for v, d in enumerate(src_placement.devices)}
    big = len(src_placement.devices) + max(devices) + 1
    slots = np.array([sorted(s, key=lambda d: (inv_a.get(d, big + d), d)) for s in slots],
                     np.int64)
    score = _score(geom, src_placement, slots, K, U)
    first_of = {int(s[0]): i for i, s in enumerate(np.sort(slots, axis=1))}
    dflt = np.array([first_of.get(devices[u * K], u % len(slots)) for u in range(U)], np.int64)
    pick = _greedy(score, dflt)
    placed = _refine(geom, src_placement, slots[pick].ravel(), ranks_per_node,
                     _groups(slots, pick, ranks_per_node))
    chosen = Placement(tuple(int(d) for d in placed))
    chosen_plan = build_plan(spec, side_a, (dst_layout, chosen), kinds, ranks_per_node, (bs, bd))
    c, d = chosen_plan.stats, default_plan.stats
    if (c.moved_bytes, c.max_traffic_bytes) >= (d.moved_bytes, d.max_traffic_bytes):
        chosen, chosen_plan = default, default_plan
    return PlacementChoice(chosen, default, chosen_plan, default_plan, K,
                           time.perf_counter() - t0)


def choose_placement(spec: ModelSpec, src_layout: Layout, src_placement: Optional[Placement],
                     dst_layout: Layout, dst_devices: Optional[Sequence[int]] = None,
                     ranks_per_node: int = 8, bucket_size: BucketSize = None,
                     kinds: Sequence[str] = KINDS,
                     unit_size: Optional[int] = None) -> Placement:
    """The placement of `dst_layout` that keeps the most state where it is (module doc)."""
    return placement_choice(spec, src_layout, src_placement, dst_layout, dst_devices,
                            ranks_per_node, bucket_size, kinds, unit_size).chosen


def best_rank_ordered(choice: PlacementChoice, ranks_per_node: int = 8) -> tuple[Placement, Plan]:
    """The best *rank-ordered* placement (`vps.placement.is_rank_ordered`) and its plan: the
    chosen placement with its grid sorted along every axis, or the default order when that
    fails the expert grid or moves no fewer bytes. This is what a switch could use while B's
    groups had to number their members by sorted global rank; `dynatrain plan` reports it
    beside the best placement (which a live switch now uses) to show what that gained."""
    layout, chosen = choice.chosen_plan.geometry.dst_layout, choice.chosen
    if not is_rank_ordered(layout, chosen):
        chosen = rank_ordered(layout, chosen)
    if chosen == choice.default or not is_rank_ordered(layout, chosen):
        return choice.default, choice.default_plan
    plan = plan_for(choice.chosen_plan.geometry, choice.chosen_plan.src_placement, chosen,
                    ranks_per_node)
    if plan.stats.moved_bytes < choice.default_stats.moved_bytes:
        return chosen, plan
    return choice.default, choice.default_plan


__all__ = ["PlacementChoice", "placement_choice", "choose_placement", "best_rank_ordered"]
