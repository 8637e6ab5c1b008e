"""Placement: which device hosts each virtual rank of a layout.

A layout's fragments are computed on *virtual* ranks (megatron's rank order). Which physical
device takes virtual rank v is a separate choice: a switch picks the permutation that keeps
the most state where it already is; megatron's default is the identity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import LayoutError


@dataclass(frozen=True, slots=True)
class Placement:
    """`devices[v]` is the global rank (device) of virtual rank v."""

    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.devices:
            raise LayoutError("placement needs at least one device")
        if len(set(self.devices)) != len(self.devices) or min(self.devices) < 0:
            raise LayoutError(f"placement {self.devices} must list distinct non-negative ranks")

    @classmethod
    def default(cls, world_size: int, offset: int = 0) -> "Placement":
        return cls(tuple(range(offset, offset + world_size)))

    @property
    def is_default(self) -> bool:
        return self.devices == tuple(range(self.devices[0], self.devices[0] + len(self.devices)))

    def virtual_rank(self, device: int) -> Optional[int]:
        try:
            return self.devices.index(device)
        except ValueError:
            return None

    def __str__(self) -> str:
        return "default" if self.is_default and self.devices[0] == 0 else str(list(self.devices))


def _grids(layout, devices) -> list:
    import numpy as np

    d = np.asarray(devices)
    L = layout
    return [d.reshape(L.pp, L.dp, L.cp, L.tp), d.reshape(L.pp, L.edp, L.ep, L.etp)]


def is_rank_ordered(layout, placement: "Placement") -> bool:
    """True when, in every megatron process group of the layout, devices ascend with the
    member's position: the placements whose groups torch's default `new_group` (members
    sorted by global rank) would number in virtual-rank order. Live switches no longer
    need it (`elastic.groups` builds groups in member order); `dynatrain plan` reports the
    best such placement to show what that gains."""
    from .layout import GROUP_AXES

    dev = placement.devices
    for axes in GROUP_AXES.values():
        for g in layout.groups(axes):
            ds = [dev[v] for v in g]
            if any(x >= y for x, y in zip(ds, ds[1:])):
                return False
    return True


def rank_ordered(layout, placement: "Placement") -> "Placement":
    """The closest rank-ordered placement on the same devices: sort the dense grid along
    every axis (sorting along one axis keeps the others sorted), keeping each device's
    neighbourhood as far as possible. May still fail the expert grid: check the result."""
    import numpy as np

    g = _grids(layout, placement.devices)[0].copy()
    for axis in range(g.ndim):
        g = np.sort(g, axis=axis)
    return Placement(tuple(int(x) for x in g.reshape(-1)))
