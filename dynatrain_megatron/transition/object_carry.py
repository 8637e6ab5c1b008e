"""Carry the sharded objects (a module's `_extra_state`) from A to B as dist_checkpointing would.

A `ShardedObject` cannot be resharded (`adapters.sharded_objects`): a save at A writes the
main replica's value under its unique key, and a load at B gives each rank asking for a
unique key that value, or fails when the checkpoint does not hold the key. A switch does
the same, in two halves:
  - in the preparation (background, while A trains): every rank's unique keys at A (and
    which it holds as the main replica) and at B are gathered, and the object plan
    (`object_plan`: for each B rank and key, the A rank that sends it) is made, the same on
    every rank: with the records of a plan made from the live metadata, or, for a plan
    from the analytic layout, on B's transfer group where some rank's objects hold state
    (`plan_objects`: one 4-byte agreement otherwise). A key of B that A does not hold is
    the load's failure: the preparation fails, and the switch is refused at its first
    vote, before anything moved;
  - in the pause, after A's last step (the values change with training): each source
    reads and serialises its objects once (`LiveState.read_objects`), sends every
    destination its objects in one message, after one of their sizes (batched
    point-to-point over the transport, on the transfer group's device: NCCL or gloo), and
    each destination sets them on its modules as Megatron-LM's load does
    (`LiveState.write_objects`). A copy to the same rank is serialised too: B never
    shares an object with A, as after a load.
After a rank death, a key whose main replica died comes from a surviving replica (the
lowest rank holding one), which holds the same object wherever the model's replicas agree.
"""
from __future__ import annotations

import logging
import pickle
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..adapters.live import LiveState, unwrap
from ..adapters.sharded_objects import (ObjectCarryError, ObjectSlot, chunk_sharded_state_dict,
                                        deserialize, object_slots)
from .transport import Transport

log = logging.getLogger("dynatrain")


class ObjectPlanFailed(ObjectCarryError):
    """The object plan could not be made, on every rank alike. `reported_here`: whether
    this rank reports it at the switch's vote (one rank does: the vote of one is enough to
    refuse the switch, and its reason then reads as one line, not one per rank)."""

    def __init__(self, message: str, *, reported_here: bool) -> None:
        super().__init__(message)
        self.reported_here = reported_here


@dataclass(frozen=True, slots=True, order=True)
class ObjectRoute:
    """Object `unique_key` goes from device `src` (A) to device `dst` (B)."""

    src: int
    dst: int
    unique_key: str

    def __str__(self) -> str:
        return f"{self.unique_key}: {self.src}->{self.dst}"


@dataclass(frozen=True, slots=True)
class ObjectPlan:
    """Every object route of a switch, sorted (the message order on every rank)."""

    routes: tuple[ObjectRoute, ...] = ()

    def __post_init__(self) -> None:
        if list(self.routes) != sorted(set(self.routes)):
            raise ObjectCarryError(f"object routes must be sorted and distinct: {self.routes[:4]}")

    def sends(self, me: int) -> dict[int, list[str]]:
        """Keys this device sends, by destination."""
        out: dict[int, list[str]] = defaultdict(list)
        for r in self.routes:
            if r.src == me:
                out[r.dst].append(r.unique_key)
        return dict(out)

    def recvs(self, me: int) -> dict[int, list[str]]:
        """Keys this device receives, by source."""
        out: dict[int, list[str]] = defaultdict(list)
        for r in self.routes:
            if r.dst == me:
                out[r.src].append(r.unique_key)
        return dict(out)


def object_plan(src: Sequence[tuple[str, int, bool]], dst: Sequence[tuple[str, int]],
                unavailable: Sequence[int] = ()) -> ObjectPlan:
    """Pure: the routes from A's holders `src` (unique key, device, main replica) to B's
    slots `dst` (unique key, device). The source of a key is its main replica; where that
    device is `unavailable` (dead), the lowest surviving holder. Raises ObjectCarryError
    naming every key of B that no (living) A rank holds: dist_checkpointing's load fails
    on them (an object sharded differently at B)."""
    gone = set(unavailable)
    main: dict[str, int] = {}
    other: dict[str, int] = {}
    for key, dev, is_main in src:
        if dev in gone:
            continue
        into = main if is_main else other
        into[key] = min(dev, into.get(key, dev))
    routes, missing = set(), set()
    for key, dev in dst:
        frm = main.get(key, other.get(key) if gone else None)
        if frm is None:
            missing.add(key)
        else:
            routes.add(ObjectRoute(frm, dev, key))
    if missing:
        shown = sorted(missing)
        raise ObjectCarryError(
            f"{len(shown)} sharded object(s) of B are not held at A (sharded differently; "
            f"dist_checkpointing's load would fail): {', '.join(shown[:3])}"
            + (f" (+{len(shown) - 3} more)" if len(shown) > 3 else ""))
    return ObjectPlan(tuple(sorted(routes)))


def slots_of_model(model: Sequence[torch.nn.Module]) -> list[ObjectSlot]:
    """The object slots of a model's chunks, read from their sharded metadata (keys only:
    safe while the model trains in another thread, as binding it is)."""
    return [s for ci, m in enumerate(model)
            for s in object_slots(ci, chunk_sharded_state_dict(unwrap(m)))]


def gather_object_plan(src_slots: Optional[Sequence[ObjectSlot]],
                       dst_slots: Optional[Sequence[ObjectSlot]], group: Any = None,
                       unavailable: Sequence[int] = (),
                       error: Optional[str] = None) -> ObjectPlan:
    """Collective over `group` (every rank of the world): every rank's unique keys at A
    and B, gathered, and the object plan made from them (`object_plan`, the same on every
    rank). A rank that failed before (`error`) still joins; then every rank raises
    ObjectCarryError with the reasons, as it does for a key B asks for that A lacks."""
    me = dist.get_rank()
    # A's other replicas only matter when a main one may be dead
    mine: Any = error if error is not None else (
        me, [(s.unique_key, s.main) for s in src_slots or () if s.main or unavailable],
        sorted({s.unique_key for s in dst_slots or ()}))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    failed = [x for x in everyone if isinstance(x, str)]
    if failed:  # each failed rank reports its own reason at the vote
        raise ObjectPlanFailed("gathering the sharded objects' keys failed: "
                               + "; ".join(failed[:4]), reported_here=error is not None)
    src = [(k, dev, main) for dev, a, _ in everyone for k, main in a]
    dst = [(k, dev) for dev, _, b in everyone for k in b]
    try:
        plan = object_plan(src, dst, unavailable)
    except ObjectCarryError as e:  # the same on every rank: the group's first reports it
        raise ObjectPlanFailed(str(e), reported_here=me == min(d for d, _, _ in everyone)) from e
    log.debug("rank %d: %d sharded object route(s) (%d B of keys gathered)", me,
              len(plan.routes), len(pickle.dumps(mine)))
    return plan


def plan_once(src: Sequence[tuple[str, int, bool]], dst: Sequence[tuple[str, int]],
              unavailable: Sequence[int], reporter: bool, switch: str) -> Optional[ObjectPlan]:
    """`object_plan` of records every rank holds alike: where it cannot be made, the
    `reporter` rank raises and the others return None (the reporter's vote refuses the
    switch, and its reason reads as one line, not one per rank)."""
    try:
        return object_plan(src, dst, unavailable)
    except ObjectCarryError as e:
        if reporter:
            raise
        log.info("rank %d: the switch %s will be refused: %s", dist.get_rank(), switch, e)
        return None


# the flag of `plan_objects`: no rank's objects hold state / some do / a preparation failed
_NONE, _SOME, _FAILED = 0, 1, 2


def plan_objects(holds_a: bool, bound: Optional[LiveState], model: Optional[Sequence[Any]],
                 dst_live: Optional[LiveState], group: Any, unavailable: Sequence[int],
                 joined: list, switch: str, device: torch.device) -> Optional[ObjectPlan]:
    """The objects' plan of a switch planned from the analytic layout (collective over
    `group`, the world): one 4-byte all-reduce says whether any rank's objects at B (or
    at A, where bound: `bound`) hold state (a value, not None). Only then are the keys
    gathered (`gather_object_plan`; A's from `bound`, else read from A's `model` chunks
    where this rank `holds_a`), so that a job without such objects pays no collective
    that grows with the world. Objects whose value is None everywhere stay as built (a
    load would hand them None). `joined[0]` is set once this rank joined the flag (a
    failed preparation joins it with `join_failed` otherwise)."""
    slots = list(dst_live.objects if dst_live is not None else ()) + list(
        bound.objects if bound is not None else ())
    joined[0] = True
    if _agree_flag(_SOME if any(s.holds_state for s in slots) else _NONE, group,
                   device) != _SOME:
        return None
    me = dist.get_rank()
    try:
        held = (bound.objects if bound is not None else slots_of_model(model or ())
                ) if holds_a else None
    except Exception as e:  # noqa: BLE001 - joins the gather failed
        gather_object_plan(None, None, group, error=f"rank {me}: reading A's sharded "
                                                    f"objects: {type(e).__name__}: {e}")
        raise
    try:
        return gather_object_plan(held, dst_live.objects if dst_live is not None else None,
                                  group, unavailable)
    except ObjectPlanFailed as e:
        if e.reported_here:
            raise
        log.info("rank %d: the switch %s will be refused: %s", me, switch, e)
        return None


def join_failed(group: Any, device: torch.device) -> None:
    """A rank whose preparation failed before `plan_objects` joins its flag (the others
    then gather nothing: this rank's vote refuses the switch)."""
    _agree_flag(_FAILED, group, device)


def _agree_flag(mine: int, group: Any, device: torch.device) -> int:
    flag = torch.tensor([mine], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


@dataclass(frozen=True, slots=True)
class ObjectCarryStats:
    """What one rank's carry did: objects sent / received, their bytes, and the seconds
    spent reading and serialising A's values, exchanging and setting them on B."""

    sent: int = 0
    received: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    read_s: float = 0.0
    exchange_s: float = 0.0
    set_s: float = 0.0


def _payload(blobs: Sequence[Optional[bytes]],
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One message of sizes (-1: a value this rank could not read) and one of bytes."""
    sizes = torch.tensor([-1 if b is None else len(b) for b in blobs], dtype=torch.int64)
    data = torch.frombuffer(bytearray(b"".join(b for b in blobs if b)) or bytearray(1),
                            dtype=torch.uint8)
    return sizes.to(device), data.to(device)


def carry_objects(plan: Optional[ObjectPlan], me: int, src_live: Optional[LiveState],
                  dst_live: Optional[LiveState], transport: Transport, *, device: torch.device,
                  tag: int = 0, timeout: Optional[float] = None
                  ) -> tuple[ObjectCarryStats, list[str]]:
    """This rank's part of the carry (module doc), in the pause: read, exchange, set. The
    exchange is two batched rounds (sizes, then the bytes) that every rank posts, empty or
    not. Returns the stats and this rank's errors (for the commit vote; B alone is
    written, so an error leaves A as it was)."""
    t = time.perf_counter
    if plan is None or not plan.routes:
        return ObjectCarryStats(), []
    sends, recvs = plan.sends(me), plan.recvs(me)
    errors: list[str] = []
    try:
        t0 = t()
        wanted = {k for keys in sends.values() for k in keys}
        blobs: dict[str, bytes] = {}
        try:
            blobs = src_live.read_objects(wanted) if wanted and src_live is not None else {}
        except Exception as e:  # noqa: BLE001 - still posts its part of the exchange
            errors.append(f"rank {me}: reading the sharded objects: {type(e).__name__}: {e}")
        read_s = t() - t0
        t0 = t()
        local = {k: blobs.get(k) for k in sends.pop(me, [])}
        recvs.pop(me, None)
        out = {peer: _payload([blobs.get(k) for k in keys], device)
               for peer, keys in sends.items()}
        sizes_in = {peer: torch.empty(len(keys), dtype=torch.int64, device=device)
                    for peer, keys in recvs.items()}
        transport.start({p: [s] for p, (s, _) in out.items()},
                        {p: [s] for p, s in sizes_in.items()}, tag=tag).wait(timeout)
        counts = {p: [int(n) for n in s.cpu().tolist()] for p, s in sizes_in.items()}
        data_in = {p: torch.empty(max(1, sum(max(0, n) for n in c)), dtype=torch.uint8,
                                  device=device) for p, c in counts.items()}
        transport.start({p: [d] for p, (_, d) in out.items()},
                        {p: [d] for p, d in data_in.items()}, tag=tag).wait(timeout)
        received: dict[str, Optional[bytes]] = dict(local)
        for p, keys in recvs.items():
            raw, at = data_in[p].cpu().numpy().tobytes(), 0
            for k, n in zip(keys, counts[p]):
                received[k], at = (None, at) if n < 0 else (raw[at:at + n], at + n)
        exchange_s = t() - t0
        lacking = sorted(k for k, v in received.items() if v is None)
        if lacking and not errors:
            raise ObjectCarryError(f"rank {me}: no value arrived for {lacking[:3]}")
        if errors:
            return ObjectCarryStats(), errors
        t0 = t()
        if dst_live is not None:
            dst_live.write_objects({k: deserialize(v) for k, v in received.items()})
        stats = ObjectCarryStats(
            sent=sum(map(len, sends.values())), received=len(received) - len(local),
            sent_bytes=sum(int(s.clamp(min=0).sum()) for s, _ in out.values()),
            recv_bytes=sum(sum(c) for c in counts.values()), read_s=read_s,
            exchange_s=exchange_s, set_s=t() - t0)
        log.debug("rank %d: sharded objects: %d sent, %d received (%d B, %d B), read %.4f s, "
                  "exchanged %.4f s, set %.4f s", me, stats.sent, stats.received,
                  stats.sent_bytes, stats.recv_bytes, stats.read_s, stats.exchange_s,
                  stats.set_s)
        return stats, []
    except Exception as e:  # noqa: BLE001 - reported at the commit vote
        return ObjectCarryStats(), errors + [f"rank {me}: carrying the sharded objects: "
                                             f"{type(e).__name__}: {e}"]


__all__ = ["ObjectCarryStats", "ObjectPlan", "ObjectPlanFailed", "ObjectRoute", "carry_objects",
           "gather_object_plan", "join_failed", "object_plan", "plan_objects", "plan_once",
           "slots_of_model"]
