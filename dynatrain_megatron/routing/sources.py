"""Source choice: which holder sends each (set pair, destination device) row.

Each set pair of a `geometry.Geometry` expands into one row per destination device. A
row whose device is among the source holders is a **local copy** (it never crosses the
network). Otherwise the source is chosen among the holders: a holder on the
destination's node if there is one (NVLink before the NIC), else round-robin over all
holders of the source set; then a min-max local search (`_rebalance`) re-sources rows,
NVLink or NIC, to lower the slowest device's time under the default link model, down to
a lower bound of any source choice (`_time_floor`). Everything is vectorised over rows:
nothing loops over ranks or rank pairs. Deterministic (integer loads, stable sorts), so
every rank chooses the same sources.
"""
from __future__ import annotations

import numpy as np

from .geometry import Geometry
from .links import LinkModel, node_cut_seconds


def _group_rank(keys: np.ndarray) -> np.ndarray:
    """For each element, how many earlier elements (in array order) share its key."""
    if not len(keys):
        return np.zeros(0, np.int64)
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    start = np.r_[True, sk[1:] != sk[:-1]]
    idx = np.arange(len(sk))
    first = np.maximum.accumulate(np.where(start, idx, 0))
    out = np.empty(len(keys), np.int64)
    out[order] = idx - first
    return out


def _link_weights() -> tuple[int, int, int]:
    """Integer time weights per byte of (NVLink, NIC, local copy), proportional to
    1 / bandwidth of the default `links.LinkModel` (integers: every rank compares the same
    exact numbers)."""
    lm = LinkModel()
    k = 9000.0
    return tuple(max(1, int(round(k / g))) for g in
                 (lm.intra_node_gbps, lm.inter_node_gbps, lm.local_copy_gbps))


_MAX_ITER = 64  # rebalancing passes (each moves many rows at once)
# and row evaluations in all: bounds the planning time, so that the largest scenarios
# (4096 ranks) plan in under a second; the trade-off is in docs/bench/notes.md
_MAX_WORK = 350_000
_STEP = 16  # first target: 1/_STEP below the slowest device
_MIN_STEP = 64  # stop when stuck even 1/_MIN_STEP below it
_TURNS = 8


def _times(s0, s1, r0, r1, floor, w):
    """Device times in integer units (`_rebalance`): the slower link, at least the local
    copies (they overlap the round); `w` = (NVLink, NIC) weights per byte. The checksum
    passes are left out: they add the same per-byte cost whatever the link, so they do
    not change which source is better, and counting them makes the search settle worse
    (docs/bench/notes.md)."""
    wi, we = w
    return np.maximum(np.maximum(np.maximum(s0, r0) * wi, np.maximum(s1, r1) * we), floor)


def _accept_gains(rank, h2, d, t, t2, v, S, R, floor, w, target):
    """Which of a pass's improving moves to apply together (`_rebalance`).

    A move adds load to its new source h2 (send, link t2) and, when the link changes, to
    its destination d (receive, link t2). Per device, its gains are taken in priority
    order (`rank`, 0 first): the first as evaluated (the move was checked alone), the
    next ones while the device's time with every earlier-ranked gain on it, applied or
    not, stays at or below `target`. So the devices that gain end no higher than their
    moves were evaluated or than the target, whatever else the pass applies (losses only
    lower a time). Returns a boolean mask over the moves."""
    n = len(rank)
    dg = np.flatnonzero(t2 != t)
    mv = np.r_[np.arange(n), dg]
    dev = np.r_[h2, d[dg]]
    ctr = np.r_[t2, 2 + t2[dg]]  # 0/1: send NVLink/NIC, 2/3: receive NVLink/NIC
    o = np.lexsort((rank[mv], dev))
    mv, dev, ctr = mv[o], dev[o], ctr[o]
    add = np.zeros((len(o), 4), np.int64)
    add[np.arange(len(o)), ctr] = v[mv]
    cum = np.cumsum(add, axis=0)
    start = np.r_[True, dev[1:] != dev[:-1]]
    first = np.maximum.accumulate(np.where(start, np.arange(len(o)), 0))
    cum -= cum[first] - add[first]
    base = np.stack([S[0, dev], S[1, dev], R[0, dev], R[1, dev]], axis=1) + cum
    tnew = _times(base[:, 0], base[:, 1], base[:, 2], base[:, 3], floor[dev], w)
    good = start | (tnew <= target)
    ok = np.ones(n, bool)
    np.logical_and.at(ok, mv, good)
    return ok


def _shed_in_turn(rank, h, v, t, T, target, w):
    """Of moves accepted together, the ones each losing device h keeps: in priority
    order, while the time it has shed so far is below its excess over `target` (the
    first always), so that a slow device does not hand off more than it needs to and
    fill its peers up to the target for nothing. Boolean mask over the moves."""
    o = np.lexsort((rank, h))
    shed = v[o] * np.where(t[o] == 1, w[1], w[0])
    cum = np.cumsum(shed) - shed
    start = np.r_[True, h[o][1:] != h[o][:-1]]
    before = cum - np.maximum.accumulate(np.where(start, cum, 0))
    keep = np.empty(len(o), bool)
    keep[o] = start | (before < T[h[o]] - target)
    return keep


def _time_floor(p_r, d_r, idx, same, lo, hi, s_n, sdev, vb, rpn, M, local) -> int:
    """A lower bound on the slowest device's time (integer units of `_link_weights`)
    under any source choice: the floor of the local search (`_rebalance`), which aims no
    lower and stops when it is reached. Per device: local copies, receives with no
    holder on the node (NIC), sends as the only holder, all receives over both links;
    then the single-device node cuts of `links.node_cut_seconds` (a device that alone on
    its node holds what its node-mates need, against their NICs)."""
    wi, we, wl = _link_weights()
    v = vb[p_r].astype(np.float64)
    src = sdev[idx]
    one = s_n[p_r] == 1
    lb = max(float((local * wl).max(initial=0)),
             float(np.bincount(d_r[~same], weights=v[~same], minlength=M).max(initial=0)) * we,
             float(np.bincount(src[one & same], weights=v[one & same],
                               minlength=M).max(initial=0)) * wi,
             float(np.bincount(src[one & ~same], weights=v[one & ~same],
                               minlength=M).max(initial=0)) * we,
             float(np.bincount(d_r, weights=v, minlength=M).max(initial=0)) * wi * we
             / (wi + we))
    if rpn <= 62 and len(p_r):  # one bit per device of a node in an int64
        cs = np.r_[0, np.cumsum(np.left_shift(1, sdev % rpn))]
        mask = np.where(same, cs[hi] - cs[lo], 0)
        lb = node_cut_seconds(v, d_r, mask, (hi - lo) == s_n[p_r], rpn, 1.0 / wi, 1.0 / we,
                              lb, all_subsets=False)
    return int(np.ceil(lb * (1 - 1e-12)))  # float round-off below an integer optimum


def _rebalance(p_r, d_r, idx, s_off, sdev, snode, g_of_p, same_ok, vb, rpn, M, local,
               bound=0):
    """Min-max local search over the source choice of the rows of several holders.

    Device time (the cost model's, in integer units): t_d = max(max(send_intra,
    recv_intra) * w_nvlink, max(send_inter, recv_inter) * w_nic, local_copies * w_copy).
    A *move* re-sources one row (set pair part, destination d) from its holder h to another
    holder h2 of the same set: the best holder on d's node (NVLink) or the best off it
    (NIC), by the time it would have after taking the row. A move is *improving* when it
    lowers the devices' excess over the current target without raising max(t_h, t_h2,
    t_d) above max(its old value, target). Passes aim at a target below the slowest
    device (1/_STEP below, closer when stuck, never below `bound`, a lower bound on any
    source choice: `_time_floor`) and apply many improving moves at once, touching the
    slowest devices first. The first pass is *wide*: a device may shed several rows
    (until its excess is gone, `_shed_in_turn`) and take several (while it stays under
    the target, `_accept_gains`), which does the bulk of the work in one pass when
    hundreds of devices are equally overloaded. The later passes are *narrow* (a device
    takes part in one move), which settles closer to the bound than wide passes to the
    end (docs/bench/notes.md). The gaining devices end no higher than their moves were evaluated, so
    every pass lowers the sorted vector of device times lexicographically and the search
    terminates; it stops at the bound, when stuck 1/_MIN_STEP below the slowest device,
    after `_MAX_ITER` passes, or after `_MAX_WORK` row evaluations. Deterministic:
    integer loads, stable sorts.
    Returns the updated `idx` (positions into the holder arrays)."""
    wi, we, wl = _link_weights()
    w = (wi, we)
    v = vb[p_r].astype(np.int64)
    dn = d_r // rpn
    idx = idx.copy()
    src = sdev[idx]
    inter = (snode[idx] != dn).astype(np.int64)
    S = np.zeros((2, M), np.int64)
    R = np.zeros((2, M), np.int64)
    np.add.at(S, (inter, src), v)
    np.add.at(R, (inter, d_r), v)
    floor = local.astype(np.int64) * wl
    mv = np.flatnonzero(g_of_p[p_r] >= 0)
    if not len(mv):
        return idx
    # holders of every source set (one representative set pair per set), by (node, dev)
    G = int(g_of_p.max()) + 1
    rep = np.full(G, -1, np.int64)
    ps_multi = np.flatnonzero(g_of_p >= 0)
    rep[g_of_p[ps_multi[::-1]]] = ps_multi[::-1]  # first set pair of each set
    gn = s_off[rep + 1] - s_off[rep]
    goff = np.zeros(G + 1, np.int64)
    np.cumsum(gn, out=goff[1:])
    hpos = np.repeat(s_off[rep] - goff[:-1], gn) + np.arange(int(goff[-1]))
    hg, hdev, hnode = np.repeat(np.arange(G), gn), sdev[hpos], snode[hpos]
    vg = np.zeros(G, np.int64)
    np.maximum.at(vg, g_of_p[ps_multi], vb[ps_multi].astype(np.int64))
    NN = M // rpn + 1
    hkey = hg * NN + hnode  # sorted (holders sorted by node inside a set)
    ukey, ustart = np.unique(hkey, return_index=True)
    big = np.iinfo(np.int64).max
    T = _times(S[0], S[1], R[0], R[1], floor, w)
    tmax = int(T.max(initial=0))
    step, work = _STEP, 0
    target = max(tmax - tmax // step, bound)
    for it in range(_MAX_ITER):
        if tmax <= bound or step > _MIN_STEP:
            break
        m = mv[np.maximum(T[src[mv]], T[d_r[mv]]) > target]
        work += len(m)
        if work > _MAX_WORK:
            break
        # best holder of each set on each node (NVLink) and best two nodes (NIC)
        ci = np.maximum(T[hdev], (S[0, hdev] + vg[hg]) * wi)
        ce = np.maximum(T[hdev], (S[1, hdev] + vg[hg]) * we)
        oi = np.lexsort((hdev, ci, hkey))
        best_i = oi[np.searchsorted(hkey[oi], ukey)]  # per (set, node)
        oe = np.lexsort((hdev, S[1, hdev], ce, hg))
        b1 = oe[goff[:-1]]
        ok2 = hnode[oe] != hnode[b1][hg[oe]]
        oe2 = oe[ok2]
        g2 = hg[oe2]
        has2 = np.zeros(G, bool)
        has2[g2] = True
        b2 = np.full(G, -1, np.int64)
        b2[g2[::-1]] = oe2[::-1]
        g = g_of_p[p_r[m]]
        node = dn[m]
        # the holders of a set take turns as NIC candidates (symmetric layouts: many ties)
        first = oe[goff[:-1][g] + _group_rank(g) % np.minimum(gn[g], _TURNS)]
        cand_e = np.where(hnode[first] != node, first, np.where(has2[g], b2[g], -1))
        q = g * NN + node
        j = np.minimum(np.searchsorted(ukey, q), len(ukey) - 1)
        cand_i = np.where(same_ok[m] & (ukey[j] == q), best_i[j], -1)
        h, d, vm, t = src[m], d_r[m], v[m], inter[m]
        best_gain = np.zeros(len(m), np.int64)
        best_c = np.full(len(m), -1, np.int64)

        def excess(x):
            return np.maximum(x - target, 0)
        for cand in (cand_i, cand_e):
            ok = cand >= 0
            c = np.where(ok, cand, 0)
            h2 = hdev[c]
            t2 = (hnode[c] != node).astype(np.int64)
            ok &= h2 != h
            # new times of h (loses the row), h2 (takes it), d (its link may change)
            sh = S[:, h] - vm * np.stack([1 - t, t])
            nh = _times(sh[0], sh[1], R[0, h], R[1, h], floor[h], w)
            s2 = S[:, h2] + vm * np.stack([1 - t2, t2])
            n2 = _times(s2[0], s2[1], R[0, h2], R[1, h2], floor[h2], w)
            rd = R[:, d] + vm * (np.stack([1 - t2, t2]) - np.stack([1 - t, t]))
            nd = _times(S[0, d], S[1, d], rd[0], rd[1], floor[d], w)
            gain = (excess(T[h]) + excess(T[h2]) + excess(T[d])
                    - excess(nh) - excess(n2) - excess(nd))
            cap = np.maximum(np.maximum(T[h], T[h2]), np.maximum(T[d], target))
            better = ok & (gain > best_gain) & (np.maximum(np.maximum(nh, n2), nd) <= cap)
            best_gain = np.where(better, gain, best_gain)
            best_c = np.where(better, c, best_c)
        imp = np.flatnonzero(best_c >= 0)
        if not len(imp):  # stuck at this target: aim closer to the current slowest
            step *= 2
            target = max(target, tmax - tmax // step, bound)
            continue
        r, c = m[imp], best_c[imp]
        h, h2, d = src[r], hdev[c], d_r[r]
        t, t2 = inter[r], (hnode[c] != dn[r]).astype(np.int64)
        rank = np.empty(len(r), np.int64)
        rank[np.lexsort((r, -best_gain[imp]))] = np.arange(len(r))
        if it == 0:  # one wide pass: every device may shed and gain several rows
            ok = _accept_gains(rank, h2, d, t, t2, v[r], S, R, floor, w, target)
            ok[ok] = _shed_in_turn(rank[ok], h[ok], v[r[ok]], t[ok], T, target, w)
        else:  # then narrow passes: a device takes part in one move
            mr = np.full(M, big, np.int64)
            for dev in (h, h2, d):
                np.minimum.at(mr, dev, rank)
            ok = (mr[h] == rank) & (mr[h2] == rank) & (mr[d] == rank)
        r, c, h, h2, d, t, t2 = r[ok], c[ok], h[ok], h2[ok], d[ok], t[ok], t2[ok]
        vr = v[r]
        np.subtract.at(S, (t, h), vr)
        np.add.at(S, (t2, h2), vr)
        np.subtract.at(R, (t, d), vr)
        np.add.at(R, (t2, d), vr)
        idx[r] = s_off[p_r[r]] + (hpos[c] - s_off[rep[hg[c]]])
        src[r], inter[r] = h2, t2
        T = _times(S[0], S[1], R[0], R[1], floor, w)
        tmax = int(T.max(initial=0))
        if tmax <= target:  # reached: aim lower
            target = max(tmax - tmax // step, bound)
    return idx


def assign(geom: Geometry, dev_a: np.ndarray, dev_b: np.ndarray, rpn: int):
    """Rows (set pair, dst device, src device) for placements `dev_a`/`dev_b` (arrays
    virtual rank -> device), plus the per-row flags needed for statistics."""
    nP = geom.num_set_pairs
    ps = np.arange(nP)
    s_off, s_mem = geom.all_members("src")
    d_off, d_mem = geom.all_members("dst")
    s_n, d_n = np.diff(s_off), np.diff(d_off)
    sp = np.repeat(ps, s_n)
    sdev = dev_a[s_mem]
    rp = np.repeat(ps, d_n)
    rdst = dev_b[d_mem]
    M = int(max(sdev.max(initial=0), rdst.max(initial=0))) + 1
    NN = M // rpn + 1
    snode = sdev // rpn
    # sources of each set pair sorted by (node, device): contiguous per set pair
    so = np.lexsort((sdev, snode, sp))
    sdev, snode, sp = sdev[so], snode[so], sp[so]
    kdev = np.sort(sp * M + sdev)
    q = rp * M + rdst
    pos = np.minimum(np.searchsorted(kdev, q), max(len(kdev) - 1, 0))
    local = (kdev[pos] == q) if len(kdev) else np.zeros(len(q), bool)
    rem = np.flatnonzero(~local)
    p_r, d_r = rp[rem], rdst[rem]
    kn = sp * NN + snode
    qn = p_r * NN + d_r // rpn
    lo = np.searchsorted(kn, qn, "left")
    hi = np.searchsorted(kn, qn, "right")
    same = hi > lo
    vb = geom.p_numel * geom.p_bytes_per_element()
    # start: a holder on the destination's node when there is one (NVLink is ~10x the
    # NIC), else any holder; round-robin over the holders of each source set (on that
    # node), in row order, so that the parts of one set spread over its members
    nsa = int(geom.p_sa.max(initial=0)) + 1
    gkey = geom.p_cls * nsa + geom.p_sa
    g_of_p = np.unique(gkey, return_inverse=True)[1].ravel()
    g_r = g_of_p[p_r]
    cnt = np.where(same, hi - lo, s_n[p_r])
    base = np.where(same, lo, s_off[p_r])
    turn = _group_rank(np.where(same, (g_r * NN + d_r // rpn) * 2, g_r * 2 * NN + 1))
    idx = base + turn % np.maximum(cnt, 1)
    # then a min-max local search over the rows of several holders
    ldev = np.bincount(rdst[local], weights=vb[rp[local]], minlength=M)
    mp = s_n > 1  # sets of several holders, numbered 0.. for the local search
    multi = np.full(nP, -1, np.int64)
    multi[mp] = np.unique(gkey[mp], return_inverse=True)[1].ravel()
    bound = _time_floor(p_r, d_r, idx, same, lo, hi, s_n, sdev, vb, rpn, M, ldev)
    idx = _rebalance(p_r, d_r, idx, s_off, sdev, snode, multi, same, vb, rpn, M, ldev, bound)
    rsrc = rdst.copy()
    rsrc[rem] = sdev[idx]
    forced = np.zeros(len(rp), bool)
    forced[rem] = s_n[p_r] == 1
    no_same = np.zeros(len(rp), bool)
    no_same[rem] = ~same
    return rp, rdst, rsrc, forced, no_same


__all__ = ["assign"]
