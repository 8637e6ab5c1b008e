"""Rounds: the network pieces of a plan, batched so that staging memory stays in budget.

Model of execution (what the executor does, and what makes this deadlock-free by
construction): local copies first (`Schedule.local_pieces`, no network, no staging),
then rounds `0 .. R-1` in that order on every device of the union of both worlds. A
round is ONE batched exchange: a device posts all its sends and receives of the round
at once (`batch_isend_irecv`) and waits for all of them. Every device runs the same
rounds in the same order and no round waits on a message of a later one, so no cyclic
wait can form, whatever the order ranks arrive in. A device with nothing to do in a
round simply skips it.

Staging memory of a device in a round = bytes it packs to send + bytes it receives in
that round. With a budget B, the plan's traffic is split into the fewest rounds R such
that every device's staging fits: each flow (src, dst, kind) is cut into R consecutive
parts of its pieces in canonical order, part r = elements [floor(r*E/R),
floor((r+1)*E/R)) of the flow; a piece that straddles a cut is chunked into
flat-contiguous sub-boxes (`Piece.sub`), so pieces stay boxes. Sender and receiver
compute the same cuts from the same plan. Every device's traffic is spread evenly over
the rounds, so R rounds take about as long as one (plus R latencies). The staging of a
device in any round is at most sum over its flows of ceil(E/R) * itemsize, which is
what R is chosen against (the exact per-round peak is reported as well).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..vps.fragment import KINDS
from .plan import Piece, Plan
from .regions import RoutingError

_EXACT_LIMIT = 50_000_000  # rounds x flows above this: report the staging bound only


@dataclass(frozen=True, eq=False)
class Round:
    """One batched exchange of a `Schedule` (module doc)."""

    index: int
    schedule: "Schedule"

    def sends(self, device: int) -> list[Piece]:
        """Pieces `device` sends in this round, by (dst, canonical order)."""
        return self.schedule._round_pieces(device, "src", self.index)

    def recvs(self, device: int) -> list[Piece]:
        """Pieces `device` receives in this round, by (src, canonical order)."""
        return self.schedule._round_pieces(device, "dst", self.index)

    @property
    def pieces(self) -> list[Piece]:
        """Every piece of the round (explicit: small worlds and tests)."""
        out: list[Piece] = []
        for d in self.schedule.plan.src_devices:
            out += self.sends(d)
        return out

    def staging_bytes(self, device: int) -> int:
        return (sum(p.nbytes for p in self.sends(device))
                + sum(p.nbytes for p in self.recvs(device)))


@dataclass(frozen=True, eq=False)
class Schedule:
    """Rounds of a plan under a staging budget (module doc).

    `peak_staging[d]`: the largest staging of device d in any round (exact when
    `peak_exact`, else the bound the round count was chosen against). `round_traffic`:
    per round, per device (send_intra, send_inter, recv_intra, recv_inter) bytes; it
    feeds the cost model.
    """

    plan: Plan
    budget: Optional[int]
    num_rounds: int
    peak_staging: np.ndarray
    peak_exact: bool
    round_traffic: tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def rounds(self) -> tuple[Round, ...]:
        return tuple(Round(i, self) for i in range(self.num_rounds))

    @property
    def max_peak_staging(self) -> int:
        return int(self.peak_staging.max(initial=0))

    def local_pieces(self, device: int) -> list[Piece]:
        """The local copies of `device`, run before round 0."""
        return self.plan.local_pieces_for(device)

    def _round_pieces(self, device: int, role: str, r: int) -> list[Piece]:
        if not 0 <= r < self.num_rounds:
            raise RoutingError(f"round {r} outside 0..{self.num_rounds - 1}")
        key = (device, role)
        got = self._cache.get(key)
        if got is None:
            got = self._cut(device, role)
            self._cache[key] = got
        return got[r]

    def _cut(self, device: int, role: str) -> list[list[Piece]]:
        R = self.num_rounds
        out: list[list[Piece]] = [[] for _ in range(R)]
        flows: dict[tuple[int, int, str], list[Piece]] = {}
        for p in self.plan.pieces_for(device, role):
            if p.is_local or (p.src_device if role == "src" else p.dst_device) != device:
                continue
            flows.setdefault((p.src_device, p.dst_device, p.kind), []).append(p)
        peer = (lambda f: f[1]) if role == "src" else (lambda f: f[0])
        for f in sorted(flows, key=lambda f: (peer(f), KINDS.index(f[2]))):
            ps = flows[f]
            E = sum(p.numel for p in ps)
            cuts = [(r * E) // R for r in range(R + 1)]
            pos, r = 0, 0
            for p in ps:  # canonical order (pieces_for sorts)
                a, b = pos, pos + p.numel
                while a < b:
                    while cuts[r + 1] <= a:
                        r += 1
                    e = min(b, cuts[r + 1])
                    if a == pos and e == b:
                        out[r].append(p)
                    else:
                        out[r] += p.sub(a - pos, e - pos)
                    a = e
                pos = b
        return out


def _shares(E: np.ndarray, R: int, r: int) -> np.ndarray:
    return (E * (r + 1)) // R - (E * r) // R


def build_schedule(plan: Plan, memory_budget_bytes: Optional[int] = None,
                   align: int = 1) -> Schedule:
    """The rounds of `plan` with at most `memory_budget_bytes` of staging per device and
    round (None: one round). Raises RoutingError when no number of rounds fits.

    `align`: the executor pads every packed piece to a multiple of `align` bytes; the
    round count then also covers that padding (bounded by align - 1 bytes for every piece
    of the device, chunks included)."""
    if align < 1:
        raise RoutingError(f"align must be >= 1, got {align}")
    src, dst, kind, E = plan.flows()
    isz = np.array([plan.itemsize(k) for k in KINDS], np.int64)[kind]
    ndev = int(max(max(plan.src_devices), max(plan.dst_devices))) + 1
    byts = E * isz

    def per_dev(v: np.ndarray) -> np.ndarray:
        return (np.bincount(src, weights=v, minlength=ndev)
                + np.bincount(dst, weights=v, minlength=ndev)).astype(np.int64)

    total = per_dev(byts)
    if memory_budget_bytes is None:
        R = 1
    else:
        B = int(memory_budget_bytes)
        if B < 1:
            raise RoutingError(f"memory budget must be positive, got {memory_budget_bytes}")
        pad = _padding(plan, src, dst, ndev, align)
        floor = per_dev(np.minimum(E, 1) * isz) + pad  # one element of every flow
        if len(E) and floor.max() > B:
            d = int(floor.argmax())
            raise RoutingError(
                f"memory budget {B} B is too small: device {d} exchanges with "
                f"{int(((src == d) | (dst == d)).sum())} flows and needs at least "
                f"{int(floor[d])} B of staging per round"
                + (f" ({int(pad[d])} B of {align}-byte alignment)" if align > 1 else ""))
        R = max(1, math.ceil(int((total + pad).max(initial=0)) / B))
        while True:
            bound = per_dev(-(-E // R) * isz) + pad
            if bound.max(initial=0) <= B:
                break
            R = max(R + 1, math.ceil(R * bound.max() / B))
    intra = (src // plan.ranks_per_node) == (dst // plan.ranks_per_node)
    exact = R * max(len(E), 1) <= _EXACT_LIMIT
    peak = np.zeros(ndev, np.int64)
    traffic = []
    if exact:
        for r in range(R):
            sh = _shares(E, R, r) * isz
            peak = np.maximum(peak, per_dev(sh))
            traffic.append(_traffic(src, dst, sh, intra, ndev))
    else:
        peak = per_dev(-(-E // R) * isz)
        sh = -(-E // R) * isz
        t = _traffic(src, dst, sh, intra, ndev)
        traffic = [t] * R
    return Schedule(plan, memory_budget_bytes, R, peak, exact, tuple(traffic))


def _padding(plan: Plan, src, dst, ndev: int, align: int) -> np.ndarray:
    """Per device, the most alignment padding one round can add: (align - 1) bytes for
    each of its network pieces, plus 6 chunks per flow (a round's range of a flow cuts
    at most two pieces, each into at most 3 boxes)."""
    if align == 1:
        return np.zeros(ndev, np.int64)
    n = plan.network_pieces_per_device(ndev)
    f = (np.bincount(src, minlength=ndev) + np.bincount(dst, minlength=ndev)).astype(np.int64)
    return (align - 1) * (n + 6 * f)


def _traffic(src, dst, sh, intra, ndev):
    def b(dev, m):
        return np.bincount(dev[m], weights=sh[m], minlength=ndev).astype(np.int64)
    return b(src, intra), b(src, ~intra), b(dst, intra), b(dst, ~intra)


def schedule(plan: Plan, memory_budget_bytes: Optional[int] = None,
             align: int = 1) -> list[Round]:
    """The rounds of `plan` under the budget (see `build_schedule`)."""
    return list(build_schedule(plan, memory_budget_bytes, align).rounds)


__all__ = ["Round", "Schedule", "build_schedule", "schedule"]
