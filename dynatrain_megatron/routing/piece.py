"""A piece: one box of one logical tensor and state kind, from one device to another.

`Piece` is the unit a transition plan is made of (`plan.Plan` lists them per device,
`schedule` groups them into rounds, the executor packs and unpacks them). Its canonical
order `(kind, key, box offsets, src, dst)` (`Piece.sort_key`) is what lets a sender and a
receiver agree on the layout of a message without exchanging metadata.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..vps.box import Box
from ..vps.fragment import KINDS
from .regions import RoutingError


@dataclass(frozen=True, slots=True, order=True)
class Piece:
    """Box `box` of logical tensor `key`, state `kind`, from `src_device` to `dst_device`.

    `src_*` / `dst_*` locate it in the devices' local storage: model chunk, local
    parameter name and the offsets of the box inside the TP-local tensor (unflattened; for
    optimizer kinds the executor turns them into flat offsets with the owned range).
    `itemsize` is the element size in bytes. A piece with `src_device == dst_device` is a
    local copy and never crosses the network.
    """

    src_device: int
    dst_device: int
    key: str
    kind: str
    box: Box
    src_chunk: int
    src_local_name: str
    src_local_offsets: tuple[int, ...]
    dst_chunk: int
    dst_local_name: str
    dst_local_offsets: tuple[int, ...]
    itemsize: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RoutingError(f"piece {self!r}: kind must be one of {KINDS}")
        if self.src_device < 0 or self.dst_device < 0 or self.itemsize < 1:
            raise RoutingError(f"piece {self!r}: negative device or bad itemsize")
        nd = self.box.ndim
        if len(self.src_local_offsets) != nd or len(self.dst_local_offsets) != nd:
            raise RoutingError(f"piece {self!r}: local offsets do not match the box")

    @property
    def is_local(self) -> bool:
        return self.src_device == self.dst_device

    @property
    def numel(self) -> int:
        return self.box.numel

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.itemsize

    @property
    def src_local_box(self) -> Box:
        return Box(self.src_local_offsets, self.box.shape)

    @property
    def dst_local_box(self) -> Box:
        return Box(self.dst_local_offsets, self.box.shape)

    def sort_key(self, key_id: Optional[int] = None) -> tuple:
        return (KINDS.index(self.kind), self.key if key_id is None else key_id,
                self.box.offsets, self.src_device, self.dst_device)

    def sub(self, start: int, stop: int) -> list["Piece"]:
        """The flat element range [start, stop) of this piece (its box's row-major order)
        as pieces whose boxes are flat-contiguous sub-boxes (at most 2*ndim - 1)."""
        out = []
        for b in Box.from_flat_range(self.box.shape, start, stop):
            o = b.offsets
            out.append(Piece(
                self.src_device, self.dst_device, self.key, self.kind,
                Box(tuple(x + y for x, y in zip(self.box.offsets, o)), b.shape),
                self.src_chunk, self.src_local_name,
                tuple(x + y for x, y in zip(self.src_local_offsets, o)),
                self.dst_chunk, self.dst_local_name,
                tuple(x + y for x, y in zip(self.dst_local_offsets, o)), self.itemsize))
        return out

    def __str__(self) -> str:
        arrow = "local" if self.is_local else f"d{self.src_device}->d{self.dst_device}"
        return (f"{self.key}/{self.kind}{self.box} {arrow} "
                f"c{self.src_chunk}:{self.src_local_name}{self.src_local_box} -> "
                f"c{self.dst_chunk}:{self.dst_local_name}{self.dst_local_box}")


__all__ = ["Piece"]
