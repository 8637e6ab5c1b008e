"""The planner: which device sends which box of which tensor to which device.

`build_plan(spec, (layout_A, placement_A), (layout_B, placement_B))` is a pure function
of its (frozen, hashable) arguments, memoised, and identical on every rank: no metadata is
exchanged, every rank computes the same plan from the same layouts.

How it works, in two halves (neither loops over ranks or rank pairs):

1. **Geometry** (independent of placements, cached per layout pair): the region tables
   of A (sources, see `regions`) and B (destinations) are joined per logical tensor; the
   intersections are grouped into **set pairs**: all intersections whose source holder
   set and destination holder set are the same. For Llama-3-70B on 128 ranks there are a
   few thousand, for Qwen3-235B on 4096 ranks a few 1e4.
2. **Devices** (per placement pair, vectorised): each set pair expands into one row per
   destination device. A row whose device is among the source holders is a **local
   copy** (it never crosses the network). Otherwise the source is chosen among the
   holders: a holder on the destination's node if there is one (NVLink before the NIC),
   else round-robin over all holders of the source set; then a min-max local search
   (`_rebalance`) re-sources rows, NVLink or NIC, to lower the slowest device's time under
   the default link model, down to a lower bound of any source choice (`_time_floor`).
   Set pairs of several holders are first cut into parts (`refined`) so that one
   destination's share can come from several holders. For optimizer state of TP-split
   tensors the holder is unique anyway. Every destination receives each byte exactly
   once, so bytes moved == the lower bound.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from ..vps.analytic import OPT_DTYPE_BYTES, analytic_layout
from ..vps.fragment import KINDS, OPT_KINDS
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.naming import DTYPE_BYTES
from ..vps.placement import Placement
from .plan import DeviceTraffic, Piece, Plan, PlanStats
from .regions import OPT, PARAM, KeyIndex, RegionTable, RoutingError, join_boxes, \
    key_index, region_table

Side = tuple[Layout, Optional[Placement]]
BucketSize = Union[Optional[int], tuple[Optional[int], Optional[int]]]


# ---------------------------------------------------------------------------------------
# geometry: set pairs (placement independent)
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Geometry:
    """Intersections of A's and B's regions grouped into set pairs (module doc).

    Set pair `i` (class `classes[p_cls[i]]`): source holder set `p_sa[i]`, destination
    holder set `p_sb[i]`, `p_numel[i]` elements per kind, region pairs
    `rp_*[p_off[i]:p_off[i+1]]` sorted by (key, r0, c0).
    """

    spec: ModelSpec
    src_layout: Layout
    dst_layout: Layout
    kinds: tuple[str, ...]
    bucket_src: Optional[int]
    bucket_dst: Optional[int]
    kidx: KeyIndex
    classes: tuple[str, ...]
    src_tables: tuple[RegionTable, ...]
    dst_tables: tuple[RegionTable, ...]
    class_kinds: tuple[tuple[str, ...], ...]
    itemsize: dict
    p_cls: np.ndarray
    p_sa: np.ndarray
    p_sb: np.ndarray
    p_numel: np.ndarray
    p_off: np.ndarray
    rp_key: np.ndarray
    rp_r0: np.ndarray
    rp_r1: np.ndarray
    rp_c0: np.ndarray
    rp_c1: np.ndarray
    need_numel: tuple[int, ...]  # per class: elements all destination devices hold in B
    # virtual ranks of A that cannot send (their device died): never chosen as a source
    src_exclude: frozenset = frozenset()
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_set_pairs(self) -> int:
        return len(self.p_cls)

    def p_bytes_per_element(self) -> np.ndarray:
        """Bytes per element of every set pair, all its kinds together."""
        per = np.array([sum(self.itemsize[k] for k in ks) for ks in self.class_kinds],
                       np.int64)
        return per[self.p_cls]

    def p_kinds(self) -> np.ndarray:
        return np.array([len(ks) for ks in self.class_kinds], np.int64)[self.p_cls]

    def p_npairs(self) -> np.ndarray:
        return np.diff(self.p_off)

    def all_members(self, side: str) -> tuple[np.ndarray, np.ndarray]:
        """`members(side, every set pair)`, computed once."""
        got = self._cache.get(side)
        if got is None:
            got = self._cache[side] = self.members(side, np.arange(self.num_set_pairs))
        return got

    def members(self, side: str, ps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """CSR (offsets, virtual ranks) of the source (`side="src"`) or destination holder
        sets of set pairs `ps`, in the order of `ps`."""
        tabs = self.src_tables if side == "src" else self.dst_tables
        sets = self.p_sa if side == "src" else self.p_sb
        ps = np.asarray(ps, np.int64)
        sizes = np.zeros(len(ps), np.int64)
        parts = []
        for c, t in enumerate(tabs):
            sel = np.flatnonzero(self.p_cls[ps] == c)
            if len(sel):
                off, mem = t.holders.csr(sets[ps[sel]])
                sizes[sel] = np.diff(off)
                parts.append((sel, off, mem))
        offs = np.zeros(len(ps) + 1, np.int64)
        np.cumsum(sizes, out=offs[1:])
        out = np.empty(int(offs[-1]), np.int64)
        for sel, off, mem in parts:
            idx = np.repeat(offs[sel], np.diff(off)) + (
                np.arange(len(mem)) - np.repeat(off[:-1], np.diff(off)))
            out[idx] = mem
        if side == "src" and self.src_exclude:
            keep = ~np.isin(out, np.fromiter(self.src_exclude, np.int64))
            kept = np.concatenate([[0], np.cumsum(keep)])
            offs, out = kept[offs], out[keep]
        return offs, out

    # ------------------------------------------------------------------ materialise
    def materialize(self, plan: Plan, rows: np.ndarray) -> list[Piece]:
        inv_a = _inverse(plan.src_placement)
        inv_b = _inverse(plan.dst_placement)
        out: list[Piece] = []
        keys = self.kidx.keys
        for r in np.asarray(rows, np.int64):
            p = int(plan.rows_p[r])
            s, d = int(plan.rows_src[r]), int(plan.rows_dst[r])
            va, vb = inv_a.get(s), inv_b[d]
            if va is None:  # pragma: no cover - guarded by construction
                raise RoutingError(f"plan row {r}: source device {s} is not in layout A")
            ks = self.class_kinds[self.p_cls[p]]
            for j in range(self.p_off[p], self.p_off[p + 1]):
                k = int(self.rp_key[j])
                r0, r1 = int(self.rp_r0[j]), int(self.rp_r1[j])
                c0, c1 = int(self.rp_c0[j]), int(self.rp_c1[j])
                box = self.kidx.box(k, r0, r1, c0, c1)
                sc, sn, so = _local_place(self.spec, self.src_layout, va, k, r0, c0, r1, c1,
                                          self.kidx)
                dc, dn, do = _local_place(self.spec, self.dst_layout, vb, k, r0, c0, r1, c1,
                                          self.kidx)
                for kind in ks:
                    out.append(Piece(s, d, keys[k], kind, box, sc, sn, so, dc, dn, do,
                                     self.itemsize[kind]))
        out.sort(key=lambda x: (KINDS.index(x.kind), self.kidx.ids[x.key], x.box.offsets,
                                x.src_device, x.dst_device))
        return out

    def flows(self, plan: Plan):
        net = np.flatnonzero(plan.rows_src != plan.rows_dst)
        p = plan.rows_p[net]
        nk = self.p_kinds()[p]
        rr = np.repeat(np.arange(len(net)), nk)
        first = np.repeat(np.cumsum(nk) - nk, nk)
        kind_of = np.array([[KINDS.index(k) for k in ks] + [0] * (4 - len(ks))
                            for ks in self.class_kinds], np.int64)
        kind = kind_of[self.p_cls[p[rr]], np.arange(len(rr)) - first]
        src, dst = plan.rows_src[net][rr], plan.rows_dst[net][rr]
        el = self.p_numel[p[rr]]
        D = int(max(src.max(initial=0), dst.max(initial=0))) + 1
        comb = (src * D + dst) * len(KINDS) + kind
        u, inv = np.unique(comb, return_inverse=True)
        tot = np.bincount(inv.ravel(), weights=el, minlength=len(u)).astype(np.int64)
        return (u // len(KINDS)) // D, (u // len(KINDS)) % D, u % len(KINDS), tot


_GEOM_FIELDS = tuple(f for f in Geometry.__dataclass_fields__
                     if f not in ("src_exclude", "_cache"))


def _inverse(pl: Placement) -> dict[int, int]:
    return {d: v for v, d in enumerate(pl.devices)}


@functools.lru_cache(maxsize=4096)
def _local_map(spec: ModelSpec, layout: Layout, tp: int, pp: int, ep: int, etp: int,
               kidx: KeyIndex) -> dict[int, list[tuple]]:
    from ..vps.layout import RankCoords
    from ..vps.naming import local_tensors
    c = RankCoords(rank=0, tp=tp, cp=0, dp=0, pp=pp, etp=etp, ep=ep, edp=0, dp_cp=0)
    out: dict[int, list[tuple]] = {}
    for lt in local_tensors(spec, layout, c):
        for b in lt.blocks:
            g, loc = b.logical, b.local
            two = g.ndim == 2
            out.setdefault(kidx.ids[lt.key], []).append(
                (lt.chunk, lt.local_name, g.offsets[0], g.offsets[0] + g.shape[0],
                 g.offsets[1] if two else 0, g.offsets[1] + g.shape[1] if two else 1,
                 loc.offsets[0], loc.offsets[1] if two else 0, two))
    return out


def _local_place(spec, layout, vrank, k, r0, c0, r1, c1, kidx):
    c = layout.coords(vrank)
    for ch, name, g0, g1, h0, h1, l0, m0, two in _local_map(spec, layout, c.tp, c.pp, c.ep,
                                                              c.etp, kidx).get(k, ()):
        if g0 <= r0 and r1 <= g1 and h0 <= c0 and c1 <= h1:
            off = (r0 - g0 + l0, c0 - h0 + m0) if two else (r0 - g0 + l0,)
            return ch, name, off
    raise RoutingError(f"virtual rank {vrank} of {layout} holds no block of "  # pragma: no cover
                       f"{kidx.keys[k]} containing rows {r0}:{r1} cols {c0}:{c1}")


def _split_bucket(bucket_size: BucketSize) -> tuple[Optional[int], Optional[int]]:
    if isinstance(bucket_size, tuple):
        if len(bucket_size) != 2:
            raise RoutingError(f"bucket_size tuple must be (src, dst), got {bucket_size}")
        return bucket_size[0], bucket_size[1]
    return bucket_size, bucket_size


def _norm_kinds(kinds: Sequence[str]) -> tuple[str, ...]:
    if isinstance(kinds, str):
        kinds = (kinds,)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise RoutingError(f"kinds must be a non-empty subset of {KINDS}, got {list(kinds)}")
    return tuple(k for k in KINDS if k in kinds)


@functools.lru_cache(maxsize=32)
def geometry(spec: ModelSpec, src_layout: Layout, dst_layout: Layout,
             kinds: tuple[str, ...] = KINDS, bucket_src: Optional[int] = None,
             bucket_dst: Optional[int] = None) -> Geometry:
    """The placement-independent half of a plan (module doc), memoised."""
    kinds = _norm_kinds(kinds)
    for lay, b in ((src_layout, bucket_src), (dst_layout, bucket_dst)):
        analytic_layout(spec, lay, b)  # validates layout vs model (LayoutError)
    kidx = key_index(spec)
    classes, ckinds = [], []
    if "param" in kinds:
        classes.append(PARAM)
        ckinds.append(("param",))
    opt = tuple(k for k in OPT_KINDS if k in kinds)
    if opt:
        classes.append(OPT)
        ckinds.append(opt)
    itemsize = {"param": DTYPE_BYTES[spec.params_dtype]}
    itemsize.update({k: OPT_DTYPE_BYTES for k in OPT_KINDS})
    cols = {n: [] for n in ("cls", "sa", "sb", "key", "r0", "r1", "c0", "c1")}
    src_tabs, dst_tabs, need = [], [], []
    for c, cls in enumerate(classes):
        A = region_table(spec, src_layout, bucket_src, cls, True)
        B = region_table(spec, dst_layout, bucket_dst, cls, False)
        src_tabs.append(A)
        dst_tabs.append(B)
        ia, ib, r0, r1, c0, c1 = join_boxes(A.key, A.r0, A.r1, A.c0, A.c1, A.band_width,
                                            B.key, B.r0, B.r1, B.c0, B.c1)
        # exact coverage, cheaply: A is a partition, so the intersections of each B box
        # add up to its volume iff the box is covered
        got = np.bincount(ib, weights=(r1 - r0) * (c1 - c0), minlength=len(B))
        bad = np.flatnonzero(got != B.numel)
        if len(bad):  # pragma: no cover - an invariant of the region tables
            i = int(bad[0])
            raise RoutingError(
                f"{cls} region {kidx.keys[B.key[i]]} rows {B.r0[i]}:{B.r1[i]} cols "
                f"{B.c0[i]}:{B.c1[i]} of {dst_layout}: layout {src_layout} covers "
                f"{int(got[i])} of {int(B.numel[i])} elements ({len(bad)} such regions)")
        need.append(int((B.numel * B.holders.size(B.hset)).sum()))
        for n, v in (("sa", A.hset[ia]), ("sb", B.hset[ib]), ("key", A.key[ia]), ("r0", r0),
                     ("r1", r1), ("c0", c0), ("c1", c1)):
            cols[n].append(v)
        cols["cls"].append(np.full(len(ia), c, np.int64))
    a = {n: (np.concatenate(v) if v else np.zeros(0, np.int64)) for n, v in cols.items()}
    nsets = max([len(t.holders) for t in dst_tabs] + [1])
    nseta = max([len(t.holders) for t in src_tabs] + [1])
    comb = (a["cls"] * nseta + a["sa"]) * nsets + a["sb"]
    order = np.lexsort((a["c0"], a["r0"], a["key"], comb))
    comb = comb[order]
    u, first = np.unique(comb, return_index=True)
    off = np.append(first, len(comb)).astype(np.int64)
    numel = (a["r1"] - a["r0"]) * (a["c1"] - a["c0"])
    pnumel = np.add.reduceat(numel[order], first) if len(first) else np.zeros(0, np.int64)
    return Geometry(spec, src_layout, dst_layout, kinds, bucket_src, bucket_dst, kidx,
                    tuple(classes), tuple(src_tabs), tuple(dst_tabs), tuple(ckinds),
                    itemsize, (u // nsets) // nseta, (u // nsets) % nseta, u % nsets,
                    pnumel.astype(np.int64), off, a["key"][order], a["r0"][order],
                    a["r1"][order], a["c0"][order], a["c1"][order], tuple(need))


_SPLIT = 32  # a replicated set pair is cut into parts of ~1/_SPLIT of a device's B state
_MAX_PARTS = 64


def refined(geom: Geometry) -> Geometry:
    """`geom` with every set pair of several source holders cut into parts (memoised).

    A set pair's rows are the planner's unit of source choice; when a row is a large
    share of a device's traffic (e.g. a whole pipeline stage of TP-replicated weights),
    no choice of one source per row balances the senders (33 receivers of a 2 GB row and
    32 holders: one holder sends 4 GB whatever the choice). Cutting the set pair at region
    pair boundaries into parts of about `1/_SPLIT` of a device's average layout-B state
    (at most `_MAX_PARTS`, at most one per region pair) lets different holders serve
    different parts of one destination. Pieces are unchanged (a part is a run of whole
    region pairs), so are the bytes moved and the local copies; only set pairs with more
    than one holder are cut (a single holder has no choice to balance). Placement
    independent: `plan_for` uses it for every placement of the same geometry."""
    got = geom._cache.get("refined")
    if got is not None:
        return got
    s_n = np.diff(geom.all_members("src")[0])
    vb = (geom.p_numel * geom.p_bytes_per_element()).astype(np.float64)
    per = np.array([sum(geom.itemsize[k] for k in ks) for ks in geom.class_kinds], np.float64)
    avg = np.maximum(np.asarray(geom.need_numel, np.float64) * per
                     / max(geom.dst_layout.world_size, 1), 1.0)[geom.p_cls]
    npairs = geom.p_npairs()
    k = np.where(s_n > 1, np.minimum(np.minimum(np.ceil(vb * _SPLIT / avg), _MAX_PARTS),
                                     npairs), 1).astype(np.int64)
    if not len(k) or k.max(initial=1) <= 1:
        geom._cache["refined"] = geom
        return geom
    nrp = len(geom.rp_key)
    sp = np.repeat(np.arange(geom.num_set_pairs), npairs)
    n = (geom.rp_r1 - geom.rp_r0) * (geom.rp_c1 - geom.rp_c0)
    cum = np.cumsum(n) - n  # elements before each region pair ...
    cum = cum - np.repeat(cum[geom.p_off[:-1]], npairs)  # ... inside its set pair
    part = ((2 * cum + n) * k[sp]) // (2 * geom.p_numel[sp])
    start = np.ones(nrp, bool)
    if nrp:
        start[1:] = (sp[1:] != sp[:-1]) | (part[1:] != part[:-1])
    first = np.flatnonzero(start)
    parent = sp[first]
    numel = np.add.reduceat(n, first) if len(first) else np.zeros(0, np.int64)
    out = Geometry(geom.spec, geom.src_layout, geom.dst_layout, geom.kinds, geom.bucket_src,
                   geom.bucket_dst, geom.kidx, geom.classes, geom.src_tables,
                   geom.dst_tables, geom.class_kinds, geom.itemsize, geom.p_cls[parent],
                   geom.p_sa[parent], geom.p_sb[parent], numel.astype(np.int64),
                   np.append(first, nrp).astype(np.int64), geom.rp_key, geom.rp_r0,
                   geom.rp_r1, geom.rp_c0, geom.rp_c1, geom.need_numel)
    geom._cache["refined"] = out
    return out


# ---------------------------------------------------------------------------------------
# devices: local copies and source choice (vectorised)
# ---------------------------------------------------------------------------------------
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
    1 / bandwidth of the default `cost.LinkModel` (integers: every rank compares the same
    exact numbers)."""
    from .cost import LinkModel
    lm = LinkModel()
    k = 9000.0
    return tuple(max(1, int(round(k / g))) for g in
                 (lm.intra_node_gbps, lm.inter_node_gbps, lm.local_copy_gbps))


_MAX_ITER = 64  # rebalancing passes (each moves many rows at once)
# and row evaluations in all: bounds the planning time. Measured on one core: 350k keeps
# the 4096-rank Qwen3 scenarios' whole planning (placement + two plans + bounds) at
# ~0.7 s, under the 1 s target; on ep32 -> ep64 the search is then at 1.049x the node-cut
# bound, and unlimited work (~1.3M evaluations, +0.3 s) reaches 1.037x
_MAX_WORK = 350_000
_STEP = 16  # first target: 1/_STEP below the slowest device
_MIN_STEP = 64  # stop when stuck even 1/_MIN_STEP below it
_TURNS = 8


def _times(s0, s1, r0, r1, floor, w):
    """Device times in integer units (`_rebalance`): the slower link, at least the local
    copies (they overlap the round); `w` = (NVLink, NIC) weights per byte. The checksum
    passes are left out: they add the same per-byte cost whatever the link, and counting
    them made the search settle worse in a trial on the 4096-rank scenario (estimate
    1.33x the bound instead of 1.31x)."""
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
    then the single-device node cuts of `cost.node_cut_seconds` (a device that alone on
    its node holds what its node-mates need, against their NICs)."""
    from .cost import node_cut_seconds
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
    hundreds of devices are equally overloaded (4096-rank scenario: 800 moves instead of
    270). The later passes are *narrow* (a device takes part in one move), which settles
    better: wide passes to the end left Llama-3-70B tp8 -> tp4 at 1.055x the bound instead
    of 1.032x. The gaining devices end no higher than their moves were evaluated, so
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


def _group_bounds(geom: Geometry, src_pl: Placement, p_inter, b_inter, p_all, b_all):
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


def _stats(geom: Geometry, rp, rdst, rsrc, forced, no_same, rpn, src_pl, dst_pl):
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
    # (with the bytes of every source set inside it: `_group_bounds`)
    m = net & no_same
    group, group_all = _group_bounds(geom, src_pl, rp[m], byts[m], rp[net], byts[net])
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


# ---------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------
def _side(side: Union[Side, Layout], what: str) -> tuple[Layout, Placement]:
    if isinstance(side, Layout):
        side = (side, None)
    try:
        lay, pl = side
    except (TypeError, ValueError):
        raise RoutingError(f"{what} must be (Layout, Placement), got {side!r}") from None
    if not isinstance(lay, Layout):
        raise RoutingError(f"{what}: expected a Layout, got {lay!r}")
    if pl is None:
        pl = Placement.default(lay.world_size)
    if not isinstance(pl, Placement):
        pl = Placement(tuple(int(d) for d in pl))
    if len(pl.devices) != lay.world_size:
        raise RoutingError(f"{what}: placement has {len(pl.devices)} devices but layout "
                           f"{lay} has world size {lay.world_size}")
    return lay, pl


def build_plan(spec: ModelSpec, src: Union[Side, Layout], dst: Union[Side, Layout],
               kinds: Sequence[str] = KINDS, ranks_per_node: int = 8,
               bucket_size: BucketSize = None, unavailable: Sequence[int] = ()) -> Plan:
    """The transition plan from `src = (layout A, placement A)` to `dst` (module doc).

    `placement.devices[v]` is the device of virtual rank v (None: identity); the two
    sides may use different device sets (scale in/out). `kinds`: the state kinds to move
    (e.g. `OPT_KINDS` when weights are rebuilt from fp32 masters). `bucket_size`: the
    resolved DDP bucket size of both layouts, or a (src, dst) pair. `unavailable`:
    devices of A that cannot send (dead): their state comes from its replicas, or the
    plan is refused. Memoised.
    """
    la, pa = _side(src, "src")
    lb, pb = _side(dst, "dst")
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise RoutingError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
    bs, bd = _split_bucket(bucket_size)
    bad = sorted(set(unavailable) - set(pa.devices))
    if bad:
        raise RoutingError(f"unavailable devices {bad} are not devices of layout A {la}")
    return _build_plan(spec, la, pa, lb, pb, _norm_kinds(kinds), ranks_per_node, bs, bd,
                       tuple(sorted(set(unavailable))))


@functools.lru_cache(maxsize=32)
def _build_plan(spec, la, pa, lb, pb, kinds, rpn, bs, bd, unavailable=()) -> Plan:
    geom = geometry(spec, la, lb, kinds, bs, bd)
    return plan_for(geom, pa, pb, rpn, unavailable)


def _without_sources(geom: Geometry, pa: Placement, unavailable: Sequence[int]) -> Geometry:
    """`geom` whose source holder sets leave out the virtual ranks on `unavailable`
    devices; refuses when some state then has no holder left (it died with them)."""
    gone = frozenset(v for v, d in enumerate(pa.devices) if d in set(unavailable))
    out = Geometry(*(getattr(geom, f) for f in _GEOM_FIELDS), src_exclude=gone)
    off, _ = out.all_members("src")
    empty = np.flatnonzero(np.diff(off) == 0)
    if len(empty):
        j = int(out.p_off[empty[0]])
        raise RoutingError(
            f"{len(empty)} parts of the state of {geom.src_layout} are held only by the "
            f"unavailable devices {sorted(unavailable)} (e.g. "
            f"{geom.kidx.keys[int(out.rp_key[j])]} {geom.classes[int(out.p_cls[empty[0]])]}): "
            f"they cannot be recovered from the others")
    return out


def plan_for(geom: Geometry, pa: Placement, pb: Placement, rpn: int,
             unavailable: Sequence[int] = ()) -> Plan:
    """The plan of a (cached) geometry under placements `pa`, `pb`; no piece comes from
    a device in `unavailable` (A's devices that died: recovery from their replicas)."""
    dev_a = np.asarray(pa.devices, np.int64)
    dev_b = np.asarray(pb.devices, np.int64)
    geom = refined(geom)
    if unavailable:
        geom = _without_sources(geom, pa, unavailable)
    rp, rdst, rsrc, forced, no_same = assign(geom, dev_a, dev_b, rpn)
    stats, tr = _stats(geom, rp, rdst, rsrc, forced, no_same, rpn, pa, pb)
    if stats.moved_bytes != stats.lower_bound_bytes:  # pragma: no cover - invariant
        raise RoutingError(f"plan {geom.src_layout} -> {geom.dst_layout} moves "
                           f"{stats.moved_bytes} B, lower bound {stats.lower_bound_bytes} B")
    return Plan(geom.spec, geom.src_layout, pa, geom.dst_layout, pb, geom.kinds, rpn, geom,
                rp, rdst, rsrc, stats, tr)


__all__ = ["Geometry", "geometry", "assign", "build_plan", "plan_for", "clear_caches"]


def clear_caches() -> None:
    """Drop every memoised table and plan (for cold-start timings)."""
    from ..vps import analytic, naming
    from . import regions
    for f in (_build_plan, geometry, _local_map, regions.region_table, regions.key_index,
              analytic.analytic_layout, naming.chunk_param_specs, naming.logical_tensors):
        f.cache_clear()
