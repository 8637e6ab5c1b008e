"""Vocabulary padding rows: the one piece of state outside the VPS.

The embedding and output layer hold V' = ceil(V/(m*TP))*m*TP rows, so rows [V, V') exist
or not depending on TP. They are trained (the output layer's padded logits take part in
the softmax), and megatron's checkpoint path carries them wherever both layouts have them
(`allow_shape_mismatch`: rows beyond the stored V' are zero-filled). We do the same, so a
switch stays bit-identical to the checkpoint path: rows [V, min(V'_A, V'_B)) are carried
(weights and optimizer state), rows beyond V'_A start at zero.

Who holds which padding rows at A and who needs which at B are pure functions of the two
analytic layouts (`padding_plan`), the same on every rank: only the holders and the
needers exchange, point to point, in one batched round on the switch's transport (no
world-wide gather: a rank sends and receives only its own rows, whatever the world size).
Every kept replica is identical (DP copies of a weight, the optimizer instances), so each
needed interval is served by one holder, chosen to spread the senders' load, never a
device in `unavailable` (after a death).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from ..adapters.live import LiveState
from ..vps.analytic import AnalyticLayout
from ..vps.errors import DynatrainError
from ..vps.fragment import KINDS, OPT_KINDS
from ..vps.placement import Placement
from .transport import Transport


class PaddingError(DynatrainError):
    """A rank's live padding rows are not where the analytic layout puts them."""


@dataclass(frozen=True, slots=True, order=True)
class Holding:
    """Flat elements `[lo, hi)` of the padded logical tensor `key` (row-major, rows >= V)
    that `device` stores for `kind`; `replica` 0 is the main copy."""

    key: str
    kind: str
    lo: int
    hi: int
    device: int
    replica: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi or self.kind not in KINDS:
            raise PaddingError(f"bad padding holding {self}")


@dataclass(frozen=True, slots=True, order=True)
class PaddingPiece:
    """`[lo, hi)` of (`key`, `kind`) goes from device `src` to device `dst`."""

    key: str
    kind: str
    lo: int
    hi: int
    src: int
    dst: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi:
            raise PaddingError(f"bad padding piece {self}")

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True, slots=True)
class PaddingPlan:
    """Every padding piece of a switch, in one order every rank derives alone."""

    pieces: tuple[PaddingPiece, ...] = ()
    held: tuple[Holding, ...] = ()  # A's holdings (checked against each rank's live state)
    needed: tuple[Holding, ...] = ()  # B's

    def for_device(self, device: int) -> tuple[list[PaddingPiece], list[PaddingPiece]]:
        """(pieces `device` sends, pieces it receives), local copies in both."""
        return ([p for p in self.pieces if p.src == device],
                [p for p in self.pieces if p.dst == device])

    def elements_per_device(self) -> dict[int, tuple[int, int]]:
        """device -> (elements sent to others, elements received from others)."""
        out: dict[int, list[int]] = {}
        for p in self.pieces:
            if p.src != p.dst:
                out.setdefault(p.src, [0, 0])[0] += p.numel
                out.setdefault(p.dst, [0, 0])[1] += p.numel
        return {d: (s, r) for d, (s, r) in out.items()}


def padding_holdings(a: AnalyticLayout, placement: Placement,
                     kinds: Iterable[str] = KINDS) -> list[Holding]:
    """The vocab padding every device of `placement` stores at `a`'s layout (pure: the
    analytic layout's local tensors, replica numbers and owned optimizer ranges)."""
    kinds = tuple(kinds)
    opt = [k for k in OPT_KINDS if k in kinds]
    V, L = a.spec.vocab_size, a.layout
    if a.spec.padded_vocab_size(L.tp) == V:
        return []
    owned_cache: dict[tuple[int, ...], dict] = {}
    out: list[Holding] = []
    for vr in range(L.world_size):
        lts = [lt for lt in a.local_tensors(vr) if lt.spec.rule == "vocab"]
        if not lts:
            continue
        c = L.coords(vr)
        dev = placement.devices[vr]
        for lt in lts:
            rows, cols = lt.local_shape[0], math.prod(lt.local_shape[1:])
            row0 = c.tp * rows  # the vocab is split over TP in row blocks
            pad = max(0, V - row0) * cols  # local flat index of the first padding element
            if pad >= rows * cols:
                continue
            base = row0 * cols
            if "param" in kinds:
                n, idx = a.dp_index(lt.spec, c)
                out.append(Holding(lt.key, "param", base + pad, base + rows * cols, dev,
                                   a.copy_index(lt.spec, c) * n + idx))
            if not opt:
                continue
            # the ranks with the same owned ranges (all of them without the distributed
            # optimizer: each owns all it holds)
            ck = ((c.pp, c.dp_cp % L.dense_shards, c.edp % L.expert_shards)
                  if a.spec.distributed_optimizer else (c.pp,))
            if ck not in owned_cache:
                owned_cache[ck] = a.owned_ranges(vr)
            rng = owned_cache[ck].get((lt.chunk, lt.local_name))
            if rng is None:
                continue
            s, e = max(rng[0], pad), min(rng[1], rows * cols)
            if e <= s:
                continue
            rep = a.opt_replica(lt.spec, c)
            for kind in opt:
                out.append(Holding(lt.key, kind, base + s, base + e, dev, rep))
    return sorted(out)


def padding_plan(src: Optional[tuple[AnalyticLayout, Placement]],
                 dst: tuple[AnalyticLayout, Placement], kinds: Iterable[str] = KINDS,
                 unavailable: Sequence[int] = ()) -> PaddingPlan:
    """Which device sends which padding elements to which (pure, the same on every rank).

    `src` None: A has no padding rows (nothing to carry; B's start at zero). A device
    that holds what it needs copies locally; otherwise the needers of an interval are
    dealt out over its holders in turn (lowest replica first), so a holder serves about
    needers/holders of them, a number that does not grow with the world at a fixed
    model parallelism."""
    kinds = tuple(kinds)
    needed = padding_holdings(dst[0], dst[1], kinds)
    held = padding_holdings(src[0], src[1], kinds) if src is not None else []
    return padding_plan_from(held, needed, unavailable)


def padding_plan_from(held: Sequence[Holding], needed: Sequence[Holding],
                      unavailable: Sequence[int] = ()) -> PaddingPlan:
    """`padding_plan` from the holdings of both sides, however they were found (the
    analytic layouts, or every rank's live metadata: `metadata_exchange`)."""
    held, needed = sorted(held), sorted(needed)
    if not held or not needed:
        return PaddingPlan((), tuple(held), tuple(needed))
    dead = set(unavailable)
    by_tensor: dict[tuple[str, str], list[Holding]] = {}
    for h in held:
        if h.device not in dead:
            by_tensor.setdefault((h.key, h.kind), []).append(h)
    turn: dict[tuple[str, str, int, int], int] = {}
    pieces: list[PaddingPiece] = []
    for n in needed:
        hs = by_tensor.get((n.key, n.kind), [])
        cuts = sorted({n.lo, n.hi} | {x for h in hs for x in (h.lo, h.hi) if n.lo < x < n.hi})
        for lo, hi in zip(cuts, cuts[1:]):
            cover = sorted((h for h in hs if h.lo <= lo and hi <= h.hi),
                           key=lambda h: (h.replica, h.device))
            if not cover:
                continue  # beyond A's padding rows: stays zero
            local = [h for h in cover if h.device == n.device]
            if local:
                pieces.append(PaddingPiece(n.key, n.kind, lo, hi, n.device, n.device))
                continue
            k = (n.key, n.kind, lo, hi)
            i = turn.get(k, 0)
            turn[k] = i + 1
            pieces.append(PaddingPiece(n.key, n.kind, lo, hi, cover[i % len(cover)].device,
                                       n.device))
    return PaddingPlan(tuple(sorted(pieces)), tuple(held), tuple(needed))


# ----------------------------------------------------------------------------- live side
def _flat_lo(live: LiveState, f) -> int:
    """Global flat index of a live fragment's first element (row-major, padded tensor)."""
    shape = tuple(live.params[f.chunk][f.local_name].shape)
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return sum(o * s for o, s in zip(f.box.offsets, strides))


class _Rows:
    """A rank's live padding storage as global flat intervals, per (key, kind)."""

    def __init__(self, live: Optional[LiveState], kinds: tuple[str, ...]) -> None:
        self.parts: dict[tuple[str, str], list[tuple[int, int, torch.Tensor]]] = {}
        if live is None:
            return
        for f in live.padding_fragments(kinds):
            v = live.view(f.kind, f.chunk, f.local_name, f.local_box)
            if not v.is_contiguous():
                raise PaddingError(f"rank {live.rank}: padding view of {f.key} ({f.kind}) "
                                   f"box {f.box} is not contiguous")
            lo = _flat_lo(live, f)
            self.parts.setdefault((f.key, f.kind), []).append((lo, lo + v.numel(), v.view(-1)))

    def intervals(self) -> set[tuple[str, str, int, int]]:
        """Merged intervals, for the check against the analytic holdings."""
        return {(key, kind, lo, hi) for (key, kind), parts in self.parts.items()
                for lo, hi in _merge_intervals((lo, hi) for lo, hi, _ in parts)}

    def slices(self, key: str, kind: str, lo: int, hi: int) -> list[torch.Tensor]:
        """Views covering `[lo, hi)` in order (PaddingError if some element is missing)."""
        out, at = [], lo
        for plo, phi, v in sorted(self.parts.get((key, kind), []), key=lambda p: p[0]):
            if plo <= at < phi:
                end = min(hi, phi)
                out.append(v[at - plo:end - plo])
                at = end
                if at == hi:
                    return out
        raise PaddingError(f"padding elements [{at}, {hi}) of {key} ({kind}) are not here")


def _merge_intervals(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Half-open intervals merged where they touch or overlap, in order."""
    merged: list[list[int]] = []
    for lo, hi in sorted(intervals):
        if merged and merged[-1][1] >= lo:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _merged(holdings: Iterable[Holding]) -> set[tuple[str, str, int, int]]:
    by: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for h in holdings:
        by.setdefault((h.key, h.kind), []).append((h.lo, h.hi))
    return {(key, kind, lo, hi) for (key, kind), ivs in by.items()
            for lo, hi in _merge_intervals(ivs)}


@torch.no_grad()
def carry_vocab_padding(plan: PaddingPlan, me: int, old: Optional[LiveState],
                        new: Optional[LiveState], transport: Optional[Transport], *,
                        tag: int = 0, timeout: Optional[float] = None) -> tuple[int, list[str]]:
    """Run `plan` on device `me`: zero B's padding rows, then one batched exchange on
    `transport` with exactly the peers the plan names (none: no exchange at all).
    Returns (padding elements written here, errors). An error never skips a message a
    peer expects (it is sent as zeros), so every rank's exchange stays matched; the caller
    votes on the errors. `transport` may be None only when this rank has no remote piece."""
    kinds = tuple(sorted({h.kind for h in plan.held + plan.needed}))
    errors: list[str] = []
    try:
        src_rows = _Rows(old, kinds)
        dst_rows = _Rows(new, kinds)
        for name, rows, want in (("A", src_rows, [h for h in plan.held if h.device == me]),
                                 ("B", dst_rows, [h for h in plan.needed if h.device == me])):
            live = old if name == "A" else new
            if live is None:
                continue
            got, exp = rows.intervals(), _merged(want)
            if got != exp:
                raise PaddingError(f"rank {me}: live padding rows at {name} {sorted(got)[:3]} "
                                   f"differ from the plan's {sorted(exp)[:3]}")
    except Exception as e:  # noqa: BLE001 - reported at the vote; the exchange goes on
        errors.append(f"rank {me}: vocab padding: {type(e).__name__}: {e}")
        src_rows = dst_rows = _Rows(None, ())
    for parts in dst_rows.parts.values():
        for _, _, v in parts:
            v.zero_()
    sends, recvs = plan.for_device(me)
    out: dict[int, list[torch.Tensor]] = {}
    inbox: dict[int, list[torch.Tensor]] = {}
    landing: list[tuple[PaddingPiece, torch.Tensor]] = []
    written = 0

    def like(p: PaddingPiece, rows: _Rows) -> torch.Tensor:
        parts = rows.parts.get((p.key, p.kind))
        ref = parts[0][2] if parts else None
        if ref is None:
            other = next(iter(rows.parts.values()), None) or next(
                iter(src_rows.parts.values()), None)
            ref = other[0][2] if other else torch.empty(0)
        return torch.zeros(p.numel, dtype=ref.dtype, device=ref.device)

    for p in sends:
        try:
            data = src_rows.slices(p.key, p.kind, p.lo, p.hi)
            data = data[0] if len(data) == 1 else torch.cat(data)
        except Exception as e:  # noqa: BLE001
            errors.append(f"rank {me}: vocab padding send {p}: {e}")
            data = like(p, dst_rows if p.dst == me else src_rows)
        if p.dst == me:
            written += _write_rows(dst_rows, p, data, errors, f"rank {me}: vocab padding copy")
            continue
        out.setdefault(p.dst, []).append(data.contiguous())
    for p in recvs:
        if p.src == me:
            continue
        buf = like(p, dst_rows)
        inbox.setdefault(p.src, []).append(buf)
        landing.append((p, buf))
    if out or inbox:
        if transport is None:
            raise PaddingError(f"rank {me}: the padding plan has remote pieces but no transport")
        try:
            transport.start(out, inbox, tag).wait(timeout)
        except Exception as e:  # noqa: BLE001 - a late or dead peer: the vote rolls back
            errors.append(f"rank {me}: vocab padding exchange: {type(e).__name__}: {e}")
            return written, errors
    for p, buf in landing:
        written += _write_rows(dst_rows, p, buf, errors, f"rank {me}: vocab padding receive")
    return written, errors


def _write_rows(dst_rows, p, data: torch.Tensor, errors: list[str], what: str) -> int:
    """Copy a piece's flat data into the destination rows it covers (one or more slices);
    returns the elements written, or 0 with the failure appended to `errors`."""
    try:
        at = 0
        for v in dst_rows.slices(p.key, p.kind, p.lo, p.hi):
            v.copy_(data[at:at + v.numel()])
            at += v.numel()
        return p.numel
    except Exception as e:  # noqa: BLE001 - reported through the vote, which rolls back
        errors.append(f"{what} {p}: {e}")
        return 0
