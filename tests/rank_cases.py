"""Functions that run inside spawned gloo ranks (imported by name in the children)."""
from __future__ import annotations

import threading
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from dynatrain_megatron.mcore.builders import bucket_size_of
from dynatrain_megatron.mcore.session import release, start_job
from dynatrain_megatron.mcore.train_config import TrainConfig
from dynatrain_megatron.vps.model_spec import ModelSpec

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "models"


def spec(name: str) -> ModelSpec:
    return ModelSpec.from_yaml(CONFIGS / f"{name}.yaml")


def dp_replicas_identical(trainer) -> bool:
    """Exact equality of every parameter across the DP (dense) / expert-DP replicas."""
    objs = trainer.objs
    pgc = objs.groups.pg_collection
    ok = True
    for chunk in objs.model:
        for name, p in chunk.module.named_parameters():
            expert = not getattr(p, "allreduce", True)
            group = pgc.expt_dp if expert else pgc.dp_cp
            n = dist.get_world_size(group)
            if n == 1:
                continue
            gathered = [torch.empty_like(p.data) for _ in range(n)]
            dist.all_gather(gathered, p.data.contiguous(), group=group)
            ok &= all(torch.equal(gathered[0], g) for g in gathered[1:])
    return ok


def train_cases(cases: list[tuple[str, str, int, dict]]) -> list[dict]:
    """Train each (model, layout, steps, train overrides) case from scratch in this group."""
    out = []
    for model, layout, steps, overrides in cases:
        kw = dict(global_batch_size=8, micro_batch_size=2, lr=1e-2, min_lr=1e-3,
                  lr_warmup_iters=1, train_iters=steps)
        kw.update(overrides)
        before = len(dist.distributed_c10d._world.pg_map)
        trainer = start_job(spec(model), layout, TrainConfig(**kw))
        eval_before = trainer.evaluate()
        losses = [trainer.step().loss for _ in range(steps)]
        eval_after = trainer.evaluate()
        same = dp_replicas_identical(trainer)
        release(trainer.objs)
        after = len(dist.distributed_c10d._world.pg_map)
        out.append(dict(model=model, layout=str(trainer.objs.layout), losses=losses,
                        eval_before=eval_before, eval_after=eval_after,
                        dp_identical=same, leaked_groups=after - before))
    return out


def spec_variant(name: str) -> ModelSpec:
    """`tiny-gpt+tied` = tiny-gpt with tied embeddings, `+bf16` = bf16 params, `+v1280` = a
    vocab of 1280, `+gmm` = grouped experts, `+ddp` = without the distributed optimizer,
    ..."""
    base, *mods = name.split("+")
    s = spec(base)
    for m in mods:
        s = {"tied": lambda x: x.replace(untie_embeddings_and_output_weights=False),
             "bf16": lambda x: x.replace(params_dtype="bf16"),
             "ln": lambda x: x.replace(normalization="LayerNorm", add_bias_linear=True),
             # 1280 rows: no vocab padding up to TP 2, padding rows at TP 4 (1536)
             "v1280": lambda x: x.replace(vocab_size=1280),
             # grouped experts (GroupedMLP; megatron-core requires bf16 for them)
             "gmm": lambda x: x.replace(moe_grouped_gemm=True),
             # plain DDP: megatron's FP32Optimizer / Float16OptimizerWithFloat16Params
             "ddp": lambda x: x.replace(distributed_optimizer=False)}[m](s)
    return s


def ids(frags, main_only=False):
    return sorted((f.key, f.kind, f.box, f.rank, f.chunk, f.local_name, f.local_offsets)
                  for f in frags
                  if not main_only or getattr(f, "main", None) or getattr(f, "replica", 1) == 0)


def analytic_vs_live(cases: list[tuple[str, str, dict, bool]]) -> list[dict]:
    """Per (model, layout, train overrides, round_trip): live fragments vs analytic on this
    rank; with round_trip, gather -> scatter into a fresh job -> gather, compared exactly."""
    from dynatrain_megatron.adapters.live import LiveState
    from dynatrain_megatron.testing import gather as G
    from dynatrain_megatron.vps import analytic_layout

    out = []
    for model, layout, overrides, round_trip in cases:
        kw = dict(global_batch_size=8, micro_batch_size=2)
        kw.update(overrides)
        train = TrainConfig(**kw)
        s = spec_variant(model)
        trainer = start_job(s, layout, train)
        trainer.step()  # real Adam state
        objs = trainer.objs
        vr = objs.groups.virtual_rank
        live = LiveState(objs.model, objs.optimizer, vr, s.vocab_size)
        lf = live.fragments()
        an = analytic_layout(s, objs.layout, bucket_size_of(train, objs.layout)).fragments(vr)
        res = dict(model=model, layout=str(objs.layout), n=len(lf),
                   equal=ids(lf) == ids(an), main_equal=ids(lf, True) == ids(an, True),
                   only_live=[str(x) for x in sorted(set(ids(lf)) - set(ids(an)))[:3]],
                   only_analytic=[str(x) for x in sorted(set(ids(an)) - set(ids(lf)))[:3]])
        if round_trip:
            world = objs.groups.layout_group
            full = G.broadcast_full_state(G.gather_full_state(live, s, world), group=world)
            fresh = start_job(s, layout, TrainConfig(**{**kw, "seed": 999}))
            live2 = LiveState(fresh.objs.model, fresh.objs.optimizer, vr, s.vocab_size)
            res["differs_before"] = len(G.mismatches_against(live2, full)) > 0
            res["written"] = G.scatter_full_state(live2, full)
            res["mismatches_after"] = G.mismatches_against(live2, full)
            again = G.gather_full_state(live2, s, world)
            res["full_equal"] = None if again is None else G.states_equal(full, again) == []
            res["n_tensors"] = len(full)
            release(fresh.objs)
        out.append(res)
        release(objs)
    return out


def switch_train_config(overrides: dict | None = None) -> TrainConfig:
    """One training config for a switch run and its checkpoint-path reference."""
    kw = dict(global_batch_size=8, micro_batch_size=2, lr=1e-2, min_lr=1e-3, lr_warmup_iters=1,
              train_iters=20)
    kw.update(overrides or {})
    return TrainConfig(**kw)


def checkpoint_path_case(model: str, a: str, b: str, ckpt_dir: str, steps_before: int = 2,
                         steps_after: int = 3, overrides: dict | None = None,
                         b_devices: tuple | None = None) -> dict:
    """Train at A, dist_checkpointing save, build B, load, compare full state, train on.

    `b_devices`: B's placement (which device takes which virtual rank), to restart B on the
    same device assignment a switch chose (reductions over the world then sum in the same
    order)."""
    from dynatrain_megatron.vps import Placement

    from dynatrain_megatron.adapters.live import LiveState
    from dynatrain_megatron.mcore import dist_ckpt
    from dynatrain_megatron.testing import gather as G

    train = switch_train_config(overrides)
    s = spec_variant(model)
    ta = start_job(s, a, train)
    losses_before = [ta.step().loss for _ in range(steps_before)]
    world = ta.objs.groups.layout_group
    full_a = G.gather_full_state(LiveState(ta.objs.model, ta.objs.optimizer,
                                           ta.objs.groups.virtual_rank, s.vocab_size), s, world)
    dist_ckpt.save(ta.objs, ta.iteration, ta.consumed_samples, ckpt_dir)
    release(ta.objs)
    tb = start_job(s, b, train, placement=Placement(b_devices) if b_devices else None)
    it, consumed = dist_ckpt.load(tb.objs, ckpt_dir)
    tb.iteration, tb.consumed_samples = it, consumed
    world = tb.objs.groups.layout_group
    full_b = G.gather_full_state(LiveState(tb.objs.model, tb.objs.optimizer,
                                           tb.objs.groups.virtual_rank, s.vocab_size), s, world,
                                 dst=min(tb.objs.groups.placement.devices))
    losses = [tb.step().loss for _ in range(steps_after)]
    release(tb.objs)
    diff = None if full_a is None else G.states_equal(full_a, full_b)
    return dict(losses=losses, state_diff=diff, iteration=it, losses_before=losses_before)


def _sum_over_ranks(x: int) -> int:
    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def _gathered(x) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, x)
    return everyone


def _reallocate_one_moment(optimizer) -> None:
    from dynatrain_megatron.adapters.live import optimizers_of

    for opt in optimizers_of(optimizer):
        for st in opt.optimizer.state.values():
            if "exp_avg" in st:
                st["exp_avg"] = st["exp_avg"].clone().add_(1.0)
                return


def switch_cases(model: str, cases: list[tuple], overrides: dict | None = None,
                 ckpt_root: str | None = None) -> list[dict]:
    """Train at A, switch to B (and back), compare full state bit for bit at each step.

    Each case is (A, B, options) where options may hold placement ("best"/"default"),
    move_weights, memory_budget, steps_after, small_piece_bytes, background, model (a
    variant of the group's model for this case).
    """
    from dynatrain_megatron.adapters.live import LiveState
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.loop.switching import switch_trainer
    from dynatrain_megatron.transition import executor
    from dynatrain_megatron.testing import gather as G
    from dynatrain_megatron.testing.prepare import prepare_while_training
    from dynatrain_megatron.vps import Layout

    small_default = executor.SMALL_PIECE_BYTES
    train = switch_train_config(overrides)
    world = dist.get_world_size()

    out = []
    for a, b, opts in cases:
        # a case may use another model than the group's (e.g. another vocab size)
        case_model = opts.get("model", model)
        s = spec_variant(case_model)
        builder = MegatronBuilder(s, train, plan_from=opts.get("plan_from", "analytic"))

        def full(tr):
            return gather_layout_state(s, tr)

        tr = start_job(s, a, train)
        for _ in range(2):
            tr.step()
        la, pa = tr.objs.layout, tr.objs.groups.placement
        lb = Layout.parse(b, world)
        kw, steps_while_preparing = {}, 0
        p2p_groups: list = []  # the groups the preparation thread exchanged on, point to point
        if opts.get("background"):
            batch = dist.batch_isend_irecv

            def recorded(ops):
                if threading.current_thread().name == "dynatrain-prepare":
                    p2p_groups.extend(op.group for op in ops)
                return batch(ops)
            dist.batch_isend_irecv = recorded
            try:  # as the hook does it: B prepared in a thread while A trains on
                pw = prepare_while_training(
                    tr, builder, la, pa, lb, placement=opts.get("placement", "best"),
                    ranks_per_node=opts.get("ranks_per_node", 4),
                    memory_budget=opts.get("memory_budget"),
                    move_weights=opts.get("move_weights", False))
            finally:
                dist.batch_isend_irecv = batch
            kw, steps_while_preparing = pw.switch_args, len(pw.step_seconds)
            b_pp = kw["new_groups"].pg_collection.pp
            p2p_groups = dict(  # B's pipeline group warmed up; nothing of A's or the world's
                b_pp=sum(g is b_pp for g in p2p_groups),
                other_b=sum(g is not b_pp and any(g is x for x in kw["new_groups"].created)
                            for g in p2p_groups),
                not_b=sum(not any(g is x for x in kw["new_groups"].created) for g in p2p_groups))
        if opts.get("realloc_after_prepare"):
            # A's storage changes after it was bound in the background: one Adam moment
            # reallocated (and changed), so the background binding views stale memory
            _reallocate_one_moment(tr.objs.optimizer)
        tr.sync_params()  # with overlap_param_gather the weights lag until the next forward
        before = full(tr)
        # 0: every piece travels on its own, straight from/into live storage where contiguous
        executor.SMALL_PIECE_BYTES = opts.get("small_piece_bytes", small_default)
        dropped_on: list = []  # the thread where the transfer group's handle was destroyed
        if kw:
            weakref.finalize(kw["new_groups"].transfer,
                             lambda: dropped_on.append(threading.current_thread().name))
        broadcasts, bcast = [], dist.broadcast_object_list  # objects sent in the switch
        dist.broadcast_object_list = lambda *a, **k: (broadcasts.append(a), bcast(*a, **k))[1]
        try:
            tr, res = switch_trainer(tr, builder, la, pa, lb,
                                     placement=opts.get("placement", "best"),
                                     ranks_per_node=opts.get("ranks_per_node", 4),
                                     memory_budget=opts.get("memory_budget"),
                                     move_weights=opts.get("move_weights", False), **kw)
        finally:
            dist.broadcast_object_list = bcast
        after = full(tr)
        for th in threading.enumerate():
            if th.name == "dynatrain-drop":
                th.join(30)
        bound_in_background = None
        if kw:
            # B was bound while megatron's globals still described A: the same fragments
            # (main replicas included) as binding it now, with B current
            fresh = LiveState(tr.objs.model, tr.objs.optimizer, tr.objs.groups.virtual_rank,
                              s.vocab_size)
            bound_in_background = kw["prepared"].live.fragments() == fresh.fragments()
        # every replica (not only the main ones) must hold the state
        bad_all = replica_mismatches(s, tr, after)
        r = res.report
        rec = dict(a=a, b=str(lb), diff=None if before is None else G.states_equal(before, after),
                   moved=r.bytes_moved, lower=r.lower_bound_bytes, rounds=r.rounds,
                   peak=r.peak_staging_bytes, sent=r.sent_bytes, recv=r.recv_bytes,
                   placement=r.placement, phases=r.phases, iteration=tr.iteration,
                   zero_copy=_sum_over_ranks(r.zero_copy_bytes),
                   net_all=_sum_over_ranks(r.sent_bytes + r.recv_bytes),
                   replica_mismatches=bad_all,
                   steps_while_preparing=steps_while_preparing,
                   bound_in_background=bound_in_background, background=r.background,
                   source_bound_early=_gathered(r.source_bound_early),
                   transfer_dropped_on=_gathered(dropped_on), kinds=list(r.kinds),
                   params_dtype=s.params_dtype, broadcasts=len(broadcasts),
                   prepare_p2p=_gathered(p2p_groups), pp_b=lb.pp, masters_apart=_gathered(len(LiveState(
                       tr.objs.model, tr.objs.optimizer, tr.objs.groups.virtual_rank,
                       s.vocab_size).masters_apart_from_weights())),
                   placement_devices=tr.objs.groups.placement.devices)
        if opts.get("back"):
            tr, res2 = switch_trainer(tr, builder, tr.objs.layout, tr.objs.groups.placement, la,
                                      ranks_per_node=opts.get("ranks_per_node", 4))
            again = full(tr)
            rec["back_diff"] = None if before is None else G.states_equal(before, again)
        rec["losses"] = [tr.step().loss for _ in range(opts.get("steps_after", 0))]
        release(tr.objs)
        if opts.get("ckpt"):
            import os

            d = os.path.join(ckpt_root, f"{len(out)}-{a}-{b}")
            ref = checkpoint_path_case(case_model, a, b, d, rec["iteration"], opts["steps_after"],
                                       overrides, rec["placement_devices"])
            rec["ckpt_losses"] = ref["losses"]
        out.append(rec)
    return out


def hook_cases(root: str) -> dict:
    """The training-step hook driven by a signal file: one switch, and three bad requests."""
    import os
    from pathlib import Path

    from dynatrain_megatron.elastic.controller import Controller
    from dynatrain_megatron.elastic.signal_file import write_request
    from dynatrain_megatron.loop.hook import DynatrainHook

    s = spec_variant("tiny-gpt")
    train = switch_train_config()
    out: dict = {}

    def run(signal: str, writes: dict, steps: int, background: bool = True):
        tr = start_job(s, "tp2pp2dp1", train)
        hook = DynatrainHook(s, train, Controller(s, signal), ranks_per_node=4,
                             background_groups=background)
        losses = []
        for _ in range(steps):
            losses.append(tr.step().loss)
            if dist.get_rank() == 0 and tr.iteration in writes:
                w = writes[tr.iteration]
                if w.startswith("RAW:"):
                    Path(signal).write_text(w[4:])
                    os.chmod(signal, 0o600)
                elif w.startswith("WW:"):  # a valid request anyone could have written
                    write_request(signal, w[3:])
                    os.chmod(signal, 0o666)
                else:
                    write_request(signal, w)
            tr = hook.after_step(tr)
        layout = str(tr.objs.layout)
        release(tr.objs)
        return losses, hook, layout

    sig = os.path.join(root, "a.json")
    losses, hook, layout = run(sig, {2: "tp1pp2dp2"}, 6)
    h = hook.history[0] if hook.history else None
    out["switch"] = dict(losses=losses, layout=layout, iteration=h.iteration if h else None,
                         phases=h.phases if h else None,
                         groups_bg=h.groups_s if h else None, pause=h.pause_s if h else None,
                         files=sorted(p.name for p in Path(root).glob("a.json.*")))
    # B is prepared in the background: the switch comes at the first step boundary where
    # every rank is ready (iteration 3 or later); the reference restarts there
    it = h.iteration if h else 3
    ref = checkpoint_path_case("tiny-gpt", "tp2pp2dp1", "tp1pp2dp2", os.path.join(root, "ck"),
                               steps_before=it, steps_after=6 - it)
    out["switch"]["ckpt_losses"] = ref["losses"]
    out["switch"]["ckpt_losses_before"] = ref["losses_before"]

    # the same request with the groups built inside the switch (the classic way), side by side
    losses, hook, layout = run(os.path.join(root, "c.json"), {2: "tp1pp2dp2"}, 4, background=False)
    h = hook.history[0] if hook.history else None
    out["sync"] = dict(layout=layout, iteration=h.iteration if h else None,
                       groups_in_pause=h.groups_in_pause if h else None,
                       groups_s=h.groups_s if h else None, pause=h.pause_s if h else None,
                       phases=h.phases if h else None)

    sig = os.path.join(root, "b.json")
    losses, hook, layout = run(sig, {1: "RAW:{corrupt", 2: "tp2xx", 3: "tp8pp1",
                                     4: "WW:tp1pp2dp2"}, 5)
    out["rejects"] = dict(losses=losses, layout=layout, rejected=hook.rejected,
                          files=sorted(p.name for p in Path(root).glob("b.json.*")))
    tr = start_job(s, "tp2pp2dp1", train)
    out["rejects"]["plain_losses"] = [tr.step().loss for _ in range(5)]
    release(tr.objs)
    return out


def scale_cases(model: str, big: str, small: str, steps_after: int = 3,
                signal_dir: str | None = None) -> dict:
    """Scale-in (all ranks -> the first half, the rest standby) and scale-out (back to all)
    during training. At each change: full state bit-identical, bytes at the lower bound, the
    ranks outside the new layout hold nothing, and the losses after it equal those of a
    fresh job started at the new layout from the same state (written into it directly)."""
    from dynatrain_megatron.adapters.live import LiveState
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.loop.switching import switch_trainer
    from dynatrain_megatron.testing import gather as G
    from dynatrain_megatron.elastic.groups import install
    from dynatrain_megatron.transition.scalars import read_scalars, write_scalars
    from dynatrain_megatron.transition.transport import TorchP2PTransport
    from dynatrain_megatron.transition.vocab_padding import carry_vocab_padding, padding_plan
    from dynatrain_megatron.vps.analytic import analytic_layout
    from dynatrain_megatron.vps import Layout
    from dynatrain_megatron.vps.fragment import KINDS
    from dynatrain_megatron.vps.placement import Placement

    s = spec_variant(model)
    train = switch_train_config()
    builder = MegatronBuilder(s, train)
    world = dist.get_world_size()
    rank = dist.get_rank()
    la = Layout.parse(big, world)
    lb = Layout.parse(small, world // 2)
    half = Placement(tuple(range(world // 2)))
    out: dict = {}

    def full_everywhere(tr):
        """The full state on every rank of the world (gathered inside the layout)."""
        f = gather_layout_state(s, tr) if tr is not None else None
        return G.broadcast_full_state(f, src=0)

    def scalars_everywhere(tr):
        box = [read_scalars(tr.objs, tr.iteration, tr.consumed_samples) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def live(tr):
        return None if tr is None else LiveState(tr.objs.model, tr.objs.optimizer,
                                                 tr.objs.groups.virtual_rank, s.vocab_size)

    def reference(layout, placement, state, sc, steps, pad_from):
        """A fresh job at `layout` with `state` written into it: the losses it trains.
        The vocab padding rows (outside the logical state, but in the softmax) are taken
        from `pad_from`, the switched job at the same layout."""
        ref = start_job(s, layout, train, placement)
        a = analytic_layout(s, layout, builder.bucket_size(layout))
        plan = padding_plan((a, placement), (a, placement), KINDS)  # pad_from -> ref
        _, errs = carry_vocab_padding(plan, rank, live(pad_from), live(ref),
                                      TorchP2PTransport())
        assert not errs, errs
        if ref is None:
            return None
        G.scatter_full_state(live(ref), state)
        write_scalars(ref.objs, sc)
        ref.iteration, ref.consumed_samples = sc.iteration, sc.consumed_samples
        losses = [ref.step().loss for _ in range(steps)]
        release(ref.objs)
        return losses

    def change(tr, src, src_pl, dst, devices, tag):
        before = full_everywhere(tr)
        sc = scalars_everywhere(tr)
        tr, res = switch_trainer(tr, builder, src, src_pl, dst, dst_devices=devices,
                                 ranks_per_node=4)
        members = [None] * world
        dist.all_gather_object(members, tr is not None)
        after = full_everywhere(tr)
        it_after = None if tr is None else tr.iteration
        holds = 0 if tr is None else sum(p.numel() for m in tr.objs.model for p in m.parameters())
        held = [None] * world
        dist.all_gather_object(held, holds)
        r = res.report
        # the reference first (it needs the switched job's untrained padding rows)
        ref = [reference(dst, res.placement, before, sc, steps_after, tr)]
        dist.broadcast_object_list(ref, src=0)
        if tr is not None:
            install(tr.objs.groups)  # the reference job pointed megatron's globals elsewhere
        losses = [tr.step().loss for _ in range(steps_after)] if tr is not None else None
        box = [losses]
        dist.broadcast_object_list(box, src=0)
        out[tag] = dict(members=members, held=held, diff=G.states_equal(before, after),
                        moved=r.bytes_moved, lower=r.lower_bound_bytes, placement=r.placement,
                        iteration_before=sc.iteration, iteration_after=it_after,
                        losses=box[0], ref_losses=ref[0])
        return tr, res

    tr = start_job(s, la, train)
    for _ in range(2):
        tr.step()
    tr, res = change(tr, la, tr.objs.groups.placement, lb, half.devices, "in")
    tr, res = change(tr, lb, res.placement, la, tuple(range(world)), "out")
    release(tr.objs)
    if signal_dir is not None:
        out["hook"] = _hook_scale(s, train, builder, la, lb, signal_dir)
    return out


def _hook_scale(s, train, builder, la, lb, signal_dir: str, steps: int = 9) -> dict:
    """The same scale-in and scale-out requested through the signal file, with the ranks
    outside the layout in the hook's standby loop (as in loop/main.py); then the
    same switches at the same iterations called directly, for the reference losses."""
    import os
    from pathlib import Path

    from dynatrain_megatron.elastic.controller import Controller
    from dynatrain_megatron.elastic.signal_file import write_request
    from dynatrain_megatron.loop.hook import DynatrainHook
    from dynatrain_megatron.loop.switching import switch_trainer

    rank = dist.get_rank()
    signal = os.path.join(signal_dir, "scale.json")
    writes = {2: (str(lb), lb.world_size), 5: (str(la), la.world_size)}
    tr = start_job(s, la, train)
    hook = DynatrainHook(s, train, Controller(s, signal), ranks_per_node=4)
    hook.start(tr, la, tr.objs.groups.placement)
    losses, standby_at = [], []
    while True:
        if tr is None:
            standby_at.append(len(losses))
            tr = hook.standby()
            if tr is None:
                break
            continue
        if tr.iteration >= steps:
            break
        losses.append(tr.step().loss)
        if rank == 0 and tr.iteration in writes:
            write_request(signal, *writes[tr.iteration])
        tr = hook.after_step(tr)
    if tr is not None:
        hook.end_job(tr)
        release(tr.objs)
    box = [losses]
    dist.broadcast_object_list(box, src=0)
    switched_at = [h.iteration for h in hook.history]
    res = dict(losses=box[0], rank_losses=len(losses), standby_at=standby_at,
               switched_at=switched_at, layouts=[(h.src, h.dst) for h in hook.history],
               files=sorted(p.name for p in Path(signal_dir).glob("scale.json.*")))
    box = [switched_at]
    dist.broadcast_object_list(box, src=0)
    # reference: the same switches called directly at the same iterations
    tr = start_job(s, la, train)
    cur, pl = la, tr.objs.groups.placement
    targets = dict(zip(box[0], (lb, la)))
    ref = []
    while True:
        if tr is not None:
            ref.append(tr.step().loss)
        itb = [tr.iteration if tr is not None else None]
        dist.broadcast_object_list(itb, src=0)  # rank 0 trains throughout
        if itb[0] in targets:
            dst = targets[itb[0]]
            tr, r = switch_trainer(tr, builder, cur, pl, dst,
                                   dst_devices=tuple(range(dst.world_size)), ranks_per_node=4)
            cur, pl = dst, r.placement
        if itb[0] >= steps:
            break
    if tr is not None:
        release(tr.objs)
    box = [ref]
    dist.broadcast_object_list(box, src=0)
    res["ref_losses"] = box[0]
    return res


def replica_mismatches(s, tr, full) -> list:
    """Every replica (not only the main ones) of `tr`'s live state against the gathered
    `full` state: the first mismatches of every rank, on all ranks."""
    from dynatrain_megatron.adapters.live import LiveState
    from dynatrain_megatron.testing import gather as G

    objs = tr.objs
    ref = G.broadcast_full_state(full, group=objs.groups.layout_group,
                                 src=min(objs.groups.placement.devices))
    bad = G.mismatches_against(LiveState(objs.model, objs.optimizer, objs.groups.virtual_rank,
                                         s.vocab_size), ref)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, bad[:3])
    return [b for part in out for b in part]


def gather_layout_state(s: ModelSpec, tr):
    """The full logical state of a trainer's layout, on the layout's lowest global rank
    (whatever the placement: global rank 0 when the layout spans the world)."""
    from dynatrain_megatron.adapters.live import LiveState
    from dynatrain_megatron.testing import gather as G

    g = tr.objs.groups.layout_group
    return G.gather_full_state(LiveState(tr.objs.model, tr.objs.optimizer,
                                         tr.objs.groups.virtual_rank, s.vocab_size), s, g,
                               dst=min(tr.objs.groups.placement.devices))


def fault_cases(model: str, a: str, b: str, faults: list[dict], timeout: float,
                steps_after: int = 3) -> list[dict]:
    """Per injected fault: train at A, attempt A -> B with the fault, then train on. Records
    whether the switch aborted (and why), the full state after the attempt against before,
    and the losses after it; `plain` is the same job that never attempted a switch."""
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.loop.switching import switch_trainer
    from dynatrain_megatron.testing import gather as G
    from dynatrain_megatron.transition.faults import FaultPlan
    from dynatrain_megatron.vps import Layout

    s = spec_variant(model)
    train = switch_train_config()
    builder = MegatronBuilder(s, train)
    world = dist.get_world_size()

    tr = start_job(s, a, train)
    plain = [tr.step().loss for _ in range(2 + steps_after)]
    release(tr.objs)
    out = []
    for spec_ in faults:
        tr = start_job(s, a, train)
        for _ in range(2):
            tr.step()
        before = gather_layout_state(s, tr)
        groups_before = len(dist.distributed_c10d._world.pg_map)
        tr, res = switch_trainer(tr, builder, tr.objs.layout, tr.objs.groups.placement,
                                 Layout.parse(b, world), ranks_per_node=4, timeout=timeout,
                                 faults=FaultPlan(**spec_))
        after = gather_layout_state(s, tr)
        rec = dict(fault=spec_, aborted=res.aborted, layout=str(tr.objs.layout),
                   diff=None if before is None else G.states_equal(before, after),
                   groups_leaked=len(dist.distributed_c10d._world.pg_map) - groups_before,
                   losses=[tr.step().loss for _ in range(steps_after)], plain=plain[2:],
                   checksummed=_sum_over_ranks(res.report.checksummed_messages))
        release(tr.objs)
        out.append(rec)
    return out


def repeated_switch_case(model: str, layouts: list[str], n: int) -> dict:
    """`n` switches in a row cycling through `layouts`: RSS and the number of live process
    groups after every switch, and the full state at the end against the start (a switch
    only moves state, so n switches must leave it bit-identical)."""
    import gc

    import psutil

    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.loop.switching import switch_trainer
    from dynatrain_megatron.testing import gather as G
    from dynatrain_megatron.vps import Layout

    s = spec_variant(model)
    train = switch_train_config()
    builder = MegatronBuilder(s, train)
    world = dist.get_world_size()

    tr = start_job(s, layouts[0], train)
    for _ in range(2):
        tr.step()
    start = gather_layout_state(s, tr)
    proc = psutil.Process()
    rss, groups = [], []
    for i in range(n):
        dst = Layout.parse(layouts[(i + 1) % len(layouts)], world)
        tr, res = switch_trainer(tr, builder, tr.objs.layout, tr.objs.groups.placement, dst,
                                 ranks_per_node=4)
        assert res.aborted is None, res.aborted
        rss.append(proc.memory_info().rss)
        groups.append(len(dist.distributed_c10d._world.pg_map))
    # back at the first layout: the state must be what it was
    while str(tr.objs.layout) != str(Layout.parse(layouts[0], world)):
        tr, _ = switch_trainer(tr, builder, tr.objs.layout, tr.objs.groups.placement,
                               Layout.parse(layouts[0], world), ranks_per_node=4)
    end = gather_layout_state(s, tr)
    release(tr.objs)
    gc.collect()
    return dict(rss=rss, groups=groups, diff=None if start is None else G.states_equal(start, end))


def death_case(store_dir: str, ckpt_dir: str, layout: str = "tp2pp1dp2", dead: int = 3,
               ref_ckpt_dir: str | None = None) -> dict:
    """A rank dies one step after the last checkpoint: the survivors notice, re-form the
    world, name what was lost and recover: from their own memory when every piece of the
    state has a replica (`doi` > 1), else from the checkpoint, at a layout that fits them.

    `ref_ckpt_dir`: also save the state at the moment of the death there (a reference the
    recovery never reads) and gather it, to compare the in-memory recovery bit for bit."""
    from dynatrain_megatron.mcore import dist_ckpt
    from dynatrain_megatron.loop.death_recovery import recover_after_death

    s = spec_variant("tiny-gpt")
    train = switch_train_config()
    rank = dist.get_rank()
    tr = start_job(s, layout, train)
    for _ in range(2):
        tr.step()
    dist_ckpt.save(tr.objs, tr.iteration, tr.consumed_samples, ckpt_dir)
    tr.step()  # progress after the checkpoint, lost with the rank unless replicated
    before = None
    if ref_ckpt_dir:
        from dynatrain_megatron.testing import gather as G

        # every rank keeps the full state: whichever survivor leads the new layout compares
        before = G.broadcast_full_state(gather_layout_state(s, tr), group=tr.objs.groups.layout_group)
        dist_ckpt.save(tr.objs, tr.iteration, tr.consumed_samples, ref_ckpt_dir)
    if rank == dead:
        import os

        os._exit(0)  # the process is gone at once, like a crash: its sockets close
    import time

    t0 = time.monotonic()
    try:
        tr.step()
        return {"error": "the death of a rank went unnoticed"}
    except Exception as e:  # noqa: BLE001 - what a survivor sees
        detected = f"after {time.monotonic() - t0:.1f} s: " + str(e).splitlines()[0][:200]
    rec = recover_after_death(tr, s, train, store_dir, ckpt_dir)
    nw = rec.world
    out = dict(detected=detected, dead=list(nw.dead), members=list(nw.members), lost=rec.lost,
               new_rank=nw.rank, mode=rec.mode, target=str(rec.layout))
    if rec.trainer is None:
        return out
    new = rec.trainer
    if ref_ckpt_dir:
        from dynatrain_megatron.testing import gather as G

        after = gather_layout_state(s, new)
        if before is not None and after is not None:
            out["state_diff"] = G.states_equal(before, after)
    out.update(layout=str(new.objs.layout), iteration=new.iteration,
               world=dist.get_world_size(),
               losses=[new.step().loss for _ in range(2)])
    release(new.objs)
    return out


def death_in_switch_case(store_dir: str, ref_ckpt_dir: str, layout: str = "tp1pp2doi2dp2",
                         target: str = "tp2pp1doi2dp2", dead: int = 3) -> dict:
    """A rank dies inside a switch (after the first transfer round): the survivors' switch
    fails with WorldBroken, their trainer is still at A, untouched, and they recover from
    their memory (every optimizer shard has a replica) at a layout that fits them."""
    from dynatrain_megatron.mcore import dist_ckpt
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.loop.death_recovery import recover_after_death
    from dynatrain_megatron.loop.switching import WorldBroken, switch_trainer
    from dynatrain_megatron.testing import gather as G
    from dynatrain_megatron.transition.faults import FaultPlan
    from dynatrain_megatron.vps import Layout

    s = spec_variant("tiny-gpt")
    train = switch_train_config()
    tr = start_job(s, layout, train)
    for _ in range(2):
        tr.step()
    before = G.broadcast_full_state(gather_layout_state(s, tr), group=tr.objs.groups.layout_group)
    dist_ckpt.save(tr.objs, tr.iteration, tr.consumed_samples, ref_ckpt_dir)  # reference only
    out: dict = {}
    try:
        switch_trainer(tr, MegatronBuilder(s, train), tr.objs.layout, tr.objs.groups.placement,
                       Layout.parse(target, dist.get_world_size()),
                       faults=FaultPlan(fail_rank=dead, fail_phase="round", kill=True, exit_code=0))
        return {"error": "the switch survived the death of a rank"}
    except WorldBroken as e:
        out["broken"] = str(e)
    rec = recover_after_death(tr, s, train, store_dir, None)
    out.update(dead=list(rec.world.dead), members=list(rec.world.members), mode=rec.mode)
    if rec.trainer is None:
        return out
    after = gather_layout_state(s, rec.trainer)
    if after is not None:
        out["state_diff"] = G.states_equal(before, after)
    out.update(layout=str(rec.trainer.objs.layout), iteration=rec.trainer.iteration,
               losses=[rec.trainer.step().loss for _ in range(2)])
    release(rec.trainer.objs)
    return out


def main_job_case(run_dir: str, argv: list[str]) -> dict:
    """The training entry point (scripts/pretrain_gpt.py's main) on this rank."""
    from dynatrain_megatron.loop.main import main

    return {"code": main(argv)}


def resume_case(ckpt_dir: str, layout: str, steps: int = 2) -> dict:
    """The reference: a fresh job at `layout` loading the checkpoint and training on."""
    from dynatrain_megatron.mcore import dist_ckpt

    s = spec_variant("tiny-gpt")
    tr = start_job(s, layout, switch_train_config())
    tr.iteration, tr.consumed_samples = dist_ckpt.load(tr.objs, ckpt_dir)
    out = dict(iteration=tr.iteration, losses=[tr.step().loss for _ in range(steps)])
    release(tr.objs)
    return out


def metadata_gather_with_a_failed_rank() -> str:
    """Every rank joins the metadata gather; the last failed before it (its B did not
    build): every rank raises, with that rank's reason, none waits."""
    from dynatrain_megatron.transition.metadata_exchange import gather_metadata

    me, n = dist.get_rank(), dist.get_world_size()
    try:
        gather_metadata(None, None, ("main_param",), None,
                        error=f"rank {me}: prepare: boom" if me == n - 1 else None)
    except ValueError as e:
        return str(e)
    return "no error"
