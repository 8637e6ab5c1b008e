"""`dynatrain bench-switch`: our switch against the checkpoint path and megatron's refit.

Everything runs in ONE spawned group of gloo ranks, on the same live job (layout A, trained
for a few steps so the Adam state is real), one measurement after the other:

  (d) link: pairwise point-to-point bandwidth between the same ranks (every rank exchanges
      a buffer with a partner at the same time, `batch_isend_irecv`, like the executor);
      also a small-message round trip (the cost model's round latency) and a local memcpy
      (the cost model's local-copy bandwidth);
  (a) ours: `switch_trainer` A -> B, then B -> A, `repeat` times (the job ends at A). By
      default B is prepared as the hook does it (groups, objects, binding, plan in the
      device manager's thread while A trains: `testing.prepare`, whose wall time
      and training steps are reported); the pause is what the training loop then waits
      for: the switch at the step boundary, releasing A and rebinding the trainer.
      `prepare="inline"` puts all of it in the pause except group construction;
      the wall time around the call is kept too;
  (e) the same bytes moved the simplest way (`measure_raw_movement`): one message per
      peer with the plan's volumes, the plan's local bytes in one memcpy meanwhile, and
      again with checksums. Where the link is itself CPU work (loopback TCP on a few
      cores), this, not the network-only floor, is what the transfer can reach;
  (c) megatron-core's weights-only refit `resharding.swap_model_weights(..., "gloo")` from
      the live A model into a B model built on B's groups (default rank order, as a
      megatron user gets it): first call (builds and caches its plan), then `repeat`
      calls with the cached plan;
  (b) the checkpoint path: `dist_checkpointing` save at A (fully reshardable optimizer
      format) to /dev/shm (else /tmp), build B's objects, load; save, build and load
      timed separately. B's group construction is timed but left out of the total, as it
      is left out of our pause; no process restart is counted (a real restart adds tens
      of seconds), and B is built without weight initialisation: the figure is a lower
      bound of what a Megatron user pays.

Every interval is barrier-to-barrier and the max over ranks. Figures of repeated
measurements are medians.
"""
from __future__ import annotations

import gc
import os
import shutil
import time
from typing import Any

import torch.distributed as dist

from .config import BenchConfig
from .measure import (TRANSFER_PARTS, Progress, TransferProbe, ckpt_root, max_over_ranks,
                      measure_link, measure_raw_movement, median, refit_bytes, rss_bytes,
                      rss_reset, sum_over_ranks, timed)
from .report import load_average, summarize


def bench_rank(cfg: BenchConfig) -> dict:
    """Runs on every rank of the spawned group (module doc). Returns the same dict on every
    rank (rank-dependent figures are reduced), plus this rank's own traffic."""
    from ..mcore.builders import MegatronBuilder
    from ..mcore.session import release, start_job
    from ..routing.cost import state_bytes
    from ..routing.regions import key_index
    from ..vps.layout import Layout
    from ..vps.model_spec import ModelSpec

    world = dist.get_world_size()
    spec = ModelSpec.from_yaml(cfg.model_path)
    out: dict[str, Any] = {}
    t_start = time.perf_counter()
    progress = Progress(cfg.progress)

    # the job at A, trained so that Adam's moments and step are real
    tr, t_job = timed(start_job, spec, cfg.src, cfg.train)
    out["job_start_seconds"] = t_job
    losses = []
    for _ in range(cfg.iters_before):
        losses.append(tr.step().loss)
    out["losses_before"] = losses
    out["rss_after_steps_bytes"] = int(max_over_ranks(rss_bytes()[0]))
    la = tr.objs.layout
    lb = Layout.parse(cfg.dst, world)
    builder = MegatronBuilder(spec, cfg.train)
    out["params"] = int(key_index(spec).numel.sum())  # logical, vocab padding excluded
    out["state_bytes_all_kinds"] = state_bytes(spec)

    # (d) the link between the same ranks
    progress(f"job at {la} started, {cfg.iters_before} step(s) trained")
    out.update(measure_link(cfg.link_bytes))
    progress(f"link measured: {out['link_gbps']:.2f} GB/s per rank")

    # (a) ours: A -> B -> A, `repeat` times
    tr, fwd, back = _switches(tr, builder, la, lb, cfg, progress)
    out["ours_fwd"] = [{k: v for k, v in x.items() if k not in ("src_placement", "dst_placement")}
                       for x in fwd]
    out["ours_back"] = [{k: v for k, v in x.items() if k not in ("src_placement", "dst_placement")}
                        for x in back]
    first = fwd[0]
    sent_all = [None] * world
    dist.all_gather_object(sent_all, (first["sent"], first["recv"]))
    out["per_rank_sent_recv_bytes"] = sent_all
    plan = _plan_figures(builder, la, lb, first, cfg, out)

    # (e) the same bytes moved the simplest way: the floor of the whole transfer here
    if "raw" not in cfg.skip:
        out.update(measure_raw_movement(plan, cfg.repeat))
        gc.collect()
        progress(f"raw movement of the plan's bytes: {out['raw_movement_seconds']:.3f} s, "
                 f"{out['raw_movement_checksummed_seconds']:.3f} s with checksums")

    # (c) megatron-core's weights-only refit, A's live model -> a B model on B's groups
    if "refit" not in cfg.skip:
        out.update(_refit(tr, spec, lb, cfg))
        progress(f"refit measured: {out['refit_seconds']:.2f} s")

    out["iteration"] = tr.iteration
    out["layout_at_end"] = str(tr.objs.layout)

    # (b) the checkpoint path, as a restart does it: save at A, A goes away, build B, load
    if "checkpoint" not in cfg.skip:
        objs_a, iteration, consumed = tr.objs, tr.iteration, tr.consumed_samples
        del tr
        out.update(_checkpoint_path(objs_a, iteration, consumed, builder, la, lb, cfg,
                                    progress))
    else:
        release(tr.objs)
    out["bench_seconds"] = max_over_ranks(time.perf_counter() - t_start)
    return out


def _switches(tr, builder, la, lb, cfg: BenchConfig, progress: Progress
              ) -> tuple[Any, list[dict], list[dict]]:
    """(a) `switch_trainer` A -> B -> A, `cfg.repeat` times; one record per switch. Returns
    the trainer (at A again) and the records of both directions."""
    from ..loop.switching import switch_trainer
    from ..testing.prepare import prepare_while_training

    fwd, back = [], []
    rss_ok = rss_reset()
    probe = TransferProbe()
    for i in range(cfg.repeat):
        for direction in ("fwd", "back"):
            src_l, src_p = tr.objs.layout, tr.objs.groups.placement
            dst_l = lb if direction == "fwd" else la
            prep = {}
            if cfg.background:
                # as the hook does it: B is prepared while A trains; one plain step first,
                # the baseline the steps during the preparation are compared with
                prep["step_alone"] = max_over_ranks(tr.step().seconds)
            rss_reset()
            rss0 = rss_bytes()[0]
            kw = {}
            if cfg.background:
                pw = prepare_while_training(
                    tr, builder, src_l, src_p, dst_l, placement=cfg.placement,
                    ranks_per_node=cfg.ranks_per_node, memory_budget=cfg.memory_budget,
                    move_weights=cfg.move_weights)
                kw = pw.switch_args
                prep.update(wall=max_over_ranks(pw.wall_seconds),
                            placement=max_over_ranks(pw.placement_seconds),
                            steps=len(pw.step_seconds),
                            step_during=max_over_ranks(sum(pw.step_seconds)
                                                       / len(pw.step_seconds)),
                            groups=max_over_ranks(pw.groups_seconds),
                            work=max_over_ranks(pw.work_seconds))
            (tr, res), wall = timed(switch_trainer, tr, builder, src_l, src_p, dst_l,
                                    placement=cfg.placement, ranks_per_node=cfg.ranks_per_node,
                                    memory_budget=cfg.memory_budget,
                                    move_weights=cfg.move_weights, **kw)
            r, dst_p = res.report, res.placement
            del res
            # A's model/DDP/optimizer are left in reference cycles (DDP hooks, bound methods
            # in the TransformerConfig): without a collection here each switch would keep
            # the previous layout's state alive until Python's GC happens to run, and the
            # repeated switches of a large model would run out of memory
            rss_kept = rss_bytes()[0]
            _, t_gc = timed(gc.collect)
            parts = probe.take()
            parts["other"] = r.phases.get("transfer", 0.0) - sum(parts.values())
            # the pause is what the training loop waits for: the whole call (the switch,
            # then releasing A and rebinding the trainer), less B's groups where they were
            # built inside it (`--prepare inline`; the hook builds them in the background)
            rec = dict(wall=wall, pause=wall - max_over_ranks(r.phases.get("groups", 0.0)),
                       switch=max_over_ranks(r.pause_seconds),
                       transfer_parts={k: max_over_ranks(parts.get(k, 0.0)) for k in
                                       TRANSFER_PARTS},
                       phases={k: max_over_ranks(v) for k, v in sorted(r.phases.items())},
                       peak_staging=int(max_over_ranks(r.peak_staging_bytes)),
                       rss_peak_delta=(int(max_over_ranks(rss_bytes()[1] - rss0)) if rss_ok
                                       else None),
                       rss_before=int(max_over_ranks(rss0)),
                       rss_peak=int(max_over_ranks(rss_bytes()[1])),
                       rss_before_gc=int(max_over_ranks(rss_kept)),
                       rss_after_gc=int(max_over_ranks(rss_bytes()[0])),
                       gc_seconds=t_gc,
                       background={k: max_over_ranks(v) for k, v in sorted(r.background.items())},
                       prepare=prep,
                       sent=r.sent_bytes, recv=r.recv_bytes, rounds=r.rounds,
                       bytes_moved=r.bytes_moved, lower_bound=r.lower_bound_bytes,
                       local=r.local_bytes, placement=r.placement,
                       src_placement=src_p, dst_placement=dst_p)
            (fwd if direction == "fwd" else back).append(rec)
            progress(f"switch {src_l} -> {dst_l} ({i + 1}/{cfg.repeat}): pause "
                     f"{rec['pause']:.2f} s, peak RSS {rec['rss_peak'] / 1e9:.2f} GB, "
                     f"{rec['rss_before_gc'] / 1e9:.2f} GB after it, "
                     f"{rec['rss_after_gc'] / 1e9:.2f} GB after gc.collect() ({t_gc:.2f} s)")
    probe.close()
    return tr, fwd, back


def _plan_figures(builder, la, lb, first: dict, cfg: BenchConfig, out: dict):
    """The plan of the A -> B switch as run (its statistics, the default placement's bytes,
    the cost model fed with the measured link) into `out`; returns the plan."""
    from ..routing.cost import estimate
    from ..routing.links import LinkModel
    from ..routing.placement_search import best_rank_ordered, placement_choice
    from ..routing.planner import build_plan
    from ..routing.schedule import build_schedule
    from ..transition.executor import PACK_ALIGN
    from ..vps.fragment import KINDS, OPT_KINDS
    from ..vps.placement import Placement

    spec, rpn = builder.spec, cfg.ranks_per_node
    kinds = KINDS if cfg.move_weights else OPT_KINDS
    buckets = (builder.bucket_size(la), builder.bucket_size(lb))
    plan = build_plan(spec, (la, first["src_placement"]), (lb, first["dst_placement"]),
                      kinds=kinds, ranks_per_node=rpn, bucket_size=buckets)
    dplan = build_plan(spec, (la, first["src_placement"]), (lb, Placement.default(lb.world_size)),
                       kinds=kinds, ranks_per_node=rpn, bucket_size=buckets)
    st = plan.stats
    # the three placements side by side: default order, best rank-ordered, best (any order)
    ch = placement_choice(spec, la, first["src_placement"], lb, tuple(range(lb.world_size)), rpn,
                          buckets, kinds)
    out.update(best_rank_ordered_bytes_moved=best_rank_ordered(ch, rpn)[1].stats.moved_bytes,
               best_placement_bytes_moved=ch.chosen_stats.moved_bytes)
    out.update(kinds=list(kinds), max_rank_send_bytes=st.max_send_bytes,
               max_rank_recv_bytes=st.max_recv_bytes, max_rank_traffic_bytes=st.max_traffic_bytes,
               default_placement_bytes_moved=dplan.stats.moved_bytes,
               num_pieces=st.num_pieces, num_local_pieces=st.num_local_pieces,
               state_bytes_moved_kinds=sum(v for _, v in st.state_per_kind))
    g = out["link_gbps"]
    links = LinkModel(intra_node_gbps=g, inter_node_gbps=g,
                      round_latency_s=out["round_latency_seconds"],
                      local_copy_gbps=out["memcpy_gbps"], checksum_gbps=out["memcpy_gbps"])
    est = estimate(build_schedule(plan, cfg.memory_budget, PACK_ALIGN), links)
    out.update(cost_model_seconds=est.total_seconds, cost_model_network_seconds=est.network_seconds,
               cost_model_local_copy_seconds=est.local_copy_seconds,
               cost_model_lower_bound_seconds=est.bandwidth_lower_bound_seconds,
               cost_model_rounds=est.num_rounds)
    return plan


def _refit(tr, spec, lb, cfg: BenchConfig) -> dict:
    """(c) megatron-core's `swap_model_weights` from A's live model into a B model built on
    B's groups in megatron's default rank order: the first call, then `repeat` cached."""
    from megatron.core.resharding import swap_model_weights

    from ..elastic.groups import build_groups, install
    from ..mcore.builders import (build_model_chunks, make_transformer_config,
                                  restore_tensor_parallel_attributes)
    from ..vps.placement import Placement

    def build_b_model(groups):
        # what a refit target is (an inference/rollout model): model chunks only, no
        # DDP/optimizer; megatron reads some ranks from parallel_state while building
        install(groups)
        chunks = build_model_chunks(spec, lb, groups, make_transformer_config(spec, lb),
                                    init_weights=False)
        restore_tensor_parallel_attributes(chunks, spec)  # the refit plans from them
        return chunks

    gb, t_groups = timed(build_groups, lb, Placement.default(lb.world_size))
    model_b, t_build = timed(build_b_model, gb)
    install(tr.objs.groups)
    _, t_first = timed(swap_model_weights, tr.objs.model, model_b, "gloo")
    cached = [timed(swap_model_weights, tr.objs.model, model_b, "gloo")[1]
              for _ in range(cfg.repeat)]
    remote, local = refit_bytes(model_b)
    out = dict(refit_first_seconds=t_first, refit_cached_seconds=cached,
               refit_seconds=median(cached), refit_groups_seconds=t_groups,
               refit_build_seconds=t_build, refit_bytes_moved=int(sum_over_ranks(remote)),
               refit_max_rank_recv_bytes=int(max_over_ranks(remote)),
               refit_local_bytes=int(sum_over_ranks(local)))
    gb.destroy()
    del model_b
    gc.collect()
    return out


def _checkpoint_path(objs_a, iteration: int, consumed: int, builder, la, lb,
                     cfg: BenchConfig, progress: Progress) -> dict:
    """(b) save at A, A goes away, build B, load (the restart path without the restart).
    Between runs A is rebuilt and reloaded from the same checkpoint (not timed). Takes A's
    objects over and releases them."""
    from ..elastic.groups import build_groups
    from ..mcore import dist_ckpt
    from ..mcore.session import release
    from ..vps.placement import Placement

    rank, world = dist.get_rank(), dist.get_world_size()
    box = [ckpt_root(cfg.ckpt_dir) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    runs = []
    pa = objs_a.groups.placement
    n = cfg.checkpoint_runs
    try:
        for i in range(n):
            d = os.path.join(root, f"run{i}")
            _, t_save = timed(dist_ckpt.save, objs_a, iteration, consumed, d)
            progress(f"checkpoint {i + 1}/{n} saved in {t_save:.2f} s")
            release(objs_a)
            del objs_a
            gc.collect()
            gb, t_groups = timed(build_groups, lb, Placement.default(world))
            objs_b, t_build = timed(builder.build, lb, gb, init_weights=False)
            (it, _), t_load = timed(dist_ckpt.load, objs_b, d)
            progress(f"checkpoint {i + 1}/{n} loaded at {lb} in {t_load:.2f} s")
            if it != iteration:
                raise RuntimeError(f"checkpoint load gave iteration {it}, saved {iteration}")
            release(objs_b)
            del objs_b
            gc.collect()
            objs_a = None
            if i < n - 1:  # A again, for the next run
                objs_a = builder.build(la, build_groups(la, pa), init_weights=False)
                dist_ckpt.load(objs_a, d)
            dist.barrier()
            if rank == 0:
                size = sum(os.path.getsize(os.path.join(dp, f))
                           for dp, _, fs in os.walk(d) for f in fs)
                shutil.rmtree(d, ignore_errors=True)
            else:
                size = 0
            runs.append(dict(save=t_save, groups=t_groups, build=t_build, load=t_load,
                             total=t_save + t_build + t_load, bytes=int(sum_over_ranks(size))))
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = dict(checkpoint_runs=runs, checkpoint_dir=os.path.dirname(root))
    for k in ("save", "groups", "build", "load", "total"):
        out[f"dist_checkpoint_{k}_seconds"] = median([x[k] for x in runs])
    out["dist_checkpoint_seconds"] = out.pop("dist_checkpoint_total_seconds")
    out["checkpoint_bytes"] = runs[0]["bytes"]
    out["checkpoint_repeat"] = n
    return out


def run_bench(cfg: BenchConfig, timeout: float = 1800.0) -> dict:
    """Spawn `cfg.nproc` gloo ranks, run `bench_rank`, return the summary."""
    from ..testing.multiproc import run_on_ranks

    load_at_start = load_average()
    results = run_on_ranks(bench_rank, cfg.nproc, cfg, timeout=timeout)
    return summarize(results[0], cfg, load_at_start)
