"""Plan statistics and the lower bounds they are compared with.

`plan_stats` counts a plan's bytes (moved, local, per link, per device) and the bounds
on its largest per-device traffic that hold for any source choice (`group_bounds`: what
must leave each source holder set, shared at best evenly by its members).
"""
from __future__ import annotations

import numpy as np

from ..vps.placement import Placement
from .geometry import Geometry
from .plan import DeviceTraffic, PlanStats


def group_bounds(geom: Geometry, src_pl: Placement, p_inter, b_inter, p_all, b_all):
    """Lower bounds on the largest per-device send (bytes) of any source choice.

    For a set U of source devices, every byte whose holders all lie in U leaves through
    the links of U's members, so some member sends at least (those bytes) / |U|. We take
    U = each source holder set H (as devices), with the bytes of every holder set H' that
    is a subset of H (H itself, smaller replica sets inside it, the single-holder shards
    of its members): e.g. 32 replicas of a pipeline stage whose members are also the only
    4 holders of some experts must send both. `p_inter`/`b_inter`: set pair and bytes of
    the rows that must cross a NIC (no holder on the receiver's node); `p_all`/`b_all`:
    every network row. Returns (NIC bound, all-links bound), each max over H of
    ceil(bytes / |H|)."""
    if not len(p_all):
        return 0, 0
    s_off, s_mem = geom.all_members("src")
    dev = np.asarray(src_pl.devices, np.int64)[s_mem]
    nsa = int(geom.p_sa.max(initial=0)) + 1
    gk = geom.p_cls * nsa + geom.p_sa
    # one representative set pair per holder set that carries traffic
    used, gid = np.unique(gk[p_all], return_inverse=True)
    rep = np.full(len(used), -1, np.int64)
    rep[gid.ravel()[::-1]] = p_all[::-1]
    w_all = np.bincount(gid.ravel(), weights=b_all, minlength=len(used))
    w_int = np.bincount(np.searchsorted(used, gk[p_inter]), weights=b_inter,
                        minlength=len(used))
    size = s_off[rep + 1] - s_off[rep]
    # incidence (set, device), sets deduplicated by their device lists via the key
    mset = np.repeat(np.arange(len(used)), size)
    mdev = dev[np.repeat(s_off[rep], size) + np.arange(int(size.sum()))
               - np.repeat(np.cumsum(size) - size, size)]
    # join every set H' with every larger-or-equal set H sharing a device
    big = np.flatnonzero(size > 1)
    bsel = np.isin(mset, big)
    bd, bs = mdev[bsel], mset[bsel]
    o = np.lexsort((bs, bd))
    bd, bs = bd[o], bs[o]
    lo = np.searchsorted(bd, mdev, "left")
    cnt = np.searchsorted(bd, mdev, "right") - lo
    sub = np.repeat(mset, cnt)
    sup = bs[np.repeat(lo, cnt) + np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt,
                                                                          cnt)]
    G = len(used)
    pair, shared = np.unique(sub * G + sup, return_counts=True)
    a, b = pair // G, pair % G
    inside = (shared == size[a]) & (size[b] >= size[a])
    tot_int = w_int.copy()
    tot_all = w_all.copy()
    a, b = a[inside & (a != b)], b[inside & (a != b)]
    # identical device sets of two classes (weights, optimizer) count each other once
    np.add.at(tot_int, b, w_int[a])
    np.add.at(tot_all, b, w_all[a])
    return (int(np.ceil(tot_int / np.maximum(size, 1)).max(initial=0)),
            int(np.ceil(tot_all / np.maximum(size, 1)).max(initial=0)))


def plan_stats(geom: Geometry, rp, rdst, rsrc, forced, no_same, rpn, src_pl: Placement,
               dst_pl: Placement) -> tuple[PlanStats, DeviceTraffic]:
    """Byte counts and per-device traffic of the rows chosen by `sources.assign`."""
    ndev = int(max(max(src_pl.devices), max(dst_pl.devices))) + 1
    bpe = geom.p_bytes_per_element()
    byts = geom.p_numel[rp] * bpe[rp]
    local = rsrc == rdst
    net = ~local
    intra = net & (rsrc // rpn == rdst // rpn)
    inter = net & ~intra

    def per(dev, m):
        return np.bincount(dev[m], weights=byts[m], minlength=ndev).astype(np.int64)

    tr = DeviceTraffic(per(rsrc, intra), per(rsrc, inter), per(rdst, intra), per(rdst, inter),
                       per(rdst, local), per(rdst, net & no_same),
                       per(rsrc, forced & intra), per(rsrc, forced & inter))
    moved_kind, state_kind = [], []
    for c, ks in enumerate(geom.class_kinds):
        m = net & (geom.p_cls[rp] == c)
        el = int(geom.p_numel[rp[m]].sum())
        tot = int(geom.kidx.numel.sum())
        for k in ks:
            moved_kind.append((k, el * geom.itemsize[k]))
            state_kind.append((k, tot * geom.itemsize[k]))
    need = sum(n * sum(geom.itemsize[k] for k in ks)
               for n, ks in zip(geom.need_numel, geom.class_kinds))
    local_b = int(byts[local].sum())
    # bytes that must leave each source set over NICs, shared at best evenly by its members
    # (with the bytes of every source set inside it: `group_bounds`)
    m = net & no_same
    group, group_all = group_bounds(geom, src_pl, rp[m], byts[m], rp[net], byts[net])
    npairs, nk = geom.p_npairs(), geom.p_kinds()
    send, recv = tr.send, tr.recv
    force = tr.forced_send_intra + tr.forced_send_inter
    stats = PlanStats(
        kinds=geom.kinds, moved_per_kind=tuple(moved_kind), state_per_kind=tuple(state_kind),
        moved_bytes=int(byts[net].sum()), lower_bound_bytes=need - local_b,
        local_bytes=local_b, intra_node_bytes=int(byts[intra].sum()),
        inter_node_bytes=int(byts[inter].sum()),
        max_send_bytes=int(send.max(initial=0)), max_recv_bytes=int(recv.max(initial=0)),
        max_send_intra_bytes=int(tr.send_intra.max(initial=0)),
        max_send_inter_bytes=int(tr.send_inter.max(initial=0)),
        max_recv_intra_bytes=int(tr.recv_intra.max(initial=0)),
        max_recv_inter_bytes=int(tr.recv_inter.max(initial=0)),
        max_traffic_bytes=int(np.maximum(send, recv).max(initial=0)),
        balance_bound_bytes=max(int(np.maximum(recv, force).max(initial=0)), group_all),
        group_send_bound_bytes=group_all, group_send_inter_bound_bytes=group,
        num_pieces=int((npairs[rp[net]] * nk[rp[net]]).sum()),
        num_local_pieces=int((npairs[rp[local]] * nk[rp[local]]).sum()),
        num_src_devices=len(src_pl.devices), num_dst_devices=len(dst_pl.devices))
    return stats, tr


__all__ = ["group_bounds", "plan_stats"]
