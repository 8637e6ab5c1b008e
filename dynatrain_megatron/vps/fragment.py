"""Fragments: which rank holds which box of which logical tensor, for one state kind.

A `Fragment` is plain, frozen, hashable and ordered, so two sources (the analytic layout
and the live binding of a running job) can be compared as sets or sorted lists.

Replica rule (see analytic.py for how it is computed): for every state kind, the fragments
with `replica == 0` cover every logical tensor exactly once (no gap, no overlap);
`coverage_errors` checks it, returning every error at once.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .box import Box, overlapping_pairs
from .errors import DynatrainError
from .naming import LogicalTensor

KINDS = ("param", "main_param", "exp_avg", "exp_avg_sq")
OPT_KINDS = KINDS[1:]


class FragmentError(DynatrainError, ValueError):
    """A fragment is malformed."""


@dataclass(frozen=True, slots=True, order=True)
class Fragment:
    """Box `box` of logical tensor `key`, state `kind`, stored on `rank`.

    `chunk` (VPP stage) and `local_name` (parameter path inside that model chunk) name the
    local parameter; `local_offsets` is where the box starts inside the TP-local tensor
    (unflattened, also for the distributed optimizer's 1-D shards: the live binding turns
    it into a flat offset with the local shape and the owned range).
    """

    key: str
    kind: str
    box: Box
    rank: int
    replica: int
    chunk: int
    local_name: str
    local_offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.key or not self.local_name:
            raise FragmentError(f"fragment {self!r}: empty key or local_name")
        if self.kind not in KINDS:
            raise FragmentError(f"fragment {self!r}: kind must be one of {KINDS}")
        if not isinstance(self.box, Box):
            raise FragmentError(f"fragment {self!r}: box must be a Box")
        if self.rank < 0 or self.replica < 0 or self.chunk < 0:
            raise FragmentError(f"fragment {self!r}: negative rank/replica/chunk")
        if len(self.local_offsets) != self.box.ndim or any(o < 0 for o in self.local_offsets):
            raise FragmentError(f"fragment {self!r}: local_offsets do not fit the box")

    @property
    def numel(self) -> int:
        return self.box.numel

    @property
    def local_box(self) -> Box:
        return Box(self.local_offsets, self.box.shape)

    def __str__(self) -> str:
        return (f"{self.key}/{self.kind}{self.box}@r{self.rank}#{self.replica} "
                f"<- c{self.chunk}:{self.local_name}{self.local_box}")


def coverage_errors(fragments: Iterable[Fragment], tensors: Sequence[LogicalTensor] |
                    Mapping[str, LogicalTensor], kinds: Sequence[str] = KINDS,
                    max_errors: int = 50) -> list[str]:
    """Every violation of "replica-0 fragments cover each tensor exactly once, per kind".

    Checks bounds, overlap (sweep line) and volume; unknown keys are errors too.
    """
    tmap = tensors if isinstance(tensors, Mapping) else {t.key: t for t in tensors}
    by: dict[tuple[str, str], list[Box]] = defaultdict(list)
    errs: list[str] = []
    for f in fragments:
        if f.replica or f.kind not in kinds:
            continue
        t = tmap.get(f.key)
        if t is None:
            errs.append(f"{f}: unknown logical tensor")
        elif not f.box.within(t.shape):
            errs.append(f"{f}: box outside tensor shape {list(t.shape)}")
        else:
            by[(f.key, f.kind)].append(f.box)
    for kind in kinds:
        for key, t in tmap.items():
            boxes = by.get((key, kind), [])
            vol = sum(b.numel for b in boxes)
            ov = overlapping_pairs(boxes, 3)
            for a, b in ov:
                errs.append(f"{key}/{kind}: replica-0 boxes {a} and {b} overlap")
            if not ov and vol != t.numel:
                errs.append(f"{key}/{kind}: replica-0 boxes cover {vol} of {t.numel} elements")
            if len(errs) >= max_errors:
                return errs + ["... (more errors not listed)"]
    return errs


__all__ = ["KINDS", "OPT_KINDS", "Fragment", "FragmentError", "coverage_errors"]
