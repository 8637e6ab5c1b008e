"""The types a switch is described by: its seams (`Builder`, `LayoutGroups`), its
options, what its preparation leaves (`Prepared`) and what it returns.

`transition` never imports `elastic`, `mcore` or `loop`: the caller passes a `Builder`
(megatron-core objects for a layout) and B's groups (anything with a `placement` and a
`transfer` process group, e.g. `elastic.groups.ParallelGroups`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from ..adapters.live import LiveState
from ..routing.piece import Piece
from ..routing.plan import Plan
from ..routing.schedule import Round
from ..vps.errors import DynatrainError
from ..vps.fragment import KINDS, OPT_KINDS
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.placement import Placement
from .object_carry import ObjectPlan

PLACEMENT_POLICIES = ("best", "default")


class SwitchError(DynatrainError, ValueError):
    """A switch was asked for with options or prepared state that do not fit."""


class Builder(Protocol):
    """Makes a layout's training objects (model chunks, DDP, optimizer, scheduler). It
    may say, as `plan_from = "metadata"`, that the analytic layout does not describe its
    models: switches are then planned from the live metadata (`metadata_exchange`); and,
    as `rank_order` (`vps.placement.RANK_ORDERS`), the order megatron-core numbers its
    ranks in: B's placement under the "default" policy."""

    spec: ModelSpec

    def bucket_size(self, layout: Layout) -> Optional[int]: ...

    def build_detached(self, layout: Layout, groups: "LayoutGroups") -> Any:
        """B's objects without weight initialisation and without touching the globals A
        trains with (may run in a background thread)."""

    def activate(self, objs: Any) -> None:
        """Make `objs` current (globals, RNG seeds): called at the commit."""


class LayoutGroups(Protocol):
    """B's process groups as the switch sees them: B's placement, and the communicator
    the transfer runs on (None: the default group)."""

    placement: Placement
    transfer: Optional[dist.ProcessGroup]

    def release_transfer(self) -> None:
        """Destroy `transfer` (every rank of the world calls it at the same point)."""


@dataclass(frozen=True, slots=True)
class SwitchOptions:
    """How a switch runs (the same on every rank).

    `placement`: "best" (the planner's rank-ordered placement of B) or "default"
    (megatron's order). `move_weights=False` moves only the optimizer kinds and rebuilds
    the weights from the fp32 masters (fewer bytes: weights are replicated over DP,
    masters are not). `memory_budget`: staging bytes per rank and round (None: one
    round). `verify`: check A's and B's live fragments against the analytic layouts and
    this rank's part of the plan. `timeout`: seconds per round (None: no limit).
    `checksums`: every message checksummed by its sender and its receiver.
    `weights_only`: move the model weights and nothing else (B holds weights only: a
    generation layout, built without an optimizer; no scalars are carried).
    `masters_are_weights`: the fp32 masters are views of the weights (fp32 weights under
    the distributed optimizer), so with `move_weights` they travel with the weights and
    are not sent a second time (checked on B's live state before anything moves).
    """

    placement: str = "best"
    ranks_per_node: int = 8
    memory_budget: Optional[int] = None
    move_weights: bool = False
    verify: bool = True
    timeout: Optional[float] = None
    checksums: bool = True
    weights_only: bool = False
    masters_are_weights: bool = False

    def __post_init__(self) -> None:
        errs = []
        if self.placement not in PLACEMENT_POLICIES:
            errs.append(f"placement must be one of {PLACEMENT_POLICIES}, got "
                        f"{self.placement!r}")
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            errs.append(f"ranks_per_node must be a positive int, got {self.ranks_per_node!r}")
        if self.memory_budget is not None and not self.memory_budget > 0:
            errs.append(f"memory_budget must be positive or None, got {self.memory_budget!r}")
        if self.timeout is not None and not self.timeout > 0:
            errs.append(f"timeout must be positive or None, got {self.timeout!r}")
        if errs:
            raise SwitchError(f"switch options {self}: " + "; ".join(errs))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The state kinds the transfer moves."""
        if self.weights_only:
            return ("param",)
        if not self.move_weights:
            return OPT_KINDS
        return tuple(k for k in KINDS if k != "main_param") if self.masters_are_weights \
            else KINDS


@dataclass(frozen=True, slots=True)
class Scalars:
    """Training state that is not a tensor of the VPS. `grad_scalers`: the state of each
    optimizer's loss scaler (fp16), in the order of megatron-core's ChainedOptimizer
    (dense, then expert parameters), None for one without (bf16, fp32): each keeps and
    updates its own."""

    iteration: int
    consumed_samples: int
    optimizer_step: Optional[float]
    scheduler: dict
    grad_scalers: tuple[Optional[dict], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.grad_scalers, tuple) or not all(
                s is None or isinstance(s, dict) for s in self.grad_scalers):
            raise TypeError(f"grad_scalers must be a tuple of state dicts or None, got "
                            f"{self.grad_scalers!r}")


@dataclass
class SwitchReport:
    """What a switch did, for logs and benchmarks (this rank's view plus plan totals)."""

    src: str
    dst: str
    placement: str
    bytes_moved: int = 0
    lower_bound_bytes: int = 0
    local_bytes: int = 0
    rounds: int = 0
    peak_staging_bytes: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    zero_copy_bytes: int = 0  # network bytes sent from / received into live storage directly
    checksummed_messages: int = 0
    source_bound_early: bool = False  # A's binding came from the background preparation
    kinds: tuple = ()  # the state kinds the transfer moved
    objects_sent: int = 0  # sharded objects (`_extra_state`) this rank sent to another
    object_bytes: int = 0  # their serialised bytes, sent and received
    phases: dict = field(default_factory=dict)
    # seconds of what was prepared in the background while A trained (not in the pause)
    background: dict = field(default_factory=dict)

    @property
    def pause_seconds(self) -> float:
        return sum(v for k, v in self.phases.items() if k != "groups")


@dataclass
class SwitchResult:
    objs: Any  # the builder's objects at B, or None on a rank that is not in B
    layout: Layout
    placement: Placement
    groups: Optional[LayoutGroups]
    scalars: Optional[Scalars]
    report: SwitchReport
    aborted: Optional[str] = None  # why every rank stays at A (the objects at B are discarded)


@dataclass
class Prepared:
    """Layout B made ready for a switch from A: built (no weights), bound, checked against
    the analytic layout, planned and scheduled. Nothing of A is read, so this can run in
    the background while A trains (elastic.device_manager), leaving only the data
    movement to the pause. `error` (this rank's) makes the switch abort at its first vote.
    B's objects hold storage: a Prepared that is not switched to must be released.

    Filled in step by step by `switch.prepare_switch` (the fields after `error` stay
    empty when a step failed); the switch only reads it, except `drop_source`."""

    src: Layout
    src_placement: Placement
    dst: Layout
    dst_placement: Placement
    groups: LayoutGroups
    kinds: tuple[str, ...]
    unavailable: tuple[int, ...] = ()
    background: bool = False
    phases: dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None
    objs: Any = None  # B's objects (the builder's type), None on a rank outside B
    live: Optional[LiveState] = None
    plan: Optional[Plan] = None  # or a routing.metadata_plan.MetadataPlan
    padding_plan: Any = None  # the vocab padding's, when made from the live metadata
    object_plan: Optional[ObjectPlan] = None  # the sharded objects' (object_carry)
    rounds: list[Round] = field(default_factory=list)
    # this rank's pieces, materialised once: local copies, then each round's sends + recvs
    local_pieces: list[Piece] = field(default_factory=list)
    round_pieces: list[list[Piece]] = field(default_factory=list)
    # the destination views of the pieces this rank receives or copies
    dst_views: dict[Piece, torch.Tensor] = field(default_factory=dict)
    # A's side bound too (when given A's objects and A had taken a step): the binding, the
    # fingerprint of the storage it views and the source views of this rank's pieces. The
    # switch uses them only if A's storage still has that fingerprint at the pause.
    src_live: Optional[LiveState] = None
    src_fingerprint: Optional[tuple] = None
    src_views: dict[Piece, torch.Tensor] = field(default_factory=dict)

    def drop_source(self) -> None:
        """Forget A's binding: its views keep A's storage alive."""
        self.src_live, self.src_fingerprint, self.src_views = None, None, {}

    def check_for(self, src: Layout, src_placement: Placement, dst: Layout,
                  kinds: tuple[str, ...], unavailable: tuple[int, ...]) -> None:
        """SwitchError unless this is the preparation of exactly that switch."""
        if (self.src, self.src_placement, self.dst, self.kinds, self.unavailable) != \
                (src, src_placement, dst, kinds, unavailable):
            raise SwitchError(f"prepared switch {self.src} -> {self.dst} ({self.kinds}) does "
                              f"not match the requested {src} -> {dst} ({kinds})")


__all__ = ["Builder", "LayoutGroups", "SwitchOptions", "SwitchError", "Scalars",
           "SwitchReport", "SwitchResult", "Prepared", "PLACEMENT_POLICIES"]
