"""The control plane of a switch at thousands of ranks, emulated rank by rank.

For a sample of ranks that covers every distinct role of a switch A -> B (module
`role_sample`), this runs the project's own code, as a rank of a real job would run it
for one switch, with `torch.distributed` replaced by a recording stand-in
(`bench.fake_dist.RecordingDist`: nothing connects, no data moves):

  1. B's placement (`transition.switch.choose_dst_placement`; pure, every rank alike);
  2. A's groups (`elastic.groups.build_groups`, made at start: counted apart) and B's;
  3. the preparation (`transition.switch.prepare_switch`: plan, schedule, this rank's
     pieces and the check of its part of the plan) with a builder that builds nothing;
  4. one ready vote on the control group (`elastic.communicators.everyone_ok`), the
     warm-up of B's communicators (`warm_up_groups`; not its pipeline pairs'
     point-to-point exchange, `warm_up_pipeline`, which the stand-in does not record);
  5. the switch itself (`transition.switch.switch_layout` with the prepared state): its
     two votes, the transfer's messages as the executor derives them from its pieces
     (`RecordingExecutor`: one batched exchange per round and one for its checksums),
     the vocab-padding gather, the scalars' broadcast where a rank of B held none at A;
  6. the release of A's groups.

Counted per rank (`fake_dist.Counts`): `new_group` calls (member or not), communicators
created, gloo groups and connections, store operations, collectives with their bytes
and every one whose group is the world, plus point-to-point messages, bytes and peers.
The vocab-padding gather moves objects the emulation has none of: their size is the
modelled one (`padding_object_bytes`).
"""
from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence
from unittest import mock

import torch

from ..routing.piece import Piece
from ..vps.fragment import OPT_KINDS
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.placement import Placement
from .fake_dist import RecordingDist

log = logging.getLogger("dynatrain")

FAKE_DEVICE = "cuda:emulated"  # what `group_device` returns on a GPU job: eager NCCL init
FP32 = 4


def padding_object_bytes(spec: ModelSpec, src: Layout, kinds: Sequence[str] = OPT_KINDS) -> int:
    """Modelled size of the largest object of the vocab-padding gather
    (`transition.vocab_padding`): A's padding rows [V, V'_A) of the embedding and (untied)
    output layer, every kind moved, fp32, as if one rank held them all (an upper bound:
    the rows sit in the last TP rank's vocab shard, split over its DistOpt shards)."""
    rows = spec.padded_vocab_size(src.tp) - spec.vocab_size
    tensors = 1 if spec.tied else 2
    return rows * spec.hidden_size * FP32 * len(kinds) * tensors


@dataclass
class RankRecord:
    """One emulated rank: its role and what it did (counts, messages, wall time)."""

    rank: int
    role: str
    at_start: dict  # A's groups, made when the job started (not part of the switch)
    switch: dict  # everything of one switch, B's groups to the release of A
    p2p: dict = field(default_factory=dict)
    seconds: float = 0.0


class _NoBuild:
    """A builder that builds nothing: the emulated rank holds no model at A or B, so the
    preparation is the routing part (plan, schedule, pieces, checks)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def bucket_size(self, layout: Layout) -> Optional[int]:
        return None

    def build_detached(self, layout: Layout, groups: Any) -> Any:
        return None

    def activate(self, objs: Any) -> None:  # pragma: no cover - never called (no objs)
        raise AssertionError("nothing was built")


class RecordingTransport:
    """A transport that moves nothing: each batched exchange (the executor's rounds come
    through `RecordingExecutor`; the vocab-padding exchange calls `start` itself) is
    counted with its messages, bytes and peers."""

    def __init__(self) -> None:
        self.record = dict(exchanges=0, messages=0, bytes=0, peers=set())

    def start(self, sends, recvs, tag: int = 0):
        r = self.record
        r["exchanges"] += 1
        for box in (sends, recvs):
            for peer, msgs in box.items():
                r["peers"].add(peer)
                r["messages"] += len(msgs)
                r["bytes"] += sum(m.numel() * m.element_size() for m in msgs)
        return self

    def wait(self, timeout=None) -> None:
        return None

    def carry_padding(self, plan, me: int, old, new, transport=None, *, tag: int = 0,
                      timeout=None) -> tuple[int, list[str]]:
        """`transition.vocab_padding.carry_vocab_padding` without data: the plan's pieces
        of this rank (`PaddingPlan.for_device`), remote ones posted as one batched
        exchange (fp32: 4 bytes an element), as the real one posts them."""
        sends, recvs = plan.for_device(me)
        out = [p for p in sends if p.dst != me]
        inc = [p for p in recvs if p.src != me]
        if out or inc:
            r = self.record
            r["exchanges"] += 1
            r["peers"].update({p.dst for p in out} | {p.src for p in inc})
            r["messages"] += len(out) + len(inc)
            r["bytes"] += 4 * sum(p.numel for p in out + inc)
        return 0, []


class RecordingExecutor:
    """The executor's messages without their data: per round and peer, the packed message
    of the small pieces and one per large piece (`transition.executor.Executor._split`),
    posted as one batched exchange; then, when checksums are on, one int64 message per
    peer and direction with the sums of that peer's messages."""

    def __init__(self, rank: int, transport: Any, src_view=None, dst_view=None, device=None,
                 *, tag: int = 0, timeout=None, checksums: bool = True, faults=None) -> None:
        from ..transition.executor import ExecStats

        self.rank, self.checksums, self.transport = rank, checksums, transport
        self.stats = ExecStats()
        self.record = dict(batched_exchanges=0, messages_sent=0, messages_recv=0,
                           bytes_sent=0, bytes_recv=0, peers=set(), checksum_messages=0,
                           checksum_bytes=0, local_pieces=0, local_bytes=0,
                           rounds=[])

    def run(self, local: Sequence[Piece], rounds: Sequence[Sequence[Piece]]) -> list[str]:
        from ..transition.executor import PACK_ALIGN, Executor, peer_pieces

        r = self.record
        r["local_pieces"] += len(local)
        r["local_bytes"] += sum(p.nbytes for p in local)
        for pieces in rounds:
            out, inc = peer_pieces(pieces, self.rank)
            sent = recv = ns = nr = 0
            for side, peers in (("send", out), ("recv", inc)):
                for peer, ps in peers.items():
                    small, large = Executor._split(ps)
                    nmsg = (1 if small else 0) + len(large)
                    nbytes = (sum(-(-p.nbytes // PACK_ALIGN) * PACK_ALIGN for p in small)
                              + sum(p.nbytes for p in large))
                    if side == "send":
                        ns, sent = ns + nmsg, sent + nbytes
                    else:
                        nr, recv = nr + nmsg, recv + nbytes
                    r["peers"].add(peer)
                    if self.checksums:
                        r["checksum_messages"] += 1
                        r["checksum_bytes"] += 8 * nmsg
            r["batched_exchanges"] += 1 + (1 if self.checksums and (out or inc) else 0)
            r["messages_sent"] += ns
            r["messages_recv"] += nr
            r["bytes_sent"] += sent
            r["bytes_recv"] += recv
            r["rounds"].append((ns, nr, sent, recv))
            self.stats.sent_bytes += sent
            self.stats.recv_bytes += recv
            self.stats.rounds += 1
        return []


@contextlib.contextmanager
def recording(fake: RecordingDist, executors: list,
              wire: Optional[RecordingTransport] = None) -> Iterator[None]:
    """Every module of the control path sees `fake` as `torch.distributed` (and a CPU
    tensor for its small collectives, where a GPU job would use its device)."""
    from ..compat import torch_features
    from ..elastic import communicators, groups
    from ..transition import object_carry, switch, transport

    def make_executor(*a, **kw):
        ex = RecordingExecutor(*a, **kw)
        executors.append(ex)
        return ex

    cpu = lambda group=None: torch.device("cpu")  # noqa: E731
    patches = [mock.patch.object(m, "dist", fake)
               for m in (groups, communicators, switch, transport, torch_features, object_carry)]
    patches += [mock.patch.object(m, "collective_device", cpu)
                for m in (switch, communicators, transport)]
    patches += [mock.patch.object(groups, "group_device",
                                  lambda: FAKE_DEVICE if fake.backend == "nccl" else None),
                mock.patch.object(switch, "Executor", make_executor),
                mock.patch.object(switch, "carry_vocab_padding",
                                  (wire or RecordingTransport()).carry_padding),
                mock.patch.object(communicators, "_CONTROL", {"group": None, "default": None})]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def role_sample(src: Layout, src_placement: Placement, dst: Layout, dst_placement: Placement,
                world: int, extra: int = 8, seed: int = 0) -> dict[int, str]:
    """Ranks covering every distinct role of a switch, with a name for each: for each
    side, the devices whose coordinate on each axis is its first, second or last value
    (group rank 0 or not, first and last pipeline stage, ...); every device's membership
    (A and B, A only, B only, neither); world rank 0 and the last; plus `extra` drawn at
    random (seeded). Every rank of the same role does the same work: the counts of the
    sampled ranks are every rank's."""
    out: dict[int, str] = {}

    def side(lay: Layout, pl: Placement, tag: str) -> None:
        coords = [lay.coords(v) for v in range(lay.world_size)]
        for axis in ("tp", "cp", "dp", "pp", "ep", "etp", "edp"):
            size = {"edp": lay.edp}.get(axis, getattr(lay, axis))
            for val in sorted({0, min(1, size - 1), size - 1}):
                v = next(i for i, c in enumerate(coords) if getattr(c, axis) == val)
                out.setdefault(pl.devices[v], f"{tag} {axis}={val}")

    side(dst, dst_placement, "B")
    side(src, src_placement, "A")
    a, b = set(src_placement.devices), set(dst_placement.devices)
    for name, s in (("A only", a - b), ("B only", b - a),
                    ("neither", set(range(world)) - a - b)):
        if s:
            out.setdefault(min(s), name)
    out.setdefault(0, "world rank 0")
    out.setdefault(world - 1, "last world rank")
    rng = random.Random(seed)
    for r in rng.sample(range(world), min(extra, world)):
        out.setdefault(r, "random")
    return dict(sorted(out.items()))


def emulate_rank(spec: ModelSpec, src: Layout, src_placement: Placement, dst: Layout,
                 dst_placement: Placement, rank: int, world: int, *, role: str = "",
                 backend: str = "nccl", ranks_per_node: int = 8,
                 memory_budget: Optional[int] = None) -> RankRecord:
    """One rank's control plane for the switch A -> B (module doc, steps 2-6)."""
    from ..elastic.communicators import (control_group, create_control_group, everyone_ok,
                                         warm_up_groups)
    from ..elastic.groups import build_groups
    from ..transition.switch import prepare_switch, switch_layout
    from ..transition.switch_types import SwitchOptions

    t0 = time.perf_counter()
    pad = padding_object_bytes(spec, src)
    fake = RecordingDist(rank, world, backend,
                         object_bytes=lambda o: pad if isinstance(o, list) else 0)
    execs: list = []
    wire = RecordingTransport()
    with recording(fake, execs, wire):
        create_control_group()  # the job's CPU group over the world, made at start
        groups_a = build_groups(src, src_placement)
        at_start = fake.counts.as_dict()
        fake.counts = type(fake.counts)()
        builder = _NoBuild(spec)
        options = SwitchOptions(ranks_per_node=ranks_per_node, memory_budget=memory_budget)
        groups_b = build_groups(dst, dst_placement)
        prep = prepare_switch(spec, builder, src, src_placement, dst, groups_b, options,
                              background=True)
        if prep.error:
            raise RuntimeError(prep.error)
        everyone_ok(True, control_group())  # the ready vote of the step it lands at
        warm_up_groups(groups_b)
        res = switch_layout(spec, builder, None, src, src_placement, dst, build_groups, None,
                            options, prepared=prep, transport=wire)
        if res.aborted:
            raise RuntimeError(res.aborted)
        groups_a.destroy()
    rec = execs[0].record if execs else {}
    p2p = {k: (len(v) if k == "peers" else v) for k, v in rec.items() if k != "rounds"}
    # the exchanges made on the transport outside the executor's rounds: the padding rows
    w = wire.record
    p2p.update(padding_exchanges=w["exchanges"], padding_messages=w["messages"],
               padding_bytes=w["bytes"], padding_peers=len(w["peers"]))
    return RankRecord(rank, role, at_start, fake.counts.as_dict(), p2p,
                      time.perf_counter() - t0)


@dataclass
class Emulation:
    """The sampled ranks of one switch and what they did."""

    src: str
    dst: str
    world: int
    backend: str
    ranks: list[RankRecord]
    placement_seconds: float
    seconds: float

    def max_of(self, part: str, key: str) -> int:
        return max(_get(getattr(r, part), key) for r in self.ranks)

    def summary(self) -> dict:
        """Per count, the largest value over the sampled ranks (what the slowest rank
        does), for the switch and for A's start."""
        keys = ("new_group_calls", "non_member_calls", "member_groups", "communicators",
                "gloo_groups", "gloo_connections", "store_sets", "store_gets", "destroyed",
                "largest_group")
        out: dict[str, Any] = {f"switch_{k}": self.max_of("switch", k) for k in keys}
        out.update({f"start_{k}": self.max_of("at_start", k) for k in keys})
        names = sorted({n for r in self.ranks for n in r.switch["collectives"]})
        out["switch_collectives"] = {n: max(r.switch["collectives"].get(n, 0)
                                            for r in self.ranks) for n in names}
        out["switch_collective_bytes"] = {n: max(r.switch["collective_bytes"].get(n, 0)
                                                 for r in self.ranks) for n in names}
        wc: dict[str, int] = {}
        for r in self.ranks:
            for name, _, b in r.switch["world_collectives"]:
                wc[name] = max(wc.get(name, 0), b)
        out["switch_world_collective_bytes"] = wc
        for k in ("batched_exchanges", "messages_sent", "messages_recv", "bytes_sent",
                  "bytes_recv", "peers", "checksum_messages", "padding_exchanges",
                  "padding_messages", "padding_bytes", "padding_peers"):
            out[f"p2p_{k}"] = max((r.p2p.get(k, 0) for r in self.ranks), default=0)
        out.update(world=self.world, backend=self.backend, sampled_ranks=len(self.ranks),
                   roles=sorted({r.role.split("=")[0] for r in self.ranks}),
                   placement_seconds=self.placement_seconds,
                   emulation_seconds=self.seconds,
                   seconds_per_rank=max(r.seconds for r in self.ranks))
        return out


def _get(d: dict, key: str) -> int:
    return int(d.get(key, 0))


def emulate_switch(spec: ModelSpec, src: Layout, dst: Layout, *, ranks_per_node: int = 8,
                   memory_budget: Optional[int] = None, backend: str = "nccl",
                   ranks: Optional[Sequence[int]] = None, extra: int = 8,
                   placement: str = "best") -> Emulation:
    """Emulate the switch `src` -> `dst` on `max(world A, world B)` ranks: B's placement
    once (it is the same pure computation on every rank, and timed), then every rank of
    `ranks` (default: `role_sample`)."""
    from ..transition.switch import choose_dst_placement

    t0 = time.perf_counter()
    world = max(src.world_size, dst.world_size)
    src_placement = Placement.default(src.world_size)
    t1 = time.perf_counter()
    dst_placement = choose_dst_placement(spec, _NoBuild(spec), src, src_placement, dst,
                                         tuple(range(dst.world_size)), placement,
                                         ranks_per_node)
    placement_seconds = time.perf_counter() - t1
    roles = (role_sample(src, src_placement, dst, dst_placement, world, extra)
             if ranks is None else {int(r): "given" for r in ranks})
    recs = [emulate_rank(spec, src, src_placement, dst, dst_placement, r, world, role=name,
                         backend=backend, ranks_per_node=ranks_per_node,
                         memory_budget=memory_budget)
            for r, name in roles.items()]
    return Emulation(str(src), str(dst), world, backend, recs, placement_seconds,
                     time.perf_counter() - t0)


__all__ = ["Emulation", "RankRecord", "RecordingExecutor", "emulate_rank", "emulate_switch",
           "padding_object_bytes", "recording", "role_sample"]
