"""After a rank died: re-form the world, recover the state from the survivors' memory
when every piece of it has a replica, else say exactly what was lost and resume from the
user's last checkpoint, never with wrong state.

Weights are replicated over DP, so a dead rank's weights usually survive. megatron-core's
distributed optimizer shards `main_param` / `exp_avg` / `exp_avg_sq` over DP without a
replica, unless it runs several instances (`--num-distributed-optimizer-instances`, our
layout axis `doi`), each holding all of the state. `routing.lost_state.lost_state` decides:
nothing lost -> in-memory recovery (a switch whose dead sources are replaced by their
replicas, `routing.planner.build_plan(unavailable=...)`); something lost -> the last
`dist_checkpointing` checkpoint, loaded at the new layout.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

import torch.distributed as dist

from ..adapters.live import LiveState
from ..elastic.groups import build_groups, forget_megatron_groups, install
from ..elastic.rejoin import NewWorld, announce_noticed, reform_world, rendezvous_store
from ..routing.lost_state import lost_state
from ..transition.scalars import read_scalars
from ..transition.switch import switch_layout
from ..transition.switch_types import Scalars, SwitchOptions, SwitchReport
from ..vps.fragment import OPT_KINDS
from ..vps.placement import Placement
from ..vps.errors import DynatrainError, LayoutError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..mcore import dist_ckpt
from ..mcore.builders import MegatronBuilder, bucket_size_of
from ..mcore.session import release, start_job
from ..mcore.train_config import TrainConfig
from ..mcore.training import Trainer

log = logging.getLogger("dynatrain")

QUIET_SECONDS = 10.0  # the roster closes once no survivor announced itself for this long
# ... and every survivor that marked the failure announced itself, or this long has passed
MAX_WAIT_SECONDS = 180.0


def fit_layout(spec: ModelSpec, train: TrainConfig, old: Layout, n: int) -> Layout:
    """The layout to shrink to on at most `n` ranks: the old one's model parallelism with
    the largest DP that fits (and divides the global batch), keeping what else of the old
    layout still fits (`_kept_axes`); failing that, smaller TP/PP."""
    def ok(lay: Layout) -> bool:
        if lay.world_size > n or not train.splits_over(lay.dp):
            return False
        return not lay.model_errors(spec)

    mp_options = [(old.tp, old.pp)] + [(tp, pp) for tp in (8, 4, 2, 1) for pp in (8, 4, 2, 1)
                                       if tp <= old.tp and pp <= old.pp]
    for tp, pp in mp_options:
        for dp in range(n // (tp * pp * old.cp), 0, -1):
            for lay in _kept_axes(old, tp, pp, dp):
                if ok(lay):
                    return lay
    raise DynatrainError(f"no layout of {spec.name} fits {n} surviving ranks")


def _kept_axes(old: Layout, tp: int, pp: int, dp: int) -> Iterator[Layout]:
    """The valid layouts at (tp, pp, dp, old's cp), the most of `old` kept first: its
    virtual stages and layer split (at the same PP: what the job's recipe chose, e.g.
    stages that account for the embedding), its expert parallelism or else the largest
    divisor of it that fits (an MoE layer's memory), and with each EP its distributed-
    optimizer instances (the replicas the next death is recovered from in memory)."""
    stages = (dict(vpp=old.vpp, ppf=old.ppf, ppl=old.ppl, split=old.split)
              if pp == old.pp else {})
    etp = old.etp if old.etp != old.tp else tp
    # the old EP, else the largest of its divisors that fits
    experts = [dict(ep=ep, etp=etp) for ep in range(old.ep, 0, -1) if old.ep % ep == 0]
    tries = [{**stages, **e, **d} for e in experts for d in ({"doi": old.doi}, {})]
    tries += [stages, {}]
    seen: set[Layout] = set()
    for kw in tries:
        try:
            lay = Layout(tp=tp, pp=pp, dp=dp, cp=old.cp, **kw)
        except LayoutError:
            continue
        if lay not in seen:
            seen.add(lay)
            yield lay


@dataclass(frozen=True)
class HostLoop:
    """What a training loop that is not ours (Megatron-LM's `train()`) adds to a recovery.

    `let_go`: drop the loop's own references to the broken layout's objects; called once
    this rank's state was read and its objects released, before the world is re-formed
    (a gloo communicator's sockets close only with its last reference, and a survivor
    blocked on this one learns of the death only then). `resume(dst)`: build `dst` on the
    re-formed world and load the loop's own last checkpoint into it (instead of
    `--dynatrain-recovery-checkpoint`). `mid_update`: this rank may have applied part of an
    optimizer update since the last step boundary (it failed after the step's vote,
    `megatron_lm/step_guard.py`): its state is no source of the recovery, which resumes from
    the checkpoint unless the other survivors hold one iteration's state whole."""

    let_go: Callable[[], None]
    resume: Callable[[Layout], Trainer]
    mid_update: bool = False


@dataclass(frozen=True)
class Recovery:
    """What `recover_after_death` did on this process."""

    trainer: Optional[Trainer]  # None: this survivor is not part of the new layout
    world: NewWorld
    lost: str  # what died with the dead ranks, in words
    mode: str  # "memory": from the survivors' replicas; "checkpoint": from the last checkpoint
    layout: Layout
    switch: Optional[SwitchReport] = None  # the in-memory transfer
    note: str = ""  # why this layout, when the advisor chose it (auto-layout)


def recover_after_death(trainer: Optional[Trainer], spec: ModelSpec, train: TrainConfig,
                        rendezvous_dir: Optional[str], checkpoint_dir: Optional[str],
                        generation: int = 1, timeout: Optional[float] = None,
                        layout: Optional[Layout] = None,
                        placement: Optional[Placement] = None,
                        choose: Optional[Callable[[int], tuple[Layout, str]]] = None,
                        host: Optional[HostLoop] = None,
                        builder: Optional[MegatronBuilder] = None) -> Recovery:
    """Every survivor calls this after a collective failed because a rank died; a
    survivor on standby (`trainer` None, no state) passes the job's `layout` and
    `placement` instead.

    If every piece of optimizer state of the dead ranks has a replica on a survivor (a
    partial distributed optimizer, `doi` > 1), all survivors re-form the world and switch
    from A, with the dead ranks' state taken from its replicas, to the largest layout
    that fits them: nothing is lost and training goes on from the current iteration (the
    newest whose state the survivors hold whole: a death inside a step may leave them at
    two, `newest_whole_state`). Survivors B does not need stay in the new world (standby).
    Otherwise only B's ranks re-form the world and load the last checkpoint; the lost
    tensors are named.
    `choose` (auto-layout): survivors -> (layout, note) replaces "the largest layout that
    fits" (`fit_layout`). `host`: the hooks of a host training loop (`HostLoop`).
    `builder`: how B's objects are made (the job's own; default `MegatronBuilder`)."""
    old = trainer.objs if trainer is not None else None
    old_rank, old_world = dist.get_rank(), dist.get_world_size()
    if old is not None:
        src, pa = old.layout, old.groups.placement
    elif layout is not None and placement is not None:
        src, pa = layout, placement
    else:
        raise ValueError("recover_after_death needs the trainer, or the layout and placement")
    bs = bucket_size_of(train, src)
    # a closed socket is how the survivors still blocked in a collective with this rank
    # learn of the failure: one blocked on us would otherwise wait until we are done with
    # the roster, and be left out of the new world
    del old
    store = rendezvous_store(rendezvous_dir)
    announce_noticed(store, old_rank, generation)  # the roster waits for this rank's let-go
    held, scalars = let_go_of_layout(trainer, spec, pa, broken=True)
    if host is not None:
        host.let_go()

    def dead_of(survivors) -> list[int]:
        return [d for d in pa.devices if d not in survivors]

    # what this rank's memory holds, read by every survivor's `in_memory` (set before this
    # rank joins the roster, so every survivor the roster names has set it)
    mixed = (host is not None and host.mid_update) or getattr(trainer, "mid_update", False)
    store.set(_state_key(generation, old_rank),
              _MIXED if mixed else (str(scalars.iteration) if held is not None else _NONE))

    def positions(survivors) -> dict[int, Optional[int]]:
        """survivor -> the iteration of its state; -1: inside an update; None: none."""
        out = {}
        for r in survivors:
            key = _state_key(generation, r)
            value = store.get(key).decode() if store.check([key]) else _NONE
            out[r] = int(value) if value.isdigit() else (-1 if value == _MIXED else None)
        return out

    def whole(survivors) -> Optional[tuple[int, tuple[int, ...]]]:
        pos = positions(survivors)
        return newest_whole_state(
            {r: p for r, p in pos.items() if p is not None and p >= 0},
            lambda out: lost_state(spec, src, out, pa, bs, kinds=OPT_KINDS).recoverable,
            pa.devices)

    def in_memory(survivors) -> bool:
        return whole(survivors) is not None

    def target(n: int) -> tuple[Layout, str]:
        if choose is not None:
            return choose(n)
        return fit_layout(spec, train, src, n), ""

    def keep(survivors: tuple[int, ...]) -> int:
        if in_memory(survivors):
            return len(survivors)
        return target(len(survivors))[0].world_size

    # survivors blocked on a survivor learn of the death one after another, each as the
    # previous one lets go of the broken world (slow on a loaded host): a quiet period of
    # several seconds keeps a late one in the roster, at that cost to every recovery
    nw = reform_world(store, old_rank, old_world, generation, keep, quiet_seconds=QUIET_SECONDS,
                      max_wait_seconds=MAX_WAIT_SECONDS)
    what = lost_state(spec, src, dead_of(nw.survivors), pa, bs).describe()
    pos = positions(nw.survivors)
    updating = sorted(r for r, p in pos.items() if p == -1)
    if updating:
        what = (f"ranks {updating} were inside the optimizer update of the step after the "
                f"last boundary (their state may be part-updated); {what}")
    found = whole(nw.survivors)
    other = {r: p for r, p in pos.items()
             if p is not None and p >= 0 and found and p != found[0]}
    if other:
        what = (f"ranks {sorted(other)} hold the state of iteration "
                f"{', '.join(map(str, sorted(set(other.values()))))}, not of {found[0]}, the "
                f"newest the survivors hold whole: they are no source of it; {what}")
    dst, note = target(len(nw.survivors))
    if note:
        log.warning("%s", note)
    mode = "memory" if found is not None else "checkpoint"
    log.error("ranks %s died: %s; recovering %s at %s", list(nw.dead), what,
              "from the survivors' memory" if mode == "memory" else "from the last checkpoint",
              dst)
    if nw.rank is None:
        log.warning("rank %d is not needed by the new layout: leaving", old_rank)
        return Recovery(None, nw, what, mode, dst, note=note)
    if mode == "memory":
        if old_rank in found[1]:  # this rank's state is not the iteration recovered
            held = scalars = None
        rec = _recover_in_memory(spec, train, src, pa, dst, nw, held, scalars, what, timeout,
                                 builder, not_sources=found[1])
        return replace(rec, note=note)
    held = None
    if host is not None:
        log.warning("resuming from the training loop's last checkpoint at %s on %d ranks "
                    "(optimizer state of the dead ranks had no replica)", dst, dst.world_size)
        new = host.resume(dst)
        assert dist.get_world_size() == dst.world_size
        return Recovery(new, nw, what, mode, dst, note=note)
    if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
        raise DynatrainError(f"state lost ({what}) and no checkpoint to resume from "
                             f"(--dynatrain-recovery-checkpoint)")
    log.warning("resuming from the checkpoint in %s at %s on %d ranks (optimizer state of the "
                "dead ranks had no replica: the survivors' memory is not used)",
                checkpoint_dir, dst, dst.world_size)
    new = start_job(spec, dst, train, builder=builder)
    new.iteration, new.consumed_samples = dist_ckpt.load(new.objs, checkpoint_dir)
    assert dist.get_world_size() == dst.world_size
    return Recovery(new, nw, what, mode, dst, note=note)


# a survivor's entry in the rendezvous store: the iteration of the state it holds, or
_MIXED = "mixed"  # it failed inside an optimizer update (part one iteration, part the next)
_NONE = "none"  # it holds none (on standby)


def _state_key(generation: int, old_rank: int) -> str:
    """Where a survivor says what its memory holds (`recover_after_death`)."""
    return f"dynatrain/gen{generation}/state/{old_rank}"


def newest_whole_state(positions: dict[int, int], recoverable: Callable[[list[int]], bool],
                       devices) -> Optional[tuple[int, tuple[int, ...]]]:
    """The newest iteration whose whole state the survivors hold, and A's devices that are
    no source of it (the dead, and the survivors at another iteration or holding none);
    None where no iteration is whole. `positions`: survivor -> the iteration of the state it
    holds (not those in the middle of an update, nor those holding none); `recoverable`:
    whether A's state is whole without a list of its devices.

    A death inside a step is seen by each survivor wherever it is: one whose update needed
    no collective with the dead rank (another distributed-optimizer instance) finishes
    that iteration, one that failed before its update keeps the last; state of two
    iterations must never be put together."""
    for it in sorted(set(positions.values()), reverse=True):
        out = tuple(d for d in devices if positions.get(d) != it)
        if recoverable(list(out)):
            return it, out
    return None


def let_go_of_layout(trainer: Optional[Trainer], spec: ModelSpec, placement: Placement,
                     broken: bool) -> tuple[Optional[LiveState], Optional[Scalars]]:
    """Before the default group is re-formed (a death, a join): bind this rank's tensors
    and scalars at the current layout, then free its megatron objects and every reference
    to their communicators (a gloo communicator's sockets close only with its last
    reference). Returns (held tensors, scalars); both None on a rank holding nothing."""
    scalars = held = None
    old = trainer.objs if trainer is not None else None
    if old is not None:
        scalars = read_scalars(old, trainer.iteration, trainer.consumed_samples)
        vr = placement.virtual_rank(dist.get_rank())
        held = (LiveState(old.model, old.optimizer, vr, spec.vocab_size).detach_from_objects()
                if vr is not None else None)
        trainer.release_references()
    forget_megatron_groups()
    if old is not None:
        release(old, broken=broken)
    return held, scalars


def switch_from_held(spec: ModelSpec, train: TrainConfig, src: Layout, src_placement: Placement,
                     dst: Layout, dst_devices, held: Optional[LiveState],
                     scalars: Optional[Scalars], timeout: Optional[float], what: str,
                     unavailable=(), builder: Optional[MegatronBuilder] = None,
                     ) -> tuple[Optional[Trainer], SwitchReport]:
    """The switch `src` -> `dst` on a re-formed world from the tensors `let_go_of_layout`
    kept (B's placement: `dst_devices` in order). Returns (the trainer at B, or None on a
    rank B does not use; the report). Raises, having released B, if it aborted: there is
    no A to roll back to (its objects are gone)."""
    res = switch_layout(spec, builder or MegatronBuilder(spec, train), None, src, src_placement, dst,
                        build_groups, scalars,
                        SwitchOptions(placement="default", timeout=timeout),
                        dst_devices=dst_devices, src_state=held, unavailable=unavailable)
    del held
    if res.aborted:
        if res.objs is not None:
            release(res.objs)
        elif res.groups is not None:
            res.groups.destroy()
        raise DynatrainError(f"{what} failed ({res.aborted}); restart from the last checkpoint")
    if res.objs is None:
        res.groups.destroy()
        return None, res.report
    install(res.groups)
    return (Trainer(spec, train, res.objs, res.scalars.iteration, res.scalars.consumed_samples),
            res.report)


def _recover_in_memory(spec: ModelSpec, train: TrainConfig, src: Layout, pa: Placement,
                       dst: Layout, nw: NewWorld, held, scalars, what: str,
                       timeout: Optional[float],
                       builder: Optional[MegatronBuilder] = None,
                       not_sources: tuple[int, ...] = ()) -> Recovery:
    """The switch A -> B on the re-formed world: A's devices renumbered to their new
    ranks, the dead ones and `not_sources` (survivors whose state is not the iteration
    recovered, `newest_whole_state`) on placeholder devices past the world that send
    nothing."""
    new_rank = {old: i for i, old in enumerate(nw.members) if old not in set(not_sources)}
    n = len(nw.members)
    placeholders = iter(range(n, n + len(pa.devices)))
    src_pl = Placement(tuple(new_rank[d] if d in new_rank else next(placeholders)
                             for d in pa.devices))
    unavailable = tuple(d for d in src_pl.devices if d >= n)
    new, report = switch_from_held(
        spec, train, src, src_pl, dst, range(dst.world_size), held, scalars, timeout,
        f"in-memory recovery after the death of ranks {list(nw.dead)}", unavailable, builder)
    log.warning("recovered in memory: %s -> %s on %d ranks, %d bytes moved in %.2f s",
                src, dst, dst.world_size, report.bytes_moved, report.pause_seconds)
    return Recovery(new, nw, what, "memory", dst, report)
