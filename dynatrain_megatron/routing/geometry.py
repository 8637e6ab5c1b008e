"""Set-pair geometry: the placement-independent half of a plan.

The region tables of layout A (sources, see `regions`) and layout B (destinations) are
joined per logical tensor; the intersections are grouped into **set pairs**: all
intersections whose source holder set and destination holder set are the same. Nothing
here depends on which device runs which virtual rank, so one geometry serves every
placement pair of the same two layouts (`geometry` is memoised); `sources` then picks a
sender per (set pair, destination device) and `planner` assembles the plan.

`refined` cuts set pairs of several holders into parts so that one destination's share
can come from several holders; `Geometry.materialize` turns plan rows back into `Piece`s.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from ..vps.analytic import OPT_DTYPE_BYTES, analytic_layout
from ..vps.fragment import KINDS, OPT_KINDS
from ..vps.layout import Layout, RankCoords
from ..vps.model_spec import ModelSpec
from ..vps.naming import DTYPE_BYTES, local_tensors
from ..vps.placement import Placement
from .piece import Piece
from .regions import OPT, PARAM, KeyIndex, RegionTable, RoutingError, join_boxes, \
    key_index, region_table

BucketSize = Union[Optional[int], tuple[Optional[int], Optional[int]]]


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

    # ------------------------------------------------------------------ derived
    def without_sources(self, gone: frozenset) -> "Geometry":
        """This geometry with the virtual ranks `gone` left out of every source holder
        set (`members("src", ...)` skips them); the set pairs are unchanged."""
        return Geometry(*(getattr(self, f) for f in _GEOM_FIELDS), src_exclude=gone)

    # ------------------------------------------------------------------ materialise
    def materialize(self, src_placement: Placement, dst_placement: Placement,
                    rows_p: np.ndarray, rows_src: np.ndarray, rows_dst: np.ndarray
                    ) -> list[Piece]:
        """The pieces of the plan rows (set pair `rows_p`, source device `rows_src`,
        destination device `rows_dst`), in canonical order (`Piece.sort_key`)."""
        inv_a = _inverse(src_placement)
        inv_b = _inverse(dst_placement)
        out: list[Piece] = []
        keys = self.kidx.keys
        for r in range(len(rows_p)):
            p = int(rows_p[r])
            s, d = int(rows_src[r]), int(rows_dst[r])
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

    def flows(self, rows_p: np.ndarray, rows_src: np.ndarray, rows_dst: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Network elements of the plan rows per (src, dst, kind): arrays (src, dst, kind
        index into KINDS, elements), sorted by (src, dst, kind)."""
        net = np.flatnonzero(rows_src != rows_dst)
        p = rows_p[net]
        nk = self.p_kinds()[p]
        rr = np.repeat(np.arange(len(net)), nk)
        first = np.repeat(np.cumsum(nk) - nk, nk)
        kind_of = np.array([[KINDS.index(k) for k in ks] + [0] * (4 - len(ks))
                            for ks in self.class_kinds], np.int64)
        kind = kind_of[self.p_cls[p[rr]], np.arange(len(rr)) - first]
        src, dst = rows_src[net][rr], rows_dst[net][rr]
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


def split_bucket(bucket_size: BucketSize) -> tuple[Optional[int], Optional[int]]:
    """(source, destination) DDP bucket sizes from one size for both or a pair."""
    if isinstance(bucket_size, tuple):
        if len(bucket_size) != 2:
            raise RoutingError(f"bucket_size tuple must be (src, dst), got {bucket_size}")
        return bucket_size[0], bucket_size[1]
    return bucket_size, bucket_size


def norm_kinds(kinds: Sequence[str]) -> tuple[str, ...]:
    """`kinds` (one name or several) as a tuple in `KINDS` order; unknown kinds refused."""
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
    kinds = norm_kinds(kinds)
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


def clear_geometry_caches() -> None:
    """Drop the memoised geometries and local-placement tables."""
    geometry.cache_clear()
    _local_map.cache_clear()


__all__ = ["BucketSize", "Geometry", "geometry", "refined", "split_bucket", "norm_kinds",
           "clear_geometry_caches"]
