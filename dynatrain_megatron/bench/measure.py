"""Measurements of the benchmark, on the ranks of the spawned group: the link, the same
bytes moved the simplest way, memory (RSS), megatron's refit traffic, and the split of our
transfer phase. Every interval is barrier-to-barrier and the max over ranks."""
from __future__ import annotations

import functools
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..transition.transport import collective_device

MB = 1 << 20


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def sum_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t[0])


def timed(fn, *a, **kw) -> tuple[Any, float]:
    """Run `fn` on every rank between barriers; (result, max seconds over ranks)."""
    dist.barrier()
    t0 = time.perf_counter()
    r = fn(*a, **kw)
    dt = time.perf_counter() - t0
    return r, max_over_ranks(dt)


def median(xs):
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
        out.append(timed(once)[1])
    if float(recv[0]) != float(frm):
        raise RuntimeError(f"bandwidth test: rank {rank} got data of rank {recv[0]}, "
                           f"expected {frm}")
    return out


def measure_link(nbytes: int = 64 * MB, iters: int = 3) -> dict[str, float]:
    """Pairwise P2P bandwidth (GB/s per rank and direction), small-message latency, and
    the local memcpy bandwidth, all ranks at once (module doc, (d))."""
    bw_t = median(_exchange_seconds(nbytes, iters))
    lat = median(_exchange_seconds(4, 10))
    a = torch.ones(nbytes // 4, dtype=torch.float32)
    b = torch.empty_like(a)
    b.copy_(a)
    cp = median([timed(b.copy_, a)[1] for _ in range(iters)])
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
    plain = median([timed(once, False)[1] for _ in range(iters)])
    summed = median([timed(once, True)[1] for _ in range(iters)])
    return dict(raw_movement_seconds=plain, raw_movement_checksummed_seconds=summed)


def rss_reset() -> bool:
    """Reset this process's peak RSS (Linux clear_refs 5); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> tuple[int, int]:
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


def refit_bytes(target_model, src_model=None) -> tuple[int, int]:
    """(bytes this rank receives from other ranks, bytes it copies locally) in the refit's
    plan: the one cached on the target (megatron-core 0.16); where a release caches its
    plans elsewhere (0.19 keeps them in a module-level dict), the same plan built again
    with megatron-core's public `build_local_reshard_plan` from `src_model` (collective:
    every rank calls this)."""
    from megatron.core.utils import unwrap_model

    core = unwrap_model(target_model[0])
    plan = getattr(core, "_cached_reshard_plan", None)
    if plan is None and src_model is not None:
        from megatron.core.resharding import build_local_reshard_plan

        src = unwrap_model(src_model[0])
        plan = build_local_reshard_plan(src, core, num_experts=src.config.num_moe_experts)
    if plan is None:
        return 0, 0
    params = dict(core.named_parameters())
    params.update(core.named_buffers())  # 0.19's plans also carry persistent buffers
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


class TransferProbe:
    """Splits our transfer phase into local copies, packing (staging copies of small or
    strided source pieces), posting the batched exchange, checksums (both sides), the wire
    and unpacking, by wrapping the executor's functions in this (benchmark) process only.
    `wire` is the time spent *waiting* for a round (and for its checksum exchange) after
    the local copies ran during it (overlapped). The rest of the phase (staging
    allocation, view lookup, vocab padding) is `other`.

    The executor's own statistics (`ExecStats`) count bytes, rounds and messages but not
    the time of each part, hence the wrapping; a function renamed in the executor makes
    the constructor fail (KeyError) instead of leaving a part silently at zero."""

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
                                 (ex, "checksums", "checksum")):
            raw = owner.__dict__[name]
            static = isinstance(raw, staticmethod)
            wrapped = self._wrap(raw.__func__ if static else raw, key)
            self._saved.append((owner, name, raw))
            setattr(owner, name, staticmethod(wrapped) if static else wrapped)

    def _wrap(self, fn, key):
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


def ckpt_root(base: Optional[str]) -> str:
    return tempfile.mkdtemp(prefix="dynatrain-bench-", dir=base or default_ckpt_dir())


class Progress:
    """One stderr line per stage from rank 0: elapsed time and the largest RSS of any rank
    (a collective: every rank passes the same stages)."""

    def __init__(self, on: bool) -> None:
        self.on, self.t0 = on, time.perf_counter()

    def __call__(self, stage: str) -> None:
        if not self.on:
            return
        rss = max_over_ranks(rss_bytes()[0])
        if dist.get_rank() == 0:
            print(f"bench-switch: [{time.perf_counter() - self.t0:7.1f} s] {stage}; largest rank "
                  f"RSS {rss / 1e9:.2f} GB", file=sys.stderr, flush=True)
