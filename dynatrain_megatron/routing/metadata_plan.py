"""Plans made from every rank's live metadata, for models the analytic layout does not describe.

The analytic planner (`planner.build_plan`) derives every rank's fragments from a model
spec, which is what lets it plan 235B moves without a model. A module the naming table does
not describe (multi-token prediction layers, a router's expert bias, ...) cannot be planned
that way; its state is still described, rank by rank, by megatron-core's own sharded
metadata (`adapters.live`). Here that metadata, gathered from every rank of A and of B
(`StateRecord`s: key, kind, global box, where it lives locally), becomes a plan with the
interface the scheduler and the executor use (`pieces_for`, `flows`, `stats`, ...):

* every box every device of B stores (every replica) is filled exactly once, from the same
  device where A holds it there (a local copy, so nothing already in place moves and the
  bytes moved are the lower bound), else from the A holders in turn, least loaded first;
* state of B that no device of A holds (outside `unavailable`) is an error, as is state A
  holds that B does not (it would be lost), or a tensor whose global shape differs;
* the result depends only on the records (sorted first), so every rank that gathered the
  same records makes the same plan alone.

Vocabulary padding rows are planned separately (`transition.vocab_padding`), as on the
analytic path. Pure: no torch, no megatron.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from ..vps.box import Box
from ..vps.fragment import KINDS
from .piece import Piece
from .regions import RoutingError


@dataclass(frozen=True, slots=True, order=True)
class StateRecord:
    """Box `box` (global coordinates) of logical tensor `key`, state `kind`, stored on
    `device` in model chunk `chunk`'s parameter `local_name` at `local_offsets`;
    `itemsize`: bytes per element there (0: the plan's size for the kind)."""

    key: str
    kind: str
    box: Box
    device: int
    chunk: int
    local_name: str
    local_offsets: tuple[int, ...]
    itemsize: int = 0

    def __post_init__(self) -> None:
        if (self.kind not in KINDS or self.device < 0 or self.chunk < 0 or not self.key
                or self.itemsize < 0):
            raise RoutingError(f"bad state record {self!r}")
        if len(self.local_offsets) != self.box.ndim:
            raise RoutingError(f"state record {self!r}: local offsets do not fit the box")

    def as_tuple(self) -> tuple:
        """A compact, picklable form (what ranks exchange)."""
        return (self.key, self.kind, self.box.offsets, self.box.shape, self.device,
                self.chunk, self.local_name, self.local_offsets, self.itemsize)

    @classmethod
    def from_tuple(cls, t: Sequence) -> "StateRecord":
        key, kind, off, shape, device, chunk, name, loff, size = t
        return cls(str(key), str(kind), Box(tuple(off), tuple(shape)), int(device), int(chunk),
                   str(name), tuple(int(x) for x in loff), int(size))


@dataclass(frozen=True, slots=True)
class MetadataPlanStats:
    """Byte counts of a metadata plan (network bytes, except `local_bytes`). Local holders
    are taken first, so `moved_bytes` is the lower bound: the bytes of B that its device
    did not already hold at A."""

    moved_bytes: int
    lower_bound_bytes: int
    local_bytes: int
    num_pieces: int
    num_local_pieces: int


def _subtract(r: Box, cut: Box) -> list[Box]:
    """`r` minus `cut` (inside `r`) as disjoint boxes (at most 2 * ndim)."""
    out = []
    off, shp = list(r.offsets), list(r.shape)
    for d in range(r.ndim):
        lo, hi = cut.offsets[d], cut.offsets[d] + cut.shape[d]
        if lo > off[d]:
            out.append(Box(tuple(off[:d] + [off[d]] + off[d + 1:]),
                           tuple(shp[:d] + [lo - off[d]] + shp[d + 1:])))
        end = off[d] + shp[d]
        if hi < end:
            out.append(Box(tuple(off[:d] + [hi] + off[d + 1:]),
                           tuple(shp[:d] + [end - hi] + shp[d + 1:])))
        off[d], shp[d] = lo, hi - lo
    return out


def _check_shapes(src: Mapping[str, tuple], dst: Mapping[str, tuple]) -> list[str]:
    errs = [f"{k}: global shape {tuple(src[k])} at A, {tuple(dst[k])} at B"
            for k in sorted(set(src) & set(dst)) if tuple(src[k]) != tuple(dst[k])]
    errs += [f"{k}: held at A, by no rank of B (it would be lost)"
             for k in sorted(set(src) - set(dst))]
    errs += [f"{k}: held at B, by no rank of A" for k in sorted(set(dst) - set(src))]
    return errs


class MetadataPlan:
    """A transition plan made from live metadata (module doc); the interface of
    `plan.Plan` that `schedule`, the executor and the switch's report use."""

    def __init__(self, src_layout, dst_layout, src_devices: Sequence[int],
                 dst_devices: Sequence[int], kinds: Sequence[str], itemsize: Mapping[str, int],
                 ranks_per_node: int, pieces: list[Piece]) -> None:
        self.src_layout, self.dst_layout = src_layout, dst_layout
        self.src_devices, self.dst_devices = tuple(src_devices), tuple(dst_devices)
        self.kinds = tuple(kinds)
        self._itemsize = dict(itemsize)
        if set(self._itemsize) != set(KINDS):
            raise RoutingError(f"itemsize must give every kind of {KINDS}, got {itemsize}")
        self.ranks_per_node = ranks_per_node
        self._by: dict[tuple[str, int], list[Piece]] = defaultdict(list)
        for p in sorted(pieces, key=Piece.sort_key):
            self._by[("dst", p.dst_device)].append(p)
            if not p.is_local:
                self._by[("src", p.src_device)].append(p)
        net = [p for p in pieces if not p.is_local]
        moved = sum(p.nbytes for p in net)
        self.stats = MetadataPlanStats(moved, moved, sum(p.nbytes for p in pieces) - moved,
                                       len(net), len(pieces) - len(net))
        flows: dict[tuple[int, int, int], int] = defaultdict(int)
        for p in net:
            flows[(p.src_device, p.dst_device, KINDS.index(p.kind))] += p.numel
        keys = sorted(flows)
        self._flows = tuple(np.array([k[i] for k in keys], np.int64) for i in range(3)) + (
            np.array([flows[k] for k in keys], np.int64),)

    def __repr__(self) -> str:
        return (f"MetadataPlan({self.src_layout} -> {self.dst_layout}, kinds="
                f"{list(self.kinds)}, moved={self.stats.moved_bytes} B, pieces="
                f"{self.stats.num_pieces}+{self.stats.num_local_pieces} local)")

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.src_devices) | set(self.dst_devices)))

    def itemsize(self, kind: str) -> int:
        return self._itemsize[kind]

    def pieces_for(self, device: int, role: str = "all") -> list[Piece]:
        """Pieces `device` receives or copies (`"dst"`), sends (`"src"`), or both, in
        canonical order (`Piece.sort_key`)."""
        if role not in ("all", "dst", "src"):
            raise RoutingError(f"pieces_for: role must be all, dst or src, got {role!r}")
        if role != "all":
            return list(self._by.get((role, device), ()))
        return sorted(set(self._by.get(("dst", device), ())) | set(self._by.get(("src", device), ())),
                      key=Piece.sort_key)

    def local_pieces_for(self, device: int) -> list[Piece]:
        return [p for p in self._by.get(("dst", device), ()) if p.is_local]

    def pieces(self, include_local: bool = True) -> list[Piece]:
        out = [p for (role, _), ps in self._by.items() if role == "dst" for p in ps
               if include_local or not p.is_local]
        return sorted(out, key=Piece.sort_key)

    def flows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Network traffic per (src, dst, kind): arrays (src, dst, kind index, elements)."""
        return self._flows

    def network_pieces_per_device(self, ndev: int) -> np.ndarray:
        """How many network pieces each device sends plus receives (the scheduler's
        alignment padding bound)."""
        out = np.zeros(ndev, np.int64)
        for (role, d), ps in self._by.items():
            out[d] += sum(1 for p in ps if not p.is_local)
        return out


def metadata_plan(src: Iterable[StateRecord], dst: Iterable[StateRecord], *,
                  src_layout, dst_layout, src_devices: Sequence[int],
                  dst_devices: Sequence[int], kinds: Sequence[str],
                  itemsize: Mapping[str, int], ranks_per_node: int = 8,
                  unavailable: Sequence[int] = (),
                  src_shapes: Optional[Mapping[str, tuple]] = None,
                  dst_shapes: Optional[Mapping[str, tuple]] = None) -> MetadataPlan:
    """The plan that fills every record of `dst` from the records of `src` (module doc).
    `src_shapes` / `dst_shapes`: every logical tensor's global shape as each side's ranks
    describe it (checked equal, and the key sets too). Raises RoutingError naming what
    cannot be planned."""
    kinds = tuple(k for k in KINDS if k in set(kinds))
    dead = set(unavailable)
    errs = _check_shapes(src_shapes, dst_shapes) if src_shapes is not None and \
        dst_shapes is not None else []
    holders: dict[tuple[str, str], list[StateRecord]] = defaultdict(list)
    for r in sorted(set(src)):
        if r.kind in kinds and r.device not in dead:
            holders[(r.kind, r.key)].append(r)
    sent: dict[int, int] = defaultdict(int)
    pieces: list[Piece] = []
    for d in sorted(set(dst)):
        if d.kind not in kinds:
            continue
        size = d.itemsize or itemsize[d.kind]
        cands = [h for h in holders.get((d.kind, d.key), ()) if h.box.intersect(d.box)]
        cands.sort(key=lambda h: (h.device != d.device, sent[h.device], h.device, h))
        remaining = [d.box]
        for h in cands:
            rest = []
            for r in remaining:
                cut = r.intersect(h.box)
                if cut is None:
                    rest.append(r)
                    continue
                pieces.append(Piece(
                    h.device, d.device, d.key, d.kind, cut, h.chunk, h.local_name,
                    tuple(c - o + lo for c, o, lo in zip(cut.offsets, h.box.offsets,
                                                         h.local_offsets)),
                    d.chunk, d.local_name,
                    tuple(c - o + lo for c, o, lo in zip(cut.offsets, d.box.offsets,
                                                         d.local_offsets)), size))
                if h.device != d.device:
                    sent[h.device] += cut.numel * size
                rest += _subtract(r, cut)
            remaining = rest
            if not remaining:
                break
        if remaining:
            errs.append(f"{d.key}/{d.kind} {remaining[0]} on device {d.device} at B: held by "
                        f"no available device of A")
        if len(errs) > 8:
            break
    if errs:
        raise RoutingError(f"cannot plan {src_layout} -> {dst_layout} from the live metadata: "
                           + "; ".join(errs[:6]) + (" ..." if len(errs) > 6 else ""))
    return MetadataPlan(src_layout, dst_layout, src_devices, dst_devices, kinds, itemsize,
                        ranks_per_node, pieces)


__all__ = ["MetadataPlan", "MetadataPlanStats", "StateRecord", "metadata_plan"]
