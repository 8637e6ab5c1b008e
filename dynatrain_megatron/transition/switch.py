"""Switch a live training state from layout A to layout B, in memory, at a step boundary.

Order of a switch (every rank of the union of A's and B's devices calls `switch_layout`):
  1. validate B against the model and the world (nothing has moved yet);
  2. choose B's placement (which device takes which virtual rank) or take the default;
  3. B's process groups (prebuilt in the background by the device manager, or built now);
  4. build B's model/DDP/optimizer on B's groups without initialising weights;
  5. bind A's and B's live state and check both against the analytic layouts;
  6. plan (identical on every rank) and schedule under the budget: from the analytic
     layouts, with no metadata exchanged, or, where the builder says the analytic layout
     does not describe the model (`metadata_exchange.plans_from_metadata`), from every
     rank's live metadata of A and B, gathered in the preparation (checked against the
     analytic layouts only where both describe a tensor);
  7. execute: one batched exchange per round, local copies while the first is on the wire;
  8. rebuild weights from fp32 masters where we chose not to move them, carry scalars
     (optimizer step, LR scheduler, grad scaler, iteration, consumed samples);
  9. release A's objects and groups.
`transition` never imports `mcore` or `loop`: the caller passes a *builder* and a group factory
(the types of these seams, the options and the prepared state: `switch_types`).
"""
from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..compat.torch_features import ordered_groups
from ..adapters.live import (LiveState, fp32_copies_of, optimizer_state_complete,
                             optimizers_of, storage_fingerprint)
from ..adapters.verify import check_live_matches_analytic, check_live_matches_analytic_where_both
from ..routing.piece import Piece
from ..routing.placement_search import best_rank_ordered, placement_choice
from ..routing.plan import device_plan_errors
from ..routing.planner import build_plan
from ..routing.regions import RoutingError
from ..routing.schedule import schedule
from ..vps.analytic import analytic_layout
from ..vps.errors import LayoutError
from ..vps.fragment import KINDS, OPT_KINDS
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.placement import DEFAULT_ORDER, Placement, megatron_rank_order
from ..vps.naming import DTYPE_BYTES
from .metadata_exchange import (gather_metadata, plan_from_metadata, plans_from_metadata,
                                unlike_analytic)
from .object_carry import ObjectCarryStats, carry_objects, join_failed, plan_objects, plan_once
from .scalars import write_scalars
from .vocab_padding import carry_vocab_padding, padding_plan
from .executor import PACK_ALIGN, Executor
from .faults import FaultPlan
from .switch_types import (Builder, LayoutGroups, Prepared, Scalars, SwitchError,
                           SwitchOptions, SwitchReport, SwitchResult)
from .transport import (TorchP2PTransport, Transport, abort_group, collective_device,
                        control_group, drop_in_background)

log = logging.getLogger("dynatrain")


def prepare_switch(spec: ModelSpec, builder: Builder, src: Layout, src_placement: Placement,
                   dst: Layout, groups: LayoutGroups, options: SwitchOptions = SwitchOptions(),
                   *, unavailable: Sequence[int] = (), background: bool = False,
                   faults: Optional[FaultPlan] = None, src_objs: Any = None,
                   src_state: Optional[LiveState] = None,
                   src_model: Optional[Sequence[Any]] = None) -> Prepared:
    """B's side of a switch (module doc, steps 4-6): never raises, a failure is recorded
    in `error`. `groups` are B's (their placement is B's placement). With
    `options.verify`, B's live fragments are checked against the analytic layout and
    this rank's part of the plan against both layouts (`routing.plan.device_plan_errors`).

    With `src_objs` (A's objects, which may be training in another thread meanwhile), A's
    side is bound and checked here too (`_bind_source`), which takes it out of the pause
    as well; A's values are not read.

    Planned from the live metadata (`plans_from_metadata(builder)`), this is collective
    over the world (B's transfer group): every rank binds what it holds at A (`src_objs`,
    or `src_state` already bound) and at B, and all gather it before planning.

    The sharded objects' plan (`object_carry`) comes with a metadata plan's records, or,
    planned from the analytic layout, from a collective over the world (B's transfer
    group) of its own; A's keys are then read from `src_state`, A's binding, `src_objs`
    or `src_model` (A's model chunks, given for that alone). A key of B that A lacks
    fails the preparation, as it fails dist_checkpointing's load."""
    t = time.perf_counter
    me = dist.get_rank()
    dst_placement = groups.placement
    kinds = options.kinds
    verify = options.verify
    prep = Prepared(src, src_placement, dst, dst_placement, groups, kinds, tuple(unavailable),
                    background=background)
    vr_b = dst_placement.virtual_rank(me)
    metadata = plans_from_metadata(builder)
    # a metadata plan's gather, or an analytic plan's agreement on the objects: every rank
    # joins it, even after a failure
    gathered = [False]
    flagged = [False]
    try:
        t0 = t()
        prep.objs = builder.build_detached(dst, groups) if vr_b is not None else None
        prep.phases["build"] = t() - t0
        t0 = t()
        if prep.objs is not None:
            prep.live = LiveState(prep.objs.model, prep.objs.optimizer, vr_b, spec.vocab_size)
        prep.phases["bind"] = t() - t0
        t0 = t()
        if verify and prep.live is not None:
            _check_analytic(prep.live, spec, builder, dst, vr_b, kinds, metadata)
        if "param" in kinds and "main_param" not in kinds and not options.weights_only \
                and prep.live is not None:  # the masters travel as the weights' own storage
            apart = prep.live.masters_apart_from_weights()
            if apart:
                raise SwitchError(f"B's fp32 masters are not views of its weights ({len(apart)} "
                                  f"boxes, e.g. {apart[:3]}): they must move themselves")
        prep.phases["verify"] = t() - t0
        t0 = t()
        if metadata:
            _plan_from_metadata(prep, spec, src_objs, src_state, options, verify, builder,
                                gathered)
        else:
            prep.plan = build_plan(spec, (src, src_placement), (dst, dst_placement), kinds=kinds,
                                   ranks_per_node=options.ranks_per_node,
                                   bucket_size=(builder.bucket_size(src),
                                                builder.bucket_size(dst)),
                                   unavailable=unavailable)
        prep.rounds = schedule(prep.plan, options.memory_budget, align=PACK_ALIGN)
        prep.phases["plan"] = t() - t0
        t0 = t()
        mine = prep.plan.pieces_for(me)
        prep.local_pieces = [p for p in mine if p.is_local]
        prep.round_pieces = [rnd.sends(me) + rnd.recvs(me) for rnd in prep.rounds]
        if prep.live is not None:
            for p in prep.local_pieces + [p for ps in prep.round_pieces for p in ps]:
                if p.dst_device == me:
                    prep.dst_views[p] = prep.live.view(p.kind, p.dst_chunk,
                                                           p.dst_local_name, p.dst_local_box)
        prep.phases["views"] = t() - t0
        t0 = t()
        if verify and not metadata:  # a metadata plan checks its coverage as it is made
            errs = device_plan_errors(prep.plan, me, mine)
            if errs:
                raise RoutingError(f"the plan {src} -> {dst} is wrong for device {me}: "
                                   + "; ".join(errs[:4]))
        prep.phases["verify"] += t() - t0
        t0 = t()
        if src_objs is not None and not unavailable:
            _bind_source(prep, spec, builder, src_objs, verify, prep.src_live, metadata)
        prep.phases["bind_src"] = t() - t0
        t0 = t()
        if not metadata:  # a metadata plan's objects came with its records
            prep.object_plan = plan_objects(
                prep.src_placement.virtual_rank(me) is not None and me not in unavailable,
                src_state if src_state is not None else prep.src_live,
                src_objs.model if src_objs is not None else src_model, prep.live,
                groups.transfer, unavailable, flagged, f"{src} -> {dst}",
                collective_device(groups.transfer))
        prep.phases["plan"] += t() - t0
        (faults or _NO_FAULTS).fail(me, "prepare", dst=str(dst))
        (faults or _NO_FAULTS).delay_preparation(me, str(dst))
    except Exception as e:  # noqa: BLE001 - every rank learns it at the switch's first vote
        prep.error = f"rank {me}: prepare: {type(e).__name__}: {e}"
        log.error("rank %d: preparing the switch %s -> %s failed (nothing has moved): %s",
                  me, src, dst, e, exc_info=True)
        if metadata and not gathered[0]:  # the others wait in the gather: join it, failed
            try:
                gather_metadata(None, None, kinds, groups.transfer, error=prep.error)
            except Exception:  # noqa: BLE001 - it raises every rank's errors, ours included
                pass
        if not metadata and not flagged[0]:  # and in the objects' agreement
            try:
                join_failed(groups.transfer, collective_device(groups.transfer))
            except Exception:  # noqa: BLE001 - its vote reports the failure that matters
                pass
    return prep


def _check_analytic(live: LiveState, spec: ModelSpec, builder: Builder, layout: Layout,
                    vr: int, kinds: tuple[str, ...], metadata: bool) -> None:
    """A rank's live fragments against the analytic layout: all of them, or, for a switch
    planned from the metadata, the weights of the tensors both describe."""
    al = analytic_layout(spec, layout, builder.bucket_size(layout))
    if metadata:  # the weights' fragments, whatever the switch moves
        check_live_matches_analytic_where_both(live.fragments(("param",)),
                                               al.fragments(vr, ("param",)), vr,
                                               unlike_analytic(builder))
    else:
        check_live_matches_analytic(live.fragments(kinds), al.fragments(vr, kinds), vr)


def _plan_from_metadata(prep: Prepared, spec: ModelSpec, src_objs: Any,
                        src_state: Optional[LiveState], options: SwitchOptions, verify: bool,
                        builder: Builder, gathered: list) -> None:
    """The plan and the padding plan from every rank's live metadata (collective over the
    world, on B's transfer group). A is bound here: from `src_state`, or from `src_objs`
    once its optimizer has state (its first step), which is then kept as the source
    binding if A's storage does not change before the pause."""
    me = dist.get_rank()
    vr_a = prep.src_placement.virtual_rank(me)
    src_live, error = src_state, None
    try:
        if src_live is None and src_objs is not None and vr_a is not None \
                and me not in prep.unavailable:
            if not optimizer_state_complete(src_objs.optimizer):
                raise RuntimeError("A's optimizer has no state yet (no step taken): its live "
                                   "metadata cannot be read")
            fp = storage_fingerprint(src_objs.model, src_objs.optimizer)
            src_live = LiveState(src_objs.model, src_objs.optimizer, vr_a, spec.vocab_size)
            if verify:
                _check_analytic(src_live, spec, builder, prep.src, vr_a, prep.kinds, True)
            prep.src_live, prep.src_fingerprint = src_live, fp
    except Exception as e:  # noqa: BLE001 - raised on every rank by the gather
        error = f"rank {me}: binding A: {type(e).__name__}: {e}"
    gathered[0] = True
    meta = gather_metadata(src_live, prep.live, prep.kinds, prep.groups.transfer, error=error)
    size = DTYPE_BYTES[spec.params_dtype]
    prep.plan, prep.padding_plan = plan_from_metadata(
        meta, src_layout=prep.src, dst_layout=prep.dst,
        src_devices=prep.src_placement.devices, dst_devices=prep.dst_placement.devices,
        kinds=prep.kinds, itemsize={k: size if k == "param" else 4 for k in KINDS},
        ranks_per_node=options.ranks_per_node, unavailable=prep.unavailable)
    prep.object_plan = plan_once(meta.src_objects, meta.dst_objects, prep.unavailable, me == 0,
                                 f"{prep.src} -> {prep.dst}")
    prep.phases["metadata_exchange"] = meta.seconds
    log.info("rank %d: switch %s -> %s planned from the live metadata (%d + %d records, "
             "%d B sent, exchanged in %.3f s)", me, prep.src, prep.dst, len(meta.src),
             len(meta.dst), meta.payload_bytes, meta.seconds)


def _bind_source(prep: Prepared, spec: ModelSpec, builder: Builder, objs: Any,
                 verify: bool, bound: Optional[LiveState] = None,
                 metadata: bool = False) -> None:
    """A's binding, analytic check and source views, kept only if nothing of A's storage
    was reallocated meanwhile. Binding must not create anything in A's optimizer while it
    trains in another thread, so this waits for A's first step (the Adam states exist);
    a failure here is no error: the switch then binds A in the pause (and fails there, at
    its vote, if A is really wrong)."""
    me = dist.get_rank()
    vr_a = prep.src_placement.virtual_rank(me)
    if vr_a is None or not optimizer_state_complete(objs.optimizer):
        return
    try:
        if bound is not None:  # bound and checked for the metadata plan
            fp, live = prep.src_fingerprint, bound
        else:
            fp = storage_fingerprint(objs.model, objs.optimizer)
            live = LiveState(objs.model, objs.optimizer, vr_a, spec.vocab_size)
            if verify:
                _check_analytic(live, spec, builder, prep.src, vr_a, prep.kinds, metadata)
        views = {p: live.view(p.kind, p.src_chunk, p.src_local_name, p.src_local_box)
                 for p in prep.local_pieces + [p for ps in prep.round_pieces for p in ps]
                 if p.src_device == me}
        if storage_fingerprint(objs.model, objs.optimizer) == fp:
            prep.src_live, prep.src_fingerprint, prep.src_views = live, fp, views
        else:
            prep.drop_source()
    except Exception as e:  # noqa: BLE001 - left to the pause, which reports it at the vote
        log.info("rank %d: binding A in the background failed (bound in the pause): %s", me, e)


_ATTEMPTS = {"n": 0}
_NO_FAULTS = FaultPlan()


def _next_attempt() -> int:
    """A message tag per switch attempt, the same on every rank (they all call
    `switch_layout` in the same order): late messages of an abandoned attempt cannot be
    matched by a later one."""
    _ATTEMPTS["n"] += 1
    return _ATTEMPTS["n"] % (1 << 30)


VOTE_TIMEOUT_S = 600.0  # a vote's deadline by default (DYNATRAIN_VOTE_TIMEOUT overrides)
_VOTE_MESSAGE_BYTES = 1024  # a failing rank's reasons, truncated, in a failed vote


class VoteFailed(RuntimeError):
    """A vote did not complete: a peer is gone or hung. No rank got a result (every
    peer's contribution is needed for one), so all of them raise alike; the caller treats
    the world as broken and recovers."""


def vote_deadline(timeout: Optional[float]) -> float:
    """A vote's deadline: well beyond a round's `timeout` (a peer that timed out in the
    transfer still arrives), at least `VOTE_TIMEOUT_S` or its environment override."""
    base = float(os.environ.get("DYNATRAIN_VOTE_TIMEOUT", VOTE_TIMEOUT_S))
    return max(base, 4 * timeout) if timeout else base


def _wait(work, deadline: float, what: str) -> None:
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=deadline))
    except RuntimeError as e:  # gloo: a timed-out or broken collective raises
        raise VoteFailed(f"{what} did not complete within {deadline:.0f} s: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if done is False:
        raise VoteFailed(f"{what} did not complete within {deadline:.0f} s")


def _agree(errors: list[str], deadline: float = VOTE_TIMEOUT_S) -> list[str]:
    """Collective over the world: everyone's errors (empty on every rank: all went well).

    Runs on the job's CPU group (`elastic.communicators.control_group`: gloo, never an
    NCCL communicator, whose abort would hand a rank its own value back as the result),
    with a deadline. One 4-byte all-reduce when all went well; each rank's reasons
    (truncated) are gathered only when some rank has one. A peer that is gone makes every
    rank raise `VoteFailed` (no rank can complete the reduction without it), never some
    ranks commit while others roll back."""
    group = control_group()
    device = collective_device(group)  # the CPU, unless a world without its CPU group
    flag = torch.tensor([1 if errors else 0], dtype=torch.int32, device=device)
    _wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True), deadline,
          "the switch's vote")
    if not int(flag.item()):
        return []
    data = "\n".join(errors).encode()[:_VOTE_MESSAGE_BYTES]
    mine = torch.zeros(_VOTE_MESSAGE_BYTES, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    mine = mine.to(device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(everyone, mine, group=group, async_op=True), deadline,
          "the switch's vote (reasons)")
    out = []
    for t in everyone:
        text = bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
        out += [line for line in text.split("\n") if line]
    return out


def _release_transfer(groups: Optional[LayoutGroups], abort: bool) -> None:
    """Every rank of the world, at the same point (after a vote, whose result they share):
    B's transfer communicator is only for this switch. `abort`: the transfer failed, so
    its NCCL communicator may hold operations that will never complete; every member
    aborts it (not only the one that timed out) before it is destroyed. Then destroyed
    by all its members together (NCCL synchronises a destroy across a node). Its handle's
    destructor (gloo: joining its threads, closing its connections) then runs in a thread,
    out of the pause: the caller holds no other reference to the group by now."""
    if groups is None or groups.transfer is None:
        return
    if abort:
        abort_group(groups.transfer)
    last = [groups.transfer]
    groups.release_transfer()
    drop_in_background(last)


def _aborted(src: Layout, dst: Layout, dst_placement: Placement, groups: Optional[LayoutGroups],
             new_objs: Any,
             stage: str, errors: list[str], phases: dict,
             background: Optional[dict] = None) -> SwitchResult:
    reason = f"switch {src} -> {dst} aborted in {stage}: " + "; ".join(errors[:4]) + \
        (f" (+{len(errors) - 4} more)" if len(errors) > 4 else "")
    log.error("%s; every rank stays at %s", reason, src)
    report = SwitchReport(src=str(src), dst=str(dst), placement=str(dst_placement), phases=phases,
                          background=background or {})
    return SwitchResult(new_objs, dst, dst_placement, groups, None, report, aborted=reason)


def rebuild_weights_from_masters(objs) -> None:
    """bf16/fp32 weights from the fp32 masters: copy each owned main shard into the
    parameter buffer, then all-gather the buffer over DP (megatron's own param sync).

    For fp32 parameters megatron's "main" shard *is* a view of the parameter buffer, so
    the transfer already wrote the weights: only optimizers with a separate fp32 copy of
    low-precision weights need the copy (a self-copy of the whole model otherwise).
    A plain optimizer (no distributed optimizer) holds whole fp32 copies: the copy is the
    whole rebuild, with nothing to gather."""
    for opt in optimizers_of(objs.optimizer):
        if any(len(g) for g in fp32_copies_of(opt)):
            opt._copy_main_params_to_model_params()
    for m in objs.model:
        if m.ddp_config.use_distributed_optimizer and any(
                bg.intra_distributed_optimizer_instance_size > 1
                for bg in m.bucket_groups + m.expert_parallel_bucket_groups):
            m.start_param_sync(force_sync=True)  # nothing to gather where DP is 1


def choose_dst_placement(spec: ModelSpec, builder: Builder, src: Layout, src_placement: Placement,
                         dst: Layout, devices: Sequence[int], policy: str = "best",
                         ranks_per_node: int = 8, move_weights: bool = False,
                         kinds: Optional[tuple[str, ...]] = None) -> Placement:
    """B's placement for a switch: megatron's order (`policy="default"`: the builder's
    `rank_order`, the one a restart at B numbers its ranks in), or the planner's best
    placement, whatever its order of global ranks (B's groups number their members by
    virtual rank: `elastic.groups`). Pure and deterministic: every rank gets the same
    answer alone. `kinds` (default: from `move_weights`): what the switch moves."""
    if policy == "default":
        order = megatron_rank_order(dst, getattr(builder, "rank_order", DEFAULT_ORDER))
        return Placement(tuple(devices[d] for d in order.devices))
    if kinds is None:
        kinds = KINDS if move_weights else OPT_KINDS
    choice = placement_choice(spec, src, src_placement, dst, devices, ranks_per_node,
                              (builder.bucket_size(src), builder.bucket_size(dst)), kinds)
    if not ordered_groups() and choice.chosen != choice.default:
        # TorchComms creates groups by splitting, and a torch without new_group(sort_ranks=)
        # sorts them: members always in global-rank order
        log.warning("this torch cannot keep a group's member order (TorchComms on, or no "
                    "new_group(sort_ranks=)): B's placement is the best rank-ordered one")
        return best_rank_ordered(choice, ranks_per_node)[0]
    return choice.chosen


def switch_layout(spec: ModelSpec, builder: Builder, old_objs: Any, src: Layout,
                  src_placement: Placement, dst: Layout,
                  make_groups: Callable[[Layout, Placement], LayoutGroups],
                  scalars: Optional[Scalars], options: SwitchOptions = SwitchOptions(), *,
                  dst_devices: Optional[Sequence[int]] = None,
                  new_groups: Optional[LayoutGroups] = None,
                  transport: Optional[Transport] = None, faults: Optional[FaultPlan] = None,
                  src_state: Optional[LiveState] = None, unavailable: Sequence[int] = (),
                  prepared: Optional[Prepared] = None) -> SwitchResult:
    """Switch this rank from `src` to `dst`. Collective over the default (world) group.

    `old_objs` is None on a rank that holds nothing at A (a joining rank). `make_groups(
    layout, placement)` builds B's groups (collective) unless `new_groups` is given.
    `options`: placement policy, what moves, budget, checks, timeout (`SwitchOptions`).

    `prepared` (from `prepare_switch`, typically run in the background while A trained)
    holds B built, bound, checked and planned: the switch then only binds A, votes, moves
    the data and commits, and B's groups and placement are the prepared ones. Its
    timings are reported as `report.background`, outside the pause.

    A transaction: A's state is only read. Every rank votes after preparing (B built,
    bound, checked, planned) and again after the transfer (every message checksummed on
    both sides, each round under `timeout` seconds); if any rank reports a failure, the
    result is *aborted* (`result.aborted` holds every rank's reasons), B is handed back
    for the caller to release, and the caller continues at A. `faults` injects failures
    (tests; `DYNATRAIN_FAULTS`); `transport` replaces the point-to-point transport over
    B's `transfer` group.

    Recovery after a death: `src_state` is this rank's state at A already bound (the
    objects themselves were freed with their broken communicators), `src_placement` maps
    A onto the re-formed world with the dead ranks on the `unavailable` placeholder
    devices, which send nothing: their state comes from its replicas (B's placement is
    then the default one).
    """
    t = time.perf_counter
    phases: dict[str, float] = {}
    background: dict[str, float] = {}
    me = dist.get_rank()
    kinds, verify = options.kinds, options.verify
    move_weights = "param" in kinds
    faults = faults or FaultPlan.from_env() or _NO_FAULTS
    if prepared is None:
        t0 = t()
        dst.check_model(spec)
        devices = tuple(dst_devices) if dst_devices is not None else tuple(range(dst.world_size))
        if len(devices) != dst.world_size:
            raise LayoutError(f"layout {dst} needs {dst.world_size} devices, got {len(devices)}")
        if max(devices) >= dist.get_world_size():
            raise LayoutError(f"devices {devices} exceed the world of {dist.get_world_size()} ranks")
        if new_groups is not None:
            dst_placement = new_groups.placement
        elif unavailable:
            dst_placement = Placement(devices)
        else:
            dst_placement = choose_dst_placement(spec, builder, src, src_placement, dst, devices,
                                                 options.placement, options.ranks_per_node,
                                                 kinds=kinds)
        phases["placement"] = t() - t0
        t1 = t()
        groups = new_groups if new_groups is not None else make_groups(dst, dst_placement)
        phases["groups"] = t() - t1
        metadata = plans_from_metadata(builder)
        prepared = prepare_switch(spec, builder, src, src_placement, dst, groups, options,
                                  unavailable=unavailable, faults=faults,
                                  src_objs=old_objs if metadata else None,
                                  src_state=src_state if metadata else None,
                                  src_model=old_objs.model if old_objs is not None else None)
    else:
        prepared.check_for(src, src_placement, dst, kinds, tuple(unavailable))
    (background if prepared.background else phases).update(prepared.phases)
    dst_placement, groups, new_objs = prepared.dst_placement, prepared.groups, prepared.objs
    plan, rounds, new_live = prepared.plan, prepared.rounds, prepared.live

    attempt = _next_attempt()
    vr_a = src_placement.virtual_rank(me)
    old_live = None
    src_views: dict[Piece, torch.Tensor] = {}
    bound_early = False  # A bound and checked in the background, storage unchanged since
    errors: list[str] = [prepared.error] if prepared.error else []
    # -- A's side: bind and check it (unless bound in the background and still valid).
    # Nothing has moved yet.
    t3 = t()
    try:
        if move_weights and old_objs is not None:
            # with overlap_param_gather the weights lag the DistOpt shards until the next
            # forward: bring them up to date before reading them
            for m in old_objs.model:
                if getattr(m, "ddp_config", None) is not None and m.ddp_config.overlap_param_gather:
                    m.start_param_sync(force_sync=True)
        if src_state is not None:
            old_live = src_state
        elif (prepared.src_live is not None and old_objs is not None and
              storage_fingerprint(old_objs.model, old_objs.optimizer) == prepared.src_fingerprint):
            old_live, src_views, bound_early = prepared.src_live, prepared.src_views, True
        else:
            old_live = (LiveState(old_objs.model, old_objs.optimizer, vr_a, spec.vocab_size)
                        if old_objs is not None and vr_a is not None else None)
        prepared.drop_source()
        phases["bind"] = phases.get("bind", 0.0) + t() - t3
        t3 = t()
        if verify and old_live is not None and not bound_early:
            _check_analytic(old_live, spec, builder, src, vr_a, kinds,
                            plans_from_metadata(builder))
        phases["verify"] = phases.get("verify", 0.0) + t() - t3
    except Exception as e:  # noqa: BLE001 - every rank learns it at the vote below
        errors.append(f"rank {me}: prepare: {type(e).__name__}: {e}")
        log.error("rank %d: switch %s -> %s failed before any byte moved: %s", me, src, dst, e,
                  exc_info=True)
    t4 = t()
    deadline = vote_deadline(options.timeout)
    errors = _agree(errors, deadline)
    phases["vote"] = t() - t4
    if errors:
        _release_transfer(groups, abort=False)
        return _aborted(src, dst, dst_placement, groups, new_objs, "prepare", errors, phases,
                        background)

    # -- transfer: A is only read; B is written. Checksummed, under a timeout.
    t5 = t()
    xfer_group = groups.transfer
    transport = transport or TorchP2PTransport(xfer_group)
    ex = Executor(me, transport,
                  src_view=lambda p: (src_views[p] if p in src_views else
                                      old_live.view(p.kind, p.src_chunk, p.src_local_name,
                                                    p.src_local_box)),
                  dst_view=lambda p: prepared.dst_views[p],
                  device=collective_device(xfer_group), tag=attempt, timeout=options.timeout,
                  checksums=options.checksums, faults=faults)
    errors = list(ex.run(prepared.local_pieces, prepared.round_pieces))
    obj_stats = ObjectCarryStats()
    try:
        # only the holders of A's padding rows and the needers of B's exchange (pure plan,
        # the same on every rank); after a death any surviving replica serves
        pad_plan = prepared.padding_plan if prepared.padding_plan is not None else padding_plan(
            (analytic_layout(spec, src, builder.bucket_size(src)), src_placement),
            (analytic_layout(spec, dst, builder.bucket_size(dst)), dst_placement), kinds,
            unavailable)
        _, pad_errors = carry_vocab_padding(pad_plan, me, old_live, new_live, transport,
                                            tag=attempt, timeout=options.timeout)
        errors += pad_errors
        # the sharded objects, read now (after A's last step) and set on B's modules
        t7 = t()
        obj_stats, obj_errors = carry_objects(prepared.object_plan, me, old_live, new_live,
                                              transport, device=collective_device(xfer_group),
                                              tag=attempt, timeout=options.timeout)
        errors += obj_errors
        phases["objects"] = t() - t7
        faults.fail(me, "commit", dst=str(dst))
    except Exception as e:  # noqa: BLE001
        errors.append(f"rank {me}: commit: {type(e).__name__}: {e}")
    phases["transfer"] = t() - t5 - phases.get("objects", 0.0)
    exec_stats = ex.stats
    del ex, transport, xfer_group  # the transfer group's last holder is `_release_transfer`
    # -- commit vote: every rank of the world agrees that everything arrived and checked
    t6 = t()
    errors = _agree(errors, deadline)
    phases["vote"] += t() - t6
    if errors:
        _release_transfer(groups, abort=True)  # every rank, whatever it saw itself
        return _aborted(src, dst, dst_placement, groups, new_objs, "transfer", errors, phases,
                        background)

    t6 = t()
    # scalars: every (living) rank of A holds them, the same on each (iteration, sample
    # counts, optimizer step and scheduler advance in lockstep); where some rank of B held
    # nothing at A (a joiner, one back from standby), the first device of A tells everyone
    holders = [d for d in src_placement.devices if d not in set(unavailable)]
    if not set(dst_placement.devices) <= set(holders):
        box = [scalars]
        dist.broadcast_object_list(box, src=holders[0])
        scalars = box[0]
    _release_transfer(groups, abort=False)
    phases["sync"] = t() - t6
    t6 = t()
    if new_objs is not None:
        builder.activate(new_objs)
        if not move_weights:
            rebuild_weights_from_masters(new_objs)
        if not options.weights_only:
            write_scalars(new_objs, scalars)
    phases["rebuild"] = t() - t6

    stats = plan.stats
    report = SwitchReport(src=str(src), dst=str(dst), placement=str(dst_placement),
                          bytes_moved=stats.moved_bytes, lower_bound_bytes=stats.lower_bound_bytes,
                          local_bytes=stats.local_bytes, rounds=len(rounds),
                          peak_staging_bytes=exec_stats.peak_staging_bytes,
                          sent_bytes=exec_stats.sent_bytes, recv_bytes=exec_stats.recv_bytes,
                          zero_copy_bytes=exec_stats.zero_copy_bytes,
                          checksummed_messages=exec_stats.checksummed_messages,
                          source_bound_early=bound_early, kinds=kinds,
                          objects_sent=obj_stats.sent,
                          object_bytes=obj_stats.sent_bytes + obj_stats.recv_bytes,
                          phases=phases, background=background)
    return SwitchResult(new_objs, dst, dst_placement, groups, scalars, report)
