"""`dynatrain bench-switch`: our switch against the checkpoint path and megatron's refit.

Everything runs in ONE spawned group of gloo ranks, on the same live job (layout A, trained
for a few steps so the Adam state is real), one measurement after the other:

  (d) link: pairwise point-to-point bandwidth between the same ranks (every rank exchanges
      a buffer with a partner at the same time, `batch_isend_irecv`, like the executor);
      also a small-message round trip (the cost model's round latency) and a local memcpy
      (the cost model's local-copy bandwidth);
  (a) ours: `switch_trainer` A -> B, then B -> A, `repeat` times (the job ends at A). By
      default B is prepared as the hook does it (groups, objects, binding, plan in the
      device manager's thread while A trains: `_prepare_while_training`, whose wall time
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
import math
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..transition.transport import collective_device
from ..units import format_bytes, format_seconds

MB = 1 << 20


# ---------------------------------------------------------------------------- rank helpers
def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _sum(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t[0])


def _timed(fn, *a, **kw) -> tuple[Any, float]:
    """Run `fn` on every rank between barriers; (result, max seconds over ranks)."""
    dist.barrier()
    t0 = time.perf_counter()
    r = fn(*a, **kw)
    dt = time.perf_counter() - t0
    return r, _max(dt)


def _median(xs):
    return float(statistics.median(xs)) if xs else None


def _peers(rank: int, world: int) -> tuple[int, int]:
    """(send-to, receive-from): pairs (0,1), (2,3), ... ; a ring for odd worlds."""
    if world % 2 == 0:
        p = rank ^ 1
        return p, p
    return (rank + 1) % world, (rank - 1) % world


def _exchange_seconds(nbytes: int, iters: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    to, frm = _peers(rank, world)
    n = max(1, nbytes // 4)
    send = torch.full((n,), float(rank), dtype=torch.float32)
    recv = torch.empty(n, dtype=torch.float32)

    def once():
        ops = [dist.P2POp(dist.isend, send, to), dist.P2POp(dist.irecv, recv, frm)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    once()  # warm up the pair's connection
    out = []
    for _ in range(iters):
        out.append(_timed(once)[1])
    if float(recv[0]) != float(frm):
        raise RuntimeError(f"bandwidth test: rank {rank} got data of rank {recv[0]}, "
                           f"expected {frm}")
    return out


def measure_link(nbytes: int = 64 * MB, iters: int = 3) -> dict[str, float]:
    """Pairwise P2P bandwidth (GB/s per rank and direction), small-message latency, and
    the local memcpy bandwidth, all ranks at once (module doc, (d))."""
    bw_t = _median(_exchange_seconds(nbytes, iters))
    lat = _median(_exchange_seconds(4, 10))
    a = torch.ones(nbytes // 4, dtype=torch.float32)
    b = torch.empty_like(a)
    b.copy_(a)
    cp = _median([_timed(b.copy_, a)[1] for _ in range(iters)])
    return dict(link_gbps=nbytes / bw_t / 1e9, link_buffer_bytes=nbytes,
                link_seconds=bw_t, round_latency_seconds=lat,
                memcpy_gbps=nbytes / cp / 1e9)


def measure_raw_movement(plan, iters: int = 3) -> dict[str, float]:
    """(e) The data movement of `plan` done the simplest way, without our executor: each
    rank sends one message per peer with the plan's bytes to that peer and receives the
    plan's bytes from each, in one batched exchange, and copies the plan's local bytes in
    one memcpy while they are on the wire; once more with an int64 checksum of every
    message on both sides (what our transfer does). On a machine whose link is itself CPU
    work (loopback TCP), this is the floor of the whole transfer: wire, local copies and
    checksums share the same cores, which the network-only floor leaves out."""
    from ..transition.checksum import checksum

    me = dist.get_rank()
    out_b: dict[int, int] = {}
    in_b: dict[int, int] = {}
    local = 0
    for p in plan.pieces_for(me):
        if p.is_local:
            local += p.nbytes
        elif p.src_device == me:
            out_b[p.dst_device] = out_b.get(p.dst_device, 0) + p.nbytes
        elif p.dst_device == me:
            in_b[p.src_device] = in_b.get(p.src_device, 0) + p.nbytes
    src = torch.ones(max([local, *out_b.values(), 1]), dtype=torch.uint8)
    dst_local = torch.empty(max(local, 1), dtype=torch.uint8)
    recv = {peer: torch.empty(n, dtype=torch.uint8) for peer, n in in_b.items()}
    dst_local.fill_(0)
    for t in recv.values():
        t.fill_(0)  # first-touched here, like the new layout's prepared buffers

    def once(sums: bool) -> None:
        ops = []
        for peer in sorted(set(out_b) | set(in_b)):
            if peer in out_b:
                ops.append(dist.P2POp(dist.isend, src[:out_b[peer]], peer))
            if peer in in_b:
                ops.append(dist.P2POp(dist.irecv, recv[peer], peer))
        works = dist.batch_isend_irecv(ops) if ops else []
        if sums:
            for peer, n in out_b.items():
                checksum(src[:n])
        if local:
            dst_local.copy_(src[:local])
        for w in works:
            w.wait()
        if sums:
            for t in recv.values():
                checksum(t)

    once(False)  # connections warm
    plain = _median([_timed(once, False)[1] for _ in range(iters)])
    summed = _median([_timed(once, True)[1] for _ in range(iters)])
    return dict(raw_movement_seconds=plain, raw_movement_checksummed_seconds=summed)


def _rss_reset() -> bool:
    """Reset this process's peak RSS (Linux clear_refs 5); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_bytes() -> tuple[int, int]:
    """(current RSS, peak RSS since the last reset) of this process, bytes."""
    cur = hwm = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    cur = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except OSError:
        pass
    return cur, hwm


def _refit_bytes(target_model) -> tuple[int, int]:
    """(bytes this rank receives from other ranks, bytes it copies locally) in the refit's
    cached plan."""
    from megatron.core.utils import unwrap_model

    core = unwrap_model(target_model[0])
    plan = getattr(core, "_cached_reshard_plan", None)
    if plan is None:
        return 0, 0
    params = dict(core.named_parameters())
    me = dist.get_rank()
    remote = local = 0
    for op in plan.recv_ops:
        p = params[op.param_name]
        n = p.data[op.my_slice].numel() * p.element_size()
        if op.peer_rank == me:
            local += n
        else:
            remote += n
    return remote, local


TRANSFER_PARTS = ("local_copy", "pack", "post", "checksum", "wire", "unpack", "other")


class _TransferProbe:
    """Splits our transfer phase into local copies, packing (staging copies of small or
    strided source pieces), posting the batched exchange, checksums (both sides), the wire
    and unpacking, by wrapping the executor's functions in this (benchmark) process only.
    `wire` is the time spent *waiting* for a round (and for its checksum exchange) after
    the local copies ran during it (overlapped). The rest of the phase (staging
    allocation, view lookup, vocab padding) is `other`."""

    def __init__(self) -> None:
        from ..transition import executor as ex
        from ..transition import transport as tp

        self.totals: dict[str, float] = {}
        self._saved = []
        for owner, name, key in ((ex.Executor, "run_local", "local_copy"),
                                 (ex.Executor, "_pack", "pack"),
                                 (ex.Executor, "_stage", "pack"),
                                 (ex.Executor, "_unpack", "unpack"),
                                 (ex.Executor, "_unpack_staged", "unpack"),
                                 (ex.Executor, "_wait", "wire"),
                                 (tp.TorchP2PTransport, "start", "post"),
                                 (ex, "checksum", "checksum")):
            raw = owner.__dict__[name]
            static = isinstance(raw, staticmethod)
            wrapped = self._wrap(raw.__func__ if static else raw, key)
            self._saved.append((owner, name, raw))
            setattr(owner, name, staticmethod(wrapped) if static else wrapped)

    def _wrap(self, fn, key):
        import functools

        @functools.wraps(fn)
        def w(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.totals[key] = self.totals.get(key, 0.0) + time.perf_counter() - t0
        return w

    def take(self) -> dict[str, float]:
        t, self.totals = self.totals, {}
        return t

    def close(self) -> None:
        for cls, name, raw in self._saved:
            setattr(cls, name, raw)


def default_ckpt_dir() -> Optional[str]:
    """/dev/shm where writable (memory-backed: the checkpoint path at its fastest), else the
    system temp dir."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return None


def _ckpt_root(base: Optional[str]) -> str:
    return tempfile.mkdtemp(prefix="dynatrain-bench-", dir=base or default_ckpt_dir())


class _Progress:
    """One stderr line per stage from rank 0: elapsed time and the largest RSS of any rank
    (a collective: every rank passes the same stages)."""

    def __init__(self, on: bool) -> None:
        self.on, self.t0 = on, time.perf_counter()

    def __call__(self, stage: str) -> None:
        if not self.on:
            return
        rss = _max(_rss_bytes()[0])
        if dist.get_rank() == 0:
            import sys

            print(f"bench-switch: [{time.perf_counter() - self.t0:7.1f} s] {stage}; largest rank "
                  f"RSS {rss / 1e9:.2f} GB", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the rank side
def _prepare_while_training(tr, builder, src_l, src_p, dst_l, cfg: dict, prep: dict
                            ) -> tuple[dict, dict]:
    """What the hook does on a request: choose B's placement, then build B's groups and
    prepare the switch in a background thread while A keeps training; at each step
    boundary one tiny all-reduce asks whether every rank is ready. Returns the switch's
    keyword arguments and the figures of the preparation (wall, steps trained meanwhile
    and their mean time)."""
    from ..elastic.device_manager import DeviceManager
    from ..transition.switch import choose_dst_placement
    from ..loop.switching import prepared_switch_args, start_preparation

    t0 = time.perf_counter()
    dst_p = choose_dst_placement(builder.spec, builder, src_l, src_p, dst_l,
                                 tuple(range(dst_l.world_size)), cfg["placement"],
                                 cfg["ranks_per_node"], cfg["move_weights"])
    t_placement = time.perf_counter() - t0
    dm = start_preparation(DeviceManager(), builder, src_l, src_p, dst_l, dst_placement=dst_p,
                           ranks_per_node=cfg["ranks_per_node"],
                           memory_budget=cfg["memory_budget"], move_weights=cfg["move_weights"],
                           src_objs=tr.objs)
    steps = []
    while True:
        steps.append(tr.step().seconds)
        if dm.ready():
            break
    kw = prepared_switch_args(dm)
    prep.update(wall=_max(time.perf_counter() - t0), placement=_max(t_placement),
                steps=len(steps), step_during=_max(sum(steps) / len(steps)),
                groups=_max(dm.build_seconds), work=_max(dm.prepare_seconds))
    return kw, prep


def bench_rank(cfg: dict) -> dict:
    """Runs on every rank of the spawned group (module doc). Returns the same dict on every
    rank (rank-dependent figures are reduced), plus this rank's own traffic."""
    from ..elastic.groups import build_groups, install
    from ..routing.cost import estimate, state_bytes
    from ..routing.links import LinkModel
    from ..routing.planner import build_plan
    from ..routing.regions import key_index
    from ..routing.schedule import build_schedule
    from ..transition.executor import PACK_ALIGN
    from ..vps.fragment import KINDS, OPT_KINDS
    from ..vps.layout import Layout
    from ..vps.model_spec import ModelSpec
    from ..vps.placement import Placement
    from ..mcore import dist_ckpt
    from ..mcore.builders import MegatronBuilder
    from ..mcore.session import release, start_job
    from ..loop.switching import switch_trainer
    from ..mcore.train_config import TrainConfig

    world = dist.get_world_size()
    rank = dist.get_rank()
    spec = ModelSpec.from_yaml(cfg["model_path"])
    train = TrainConfig(**cfg["train"])
    repeat, rpn = cfg["repeat"], cfg["ranks_per_node"]
    budget, move_weights = cfg["memory_budget"], cfg["move_weights"]
    skip = set(cfg["skip"])
    out: dict[str, Any] = {}
    t_start = time.perf_counter()
    progress = _Progress(cfg.get("progress", True))

    # the job at A, trained so that Adam's moments and step are real
    tr, t_job = _timed(start_job, spec, cfg["src"], train)
    out["job_start_seconds"] = t_job
    losses = []
    for _ in range(cfg["iters_before"]):
        losses.append(tr.step().loss)
    out["losses_before"] = losses
    out["rss_after_steps_bytes"] = int(_max(_rss_bytes()[0]))
    la = tr.objs.layout
    lb = Layout.parse(cfg["dst"], world)
    builder = MegatronBuilder(spec, train)
    out["params"] = int(key_index(spec).numel.sum())  # logical, vocab padding excluded
    out["state_bytes_all_kinds"] = state_bytes(spec)

    # (d) the link between the same ranks
    progress(f"job at {la} started, {cfg['iters_before']} step(s) trained")
    out.update(measure_link(cfg["link_bytes"]))
    progress(f"link measured: {out['link_gbps']:.2f} GB/s per rank")

    # (a) ours: A -> B -> A, `repeat` times
    fwd, back = [], []
    rss_ok = _rss_reset()
    probe = _TransferProbe()
    background = cfg.get("prepare", "background") == "background"
    for i in range(repeat):
        for direction in ("fwd", "back"):
            src_l, src_p = tr.objs.layout, tr.objs.groups.placement
            dst_l = lb if direction == "fwd" else la
            prep = {}
            if background:
                # as the hook does it: B is prepared while A trains; one plain step first,
                # the baseline the steps during the preparation are compared with
                prep["step_alone"] = _max(tr.step().seconds)
            _rss_reset()
            rss0 = _rss_bytes()[0]
            kw = {}
            if background:
                kw, prep = _prepare_while_training(tr, builder, src_l, src_p, dst_l, cfg, prep)
            (tr, res), wall = _timed(switch_trainer, tr, builder, src_l, src_p, dst_l,
                                     placement=cfg["placement"], ranks_per_node=rpn,
                                     memory_budget=budget, move_weights=move_weights, **kw)
            r, dst_p = res.report, res.placement
            del res
            # A's model/DDP/optimizer are left in reference cycles (DDP hooks, bound methods
            # in the TransformerConfig); without a collection here each switch keeps the
            # previous layout's state alive until Python's GC happens to run (measured: the
            # RSS of gpt-200m grew ~0.8 GB per switch until the machine ran out of memory)
            rss_kept = _rss_bytes()[0]
            _, t_gc = _timed(gc.collect)
            parts = probe.take()
            parts["other"] = r.phases.get("transfer", 0.0) - sum(parts.values())
            # the pause is what the training loop waits for: the whole call (the switch,
            # then releasing A and rebinding the trainer), less B's groups where they were
            # built inside it (`--prepare inline`; the hook builds them in the background)
            rec = dict(wall=wall, pause=wall - _max(r.phases.get("groups", 0.0)),
                       switch=_max(r.pause_seconds),
                       transfer_parts={k: _max(parts.get(k, 0.0)) for k in
                                       TRANSFER_PARTS},
                       phases={k: _max(v) for k, v in sorted(r.phases.items())},
                       peak_staging=int(_max(r.peak_staging_bytes)),
                       rss_peak_delta=int(_max(_rss_bytes()[1] - rss0)) if rss_ok else None,
                       rss_before=int(_max(rss0)), rss_peak=int(_max(_rss_bytes()[1])),
                       rss_before_gc=int(_max(rss_kept)), rss_after_gc=int(_max(_rss_bytes()[0])),
                       gc_seconds=t_gc,
                       background={k: _max(v) for k, v in sorted(r.background.items())},
                       prepare=prep,
                       sent=r.sent_bytes, recv=r.recv_bytes, rounds=r.rounds,
                       bytes_moved=r.bytes_moved, lower_bound=r.lower_bound_bytes,
                       local=r.local_bytes, placement=r.placement,
                       src_placement=src_p, dst_placement=dst_p)
            (fwd if direction == "fwd" else back).append(rec)
            progress(f"switch {src_l} -> {dst_l} ({i + 1}/{repeat}): pause {rec['pause']:.2f} s, "
                     f"peak RSS {rec['rss_peak'] / 1e9:.2f} GB, {rec['rss_before_gc'] / 1e9:.2f} GB "
                     f"after it, {rec['rss_after_gc'] / 1e9:.2f} GB after gc.collect() "
                     f"({t_gc:.2f} s)")
    probe.close()
    out["ours_fwd"] = [{k: v for k, v in x.items() if k not in ("src_placement", "dst_placement")}
                       for x in fwd]
    out["ours_back"] = [{k: v for k, v in x.items() if k not in ("src_placement", "dst_placement")}
                        for x in back]
    first = fwd[0]
    sent_all = [None] * world
    dist.all_gather_object(sent_all, (first["sent"], first["recv"]))
    out["per_rank_sent_recv_bytes"] = sent_all

    # the plan of the A -> B switch as run, for the floor and the cost model
    kinds = KINDS if move_weights else OPT_KINDS
    buckets = (builder.bucket_size(la), builder.bucket_size(lb))
    plan = build_plan(spec, (la, first["src_placement"]), (lb, first["dst_placement"]),
                      kinds=kinds, ranks_per_node=rpn, bucket_size=buckets)
    dplan = build_plan(spec, (la, first["src_placement"]), (lb, Placement.default(world)),
                       kinds=kinds, ranks_per_node=rpn, bucket_size=buckets)
    st = plan.stats
    out.update(kinds=list(kinds), max_rank_send_bytes=st.max_send_bytes,
               max_rank_recv_bytes=st.max_recv_bytes, max_rank_traffic_bytes=st.max_traffic_bytes,
               default_placement_bytes_moved=dplan.stats.moved_bytes,
               num_pieces=st.num_pieces, num_local_pieces=st.num_local_pieces,
               state_bytes_moved_kinds=sum(v for _, v in st.state_per_kind))
    g = out["link_gbps"]
    links = LinkModel(intra_node_gbps=g, inter_node_gbps=g,
                      round_latency_s=out["round_latency_seconds"],
                      local_copy_gbps=out["memcpy_gbps"], checksum_gbps=out["memcpy_gbps"])
    est = estimate(build_schedule(plan, budget, PACK_ALIGN), links)
    out.update(cost_model_seconds=est.total_seconds, cost_model_network_seconds=est.network_seconds,
               cost_model_local_copy_seconds=est.local_copy_seconds,
               cost_model_lower_bound_seconds=est.bandwidth_lower_bound_seconds,
               cost_model_rounds=est.num_rounds)

    # (e) the same bytes moved the simplest way: the floor of the whole transfer here
    if "raw" not in skip:
        out.update(measure_raw_movement(plan, repeat))
        gc.collect()
        progress(f"raw movement of the plan's bytes: {out['raw_movement_seconds']:.3f} s, "
                 f"{out['raw_movement_checksummed_seconds']:.3f} s with checksums")

    # (c) megatron-core's weights-only refit, A's live model -> a B model on B's groups
    if "refit" not in skip:
        from megatron.core.resharding import swap_model_weights

        from ..mcore.builders import (build_model_chunks, make_transformer_config,
                               restore_tensor_parallel_attributes)

        def build_b_model(groups):
            # what a refit target is (an inference/rollout model): model chunks only, no
            # DDP/optimizer; megatron reads some ranks from parallel_state while building
            install(groups)
            chunks = build_model_chunks(spec, lb, groups, make_transformer_config(spec, lb),
                                        init_weights=False)
            restore_tensor_parallel_attributes(chunks, spec)  # the refit plans from them
            return chunks

        gb, t_groups = _timed(build_groups, lb, Placement.default(world))
        model_b, t_build = _timed(build_b_model, gb)
        install(tr.objs.groups)
        _, t_first = _timed(swap_model_weights, tr.objs.model, model_b, "gloo")
        cached = [_timed(swap_model_weights, tr.objs.model, model_b, "gloo")[1]
                  for _ in range(repeat)]
        remote, local = _refit_bytes(model_b)
        out.update(refit_first_seconds=t_first, refit_cached_seconds=cached,
                   refit_seconds=_median(cached), refit_groups_seconds=t_groups,
                   refit_build_seconds=t_build, refit_bytes_moved=int(_sum(remote)),
                   refit_max_rank_recv_bytes=int(_max(remote)),
                   refit_local_bytes=int(_sum(local)))
        gb.destroy()
        del model_b
        gc.collect()
        progress(f"refit measured: {out['refit_seconds']:.2f} s")

    out["iteration"] = tr.iteration
    out["layout_at_end"] = str(tr.objs.layout)

    # (b) the checkpoint path, as a restart does it: save at A, A goes away, build B, load.
    # Between repeats A is rebuilt and reloaded from the same checkpoint (not timed).
    if "checkpoint" not in skip:
        box = [_ckpt_root(cfg.get("ckpt_dir")) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        root = box[0]
        runs = []
        objs_a, iteration, consumed = tr.objs, tr.iteration, tr.consumed_samples
        pa = objs_a.groups.placement
        del tr
        ckpt_repeat = cfg.get("ckpt_repeat") or repeat
        try:
            for i in range(ckpt_repeat):
                d = os.path.join(root, f"run{i}")
                _, t_save = _timed(dist_ckpt.save, objs_a, iteration, consumed, d)
                progress(f"checkpoint {i + 1}/{ckpt_repeat} saved in {t_save:.2f} s")
                release(objs_a)
                del objs_a
                gc.collect()
                gb, t_groups = _timed(build_groups, lb, Placement.default(world))
                objs_b, t_build = _timed(builder.build, lb, gb, init_weights=False)
                (it, _), t_load = _timed(dist_ckpt.load, objs_b, d)
                progress(f"checkpoint {i + 1}/{ckpt_repeat} loaded at {lb} in {t_load:.2f} s")
                if it != iteration:
                    raise RuntimeError(f"checkpoint load gave iteration {it}, saved {iteration}")
                release(objs_b)
                del objs_b
                gc.collect()
                objs_a = None
                if i < ckpt_repeat - 1:  # A again, for the next run
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
                                 total=t_save + t_build + t_load, bytes=int(_sum(size))))
        finally:
            dist.barrier()
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
        out["checkpoint_runs"] = runs
        out["checkpoint_dir"] = os.path.dirname(root)
        for k in ("save", "groups", "build", "load", "total"):
            out[f"dist_checkpoint_{k}_seconds"] = _median([x[k] for x in runs])
        out["dist_checkpoint_seconds"] = out.pop("dist_checkpoint_total_seconds")
        out["checkpoint_bytes"] = runs[0]["bytes"]
        out["checkpoint_repeat"] = ckpt_repeat
    else:
        release(tr.objs)
    out["bench_seconds"] = _max(time.perf_counter() - t_start)
    return out


# ---------------------------------------------------------------------------- summary
def summarize(r: dict, cfg: dict) -> dict:
    """The JSON object of `bench-switch --json`, from rank 0's result."""
    fwd, back = r["ours_fwd"], r["ours_back"]
    phases = {k: _median([x["phases"][k] for x in fwd]) for k in fwd[0]["phases"]}
    parts = {k: _median([x["transfer_parts"][k] for x in fwd]) for k in fwd[0]["transfer_parts"]}
    ours = _median([x["pause"] for x in fwd])
    floor = r["max_rank_traffic_bytes"] / (r["link_gbps"] * 1e9)
    transfer = phases.get("transfer")
    s: dict[str, Any] = dict(
        model=cfg["model_name"], nproc=cfg["nproc"], src=str(cfg["src"]), dst=str(cfg["dst"]),
        params=r["params"], kinds=r["kinds"], placement=fwd[0]["placement"],
        iters_before=cfg["iters_before"], repeat=cfg["repeat"],
        memory_budget_bytes=cfg["memory_budget"],
        dynatrain_seconds=ours,
        dynatrain_first_seconds=fwd[0]["pause"],
        dynatrain_wall_seconds=_median([x["wall"] for x in fwd]),
        dynatrain_switch_seconds=_median([x["switch"] for x in fwd]),
        dynatrain_back_seconds=_median([x["pause"] for x in back]),
        dynatrain_phases=phases,
        dynatrain_transfer_seconds=transfer,
        dynatrain_transfer_parts=parts,
        dynatrain_pause_runs=[x["pause"] for x in fwd],
        bytes_moved=fwd[0]["bytes_moved"], lower_bound_bytes=fwd[0]["lower_bound"],
        local_copy_bytes=fwd[0]["local"],
        default_placement_bytes_moved=r["default_placement_bytes_moved"],
        state_bytes_moved_kinds=r["state_bytes_moved_kinds"],
        state_bytes_all_kinds=r["state_bytes_all_kinds"],
        max_rank_send_bytes=r["max_rank_send_bytes"], max_rank_recv_bytes=r["max_rank_recv_bytes"],
        per_rank_sent_recv_bytes=r["per_rank_sent_recv_bytes"],
        rounds=fwd[0]["rounds"], num_pieces=r["num_pieces"], num_local_pieces=r["num_local_pieces"],
        peak_extra_bytes=max(x["peak_staging"] for x in fwd + back),
        rss_peak_delta_bytes=(max(x["rss_peak_delta"] for x in fwd)
                              if fwd[0]["rss_peak_delta"] is not None else None),
        rss_after_steps_bytes=r["rss_after_steps_bytes"],
        rss_switch_peak_bytes=max(x["rss_peak"] for x in fwd + back),
        rss_left_by_switch_bytes=max(x["rss_before_gc"] - x["rss_after_gc"] for x in fwd + back),
        gc_after_switch_seconds=_median([x["gc_seconds"] for x in fwd + back]),
        link_gbps=r["link_gbps"], link_buffer_bytes=r["link_buffer_bytes"],
        round_latency_seconds=r["round_latency_seconds"], memcpy_gbps=r["memcpy_gbps"],
        floor_seconds=floor,
        transfer_over_floor=_ratio(transfer, floor),
        pause_over_floor=_ratio(ours, floor),
        cost_model_seconds=r["cost_model_seconds"],
        cost_model_network_seconds=r["cost_model_network_seconds"],
        cost_model_lower_bound_seconds=r["cost_model_lower_bound_seconds"],
        raw_movement_seconds=r.get("raw_movement_seconds"),
        raw_movement_checksummed_seconds=r.get("raw_movement_checksummed_seconds"),
        transfer_over_raw=_ratio(transfer, r.get("raw_movement_checksummed_seconds")),
        pause_over_raw=_ratio(ours, r.get("raw_movement_checksummed_seconds")),
        dist_checkpoint_seconds=r.get("dist_checkpoint_seconds"),
        dist_checkpoint_save_seconds=r.get("dist_checkpoint_save_seconds"),
        dist_checkpoint_build_seconds=r.get("dist_checkpoint_build_seconds"),
        dist_checkpoint_load_seconds=r.get("dist_checkpoint_load_seconds"),
        dist_checkpoint_groups_seconds=r.get("dist_checkpoint_groups_seconds"),
        dist_checkpoint_bytes=r.get("checkpoint_bytes"),
        dist_checkpoint_dir=r.get("checkpoint_dir"),
        dist_checkpoint_runs=r.get("checkpoint_repeat"),
        refit_seconds=r.get("refit_seconds"),
        refit_first_seconds=r.get("refit_first_seconds"),
        refit_bytes_moved=r.get("refit_bytes_moved"),
        refit_max_rank_recv_bytes=r.get("refit_max_rank_recv_bytes"),
        losses_before=r["losses_before"], iteration=r["iteration"],
        job_start_seconds=r["job_start_seconds"], bench_seconds=r["bench_seconds"],
        load_average_start=cfg.get("load_average_start"), load_average_end=_loadavg(),
        cpu_count=os.cpu_count(),
    )
    s["prepare"] = cfg.get("prepare", "background")
    if fwd[0]["prepare"]:
        bg = {k: _median([x["background"].get(k, 0.0) for x in fwd]) for k in fwd[0]["background"]}
        pr = {k: _median([x["prepare"][k] for x in fwd + back]) for k in fwd[0]["prepare"]}
        s.update(prepare_phases=bg, prepare_wall_seconds=pr["wall"],
                 prepare_placement_seconds=pr["placement"], prepare_groups_seconds=pr["groups"],
                 prepare_steps=pr["steps"], step_seconds_alone=pr["step_alone"],
                 step_seconds_during_prepare=pr["step_during"],
                 step_slowdown_during_prepare=_ratio(pr["step_during"], pr["step_alone"]))
    s["checkpoint_over_dynatrain"] = _ratio(s["dist_checkpoint_seconds"], ours)
    s["refit_over_dynatrain"] = _ratio(s["refit_seconds"], ours)
    if s["refit_max_rank_recv_bytes"] is not None:
        s["refit_floor_seconds"] = s["refit_max_rank_recv_bytes"] / (r["link_gbps"] * 1e9)
    return s


def _loadavg() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None:
        return None
    if b <= 0:
        return math.inf if a > 0 else 1.0
    return a / b


def _x(r) -> str:
    if r is None:
        return "-"
    return f"{r:,.2f}x" if r < 1 else f"{r:,.1f}x"


def format_summary(s: dict) -> str:
    ph = s["dynatrain_phases"]
    la = s.get("load_average_start"), s.get("load_average_end")
    L = [f"dynatrain bench-switch: {s['model']} ({s['params'] / 1e6:,.1f}M params), "
         f"{s['src']} -> {s['dst']} on {s['nproc']} gloo ranks; median of {s['repeat']}; "
         f"kinds moved {','.join(s['kinds'])}",
         f"machine                 {s.get('cpu_count')} CPUs; 1-min load average "
         f"{la[0][0] if la[0] else '-'} at start, {la[1][0] if la[1] else '-'} at end",
         f"link (pairwise P2P)     {s['link_gbps']:.2f} GB/s per rank ({format_bytes(s['link_buffer_bytes'])} "
         f"buffers); small-message round {format_seconds(s['round_latency_seconds'])}; memcpy "
         f"{s['memcpy_gbps']:.2f} GB/s",
         f"(a) dynatrain switch    {format_seconds(s['dynatrain_seconds'])} pause (first "
         f"{format_seconds(s['dynatrain_first_seconds'])}; back B->A {format_seconds(s['dynatrain_back_seconds'])}): "
         f"the switch {format_seconds(s.get('dynatrain_switch_seconds'))}, then releasing A and rebinding "
         f"the trainer",
         "    switch phases       " + ", ".join(f"{k} {format_seconds(v)}" for k, v in ph.items())
         + ("  (groups: built inside the call, not counted)" if "groups" in ph else ""),
         *([f"    prepared meanwhile  {format_seconds(s['prepare_wall_seconds'])} in the background "
            "(placement, groups, then " + ", ".join(f"{k} {format_seconds(v)}" for k, v in
                                                    s["prepare_phases"].items())
            + f") while A trained {s['prepare_steps']:g} step(s) of {format_seconds(s['step_seconds_during_prepare'])}"
            f" ({_x(s['step_slowdown_during_prepare'])} a step alone, {format_seconds(s['step_seconds_alone'])})"]
           if s.get("prepare_phases") is not None else []),
         "    transfer split      " + ", ".join(f"{k} {format_seconds(v)}" for k, v in
                                                s["dynatrain_transfer_parts"].items())
         + "  (each: max over ranks)",
         f"    bytes moved         {format_bytes(s['bytes_moved'])} (lower bound {format_bytes(s['lower_bound_bytes'])}; "
         f"default placement {format_bytes(s['default_placement_bytes_moved'])}; local copies "
         f"{format_bytes(s['local_copy_bytes'])}; placement {s['placement']})",
         f"    max per rank        send {format_bytes(s['max_rank_send_bytes'])}, recv "
         f"{format_bytes(s['max_rank_recv_bytes'])}; {s['num_pieces']:,} network + "
         f"{s['num_local_pieces']:,} local pieces in {s['rounds']} round(s); peak extra (staging) "
         f"{format_bytes(s['peak_extra_bytes'])}"
         + (f" under a {format_bytes(s['memory_budget_bytes'])} budget" if s["memory_budget_bytes"] else "")
         + (f"; RSS per rank {format_bytes(s['rss_after_steps_bytes'])} before, peak delta "
            f"{format_bytes(s['rss_peak_delta_bytes'])} (B's state + staging)"
            if s["rss_peak_delta_bytes"] is not None else ""),
         f"    memory              largest rank RSS {format_bytes(s['rss_switch_peak_bytes'])} at peak; "
         f"{format_bytes(s['rss_left_by_switch_bytes'])} of the old layout still held after a switch until "
         f"gc.collect() ({format_seconds(s['gc_after_switch_seconds'])}, outside the pause)",
         f"    floor               {format_seconds(s['floor_seconds'])} (max per-rank bytes / link); transfer "
         f"{format_seconds(s['dynatrain_transfer_seconds'])} = {_x(s['transfer_over_floor'])} the floor, "
         f"pause {_x(s['pause_over_floor'])}",
         f"    cost model          {format_seconds(s['cost_model_seconds'])} predicted for the transfer "
         f"(link {s['link_gbps']:.2f} GB/s, round {format_seconds(s['round_latency_seconds'])}, memcpy "
         f"{s['memcpy_gbps']:.2f} GB/s; its lower bound {format_seconds(s['cost_model_lower_bound_seconds'])})"]
    if s.get("raw_movement_seconds") is not None:
        L.append(f"    same bytes, raw     {format_seconds(s['raw_movement_seconds'])} (one message per peer, "
                 f"the local bytes in one memcpy meanwhile), "
                 f"{format_seconds(s['raw_movement_checksummed_seconds'])} with checksums; transfer "
                 f"{_x(s['transfer_over_raw'])} that, pause {_x(s['pause_over_raw'])}")
    if s["dist_checkpoint_seconds"] is not None:
        L.append(f"(b) dist_checkpointing  {format_seconds(s['dist_checkpoint_seconds'])} = save "
                 f"{format_seconds(s['dist_checkpoint_save_seconds'])} + build B "
                 f"{format_seconds(s['dist_checkpoint_build_seconds'])} + load "
                 f"{format_seconds(s['dist_checkpoint_load_seconds'])} ({format_bytes(s['dist_checkpoint_bytes'])} in "
                 f"{s['dist_checkpoint_dir']}; B's groups {format_seconds(s['dist_checkpoint_groups_seconds'])} "
                 f"and process restart not counted; median of {s.get('dist_checkpoint_runs')} "
                 f"run(s))  = {_x(s['checkpoint_over_dynatrain'])} ours")
    else:
        L.append("(b) dist_checkpointing  skipped")
    if s["refit_seconds"] is not None:
        L.append(f"(c) megatron refit      {format_seconds(s['refit_seconds'])} weights only, cached plan "
                 f"(first call with planning {format_seconds(s['refit_first_seconds'])}); "
                 f"{format_bytes(s['refit_bytes_moved'])} moved, max {format_bytes(s['refit_max_rank_recv_bytes'])} "
                 f"per rank (floor {format_seconds(s.get('refit_floor_seconds'))})  = "
                 f"{_x(s['refit_over_dynatrain'])} ours")
    else:
        L.append("(c) megatron refit      skipped")
    return "\n".join(L)


def run_bench(cfg: dict, timeout: float = 1800.0) -> dict:
    """Spawn `cfg['nproc']` gloo ranks, run `bench_rank`, return the summary."""
    from ..testing.multiproc import run_on_ranks

    cfg = dict(cfg, load_average_start=_loadavg())
    results = run_on_ranks(bench_rank, cfg["nproc"], cfg, timeout=timeout)
    return summarize(results[0], cfg)
