"""Switches onto the planner's best placement, whatever its order of global ranks (issue
17), run inside one spawned group of gloo ranks: each check in sequence on the same world."""
from __future__ import annotations

import os

import torch.distributed as dist

from dynatrain_megatron.mcore.session import release, start_job
from rank_cases import gather_layout_state, replica_mismatches, spec_variant, switch_train_config


def _planner_bytes(spec, builder, la, pa, lb, rpn: int) -> dict:
    """What the planner says for A -> B, with the switch's own arguments: bytes moved at
    the default order, the best rank-ordered and the best placement, and the best one."""
    from dynatrain_megatron.routing.placement_search import best_rank_ordered, placement_choice
    from dynatrain_megatron.vps.fragment import OPT_KINDS
    from dynatrain_megatron.vps.placement import is_rank_ordered

    ch = placement_choice(spec, la, pa, lb, tuple(range(lb.world_size)), rpn,
                          (builder.bucket_size(la), builder.bucket_size(lb)), OPT_KINDS)
    _, ro = best_rank_ordered(ch, rpn)
    return dict(default=ch.default_stats.moved_bytes, rank_ordered=ro.stats.moved_bytes,
                best=ch.chosen_stats.moved_bytes, best_devices=ch.chosen.devices,
                best_is_rank_ordered=is_rank_ordered(lb, ch.chosen))


def _fresh_from_checkpoint(s, train, layout: str, ckpt: str, steps: int) -> list[float]:
    """A fresh job at `layout` on megatron's default order, loaded from `ckpt`: its losses."""
    from dynatrain_megatron.mcore import dist_ckpt

    tb = start_job(s, layout, train)
    tb.iteration, tb.consumed_samples = dist_ckpt.load(tb.objs, ckpt)
    losses = [tb.step().loss for _ in range(steps)]
    release(tb.objs)
    return losses


def permuted_switch_cases(root: str, steps_after: int = 3, leak_switches: int = 20) -> dict:
    """On 8 ranks, every case A -> B onto the best placement (prepared in the background,
    as the hook does), then: the state bit for bit, bytes against the planner, replicas,
    and `steps_after` steps against the checkpoint path (A saved just before the switch,
    loaded in a fresh job at B on the default order). The first case goes on from its
    permuted world: a dist_checkpointing save there (loaded at the default order, it must
    train on identically), a second switch, a scale-in and a scale-out; then a loop of
    permuted switches (process groups and RSS flat)."""
    from dynatrain_megatron.mcore import dist_ckpt
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.loop.switching import switch_trainer
    from dynatrain_megatron.testing import gather as G
    from dynatrain_megatron.vps import Layout
    from dynatrain_megatron.testing.prepare import prepare_while_training

    world, rpn = dist.get_world_size(), 4
    train = switch_train_config()
    out: dict = {}

    def switch(tr, builder, s, dst, tag, devices=None, background=False, src=None):
        # `src`: A's (layout, placement), for the ranks on standby (no trainer)
        la, pa = src if src is not None else (tr.objs.layout, tr.objs.groups.placement)
        plan = _planner_bytes(s, builder, la, pa, dst, rpn) if devices is None else None
        kw = {}
        if background:
            kw = prepare_while_training(tr, builder, la, pa, dst, placement="best",
                                        ranks_per_node=rpn, memory_budget=None,
                                        move_weights=False).switch_args
        ckpt = None
        if tag in CKPT_AT_A:
            ckpt = os.path.join(root, f"{tag}-a")
            dist_ckpt.save(tr.objs, tr.iteration, tr.consumed_samples, ckpt)
        before = gather_layout_state(s, tr) if tr is not None else None
        tr, res = switch_trainer(tr, builder, la, pa, dst, dst_devices=devices,
                                 ranks_per_node=rpn, **kw)
        after = gather_layout_state(s, tr) if tr is not None else None
        box = [after]
        dist.broadcast_object_list(box, src=0)
        r = res.report
        members = [None] * world
        dist.all_gather_object(members, tr is not None)
        out[tag] = dict(a=str(la), b=str(dst), src_devices=pa.devices, members=members,
                        devices=res.placement.devices, aborted=res.aborted,
                        diff=None if before is None else G.states_equal(before, box[0]),
                        moved=r.bytes_moved, lower=r.lower_bound_bytes, planner=plan,
                        background=sorted(r.background), phases=sorted(r.phases))
        if len(res.placement.devices) == world:  # (collective over the world)
            out[tag]["replica_mismatches"] = replica_mismatches(s, tr, after)
        return tr, ckpt, res.placement

    CKPT_AT_A = {"dense_pp", "dense_dp", "moe"}

    # --- tiny-gpt tp4pp1dp2 -> tp4pp2dp1, then on from the permuted world
    s = spec_variant("tiny-gpt")
    builder = MegatronBuilder(s, train)
    tr = start_job(s, "tp4pp1dp2", train)
    for _ in range(2):
        tr.step()
    tr, ckpt_a, _ = switch(tr, builder, s, Layout.parse("tp4pp2dp1", world), "dense_pp",
                           background=True)
    ckpt_perm = os.path.join(root, "saved-in-permuted-world")
    dist_ckpt.save(tr.objs, tr.iteration, tr.consumed_samples, ckpt_perm)
    out["dense_pp"]["losses"] = [tr.step().loss for _ in range(steps_after)]
    # a second switch from the permuted world (its best placement, from a permuted A)
    tr, _, _ = switch(tr, builder, s, Layout.parse("tp2pp2dp2", world), "second")
    out["second"]["losses"] = [tr.step().loss for _ in range(steps_after)]
    # scale-in from a permuted world: onto 4 of the 8 devices, the others on standby
    small = Layout.parse("tp2pp2dp1", world // 2)
    tr, _, pl = switch(tr, builder, s, small, "scale_in", devices=tuple(range(world // 2)))
    # and out again from there (the standby ranks join), onto all 8 devices
    tr, _, _ = switch(tr, builder, s, Layout.parse("tp2pp2dp2", world), "scale_out",
                      devices=tuple(range(world)), src=(small, pl))
    if tr is not None:
        release(tr.objs)
    out["dense_pp"]["ckpt_losses"] = _fresh_from_checkpoint(s, train, "tp4pp2dp1", ckpt_a,
                                                            steps_after)
    out["permuted_save_losses"] = _fresh_from_checkpoint(s, train, "tp4pp2dp1", ckpt_perm,
                                                         steps_after)

    # --- tiny-gpt tp2pp1dp4 -> tp2pp2dp2, and a MoE transition
    for model, a, b, tag in (("tiny-gpt", "tp2pp1dp4", "tp2pp2dp2", "dense_dp"),
                             ("tiny-moe", "tp1pp2ep2etp1dp4", "tp1pp4ep2etp1dp2", "moe")):
        s = spec_variant(model)
        builder = MegatronBuilder(s, train)
        tr = start_job(s, a, train)
        for _ in range(2):
            tr.step()
        tr, ckpt_a, _ = switch(tr, builder, s, Layout.parse(b, world), tag)
        out[tag]["losses"] = [tr.step().loss for _ in range(steps_after)]
        release(tr.objs)
        out[tag]["ckpt_losses"] = _fresh_from_checkpoint(s, train, b, ckpt_a, steps_after)

    out["leak"] = _leak_loop(leak_switches)
    return out


def _leak_loop(n: int) -> dict:
    """`n` switches tp4pp1dp2 <-> tp4pp2dp1, each onto its best placement: live process
    groups and RSS after each, the placements used, and the state at the end."""
    import gc

    import psutil

    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from rank_checks import layout_bytes
    from dynatrain_megatron.loop.switching import switch_trainer
    from dynatrain_megatron.testing import gather as G
    from dynatrain_megatron.vps import Layout

    s = spec_variant("tiny-gpt")
    train = switch_train_config()
    builder = MegatronBuilder(s, train)
    world = dist.get_world_size()
    layouts = [Layout.parse(x, world) for x in ("tp4pp1dp2", "tp4pp2dp1")]
    tr = start_job(s, layouts[0], train)
    tr.step()
    start = gather_layout_state(s, tr)
    # the first layout's objects, held as Megatron-LM's pretrain() holds them in its
    # locals for the whole run: the switch must free their memory all the same
    held = (list(tr.objs.model), tr.objs.optimizer)
    held_before = layout_bytes(*held)
    proc = psutil.Process()
    rss, groups, devices = [], [], []
    for i in range(n):
        tr, res = switch_trainer(tr, builder, tr.objs.layout, tr.objs.groups.placement,
                                 layouts[(i + 1) % 2], ranks_per_node=4)
        if i == 0:
            held_after = layout_bytes(*held)
        gc.collect()
        rss.append(proc.memory_info().rss)
        groups.append(len(dist.distributed_c10d._world.pg_map))
        devices.append(res.placement.devices)
    end = gather_layout_state(s, tr)
    release(tr.objs)
    return dict(rss=rss, groups=groups, devices=devices, held=(held_before, held_after),
                diff=None if start is None else G.states_equal(start, end))
