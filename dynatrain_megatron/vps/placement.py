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


# megatron-core's rank orders (`initialize_model_parallel(order=...)`): Megatron-LM's default,
# and the one `--use-tp-pp-dp-mapping` selects. Our virtual ranks are numbered in the first.
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"
RANK_ORDERS = (DEFAULT_ORDER, TP_PP_DP_ORDER)


def _mixed_radix(order: str, digits: dict[str, tuple[int, int]]) -> int:
    """The rank of the coordinates `digits` (axis -> (index, size)) with the axes of `order`
    varying fastest first, as megatron-core's `RankGenerator` numbers them; axes `order`
    names that `digits` lacks have size 1 there."""
    rank, stride = 0, 1
    for axis in order.split("-"):
        index, size = digits.get(axis, (0, 1))
        rank += index * stride
        stride *= size
    return rank


def megatron_rank_order(layout, order: str = DEFAULT_ORDER) -> "Placement":
    """The placement megatron-core gives `layout` when it numbers ranks in `order`
    (`RANK_ORDERS`): `devices[v]` is the global rank that holds virtual rank v. The default order is the identity; `--use-tp-pp-dp-mapping`'s puts the pipeline
    axis inside the data-parallel one, on the dense and the expert grid alike, which agree
    only where their data-parallel sizes do (megatron-core asserts the same)."""
    if order not in RANK_ORDERS:
        raise LayoutError(f"rank order {order!r} is not one of megatron-core's {RANK_ORDERS}")
    L = layout
    devices = []
    for v in range(L.world_size):
        c = L.coords(v)
        dense = _mixed_radix(order, {"tp": (c.tp, L.tp), "cp": (c.cp, L.cp),
                                     "dp": (c.dp, L.dp), "pp": (c.pp, L.pp)})
        expert = _mixed_radix(order, {"tp": (c.etp, L.etp), "ep": (c.ep, L.ep),
                                      "dp": (c.edp, L.edp), "pp": (c.pp, L.pp)})
        if dense != expert:
            raise LayoutError(
                f"layout {L} in rank order {order}: virtual rank {v} is device {dense} on the "
                f"dense grid but {expert} on the expert grid; with the pipeline axis before "
                f"the data-parallel one, dp ({L.dp}) must equal the expert dp ({L.edp})")
        devices.append(dense)
    return Placement(tuple(devices))
