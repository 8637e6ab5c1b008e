"""What the public API (`dynatrain_megatron.api`) returns: frozen, checked at construction.

Results that carry live objects (model chunks, optimizer) compare by identity (`eq=False`):
they hand the caller the objects to use, they are not values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .vps.errors import DynatrainError

OPTIMIZER_PLACES = ("keep", "host")  # where a weights-only switch leaves the optimizer state


class ApiError(DynatrainError, ValueError):
    """A call of the public API that does not fit the job's state (nothing was changed)."""


class SwitchAborted(DynatrainError, RuntimeError):
    """Every rank rolled the switch back: the job is at its old layout, state untouched,
    and training may go on with the objects it had."""


def _check(obj: object, errors: list[str]) -> None:
    if errors:
        raise ApiError(f"{type(obj).__name__}: " + "; ".join(errors))


@dataclass(frozen=True, slots=True)
class LayoutInfo:
    """Where the job is: its layout, the device of each virtual rank, this rank's place.

    `weights_at`: the layout the weights are at during a weights-only switch (the training
    state stays at `layout`), else None."""

    layout: str
    world_size: int
    placement: tuple[int, ...]
    virtual_rank: Optional[int]
    weights_at: Optional[str] = None

    def __post_init__(self) -> None:
        _check(self, [f"placement {self.placement} has not {self.world_size} devices"]
               if len(self.placement) != self.world_size else [])


@dataclass(frozen=True, slots=True)
class SwitchPlan:
    """A switch before it runs: what moves and how long it should take. The same on every
    rank (pure: no communication).

    Bytes are over all ranks; `estimated_seconds` comes from the link model
    (`routing.cost`, its defaults describe GPUs with NVLink and 400 Gb/s NICs), not from
    this machine. `kinds`: the state kinds moved (`("param",)` for weights only)."""

    src: str
    dst: str
    placement: tuple[int, ...]
    kinds: tuple[str, ...]
    bytes_moved: int
    lower_bound_bytes: int
    local_bytes: int
    moved_per_kind: tuple[tuple[str, int], ...]
    state_bytes: int  # one copy of the logical state of `kinds`
    rounds: int
    estimated_seconds: float

    def __post_init__(self) -> None:
        errs = [f"{n} = {v} is negative" for n, v in (
            ("bytes_moved", self.bytes_moved), ("lower_bound_bytes", self.lower_bound_bytes),
            ("local_bytes", self.local_bytes), ("rounds", self.rounds),
            ("estimated_seconds", self.estimated_seconds)) if v < 0]
        if self.bytes_moved < self.lower_bound_bytes:
            errs.append(f"bytes_moved {self.bytes_moved} under the lower bound "
                        f"{self.lower_bound_bytes}")
        _check(self, errs)

    def __str__(self) -> str:
        return (f"{self.src} -> {self.dst}: {self.bytes_moved / 2**20:.1f} MiB moved "
                f"(bound {self.lower_bound_bytes / 2**20:.1f} MiB) in {self.rounds} round(s), "
                f"~{self.estimated_seconds * 1e3:.1f} ms")


@dataclass(frozen=True, slots=True, eq=False)
class Switched:
    """The job after a switch: the objects to train with from now on (this rank's), and
    what the switch did. The objects of the old layout are released."""

    layout: str
    placement: tuple[int, ...]
    model: list
    optimizer: Any
    scheduler: Any
    config: Any  # the TransformerConfig of the new model chunks
    iteration: int
    consumed_samples: int
    bytes_moved: int
    lower_bound_bytes: int
    pause_seconds: float
    prepared_in_background: bool
    phases: tuple[tuple[str, float], ...] = ()  # this rank's seconds per phase of the pause

    def __post_init__(self) -> None:
        errs = []
        if not self.model:
            errs.append("no model chunks")
        if self.iteration < 0 or self.consumed_samples < 0:
            errs.append(f"iteration {self.iteration} / consumed_samples "
                        f"{self.consumed_samples} negative")
        _check(self, errs)


@dataclass(frozen=True, slots=True, eq=False)
class WeightsSwitched:
    """The weights at another layout (a generation layout): this rank's model chunks there,
    bare `GPTModel`s (in a `Float16Module` for bf16/fp16) without DDP or optimizer, with
    their config and process groups. The training state stays at the training layout;
    `optimizer` says where its optimizer state waits: "keep" (in place, on the devices) or
    "host" (`parked_bytes` of it moved to host memory on this rank)."""

    layout: str
    placement: tuple[int, ...]
    model: list
    config: Any
    pg_collection: Any
    optimizer: str
    parked_bytes: int
    bytes_moved: int
    pause_seconds: float
    phases: tuple[tuple[str, float], ...] = ()  # this rank's seconds per phase of the pause

    def __post_init__(self) -> None:
        errs = []
        if self.optimizer not in OPTIMIZER_PLACES:
            errs.append(f"optimizer must be one of {OPTIMIZER_PLACES}, got {self.optimizer!r}")
        if self.optimizer == "keep" and self.parked_bytes:
            errs.append(f"{self.parked_bytes} bytes parked with optimizer='keep'")
        if not self.model:
            errs.append("no model chunks")
        _check(self, errs)


__all__ = ["ApiError", "LayoutInfo", "OPTIMIZER_PLACES", "SwitchAborted", "SwitchPlan",
           "Switched", "WeightsSwitched"]
