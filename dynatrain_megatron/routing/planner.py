"""The planner: which device sends which box of which tensor to which device.

`build_plan(spec, (layout_A, placement_A), (layout_B, placement_B))` is a pure function
of its (frozen, hashable) arguments, memoised, and identical on every rank: no metadata is
exchanged, every rank computes the same plan from the same layouts.

A plan is made in two halves, neither of which loops over ranks or rank pairs:

1. **Geometry** (`geometry`, independent of placements, cached per layout pair): the
   intersections of A's and B's regions grouped into set pairs, refined into parts where
   several holders could share the sending.
2. **Devices** (`sources`, per placement pair): one row per (set pair part, destination
   device), each with a local copy or a chosen source; then the statistics and bounds
   (`plan_stats`). Every destination receives each byte exactly once, so bytes moved ==
   the lower bound, which `Plan` checks at construction.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import numpy as np

from ..vps.analytic import analytic_layout
from ..vps.fragment import KINDS
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.naming import chunk_param_specs, logical_tensors
from ..vps.placement import Placement
from .geometry import BucketSize, Geometry, clear_geometry_caches, geometry, norm_kinds, \
    refined, split_bucket
from .plan import Plan
from .plan_stats import plan_stats
from .regions import RoutingError, key_index, region_table
from .sources import assign

Side = tuple[Layout, Optional[Placement]]


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
    bs, bd = split_bucket(bucket_size)
    bad = sorted(set(unavailable) - set(pa.devices))
    if bad:
        raise RoutingError(f"unavailable devices {bad} are not devices of layout A {la}")
    return _build_plan(spec, la, pa, lb, pb, norm_kinds(kinds), ranks_per_node, bs, bd,
                       tuple(sorted(set(unavailable))))


@functools.lru_cache(maxsize=32)
def _build_plan(spec, la, pa, lb, pb, kinds, rpn, bs, bd, unavailable=()) -> Plan:
    geom = geometry(spec, la, lb, kinds, bs, bd)
    return plan_for(geom, pa, pb, rpn, unavailable)


def _without_sources(geom: Geometry, pa: Placement, unavailable: Sequence[int]) -> Geometry:
    """`geom` whose source holder sets leave out the virtual ranks on `unavailable`
    devices; refuses when some state then has no holder left (it died with them)."""
    gone = frozenset(v for v, d in enumerate(pa.devices) if d in set(unavailable))
    out = geom.without_sources(gone)
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
    stats, tr = plan_stats(geom, rp, rdst, rsrc, forced, no_same, rpn, pa, pb)
    return Plan(geom.spec, geom.src_layout, pa, geom.dst_layout, pb, geom.kinds, rpn, geom,
                rp, rdst, rsrc, stats, tr)


def clear_caches() -> None:
    """Drop every memoised table and plan (for cold-start timings)."""
    clear_geometry_caches()
    for f in (_build_plan, region_table, key_index, analytic_layout, chunk_param_specs,
              logical_tensors):
        f.cache_clear()


__all__ = ["Side", "build_plan", "plan_for", "clear_caches"]
