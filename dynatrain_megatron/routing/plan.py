"""Transition plans: pieces, statistics, and the lazy per-device view of a plan.

A `Plan` is what `planner.build_plan` returns: for every destination device, which box of
which logical tensor (and state kind) it receives from which source device, or copies
locally. It is stored compactly (see planner: *set pairs*, i.e. groups of region
intersections with the same source and destination holder sets, and one row per
(set pair, destination device)); `pieces_for(device)` materialises only what one device
sends, receives and copies, so every rank can plan alone at any scale.

Ordering contract (the executor relies on it): `pieces_for`, `Round.sends` and
`Round.recvs` list pieces in the canonical order `(kind, key, box offsets, src, dst)`
(`Piece.sort_key`), so a sender packs and a receiver unpacks the pieces of one
(src, dst) pair in the same order without exchanging any metadata.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..vps.analytic import analytic_layout
from ..vps.box import overlapping_pairs
from ..vps.fragment import KINDS
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.placement import Placement
from .geometry import Geometry
from .piece import Piece
from .regions import RoutingError


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Byte counts of a plan. Network bytes only, except `local_bytes`.

    `lower_bound_bytes` is computed independently of the source choice: the bytes every
    destination device needs minus those it already holds; `moved_bytes` equals it when
    the plan moves nothing twice and nothing that was already in place.
    `balance_bound_bytes` is a lower bound on any plan's largest per-device traffic
    for this placement: max over devices of what it must receive, and of what it must
    send because it holds the only copy, and `group_send_bound_bytes`: for every
    source holder set, the bytes that must leave the set, shared evenly by its members.
    `group_send_inter_bound_bytes` is the same for the bytes that must leave over NICs
    (receivers with no holder on their node).
    """

    kinds: tuple[str, ...]
    moved_per_kind: tuple[tuple[str, int], ...]
    state_per_kind: tuple[tuple[str, int], ...]  # one copy of the logical state
    moved_bytes: int
    lower_bound_bytes: int
    local_bytes: int
    intra_node_bytes: int
    inter_node_bytes: int
    max_send_bytes: int
    max_recv_bytes: int
    max_send_intra_bytes: int
    max_send_inter_bytes: int
    max_recv_intra_bytes: int
    max_recv_inter_bytes: int
    max_traffic_bytes: int  # max over devices of max(send, recv)
    balance_bound_bytes: int
    group_send_bound_bytes: int
    group_send_inter_bound_bytes: int
    num_pieces: int
    num_local_pieces: int
    num_src_devices: int
    num_dst_devices: int

    @property
    def moved(self) -> dict[str, int]:
        return dict(self.moved_per_kind)

    @property
    def state(self) -> dict[str, int]:
        return dict(self.state_per_kind)

    def moved_fraction(self, kinds: Sequence[str]) -> float:
        """Bytes moved of `kinds` over one copy of their logical state."""
        st = sum(self.state.get(k, 0) for k in kinds)
        return sum(self.moved.get(k, 0) for k in kinds) / st if st else 0.0


@dataclass(frozen=True, eq=False)
class DeviceTraffic:
    """Per-device byte arrays of a plan, indexed by device id (0 .. max device)."""

    send_intra: np.ndarray
    send_inter: np.ndarray
    recv_intra: np.ndarray
    recv_inter: np.ndarray
    local: np.ndarray
    recv_inter_min: np.ndarray  # bytes with no source on the receiver's node
    forced_send_intra: np.ndarray  # bytes a device sends as the only holder
    forced_send_inter: np.ndarray

    @property
    def send(self) -> np.ndarray:
        return self.send_intra + self.send_inter

    @property
    def recv(self) -> np.ndarray:
        return self.recv_intra + self.recv_inter


@dataclass(frozen=True, eq=False)
class Plan:
    """A transition plan (see module doc). Built by `planner.build_plan`; immutable.

    Compact form: `rows_*` has one row per (set pair, destination device): the set pair
    `rows_p`, destination `rows_dst`, chosen source `rows_src` (== rows_dst: local copy).
    """

    spec: ModelSpec
    src_layout: Layout
    src_placement: Placement
    dst_layout: Layout
    dst_placement: Placement
    kinds: tuple[str, ...]
    ranks_per_node: int
    geometry: Geometry
    rows_p: np.ndarray
    rows_dst: np.ndarray
    rows_src: np.ndarray
    stats: PlanStats
    traffic: DeviceTraffic
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        errs = []
        for side, lay, pl in (("src", self.src_layout, self.src_placement),
                              ("dst", self.dst_layout, self.dst_placement)):
            if len(pl.devices) != lay.world_size:
                errs.append(f"{side} placement has {len(pl.devices)} devices, layout {lay} "
                            f"has {lay.world_size} ranks")
        if not self.kinds or any(k not in KINDS for k in self.kinds):
            errs.append(f"kinds must be a non-empty subset of {KINDS}, got {self.kinds}")
        if self.ranks_per_node < 1:
            errs.append(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        n = len(self.rows_p)
        if len(self.rows_dst) != n or len(self.rows_src) != n:
            errs.append(f"rows of different lengths: {n} set pairs, {len(self.rows_dst)} "
                        f"destinations, {len(self.rows_src)} sources")
        else:
            if n and not np.isin(self.rows_dst, self.dst_placement.devices).all():
                errs.append("a row's destination is not a device of layout B")
            net = self.rows_src != self.rows_dst
            if net.any() and not np.isin(self.rows_src[net], self.src_placement.devices).all():
                errs.append("a row's source is not a device of layout A")
            if n and (self.rows_p.min() < 0 or self.rows_p.max() >= self.geometry.num_set_pairs):
                errs.append("a row's set pair is outside the geometry")
        if self.stats.moved_bytes != self.stats.lower_bound_bytes:
            errs.append(f"moves {self.stats.moved_bytes} B, lower bound "
                        f"{self.stats.lower_bound_bytes} B (something moves twice)")
        if errs:
            raise RoutingError(f"plan {self.src_layout} -> {self.dst_layout}: "
                               + "; ".join(errs))

    def __repr__(self) -> str:
        return (f"Plan({self.spec.name!r}, {self.src_layout} -> {self.dst_layout}, "
                f"kinds={list(self.kinds)}, moved={self.stats.moved_bytes} B, "
                f"pieces={self.stats.num_pieces}+{self.stats.num_local_pieces} local)")

    # ------------------------------------------------------------------ devices
    @property
    def src_devices(self) -> tuple[int, ...]:
        return self.src_placement.devices

    @property
    def dst_devices(self) -> tuple[int, ...]:
        return self.dst_placement.devices

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.src_devices) | set(self.dst_devices)))

    def node(self, device: int) -> int:
        return device // self.ranks_per_node

    def itemsize(self, kind: str) -> int:
        return self.geometry.itemsize[kind]

    # ------------------------------------------------------------------ pieces
    def _index(self, by: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        got = self._cache.get(by)
        if got is None:
            if by == "dst":
                dev, sel = self.rows_dst, np.arange(len(self.rows_dst))
            else:  # network rows by source
                sel = np.flatnonzero(self.rows_src != self.rows_dst)
                dev = self.rows_src[sel]
            order = np.argsort(dev, kind="stable")
            got = (dev[order], sel[order], order)
            self._cache[by] = got
        return got

    def _rows_of(self, device: int, by: str) -> np.ndarray:
        dev, sel, _ = self._index(by)
        lo, hi = np.searchsorted(dev, device, "left"), np.searchsorted(dev, device, "right")
        return sel[lo:hi]

    def pieces_for(self, device: int, role: str = "all") -> list[Piece]:
        """Pieces `device` receives or copies (`role="dst"`), sends (`"src"`), or all of
        them (local copies once), in canonical order."""
        if role not in ("all", "dst", "src"):
            raise RoutingError(f"pieces_for: role must be all, dst or src, got {role!r}")
        rows = []
        if role in ("all", "dst"):
            rows.append(self._rows_of(device, "dst"))
        if role in ("all", "src"):
            rows.append(self._rows_of(device, "src"))
        r = np.unique(np.concatenate(rows)) if rows else np.zeros(0, np.int64)
        return self._materialize(r)

    def local_pieces_for(self, device: int) -> list[Piece]:
        r = self._rows_of(device, "dst")
        r = r[self.rows_src[r] == self.rows_dst[r]]
        return self._materialize(r)

    def pieces(self, include_local: bool = True) -> list[Piece]:
        """Every piece of the plan (explicit: meant for small worlds and tests)."""
        r = np.arange(len(self.rows_p))
        if not include_local:
            r = r[self.rows_src != self.rows_dst]
        return self._materialize(r)

    def _materialize(self, r: np.ndarray) -> list[Piece]:
        return self.geometry.materialize(self.src_placement, self.dst_placement,
                                         self.rows_p[r], self.rows_src[r], self.rows_dst[r])

    def network_pieces_per_device(self, ndev: int) -> np.ndarray:
        """How many network pieces each device sends plus receives, counted on the
        geometry's rows (the scheduler's alignment padding bound)."""
        g = self.geometry
        net = self.rows_src != self.rows_dst
        cnt = (g.p_npairs() * g.p_kinds())[self.rows_p[net]]
        return (np.bincount(self.rows_src[net], weights=cnt, minlength=ndev)
                + np.bincount(self.rows_dst[net], weights=cnt, minlength=ndev)).astype(np.int64)

    # ------------------------------------------------------------------ flows
    def flows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Network traffic aggregated per (src, dst, kind): arrays (src, dst, kind index
        into KINDS, elements), sorted by (src, dst, kind)."""
        got = self._cache.get("flows")
        if got is None:
            got = self.geometry.flows(self.rows_p, self.rows_src, self.rows_dst)
            self._cache["flows"] = got
        return got


def _by_key(frags) -> dict[tuple[str, str], list]:
    out: dict[tuple[str, str], list] = defaultdict(list)
    for f in frags:
        out[(f.key, f.kind)].append(f)
    return out


def _inside(frags, p: Piece, side: str) -> bool:
    """Whether a fragment of `frags` contains `p`'s box at `p`'s local place (`side`)."""
    for f in frags:
        if f.box.contains(p.box):
            off = tuple(po - fo + lo for po, fo, lo in
                        zip(p.box.offsets, f.box.offsets, f.local_offsets))
            want = ((p.src_chunk, p.src_local_name, p.src_local_offsets) if side == "src"
                    else (p.dst_chunk, p.dst_local_name, p.dst_local_offsets))
            if (f.chunk, f.local_name, off) == want:
                return True
    return False


class _Checker:
    """The analytic layouts of a plan's two sides, fragments read per device on demand."""

    def __init__(self, plan: Plan) -> None:
        g = plan.geometry
        self.plan = plan
        self.al_a = analytic_layout(plan.spec, plan.src_layout, g.bucket_src)
        self.al_b = analytic_layout(plan.spec, plan.dst_layout, g.bucket_dst)
        self._src: dict[int, dict[tuple[str, str], list]] = {}

    def src_frags(self, device: int) -> dict[tuple[str, str], list]:
        got = self._src.get(device)
        if got is None:
            v = self.plan.src_placement.virtual_rank(device)
            got = self._src[device] = (_by_key(self.al_a.fragments(v, self.plan.kinds))
                                       if v is not None else {})
        return got

    def sends(self, device: int, pieces: Sequence[Piece]) -> list[str]:
        """The pieces `device` sends (of `pieces`): it holds each in layout A, at the
        stated place."""
        return [f"{p}: source device {device} does not hold it in layout A"
                for p in pieces if p.src_device == device and not p.is_local
                and not _inside(self.src_frags(device).get((p.key, p.kind), ()), p, "src")]

    def receives(self, device: int, pieces: Sequence[Piece]) -> list[str]:
        """The pieces `device` receives or copies (of `pieces`) tile its layout-B
        fragments exactly."""
        v = self.plan.dst_placement.virtual_rank(device)
        if v is None:
            return []
        errs: list[str] = []
        need = _by_key(self.al_b.fragments(v, self.plan.kinds))
        got = defaultdict(list)
        for p in pieces:
            if p.dst_device != device:
                continue
            got[(p.key, p.kind)].append(p)
            if not _inside(need.get((p.key, p.kind), ()), p, "dst"):
                errs.append(f"{p}: not inside a layout-B fragment of device {device}")
            if not _inside(self.src_frags(p.src_device).get((p.key, p.kind), ()), p, "src"):
                errs.append(f"{p}: source device {p.src_device} does not hold it in layout A")
            local_held = any(f.box.contains(p.box) for f in
                             self.src_frags(device).get((p.key, p.kind), ()))
            if local_held != p.is_local:
                errs.append(f"{p}: is_local={p.is_local} but destination holds it: "
                            f"{local_held}")
        for k, frs in need.items():
            boxes = [p.box for p in got.get(k, ())]
            vol = sum(b.numel for b in boxes)
            want = sum(f.box.numel for f in frs)
            ov = overlapping_pairs(boxes, 1)
            if ov:
                errs.append(f"device {device} {k[0]}/{k[1]}: pieces {ov[0][0]} and "
                            f"{ov[0][1]} overlap")
            elif vol != want:
                errs.append(f"device {device} {k[0]}/{k[1]}: pieces cover {vol} of {want} "
                            f"elements")
        for k in got:
            if k not in need:
                errs.append(f"device {device}: pieces of {k[0]}/{k[1]} it does not hold in B")
        return errs


def validate_plan(plan: Plan, max_errors: int = 50) -> list[str]:
    """Every violation of the plan's contract, checked against the analytic layouts
    fragment by fragment (explicit: every device's pieces, meant for small worlds and
    tests; a rank checks its own part with `device_plan_errors`):

      * the pieces received/copied by each destination device tile its layout-B
        fragments exactly (per key and kind: inside a fragment, no overlap, same volume),
        with the fragment's local placement;
      * every piece's source device holds the box in layout A, at the stated local place;
      * local pieces are exactly those whose destination already holds them.
    """
    check = _Checker(plan)
    errs: list[str] = []
    for d in plan.dst_devices:
        errs += check.receives(d, plan.pieces_for(d, "dst"))
        if len(errs) >= max_errors:
            return errs[:max_errors] + ["... (more errors not listed)"]
    return errs


def device_plan_errors(plan: Plan, device: int,
                       pieces: Optional[Sequence[Piece]] = None) -> list[str]:
    """`validate_plan`'s checks for one device's part of the plan: the pieces it
    receives or copies (as a destination of B) and those it sends. `pieces`: that
    device's pieces when already materialised (default `plan.pieces_for(device)`). The
    switch runs it on every rank before anything moves, so together the ranks check
    the whole plan."""
    check = _Checker(plan)
    pieces = plan.pieces_for(device) if pieces is None else pieces
    return check.receives(device, pieces) + check.sends(device, pieces)


__all__ = ["PlanStats", "DeviceTraffic", "Plan", "validate_plan", "device_plan_errors"]
