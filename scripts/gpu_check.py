#!/usr/bin/env python
"""The prepared GPU check: everything of the GPU path that the CPU tests cannot show, in at
most ~10 minutes on ONE GPU (more checks on a machine with several), with a JSON report.

    python scripts/gpu_check.py                      # run, report in runs/gpu_check.json
    python scripts/gpu_check.py --dry-run            # list the checks (CPU is fine; CI runs it)
    python scripts/gpu_check.py --no-install --only identity_switch,bandwidth

Each check runs in fresh processes under torchrun (NCCL, one rank per GPU used) with its
own time limit, so one that hangs or crashes is reported and the others still run. The
driver installs the project's `gpu` extra first (Transformer Engine) unless told not to;
without TE the checks run on megatron-core's local layers and say so.

Nothing here is a benchmark claim: the report holds what was measured on that machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
MEGATRON_LM = ROOT.parent / "shared" / "megatron-lm" / "core_v0.16.1"
GiB = 1 << 30


@dataclass(frozen=True)
class Check:
    name: str
    what: str
    min_gpus: int
    limit_s: int
    nproc: Callable[[int], int]  # ranks for this many GPUs


def _one(n: int) -> int:
    return 1


def _pair(n: int) -> int:
    return 4 if n >= 4 else 2


CHECKS: tuple[Check, ...] = (
    Check("train_tiny_gpt", "tiny-gpt trains on the GPU through our trainer (losses finite "
          "and falling, parameters and batches on the device)", 1, 90, _one),
    Check("train_tiny_moe", "tiny-moe (MoE, no TE grouped GEMM) trains on the GPU through our "
          "trainer", 1, 90, _one),
    Check("megatron_lm", "real Megatron-LM pretrain_gpt.py with --dynatrain on the GPU (only "
          "where the Megatron-LM snapshot is present)", 1, 120, _one),
    Check("bind_live_vs_analytic", "the live binding of every state kind equals the analytic "
          "layout (Transformer Engine's layer spec when TE is installed)", 1, 60, _one),
    Check("identity_switch", "a background-prepared same-device switch (A -> A) leaves every "
          "state tensor bit for bit equal; its pause against the local-copy floor", 1, 90, _one),
    Check("bandwidth", "device local-copy and checksum bandwidth (GB/s)", 1, 45, _one),
    Check("nccl_timeout_rollback", "NCCL work that cannot finish in time (queued behind a busy "
          "kernel) times out on our polled deadline, its communicator is aborted, the process "
          "and the default group live on", 1, 60, _one),
    Check("multi_rank_switch_vs_checkpoint", "a multi-rank NCCL switch, then training, bit for "
          "bit equal to dist_checkpointing save at A and load at B; then a switch with a late "
          "peer rolled back (state bit for bit kept, training goes on)", 2, 180, _pair),
)


# ----------------------------------------------------------------------------- workers
def _spec(name: str):
    from dynatrain_megatron.mcore.builders import with_layer_implementation
    from dynatrain_megatron.vps.model_spec import ModelSpec

    return with_layer_implementation(ModelSpec.from_yaml(ROOT / f"configs/models/{name}.yaml"))


def _start(model: str, layout: str):
    from dynatrain_megatron.mcore.session import start_job
    from dynatrain_megatron.mcore.train_config import TrainConfig

    spec = _spec(model)
    train = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=50, lr=1e-2)
    return spec, train, start_job(spec, layout, train)


def _train(model: str) -> dict:
    spec, _, trainer = _start(model, "tp1")
    losses = [trainer.step().loss for _ in range(6)]
    devices = {str(p.device) for m in trainer.objs.model for p in m.parameters()}
    ok = all(map(lambda x: x == x and abs(x) < 1e4, losses)) and losses[-1] < losses[0]
    return dict(ok=ok and devices == {str(trainer.device)}, losses=losses,
                param_devices=sorted(devices), batch_device=str(trainer.device),
                transformer_engine=spec.transformer_engine)


def w_train_tiny_gpt() -> dict:
    return _train("tiny-gpt")


def w_train_tiny_moe() -> dict:
    return _train("tiny-moe")


def run_megatron_lm_check(out_dir: Path, limit_s: float) -> dict:
    """Megatron-LM's own training with --dynatrain on the snapshot (helper i15's path: the
    patch and `scripts/launch_megatron_lm_example.sh`; wire its documented command here
    after the merge if it changes)."""
    if not MEGATRON_LM.is_dir():
        return dict(ok=None, skipped=f"no Megatron-LM snapshot at {MEGATRON_LM}")
    work = out_dir / "megatron-lm"
    subprocess.run(["rm", "-rf", str(work)], check=False)
    subprocess.run(["cp", "-r", str(MEGATRON_LM), str(work)], check=True)
    patches = sorted((ROOT / "patches").glob("*/dynatrain.patch"))
    if not patches:
        return dict(ok=None, skipped="no patch in patches/")
    ap = subprocess.run(["git", "apply", str(patches[-1])], cwd=work, capture_output=True,
                        text=True)
    if ap.returncode:
        return dict(ok=False, error=f"patch did not apply: {ap.stderr[-2000:]}")
    env = dict(os.environ, MEGATRON_LM=str(work), NPROC="1", TP="1", PP="1",
               JOB_DIR=str(out_dir / "mlm-job"), PYTHON=sys.executable)
    try:
        p = subprocess.run(["bash", str(ROOT / "scripts/launch_megatron_lm_example.sh")],
                           env=env, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return dict(ok=False, error=f"timed out after {limit_s:.0f} s")
    return dict(ok=p.returncode == 0, returncode=p.returncode, tail=p.stdout[-3000:] + p.stderr[-3000:])


def _state(trainer) -> dict:
    """Every fragment of every kind of this rank's live state, copied to the host."""
    from dynatrain_megatron.adapters.live import LiveState
    from dynatrain_megatron.vps.fragment import KINDS

    o = trainer.objs
    live = LiveState(o.model, o.optimizer, o.groups.virtual_rank, trainer.spec.vocab_size)
    return {(f.key, f.kind, str(f.box)): live.view(f.kind, f.chunk, f.local_name, f.local_box)
            .detach().to("cpu", copy=True) for f in live.fragments(KINDS)}


def _bits_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def w_bind_live_vs_analytic() -> dict:
    from dynatrain_megatron.adapters.live import LiveState
    from dynatrain_megatron.adapters.verify import check_live_matches_analytic
    from dynatrain_megatron.mcore.builders import bucket_size_of
    from dynatrain_megatron.vps.analytic import analytic_layout
    from dynatrain_megatron.vps.fragment import KINDS

    out = {}
    for model in ("tiny-gpt", "tiny-moe"):
        spec, train, trainer = _start(model, "tp1")
        trainer.step()
        o = trainer.objs
        vr = o.groups.virtual_rank
        live = LiveState(o.model, o.optimizer, vr, spec.vocab_size)
        check_live_matches_analytic(live.fragments(KINDS), analytic_layout(
            spec, o.layout, bucket_size_of(train, o.layout)).fragments(vr, KINDS), vr)
        out[model] = dict(fragments=len(live.fragments(KINDS)),
                          transformer_engine=spec.transformer_engine)
        _release(trainer)
    return dict(ok=True, **out)


def _release(trainer) -> None:
    from dynatrain_megatron.mcore.session import release

    release(trainer.objs)
    trainer.release_references()


def w_identity_switch() -> dict:
    import torch.distributed as dist

    from dynatrain_megatron.elastic.device_manager import DeviceManager
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.loop.switching import (prepared_switch_args,
                                                          start_preparation, switch_trainer)

    spec, train, trainer = _start("tiny-gpt", "tp1")
    for _ in range(2):
        trainer.step()
    builder = MegatronBuilder(spec, train)
    src, pl = trainer.objs.layout, trainer.objs.groups.placement
    dm = start_preparation(DeviceManager(), builder, src, pl, src, dst_placement=pl,
                           src_objs=trainer.objs)
    steps_while_preparing = 0
    while not dm.ready():
        trainer.step()
        steps_while_preparing += 1
    before = _state(trainer)
    step_before = trainer.iteration
    t0 = time.perf_counter()
    trainer, res = switch_trainer(trainer, builder, src, pl, src, dst_devices=pl.devices,
                                  **prepared_switch_args(dm))
    pause = time.perf_counter() - t0
    after = _state(trainer)
    same = sorted(before) == sorted(after) and all(_bits_equal(before[k], after[k]) for k in before)
    loss = trainer.step().loss
    r = res.report
    dist.barrier()
    return dict(ok=bool(same and res.aborted is None and loss == loss), bit_identical=same,
                tensors=len(before), aborted=res.aborted, iteration=step_before,
                steps_while_preparing=steps_while_preparing, pause_s=pause,
                report_pause_s=r.pause_seconds, phases=r.phases, background=r.background,
                local_bytes=r.local_bytes, loss_after=loss)


def w_bandwidth() -> dict:
    import torch

    from dynatrain_megatron.transition.checksum import checksums

    free, _ = torch.cuda.mem_get_info()
    n = int(min(GiB, free // 4))
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    copy_s = timed(lambda: b.copy_(a))
    sum_s = timed(lambda: checksums([a]))
    return dict(ok=True, bytes=n, local_copy_GBps=n / copy_s / 1e9, checksum_GBps=n / sum_s / 1e9,
                device=torch.cuda.get_device_name())


def w_nccl_timeout_rollback() -> dict:
    """One GPU has no peer that can be late (torch refuses a receive from oneself and NCCL
    two ranks on one device), so the NCCL work is made late instead: queued behind a
    ~5 s busy kernel on the stream, it cannot complete within our 1 s polled deadline.
    The wait must give up at the deadline (not at the end of the kernel), abort the
    communicator, and leave the process and the default group working (what the rollback
    vote needs). The late-peer rollback of a whole switch is in the multi-rank check."""
    import torch
    import torch.distributed as dist

    from dynatrain_megatron.elastic.communicators import group_device
    from dynatrain_megatron.transition.transport import Pending, abort_group, warm_up

    world = dist.get_world_size()
    g = dist.new_group(list(range(world)), device_id=group_device())
    warm_up(g)
    t = torch.ones(1 << 20, device="cuda")
    rate = torch.cuda.get_device_properties(0).clock_rate * 1000 if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else 2_000_000_000
    torch.cuda._sleep(int(5 * rate))  # ~5 s of a spinning kernel on the current stream
    work = dist.all_reduce(t, group=g, async_op=True)
    out: dict = {}
    t0 = time.perf_counter()
    try:
        Pending([work], polled=True, on_timeout=lambda: abort_group(g)).wait(timeout=1.0)
        out["timed_out"] = False
    except TimeoutError as e:
        out.update(timed_out=True, message=str(e))
    out["raised_after_s"] = time.perf_counter() - t0
    torch.cuda.synchronize()
    out["stream_drained_after_s"] = time.perf_counter() - t0
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)  # the default group (the rollback vote's) still works
    out["default_group_ok"] = float(x) == world
    out["ok"] = bool(out["timed_out"] and out["default_group_ok"] and out["raised_after_s"] < 3.0)
    return out


def w_multi_rank_switch_vs_checkpoint() -> dict:
    import torch.distributed as dist

    from dynatrain_megatron.mcore import dist_ckpt
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.mcore.session import start_job
    from dynatrain_megatron.loop.switching import switch_trainer
    from dynatrain_megatron.mcore.training import Trainer
    from dynatrain_megatron.transition.faults import FaultPlan
    from dynatrain_megatron.vps.layout import Layout

    world = dist.get_world_size()
    a, b = ("tp2", "tp1") if world == 2 else ("tp2pp2", "tp1pp2")
    spec, train, trainer = _start("tiny-gpt", a)
    for _ in range(2):
        trainer.step()
    ckpt = os.environ["GPU_CHECK_TMP"] + "/ckpt"
    dist_ckpt.save(trainer.objs, trainer.iteration, trainer.consumed_samples, ckpt)
    builder = MegatronBuilder(spec, train)
    src, pl = trainer.objs.layout, trainer.objs.groups.placement
    dst = Layout.parse(b, world)
    trainer, res = switch_trainer(trainer, builder, src, pl, dst, timeout=60.0)
    switched = [trainer.step().loss for _ in range(3)]
    _release(trainer)
    objs = start_job(spec, dst, train).objs
    it, consumed = dist_ckpt.load(objs, ckpt)
    ref = Trainer(spec, train, objs, it, consumed)
    loaded = [ref.step().loss for _ in range(3)]
    # a switch back whose round 0 is late on rank 1 beyond the timeout: NCCL rolls back
    before = _state(ref)
    ref, late = switch_trainer(ref, builder, dst, ref.objs.groups.placement, src, timeout=3.0,
                               faults=FaultPlan(delay_rank=1, delay_seconds=8.0))
    after = _state(ref)
    kept = sorted(before) == sorted(after) and all(_bits_equal(before[k], after[k]) for k in before)
    loss = ref.step().loss
    return dict(ok=res.aborted is None and switched == loaded and late.aborted is not None
                and kept and str(ref.objs.layout) == str(dst) and loss == loss,
                src=a, dst=b, switched_losses=switched, checkpoint_losses=loaded,
                pause_s=res.report.pause_seconds, bytes_moved=res.report.bytes_moved,
                timeout_rollback=dict(aborted=late.aborted, state_kept=kept, loss_after=loss))


# ----------------------------------------------------------------------------- driver
def _worker(name: str, result: str) -> int:
    from dynatrain_megatron import process_env

    process_env.apply()
    import torch.distributed as dist

    from dynatrain_megatron.compat import prepare_runtime
    from dynatrain_megatron.mcore.session import init_distributed

    init_distributed()
    prepare_runtime()
    try:
        out = globals()[f"w_{name}"]()
    except Exception as e:  # noqa: BLE001 - reported, the driver goes on
        out = dict(ok=False, error=f"{type(e).__name__}: {e}")
    if dist.get_rank() == 0:
        Path(result).write_text(json.dumps(out, default=str))
    return 0


def _run_check(c: Check, ngpu: int, limit_s: float, tmp: Path) -> dict:
    from dynatrain_megatron.loop.launch import free_port

    result = tmp / f"{c.name}.json"
    if c.name == "megatron_lm":
        return run_megatron_lm_check(tmp, limit_s)
    n = c.nproc(ngpu)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
           "--master-port", str(free_port()), str(Path(__file__).resolve()),
           "--worker", c.name, "--result", str(result)]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               GPU_CHECK_TMP=str(tmp), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit_s)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-4000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = None, f"timed out after {limit_s:.0f} s: {str(e.stderr or '')[-3000:]}"
    out = json.loads(result.read_text()) if result.exists() else dict(ok=False)
    out.update(ranks=n, seconds=round(time.perf_counter() - t0, 2))
    if not out.get("ok"):
        out.update(returncode=rc, log_tail=tail)
    return out


def _install() -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{ROOT}[gpu,test]"],
                       capture_output=True, text=True, timeout=300)
    return dict(ok=p.returncode == 0, seconds=round(time.perf_counter() - t0, 1),
                tail=(p.stdout + p.stderr)[-2000:])


def _environment() -> dict:
    import torch

    env = dict(torch=torch.__version__, cuda=torch.version.cuda,
               gpus=torch.cuda.device_count(),
               names=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001
        env["nccl"] = None
    try:
        import transformer_engine  # noqa: F401
        env["transformer_engine"] = getattr(transformer_engine, "__version__", "installed")
    except Exception:  # noqa: BLE001
        env["transformer_engine"] = None
    return env


def plan(ngpu: Optional[int], only: Optional[set[str]]) -> list[dict]:
    """What would run: every check with whether it runs here (GPUs) and its limit."""
    out = []
    for c in CHECKS:
        if only and c.name not in only:
            continue
        runs = ngpu is None or ngpu >= c.min_gpus
        out.append(dict(asdict(c) | dict(nproc=None if ngpu is None else c.nproc(ngpu)),
                        runs=runs))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="list the checks and exit (no GPU needed)")
    ap.add_argument("--out", default=str(ROOT / "runs/gpu_check.json"), help="the JSON report")
    ap.add_argument("--budget-s", type=float, default=600.0, help="seconds for the whole check")
    ap.add_argument("--no-install", action="store_true", help="do not pip install the gpu extra")
    ap.add_argument("--only", default="", help="comma list of check names")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.result)
    only = {s for s in args.only.split(",") if s} or None
    unknown = (only or set()) - {c.name for c in CHECKS}
    if unknown:
        ap.error(f"unknown checks {sorted(unknown)}; known: {[c.name for c in CHECKS]}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        checks = plan(None, only)
        for c in checks:
            print(f"{c['name']:34s} >= {c['min_gpus']} GPU(s), <= {c['limit_s']:3d} s: {c['what']}")
        out.write_text(json.dumps(dict(dry_run=True, checks=checks), indent=1, default=str))
        return 0
    t_start = time.perf_counter()
    report: dict = dict(dry_run=False, started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if not args.no_install:
        report["install"] = _install()
    report["environment"] = env = _environment()
    ngpu = env["gpus"]
    if not ngpu:
        report["error"] = "no GPU visible: nothing to check (use --dry-run to list the checks)"
        out.write_text(json.dumps(report, indent=1, default=str))
        print(report["error"], file=sys.stderr)
        return 2
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for c in plan(ngpu, only):
            left = args.budget_s - (time.perf_counter() - t_start)
            if not c["runs"]:
                results[c["name"]] = dict(ok=None, skipped=f"needs {c['min_gpus']} GPUs")
            elif left < 15:
                results[c["name"]] = dict(ok=None, skipped="out of time")
            else:
                check = next(x for x in CHECKS if x.name == c["name"])
                results[c["name"]] = _run_check(check, ngpu, min(check.limit_s, left), Path(tmp))
            print(f"{c['name']:34s} {results[c['name']].get('ok')}", flush=True)
            out.write_text(json.dumps(report | dict(checks=results), indent=1, default=str))
    bw, ident = results.get("bandwidth", {}), results.get("identity_switch", {})
    if bw.get("ok") and ident.get("ok"):  # the pause against its floor: local bytes at copy speed
        floor = ident["local_bytes"] / (bw["local_copy_GBps"] * 1e9)
        report["pause_vs_floor"] = dict(pause_s=ident["report_pause_s"], floor_s=floor,
                                        ratio=ident["report_pause_s"] / floor if floor else None)
    report.update(checks=results, seconds=round(time.perf_counter() - t_start, 1),
                  ok=all(r.get("ok") is not False for r in results.values()))
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"report: {out} ({'all passed' if report['ok'] else 'FAILURES'})")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
