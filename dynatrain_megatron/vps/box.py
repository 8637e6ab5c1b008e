"""Boxes: hyper-rectangles in the coordinates of one tensor.

A `Box` is the unit of geometry of the Virtual Parameter Space: a logical tensor is
covered by the boxes that ranks hold, a transition plan moves intersections of boxes.

The distributed optimizer owns *flat* ranges of a row-major tensor, not boxes.
`Box.from_flat_range` cuts such a range into at most `2*ndim - 1` boxes, each of which
is itself contiguous in the flat order, so a 1-D optimizer shard segment can be viewed
with `segment.view(box.shape)` and copied without gathers:

    shape (4, 6), range [3, 20)  ->  [0:1, 3:6]  [1:3, 0:6]  [3:4, 0:2]
                                      (head)      (full rows)  (tail)
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .errors import DynatrainError


class BoxError(DynatrainError, ValueError):
    """A box or a flat range is malformed (negative, empty, ragged, out of bounds)."""


def _as_int_tuple(name: str, v: Iterable[int], owner: str) -> tuple[int, ...]:
    """Plain-int tuple of `v` (numpy integers accepted); bools and non-ints refused."""
    try:
        items = tuple(v)
        if any(isinstance(x, bool) for x in items):
            raise TypeError
        return tuple(operator.index(x) for x in items)
    except TypeError:
        raise BoxError(f"{owner}: {name} must be a sequence of ints, got {v!r}") from None


@dataclass(frozen=True, slots=True, order=True)
class Box:
    """`offsets[d] : offsets[d] + shape[d]` along every dim `d`; never empty."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        off, shp = self.offsets, self.shape
        if not (type(off) is tuple and type(shp) is tuple
                and all(type(x) is int for x in off) and all(type(x) is int for x in shp)):
            owner = f"Box(offsets={off!r}, shape={shp!r})"
            off = _as_int_tuple("offsets", off, owner)
            shp = _as_int_tuple("shape", shp, owner)
            object.__setattr__(self, "offsets", off)
            object.__setattr__(self, "shape", shp)
        if len(off) != len(shp):
            raise BoxError(f"box {self!r}: offsets and shape have different ndim "
                           f"({len(off)} != {len(shp)})")
        if off and min(off) < 0:
            raise BoxError(f"box {self!r}: negative offset")
        if shp and min(shp) < 1:
            raise BoxError(f"box {self!r}: every extent must be >= 1 (boxes are never empty)")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        """The box covering a whole tensor of `shape`."""
        return cls((0,) * len(shape), tuple(shape))

    @classmethod
    def from_slices(cls, starts: Sequence[int], stops: Sequence[int]) -> "Box":
        return cls(tuple(starts), tuple(b - a for a, b in zip(starts, stops)))

    @classmethod
    def from_flat_range(cls, shape: Sequence[int], start: int, stop: int) -> list["Box"]:
        """Cut the flat range `[start, stop)` of a row-major tensor of `shape` into boxes.

        Returns at most `2*ndim - 1` boxes (one for a 0-dim tensor), in flat order, each
        contiguous in the flat order (fixed leading indices, one partial dim, full trailing
        dims). An empty range gives `[]`.
        """
        shape = tuple(int(s) for s in shape)
        numel = math.prod(shape)
        if any(s < 1 for s in shape):
            raise BoxError(f"from_flat_range: shape {shape} has an empty dim")
        if not 0 <= start <= stop <= numel:
            raise BoxError(f"from_flat_range: range [{start}, {stop}) is not inside the "
                           f"{numel} elements of shape {shape}")
        if start == stop:
            return []
        nd = len(shape)
        if nd == 0:
            return [cls((), ())]
        # strides[d] = number of elements of one step along dim d
        strides = [1] * nd
        for d in range(nd - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]

        def unravel(flat: int) -> list[int]:
            idx = []
            for st in strides:
                q, flat = divmod(flat, st)
                idx.append(q)
            return idx

        out: list[Box] = []
        # Head: walk up from the innermost dim while `a` is unaligned, emitting the rest of
        # the current (partial) slab at each level; stop before passing `stop`.
        a = start
        for d in range(nd - 1, 0, -1):
            outer = strides[d - 1]
            if a % outer == 0:
                continue
            slab_end = (a // outer + 1) * outer
            if slab_end > stop:
                break
            idx = unravel(a)
            n = (slab_end - a) // strides[d]
            out.append(cls(tuple(idx[:d]) + (idx[d],) + (0,) * (nd - d - 1),
                           (1,) * d + (n,) + tuple(shape[d + 1:])))
            a = slab_end
        # Middle and tail: from the outermost dim down, emit the largest aligned block.
        for d in range(nd):
            st = strides[d]
            n = (stop - a) // st
            if n > 0:
                idx = unravel(a)
                out.append(cls(tuple(idx[:d]) + (idx[d],) + (0,) * (nd - d - 1),
                               (1,) * d + (n,) + tuple(shape[d + 1:])))
                a += n * st
            if a == stop:
                break
        if a != stop:  # pragma: no cover - guarded by the invariants above
            raise BoxError(f"from_flat_range: internal error cutting [{start}, {stop}) of {shape}")
        return out

    # ------------------------------------------------------------------ properties
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stops(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.shape))

    def slices(self) -> tuple[slice, ...]:
        """Index a numpy array / torch tensor with `t[box.slices()]`."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))

    # ------------------------------------------------------------------ geometry
    def intersect(self, other: "Box") -> Optional["Box"]:
        """The common part, or None when the boxes do not overlap."""
        if len(other.shape) != len(self.shape):
            raise BoxError(f"intersect: {self} and {other} have different ndim")
        offs, shp = [], []
        for a0, an, b0, bn in zip(self.offsets, self.shape, other.offsets, other.shape):
            lo = a0 if a0 > b0 else b0
            hi = min(a0 + an, b0 + bn)
            if hi <= lo:
                return None
            offs.append(lo)
            shp.append(hi - lo)
        return Box(tuple(offs), tuple(shp))

    def contains(self, other: "Box") -> bool:
        """True when `other` lies entirely inside this box."""
        if len(other.shape) != len(self.shape):
            return False
        return all(a0 <= b0 and b0 + bn <= a0 + an for a0, an, b0, bn in
                   zip(self.offsets, self.shape, other.offsets, other.shape))

    def within(self, shape: Sequence[int]) -> bool:
        """True when the box lies inside a tensor of `shape`."""
        return len(shape) == self.ndim and all(
            o + s <= n for o, s, n in zip(self.offsets, self.shape, shape))

    def translate(self, src_origin: Sequence[int], dst_origin: Sequence[int]) -> "Box":
        """The same region with coordinates moved from `src_origin` to `dst_origin`."""
        return Box(tuple(o - a + b for o, a, b in zip(self.offsets, src_origin, dst_origin)),
                   self.shape)

    def flat_range(self, shape: Sequence[int]) -> tuple[int, int]:
        """`(start, stop)` of this box in a row-major tensor of `shape`, if contiguous there.

        Raises BoxError when the box is not one contiguous run of the flat order.
        """
        if not self.within(shape):
            raise BoxError(f"flat_range: {self} is not inside shape {tuple(shape)}")
        nd = self.ndim
        # contiguous iff: leading dims of extent 1, then one partial dim, then full dims
        d = 0
        while d < nd and self.shape[d] == 1:
            d += 1
        if any(self.offsets[k] != 0 or self.shape[k] != shape[k] for k in range(d + 1, nd)):
            raise BoxError(f"flat_range: {self} is not contiguous in shape {tuple(shape)}")
        start, stride = 0, 1
        for k in range(nd - 1, -1, -1):
            start += self.offsets[k] * stride
            stride *= shape[k]
        return start, start + self.numel

    # ------------------------------------------------------------------ printing
    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.shape)) + "]"


def overlapping_pairs(boxes: Sequence[Box], limit: Optional[int] = None
                      ) -> list[tuple[Box, Box]]:
    """Pairs of overlapping boxes of one tensor, by a sweep along dim 0 (at most `limit`).

    Sorting by offsets and keeping only the boxes still open at the current row start
    compares each box with its neighbours along dim 0 instead of with every other box."""
    out: list[tuple[Box, Box]] = []
    if not boxes:
        return out
    if boxes[0].ndim == 0:  # scalars: any two boxes overlap
        out = [(boxes[0], b) for b in boxes[1:]]
        return out if limit is None else out[:limit]
    active: list[Box] = []
    for b in sorted(boxes, key=lambda x: x.offsets):
        o0 = b.offsets[0]
        active = [a for a in active if a.offsets[0] + a.shape[0] > o0]
        for a in active:
            if a.intersect(b) is not None:
                out.append((a, b))
                if limit is not None and len(out) >= limit:
                    return out
        active.append(b)
    return out
