"""What a job would lose if some of its devices died: the recovery analysis of a layout.

Pure (no torch.distributed). For each logical tensor and state kind, the boxes held by the
dead devices minus everything a surviving device still holds. Weights are replicated over
DP (and TP-replicated tensors over TP), so a lost rank's weights usually survive; the
distributed optimizer shards `main_param` / `exp_avg` / `exp_avg_sq` across DP without a
replica, so a dead rank's shards are gone. A job that lost optimizer state must fall back
to its last checkpoint rather than continue with wrong state; this report says exactly
which tensors, so the decision (and the log line) is precise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ..vps.analytic import analytic_layout
from ..vps.box import Box
from ..vps.fragment import KINDS
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.placement import Placement
from .regions import RoutingError

@dataclass(frozen=True, slots=True)
class LostBox:
    key: str
    kind: str
    box: Box


@dataclass(frozen=True)
class RecoveryReport:
    """Per kind: elements lost; `lost` lists every box no surviving device holds."""

    dead: tuple[int, ...]
    lost: tuple[LostBox, ...]
    lost_elements: dict

    @property
    def recoverable(self) -> bool:
        return not self.lost

    @property
    def weights_recoverable(self) -> bool:
        return self.lost_elements.get("param", 0) == 0

    def describe(self, limit: int = 8) -> str:
        if not self.lost:
            return f"devices {list(self.dead)} hold no state that is not replicated elsewhere"
        kinds = ", ".join(f"{k}: {n} elements" for k, n in sorted(self.lost_elements.items()) if n)
        keys = sorted({(b.kind, b.key) for b in self.lost})
        shown = "; ".join(f"{kind} {key}" for kind, key in keys[:limit])
        more = f" (+{len(keys) - limit} more tensors)" if len(keys) > limit else ""
        return (f"devices {list(self.dead)} hold the only copy of {kinds} in {len(keys)} "
                f"tensors: {shown}{more}")


def subtract(a: Box, b: Box) -> list[Box]:
    """`a` minus `b` as disjoint boxes (at most 2 * ndim)."""
    inter = a.intersect(b)
    if inter is None:
        return [a]
    out = []
    lo, hi = list(a.offsets), list(a.stops)
    for d in range(a.ndim):
        if lo[d] < inter.offsets[d]:
            stops = hi.copy()
            stops[d] = inter.offsets[d]
            out.append(Box.from_slices(lo, stops))
        if inter.stops[d] < hi[d]:
            starts = lo.copy()
            starts[d] = inter.stops[d]
            out.append(Box.from_slices(starts, hi))
        lo[d], hi[d] = inter.offsets[d], inter.stops[d]
    return out


def lost_state(spec: ModelSpec, layout: Layout, dead: Iterable[int],
               placement: Optional[Placement] = None, bucket_size: Optional[int] = None,
               kinds: Sequence[str] = KINDS) -> RecoveryReport:
    """The state only the `dead` devices hold, for `layout` on `placement`."""
    placement = placement or Placement.default(layout.world_size)
    dead = tuple(sorted(set(dead)))
    bad = [d for d in dead if placement.virtual_rank(d) is None]
    if bad:
        raise RoutingError(f"devices {bad} are not part of {layout} on {placement}")
    an = analytic_layout(spec, layout, bucket_size)
    held: dict[tuple[str, str], list[Box]] = {}
    gone: dict[tuple[str, str], list[Box]] = {}
    for dev in placement.devices:
        target = gone if dev in dead else held
        for f in an.fragments(placement.virtual_rank(dev), kinds):
            target.setdefault((f.kind, f.key), []).append(f.box)
    lost: list[LostBox] = []
    elements: dict[str, int] = {k: 0 for k in kinds}
    for (kind, key), boxes in sorted(gone.items()):
        rest = list(dict.fromkeys(boxes))
        for b in held.get((kind, key), ()):
            rest = [piece for r in rest for piece in subtract(r, b)]
            if not rest:
                break
        # the same box on two dead replicas is lost once
        for r in _disjoint(rest):
            lost.append(LostBox(key, kind, r))
            elements[kind] += r.numel
    return RecoveryReport(dead, tuple(lost), elements)


def _disjoint(boxes: list[Box]) -> list[Box]:
    out: list[Box] = []
    for b in boxes:
        pieces = [b]
        for o in out:
            pieces = [p for q in pieces for p in subtract(q, o)]
        out += pieces
    return out
