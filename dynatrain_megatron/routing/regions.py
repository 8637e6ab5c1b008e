"""Region tables: what a layout holds of every logical tensor, as boxes with holder sets.

The planner never loops over ranks or rank pairs. For one layout and one *kind class*
(`param`: the model weights; `opt`: main params and both Adam moments, which share one
geometry), the state of every logical tensor is a list of **regions**: disjoint boxes
that tile the tensor (vocab padding excluded), each held identically by a **holder set**
of virtual ranks:

    param  region = one TP (expert-TP) block, held by every DP (expert-DP) replica and,
                    for TP-replicated tensors, by every TP rank of the stage;
    opt    region = one box of the part of a TP-local tensor that one distributed-optimizer
                    shard owns, held by that shard's rank in every *copy* (module doc of
                    `vps.analytic`: TP-replicated tensors keep one copy per TP rank).
           without the distributed optimizer (`ModelSpec.distributed_optimizer`
                    False) every replica of a weight holds its whole optimizer state: the
                    `opt` regions are the `param` regions.

Holder sets are arithmetic progressions of virtual ranks (`base + s1*i + s2*j`), interned,
so a table for Qwen3-235B on 4096 ranks has ~1e5 regions and a few thousand sets, built
with numpy in tens of milliseconds. Tied embeddings (the last stage's output layer is a
second copy of the embedding with its own optimizer shards) give a tensor two different
partitions; the source side refines them into common atoms held by the union of holders.

Geometry is 2-D throughout: a 1-D tensor `[n]` is viewed as `[n, 1]`. Every region is
*flat-contiguous inside its column band* (the band is the TP block of a row-parallel
weight, else the whole width), which makes the regions of a band sorted by start also
sorted by end: the join below is two `searchsorted` calls, not a pairwise loop.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..vps.analytic import analytic_layout
from ..vps.errors import DynatrainError
from ..vps.layout import Layout, RankCoords
from ..vps.model_spec import ModelSpec
from ..vps.naming import chunk_param_specs, local_blocks

PARAM, OPT = "param", "opt"
CLASSES = (PARAM, OPT)
_SHIFT = 31  # rows of a 2-D view stay below 2**31
# grouped experts ("ecols") are column blocks like "cols", plus a row block per EP rank
# (`_ep_row_shift`): their one logical tensor per layer holds every expert
_RULE = {"rep": 0, "rows": 1, "cols": 2, "glu": 3, "vocab": 4, "ecols": 2}


class RoutingError(DynatrainError, ValueError):
    """A plan, placement or schedule cannot be built (bad input or an internal check)."""


# ---------------------------------------------------------------------------------------
# logical tensors as integers
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class KeyIndex:
    """Integer ids of the logical tensors of a model (model order) and their 2-D views."""

    keys: tuple[str, ...]
    ids: dict[str, int]
    ndim: np.ndarray
    nrows: np.ndarray
    ncols: np.ndarray
    numel: np.ndarray
    cols_axis: np.ndarray  # 0: not split along dim 1; 1: split over tp; 2: over etp
    expert_stride: np.ndarray  # expert keys: id(expert g+1) - id(expert g); else 0

    def expert_ids(self, p, ep: int) -> np.ndarray:
        """Key ids of ParamSpec `p` on EP ranks 0..ep-1 (arithmetic, no string formatting)."""
        k0 = self.ids[p.logical_key(0)]
        if not p.is_expert:
            return np.array([k0], np.int64)
        return k0 + self.expert_stride[k0] * p.num_local_experts * np.arange(ep, dtype=np.int64)

    def band_width(self, layout: Layout) -> np.ndarray:
        """Column width of each key's bands in `layout` (its TP blocks of dim 1)."""
        n = np.where(self.cols_axis == 1, layout.tp, np.where(self.cols_axis == 2,
                                                               layout.etp, 1))
        return self.ncols // n

    def box(self, key_id: int, r0: int, r1: int, c0: int, c1: int):
        from ..vps.box import Box
        if self.ndim[key_id] == 1:
            return Box((r0,), (r1 - r0,))
        return Box((r0, c0), (r1 - r0, c1 - c0))


@functools.lru_cache(maxsize=16)
def key_index(spec: ModelSpec) -> KeyIndex:
    """Logical tensors in model order (the order of `vps.naming.logical_tensors`).

    Built from one layer template per layer with one expert per EP rank (ep = #experts),
    expanding the expert keys, which is ~100x faster than materialising a tp1pp1 chunk
    with every expert of a 128-expert model.
    """
    E = spec.num_moe_experts or 1
    lay = Layout(dp=E, ep=E, etp=1) if spec.is_moe else Layout()
    keys: list[str] = []
    shapes: list[tuple[int, ...]] = []
    cols: list[int] = []
    stride: list[int] = []
    seen: set[str] = set()
    specs = chunk_param_specs(spec, lay, 0, 0)
    i = 0
    while i < len(specs):
        p = specs[i]
        if p.local_expert >= 0:  # the run of one expert's params, repeated for every expert
            j = i  # the experts of one layer are consecutive (norms separate layers)
            while j < len(specs) and specs[j].local_expert >= 0:
                j += 1
            group = specs[i:j]
            keys += [q.key.format(e=e) for e in range(E) for q in group]
            shapes += [q.logical_shape for q in group] * E
            cols += [_cols_axis(q) for q in group] * E
            stride += [len(group)] * (len(group) * E)
            i = j
            continue
        if p.key not in seen:
            seen.add(p.key)
            keys.append(p.key)
            shapes.append(p.logical_shape)
            cols.append(_cols_axis(p))
            stride.append(0)
        i += 1
    for k, shp in zip(keys, shapes):
        if len(shp) not in (1, 2):
            raise RoutingError(f"logical tensor {k} has shape {shp}: the planner handles "
                               f"1-D and 2-D tensors")
    nd = np.array([len(t) for t in shapes], np.int64)
    nr = np.array([t[0] for t in shapes], np.int64)
    nc = np.array([t[1] if len(t) == 2 else 1 for t in shapes], np.int64)
    if len(keys) and nr.max() >= 2 ** _SHIFT:
        raise RoutingError("a logical tensor has more than 2**31 rows")
    return KeyIndex(tuple(keys), {k: i for i, k in enumerate(keys)}, nd, nr, nc, nr * nc,
                    np.array(cols, np.int64), np.array(stride, np.int64))


def _cols_axis(p) -> int:
    return 0 if p.rule not in ("cols", "ecols") else (1 if p.axis == "tp" else 2)


def _ep_row_shift(p, ep: int) -> np.ndarray:
    """Rows to add to a local box of `p` on EP ranks 0..ep-1: grouped experts ("ecols")
    hold the EP rank's row block of one logical tensor; other expert weights change key
    with the EP rank instead (`KeyIndex.expert_ids`)."""
    n = np.arange(ep, dtype=np.int64)
    return n * p.local_shape[0] if p.rule == "ecols" else n * 0


# ---------------------------------------------------------------------------------------
# holder sets
# ---------------------------------------------------------------------------------------
class HolderSets:
    """Interned sets of virtual ranks: progressions `base + s1*i + s2*j` (i < n1, j < n2),
    plus unions (tied embeddings). Ids are dense ints; `members(id)` is sorted."""

    def __init__(self) -> None:
        self.patterns: list[tuple[int, int, int, int]] = []
        self._pattern_id: dict[tuple[int, int, int, int], int] = {}
        self._offsets: list[np.ndarray] = []
        self.pid = np.zeros(0, np.int64)
        self.base = np.zeros(0, np.int64)
        self._union: dict[int, np.ndarray] = {}
        self._union_id: dict[tuple[int, int], int] = {}

    def pattern(self, s1: int, n1: int, s2: int = 0, n2: int = 1) -> int:
        t = (s1 if n1 > 1 else 0, n1, s2 if n2 > 1 else 0, n2)
        got = self._pattern_id.get(t)
        if got is None:
            got = self._pattern_id[t] = len(self.patterns)
            self.patterns.append(t)
            off = (np.arange(t[1], dtype=np.int64)[None, :] * t[0]
                   + np.arange(t[3], dtype=np.int64)[:, None] * t[2]).ravel()
            self._offsets.append(np.sort(off))
        return got

    def intern(self, pid: np.ndarray, base: np.ndarray) -> np.ndarray:
        """Set ids of (pattern, base) pairs (vectorised); called once, before any union."""
        if len(self.pid) or self._union:
            raise RoutingError("HolderSets.intern may be called only once")
        if not len(pid):
            return np.zeros(0, np.int64)
        nb = int(base.max()) + 1
        u, inv = np.unique(pid.astype(np.int64) * nb + base, return_inverse=True)
        self.pid, self.base = u // nb, u % nb
        return inv.astype(np.int64).ravel()

    def union(self, a: int, b: int) -> int:
        if a == b:
            return a
        k = (min(a, b), max(a, b))
        got = self._union_id.get(k)
        if got is None:
            got = len(self.pid) + len(self._union)
            self._union[got] = np.union1d(self.members(a), self.members(b))
            self._union_id[k] = got
        return got

    def __len__(self) -> int:
        return len(self.pid) + len(self._union)

    def size(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        out = np.zeros(len(ids), np.int64)
        prog = ids < len(self.pid)
        sizes = np.array([len(o) for o in self._offsets], np.int64)
        out[prog] = sizes[self.pid[ids[prog]]]
        for i in np.flatnonzero(~prog):
            out[i] = len(self._union[int(ids[i])])
        return out

    def members(self, i: int) -> np.ndarray:
        if i < len(self.pid):
            return self.base[i] + self._offsets[self.pid[i]]
        return self._union[i]

    def csr(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, members) of the sets `ids`, concatenated in order (vectorised)."""
        ids = np.asarray(ids, np.int64)
        sizes = self.size(ids)
        offs = np.zeros(len(ids) + 1, np.int64)
        np.cumsum(sizes, out=offs[1:])
        out = np.empty(int(offs[-1]), np.int64)
        prog = ids < len(self.pid)
        pids = np.full(len(ids), -1, np.int64)
        pids[prog] = self.pid[ids[prog]]
        for p in np.unique(pids[prog]):
            sel = np.flatnonzero(pids == p)
            o = self._offsets[p]
            vals = self.base[ids[sel]][:, None] + o[None, :]
            pos = offs[sel][:, None] + np.arange(len(o))[None, :]
            out[pos.ravel()] = vals.ravel()
        for i in np.flatnonzero(~prog):
            out[offs[i]:offs[i + 1]] = self._union[int(ids[i])]
        return offs, out


# ---------------------------------------------------------------------------------------
# region tables
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RegionTable:
    """Regions of one layout and kind class, sorted by (key, band, r0, c0).

    `band_width[key]` is the column width of the key's bands in this layout.
    """

    layout: Layout
    cls: str
    key: np.ndarray
    r0: np.ndarray
    r1: np.ndarray
    c0: np.ndarray
    c1: np.ndarray
    hset: np.ndarray
    band_width: np.ndarray
    holders: HolderSets

    def __len__(self) -> int:
        return len(self.key)

    @property
    def numel(self) -> np.ndarray:
        return (self.r1 - self.r0) * (self.c1 - self.c0)


class _Emitter:
    """Columns of regions under construction: (pattern, base) name the holder set."""

    def __init__(self) -> None:
        self.cols: dict[str, list[np.ndarray]] = {k: [] for k in
                                                  ("key", "r0", "r1", "c0", "c1", "pid",
                                                   "base", "copy")}

    def add(self, **kw: np.ndarray) -> None:
        n = max(np.size(v) for v in kw.values())
        for k, v in kw.items():
            self.cols[k].append(np.broadcast_to(np.asarray(v, np.int64), (n,)))

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: (np.concatenate(v) if v else np.zeros(0, np.int64))
                for k, v in self.cols.items()}


def _fake_coords(b: int, pp: int) -> RankCoords:
    return RankCoords(rank=0, tp=b, cp=0, dp=0, pp=pp, etp=b, ep=0, edp=0, dp_cp=0)


def _param_regions(spec: ModelSpec, L: Layout, hs: HolderSets, kidx: KeyIndex) -> _Emitter:
    rows: list[tuple[int, ...]] = []
    vec: list[tuple] = []
    memo: dict[tuple, list[tuple[int, int, int, int]]] = {}
    TP, ETP, EP, EDP, DPCP = L.tp, L.etp, L.ep, L.edp, L.dp_cp
    al = analytic_layout(spec, L)
    ids = kidx.ids
    for pp in range(L.pp):
        for ch in range(L.vpp):
            for p in al.chunk_params(pp, ch):
                rep = p.rule == "rep"
                n = 1 if rep else (TP if p.axis == "tp" else ETP)
                cp = int(p.tied_copy)
                if p.is_expert:
                    keys = kidx.expert_ids(p, EP)
                    erange = np.arange(EP, dtype=np.int64)
                    rsh = _ep_row_shift(p, EP)
                for b in range(n):
                    mk = (p.rule, p.local_shape, p.logical_shape, b)
                    boxes = memo.get(mk)
                    if boxes is None:
                        boxes = memo[mk] = _block_boxes(p, spec, L, b, pp)
                    if p.is_expert:
                        if rep:
                            pid, sb = hs.pattern(1, ETP, ETP * EP, EDP), 0
                        else:
                            pid, sb = hs.pattern(ETP * EP, EDP), b
                        base = sb + ETP * (erange + EP * EDP * pp)
                        for bx in boxes:
                            vec.append((keys, bx, pid, base, cp, rsh))
                        continue
                    if rep:
                        pid, base = hs.pattern(1, TP * DPCP), TP * DPCP * pp
                    else:
                        pid, base = hs.pattern(TP, DPCP), b + TP * DPCP * pp
                    k = ids[p.key]
                    for bx in boxes:
                        rows.append((k,) + bx + (pid, base, cp))
    em = _Emitter()
    if rows:
        a = np.array(rows, np.int64)
        em.add(key=a[:, 0], r0=a[:, 1], r1=a[:, 2], c0=a[:, 3], c1=a[:, 4], pid=a[:, 5],
               base=a[:, 6], copy=a[:, 7])
    if vec:
        n = np.array([len(v[0]) for v in vec])
        bx = np.repeat(np.array([v[1] for v in vec], np.int64), n, axis=0)
        sh = np.concatenate([v[5] for v in vec])
        em.add(key=np.concatenate([v[0] for v in vec]), r0=bx[:, 0] + sh, r1=bx[:, 1] + sh,
               c0=bx[:, 2], c1=bx[:, 3], pid=np.repeat([v[2] for v in vec], n),
               base=np.concatenate([v[3] for v in vec]), copy=np.repeat([v[4] for v in vec], n))
    return em


def _block_boxes(p, spec: ModelSpec, L: Layout, b: int, pp: int) -> list[tuple[int, ...]]:
    """(r0, r1, c0, c1) of the logical boxes of param `p` on TP/ETP coordinate `b`."""
    out = []
    for blk in local_blocks(p, spec, L, _fake_coords(b, pp)):
        o, sh = blk.logical.offsets, blk.logical.shape
        out.append((o[0], o[0] + sh[0]) + ((o[1], o[1] + sh[1]) if len(o) == 2 else (0, 1)))
    return out


def _flat_to_boxes(s: np.ndarray, e: np.ndarray, C: np.ndarray):
    """Head / full-rows / tail boxes of flat ranges [s, e) of row-major [*, C] tensors.

    Returns (index into the inputs, r0, r1, c0, c1) of every nonempty box."""
    rs, cs = np.divmod(s, C)
    re_, ce = np.divmod(e, C)
    same = rs == re_
    # one partial row
    i1 = np.flatnonzero(same)
    parts = [(i1, rs[i1], rs[i1] + 1, cs[i1], ce[i1])]
    d = np.flatnonzero(~same)
    h = d[cs[d] > 0]
    parts.append((h, rs[h], rs[h] + 1, cs[h], C[h]))
    mstart = rs[d] + (cs[d] > 0)
    m = d[re_[d] > mstart]
    parts.append((m, (rs + (cs > 0))[m], re_[m], np.zeros(len(m), np.int64), C[m]))
    t = d[ce[d] > 0]
    parts.append((t, re_[t], re_[t] + 1, np.zeros(len(t), np.int64), ce[t]))
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(5))


def _opt_regions(spec: ModelSpec, L: Layout, bucket_size: Optional[int], hs: HolderSets,
                 kidx: KeyIndex) -> _Emitter:
    if not spec.distributed_optimizer:  # held exactly where the weights are
        return _param_regions(spec, L, hs, kidx)
    em = _Emitter()
    TP, ETP, EP, EDP, DPCP = L.tp, L.etp, L.ep, L.edp, L.dp_cp
    al = analytic_layout(spec, L, bucket_size)
    single = hs.pattern(0, 1)
    for pp in range(L.pp):
        for ch in range(L.vpp):
            specs = {p.local_name: p for p in al.chunk_params(pp, ch)}
            for buf in al.buffers(pp, ch):
                _buffer_regions(em, buf, specs, kidx, hs, L, pp, single, TP, ETP, EP, EDP,
                                DPCP)
    return em


def _buffer_regions(em, buf, specs, kidx, hs, L, pp, single, TP, ETP, EP, EDP, DPCP):
    S = buf.shard_size
    ps = [specs[q.local_name] for q in buf.params]
    if not ps:
        return
    P = len(ps)
    start = np.fromiter((q.start for q in buf.params), np.int64, P)
    numel = np.fromiter((q.numel for q in buf.params), np.int64, P)
    bk = np.fromiter((q.bucket for q in buf.params), np.int64, P)
    boff = np.array([b.offset for b in buf.buckets], np.int64)[bk]
    q = (np.array([b.numel for b in buf.buckets], np.int64) // S)[bk]
    R = np.array([p.local_shape[0] for p in ps], np.int64)
    C = np.array([p.local_shape[1] if len(p.local_shape) == 2 else 1 for p in ps], np.int64)
    rule = np.array([_RULE[p.rule] for p in ps], np.int64)
    rep = rule == 0
    nblk = np.array([1 if p.rule == "rep" else (TP if p.axis == "tp" else ETP) for p in ps],
                    np.int64)
    expert = np.array([p.is_expert for p in ps], bool)
    copy = np.array([p.tied_copy for p in ps], np.int64)
    lrows = np.array([p.logical_shape[0] for p in ps], np.int64)  # vocab: V; glu: 2F
    # shard ranges: [s, e) flat, local to the param
    klo = (start - boff) // q
    khi = (start + numel - 1 - boff) // q
    cnt = khi - klo + 1
    pi = np.repeat(np.arange(P), cnt)
    first = np.repeat(np.cumsum(cnt) - cnt, cnt)
    k = klo[pi] + np.arange(len(pi)) - first
    s = np.maximum(start[pi], boff[pi] + k * q[pi]) - start[pi]
    e = np.minimum(start[pi] + numel[pi], boff[pi] + (k + 1) * q[pi]) - start[pi]
    ix, r0, r1, c0, c1 = _flat_to_boxes(s, e, C[pi])
    pi, k = pi[ix], k[ix]
    # blocks: one per TP/ETP coordinate of split params
    nb = nblk[pi]
    j = np.repeat(np.arange(len(pi)), nb)
    b = np.arange(len(j)) - np.repeat(np.cumsum(nb) - nb, nb)
    pi, k, r0, r1, c0, c1 = pi[j], k[j], r0[j], r1[j], c0[j], c1[j]
    ru, Rp, Cp = rule[pi], R[pi], C[pi]
    # local -> logical
    r0 = r0 + np.where((ru == 1) | (ru == 4), b * Rp, 0)
    r1 = r1 + np.where((ru == 1) | (ru == 4), b * Rp, 0)
    c0 = c0 + np.where(ru == 2, b * Cp, 0)
    c1 = c1 + np.where(ru == 2, b * Cp, 0)
    keep = np.ones(len(pi), bool)
    vocab = ru == 4
    r1 = np.where(vocab, np.minimum(r1, lrows[pi]), r1)
    keep &= r1 > r0
    glu = np.flatnonzero(ru == 3)
    if len(glu):
        half = Rp[glu] // 2
        F = lrows[pi[glu]] // 2
        a0, a1 = r0[glu], np.minimum(r1[glu], half)  # gate part
        g0, g1 = np.maximum(r0[glu], half), r1[glu]  # up part
        keep[glu] = False
        m1, m2 = a1 > a0, g1 > g0
        sel = np.concatenate([glu[m1], glu[m2]])
        add_r0 = np.concatenate([(a0 + b[glu] * half)[m1], (g0 - half + F + b[glu] * half)[m2]])
        add_r1 = np.concatenate([(a1 + b[glu] * half)[m1], (g1 - half + F + b[glu] * half)[m2]])
        idx = np.concatenate([np.flatnonzero(keep), sel])
        r0 = np.concatenate([r0[keep], add_r0])
        r1 = np.concatenate([r1[keep], add_r1])
        pi, k, c0, c1, b = pi[idx], k[idx], c0[idx], c1[idx], b[idx]
    else:
        pi, k, r0, r1, c0, c1, b = (x[keep] for x in (pi, k, r0, r1, c0, c1, b))
    # holder sets and keys; with several distributed-optimizer instances the shard k of
    # instance i sits at data-parallel index k + S*i: one more progression dimension
    I = L.doi
    if buf.is_expert:
        base0 = ETP * EP * (k + EDP * pp)  # + ETP*e (+ b for split)
        estride = ETP
        istride = ETP * EP * S
    else:
        base0 = TP * (k + DPCP * pp)
        estride = 0
        istride = TP * S
    # every EP rank holds the same expert buffer with its own experts
    ne = EP if buf.is_expert else 1
    keys2d = np.stack([kidx.expert_ids(p, ne)[:ne] if p.is_expert else
                       np.full(ne, kidx.ids[p.key], np.int64) for p in ps])
    shift2d = np.stack([_ep_row_shift(p, ne) for p in ps])
    for sel_rep in (False, True):
        for sel_exp in (False, True):
            m = (rep[pi] == sel_rep) & (expert[pi] == sel_exp)
            if not m.any():
                continue
            if buf.is_expert:
                pid = hs.pattern(1, ETP, istride, I) if sel_rep else hs.pattern(istride, I)
            elif sel_exp:  # expert weights in the dense buffer (EP = 1)
                pid = (hs.pattern(1, TP, istride, I) if sel_rep
                       else hs.pattern(ETP, TP // ETP, istride, I))
            else:
                pid = hs.pattern(1, TP, istride, I) if sel_rep else hs.pattern(istride, I)
            bb = base0[m] + (0 if sel_rep else b[m])
            mp = pi[m]
            ne = keys2d.shape[1] if sel_exp else 1
            n = len(mp)
            ee = np.tile(np.arange(ne, dtype=np.int64), n)
            rr = np.repeat(np.arange(n), ne)
            rs = shift2d[mp[rr], ee]
            em.add(key=keys2d[mp[rr], ee], r0=r0[m][rr] + rs, r1=r1[m][rr] + rs, c0=c0[m][rr],
                   c1=c1[m][rr], pid=pid, base=bb[rr] + estride * ee, copy=copy[mp[rr]])


def _sort(key, band, r0, c0) -> np.ndarray:
    return np.lexsort((c0, r0, band, key))


@functools.lru_cache(maxsize=64)
def region_table(spec: ModelSpec, layout: Layout, bucket_size: Optional[int],
                 cls: str, refine: bool) -> RegionTable:
    """The regions of `layout` for kind class `cls` (`param` or `opt`).

    `refine=True` (the source side) merges tied copies into atoms held by both copies;
    without it (the destination side) each copy keeps its own regions.
    """
    if cls not in CLASSES:
        raise RoutingError(f"unknown kind class {cls!r}; known: {CLASSES}")
    analytic_layout(spec, layout, bucket_size)  # validates the layout against the model
    kidx = key_index(spec)
    hs = HolderSets()
    band = kidx.band_width(layout)
    if cls == PARAM:
        em = _param_regions(spec, layout, hs, kidx)
    else:
        em = _opt_regions(spec, layout, bucket_size, hs, kidx)
    a = em.arrays()
    hset = hs.intern(a["pid"], a["base"])
    key, r0, r1, c0, c1, copy = a["key"], a["r0"], a["r1"], a["c0"], a["c1"], a["copy"]
    if refine and copy.any():
        key, r0, r1, c0, c1, hset = _refine(key, r0, r1, c0, c1, hset, copy, band, hs)
    order = _sort(key, c0 // band[key], r0, c0)
    t = RegionTable(layout, cls, key[order], r0[order], r1[order], c0[order], c1[order],
                    hset[order], band, hs)
    _check_band_order(t)
    return t


def _refine(key, r0, r1, c0, c1, hset, copy, band, hs):
    tied = np.unique(key[copy == 1])
    inv = np.isin(key, tied)
    a = ~inv
    m0, m1 = inv & (copy == 0), inv & (copy == 1)
    o0 = np.flatnonzero(m0)
    o0 = o0[_sort(key[o0], c0[o0] // band[key[o0]], r0[o0], c0[o0])]
    ia, ib, R0, R1, C0, C1 = join_boxes(key[o0], r0[o0], r1[o0], c0[o0], c1[o0], band,
                                        key[m1], r0[m1], r1[m1], c0[m1], c1[m1])
    h0, h1 = hset[o0][ia], hset[m1][ib]
    hu = np.array([hs.union(int(x), int(y)) for x, y in zip(h0, h1)], np.int64)
    kk = key[o0][ia]
    return (np.concatenate([key[a], kk]), np.concatenate([r0[a], R0]),
            np.concatenate([r1[a], R1]), np.concatenate([c0[a], C0]),
            np.concatenate([c1[a], C1]), np.concatenate([hset[a], hu]))


def _check_band_order(t: RegionTable) -> None:
    """The join relies on: within a (key, band), r0 and r1 are both non-decreasing."""
    if len(t) < 2:
        return
    band = t.c0 // t.band_width[t.key]
    same = (t.key[1:] == t.key[:-1]) & (band[1:] == band[:-1])
    if np.any(same & (t.r1[1:] < t.r1[:-1])):  # pragma: no cover - invariant
        raise RoutingError(f"regions of layout {t.layout} ({t.cls}) are not flat-contiguous "
                           f"within their column bands")


# ---------------------------------------------------------------------------------------
# the join
# ---------------------------------------------------------------------------------------
def join_boxes(akey, ar0, ar1, ac0, ac1, aband_width, bkey, br0, br1, bc0, bc1):
    """All overlapping (a, b) pairs of boxes of the same key, and their intersections.

    The a side is a partition sorted by (key, band, r0, c0) with flat-contiguous boxes
    inside each band (`aband_width[key]` columns); b is any list of boxes.
    Returns (ia, ib, r0, r1, c0, c1), ordered by b then a.
    """
    e = np.zeros(0, np.int64)
    if not len(akey) or not len(bkey):
        return e, e, e, e, e, e
    w = aband_width
    maxb = int(max(((ac1 + w[akey] - 1) // w[akey]).max(),
                   ((bc1 + w[bkey] - 1) // w[bkey]).max())) + 1
    aseg = akey * maxb + ac0 // w[akey]
    k0 = (aseg << _SHIFT) | ar0
    k1 = (aseg << _SHIFT) | ar1
    # each b box searches the a bands its columns overlap
    j0 = bc0 // w[bkey]
    j1 = (bc1 - 1) // w[bkey]
    nb = j1 - j0 + 1
    ib = np.repeat(np.arange(len(bkey)), nb)
    band = j0[ib] + np.arange(len(ib)) - np.repeat(np.cumsum(nb) - nb, nb)
    seg = bkey[ib] * maxb + band
    lo = np.searchsorted(k1, (seg << _SHIFT) | br0[ib], side="right")
    hi = np.searchsorted(k0, (seg << _SHIFT) | br1[ib], side="left")
    n = np.maximum(hi - lo, 0)
    jb = np.repeat(ib, n)
    ia = np.repeat(lo, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    r0 = np.maximum(ar0[ia], br0[jb])
    r1 = np.minimum(ar1[ia], br1[jb])
    c0 = np.maximum(ac0[ia], bc0[jb])
    c1 = np.minimum(ac1[ia], bc1[jb])
    ok = (r1 > r0) & (c1 > c0)
    return ia[ok], jb[ok], r0[ok], r1[ok], c0[ok], c1[ok]


__all__ = ["PARAM", "OPT", "CLASSES", "RoutingError", "KeyIndex", "key_index", "HolderSets",
           "RegionTable", "region_table", "join_boxes"]
