#!/usr/bin/env python
"""The prepared GPU check: what of the GPU path the CPU tests cannot show, on the lent
machine as it is (one GPU, its own torch, no network, nothing installed), in one command
that finishes within 8 minutes and writes its report to a folder:

    python scripts/gpu_check.py OUT_DIR            # run: OUT_DIR/gpu.md and OUT_DIR/gpu.json
    python scripts/gpu_check.py OUT_DIR --dry-run  # preflight and the list of checks (CPU)
    python scripts/gpu_check.py OUT_DIR --only a_background_prep,d_abort_destroy

Nothing is installed: the project runs from this tree (on `sys.path`), with the machine's
own torch. What the tree lacks on that machine travels as wheels in `gpu_wheels/`
(git-ignored; megatron-core 0.16.1's cp312 wheel and its pure dependencies, fetched on
our side with `pip download --no-deps --python-version 3.12 --only-binary=:all: ...`): they
are unzipped into a cache folder and put on `sys.path`, only where the module is missing.

A preflight prints torch, CUDA and NCCL versions and whether the torch APIs the project
relies on exist (`compat/torch_features.py`: `new_group(sort_ranks=, device_id=)`,
`ProcessGroup.abort`, `torch.distributed.config.use_torchcomms`); the code detects them
and does without where it can. Each check runs in fresh processes under torchrun (NCCL)
with its own time limit, so one that hangs or crashes is reported and the others run.
Nothing here is a benchmark claim: the report holds what was measured on that machine.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "gpu_wheels"
GiB = 1 << 30
TOTAL_BUDGET_S = 470.0  # under 8 minutes with the preflight and the report


@dataclass(frozen=True)
class Check:
    name: str
    what: str
    limit_s: int
    min_gpus: int = 1


CHECKS: tuple[Check, ...] = (
    Check("a_background_prep", "(a) A trains with and without a concurrent background "
          "preparation of B (dropout 0.1, deterministic mode): bit-identical losses and "
          "weights; the step-time slowdown while B is prepared", 100),
    Check("b_memory_plan", "(b) the memory plan of two back-to-back A->A switches against "
          "max_memory_reserved and mem_get_info", 90),
    Check("c_background_comms", "(c) communicators created in the background while the "
          "main thread runs collectives, under a hang watchdog", 45),
    Check("d_abort_destroy", "(d) abort and destroy of an idle and of a busy communicator, "
          "two aborted together in one NCCL group call, then a new one and the default group "
          "work", 45),
    Check("e_executor_geometry", "(e) the executor at real geometry: one rank's pieces of the "
          "llama3-70b tp8->tp4 plan through a loopback transport, against the cost model's "
          "local-copy and checksum constants; (f) that pause broken down", 110),
    Check("g_megatron_lm", "(g) real Megatron-LM pretrain_gpt.py with --dynatrain and an "
          "identity switch (only where the snapshot and its dependencies travel)", 60),
)
UNVERIFIED_HERE = (
    "needs 2+ GPUs: point-to-point transfers between devices, the votes and timeouts with a "
    "real peer, ordered groups (sort_ranks=False) on NCCL, scale-in/out, rank death",
)


# ------------------------------------------------------------------------- bootstrap
MODELS = ("gpt-50m", "gpt-200m", "llama3-70b")  # the model configs the checks read


def tree_configs_writable_by_others(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """The project reads a model config only when nobody but its owner can write it
    (`safe_files.read_yaml`). A tree copied with the copier's umask (002 is common) has
    group-writable files, and every check would then refuse its model: the group and
    world write bits of this user's own files under `root/configs` are cleared here.
    Returns (files fixed, files left as they are: another user's)."""
    fixed, left = [], []
    base = root / "configs"
    for f in sorted(base.rglob("*")) if base.is_dir() else []:
        st = f.lstat()
        if not f.is_file() or f.is_symlink() or not st.st_mode & 0o022:
            continue
        if st.st_uid != os.getuid():
            left.append(str(f.relative_to(root)))
            continue
        os.chmod(f, st.st_mode & ~0o022)
        fixed.append(str(f.relative_to(root)))
    return fixed, left


def wheel_modules(whl: Path) -> set[str]:
    """The importable names a wheel installs, from its contents (a distribution's name
    need not be its module's: PyYAML installs yaml). megatron-core's `megatron` is a
    namespace Megatron-LM's tree shares, so its name is `megatron.core`."""
    with zipfile.ZipFile(whl) as z:
        tops = {n.split("/")[0] if "/" in n else n.split(".")[0] for n in z.namelist()}
    tops = {t for t in tops if t and not t.endswith((".dist-info", ".data"))
            and t != "__pycache__"}
    return {"megatron.core" if t == "megatron" else t for t in tops}


def _private_dir(path: Path) -> Path:
    """`path` as a folder only this user can write (made if missing): the unzipped wheels
    are imported from it, so a folder someone else made or can change is refused."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise SystemExit(f"gpu_check: wheel cache {path} is not a folder of this user's "
                         f"that only it can write; remove it or pass another")
    return path


def bootstrap(wheels: Path = WHEELS, cache: Optional[Path] = None) -> list[str]:
    """Put this tree and, for each wheel whose modules are all missing here, the unzipped
    wheel on `sys.path` (the machine's own packages are never shadowed). Returns the
    folders added (also for the workers' PYTHONPATH)."""
    import importlib.util

    tree_configs_writable_by_others()
    added = [str(ROOT)]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    cache = cache or Path(tempfile.gettempdir()) / f"dynatrain_gpu_wheels-{os.getuid()}"
    here = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    for whl in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        tag = whl.name.split("-")[2]
        if not (tag.startswith("py3") or tag == here or "abi3" in whl.name):
            continue  # built for another Python
        present = False
        for top in wheel_modules(whl):
            try:
                present = present or importlib.util.find_spec(top) is not None
            except ModuleNotFoundError:
                pass
        if present:
            continue
        dest = _private_dir(cache) / whl.stem
        if not (dest / ".done").exists():
            with zipfile.ZipFile(whl) as z:
                z.extractall(dest)
            (dest / ".done").write_text("ok")
        sys.path.insert(1, str(dest))
        added.append(str(dest))
    return added


def preflight() -> dict:
    """Versions and the torch features the project relies on (printed and reported)."""
    import platform

    import torch

    from dynatrain_megatron.compat.torch_features import report

    out = dict(python=platform.python_version(), **report(),
               gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    out["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(out["gpus"])]
    for mod in ("megatron.core", "transformer_engine", "numpy", "yaml"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = getattr(m, "__version__", "present")
        except Exception as e:  # noqa: BLE001 - reported
            out[mod] = f"missing ({type(e).__name__})"
    out["model configs"] = _models_readable()
    return out


def _models_readable() -> str:
    """"ok" when every model config the checks use reads, else the first refusal."""
    from dynatrain_megatron.vps.model_spec import ModelSpec

    for name in MODELS:
        try:
            ModelSpec.from_yaml(ROOT / f"configs/models/{name}.yaml")
        except Exception as e:  # noqa: BLE001 - reported: every check would fail alike
            return f"{type(e).__name__}: {e}"
    return "ok"


# ----------------------------------------------------------------------------- workers
def _spec(name: str, **kw):
    from dynatrain_megatron.mcore.builders import with_layer_implementation
    from dynatrain_megatron.vps.model_spec import ModelSpec

    return with_layer_implementation(ModelSpec.from_yaml(ROOT / f"configs/models/{name}.yaml")
                                     .replace(**kw))


def _dropout_factory(spec, p: float):
    from dynatrain_megatron.mcore.builders import make_transformer_config

    def factory(layout, init_weights):
        c = make_transformer_config(spec, layout, init_weights=init_weights)
        c.hidden_dropout = c.attention_dropout = p
        c.deterministic_mode = True
        return c
    return factory


def _job(model: str, layout: str = "tp1", dropout: float = 0.0, **spec_kw):
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.mcore.session import start_job
    from dynatrain_megatron.mcore.train_config import TrainConfig

    spec = _spec(model, **spec_kw)
    train = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=50, lr=1e-2)
    factory = _dropout_factory(spec, dropout) if dropout else None
    builder = MegatronBuilder(spec, train, config_factory=factory)
    return spec, train, builder, start_job(spec, layout, train, builder=builder)


def _release(trainer) -> None:
    from dynatrain_megatron.mcore.session import release

    release(trainer.objs)
    trainer.release_references()


def _weights(trainer):
    return [p.detach().to("cpu", copy=True) for m in trainer.objs.model for p in m.parameters()]


def _bits_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _timed_steps(trainer, n: int) -> tuple[list[float], list[float]]:
    import torch

    losses, times = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(trainer.step().loss)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return losses, times


def w_a_background_prep() -> dict:
    import torch

    from dynatrain_megatron.elastic.device_manager import DeviceManager
    from dynatrain_megatron.loop.switching import discard_prepared, start_preparation

    torch.use_deterministic_algorithms(True)
    n = 12
    _, _, _, ref = _job("gpt-50m", dropout=0.1)
    ref_losses, ref_times = _timed_steps(ref, n)
    ref_w = _weights(ref)
    _release(ref)
    _, _, builder, tr = _job("gpt-50m", dropout=0.1)
    losses, times = _timed_steps(tr, 2)
    src, pl = tr.objs.layout, tr.objs.groups.placement
    dm = start_preparation(DeviceManager(), builder, src, pl, src, dst_placement=pl,
                           src_objs=tr.objs)
    during = 0
    while len(losses) < n:
        busy = not dm.ready()
        lo, ti = _timed_steps(tr, 1)
        losses += lo
        times += ti
        during += busy
    while not dm.ready():
        time.sleep(0.01)
    groups = dm.take()
    prepared = dm.take_prepared()
    discard_prepared(prepared) if prepared is not None else groups.destroy()
    same_w = all(_bits_equal(a, b) for a, b in zip(ref_w, _weights(tr)))
    steady = sorted(ref_times[2:])[len(ref_times[2:]) // 2]
    prep = sorted(times[2:2 + max(1, during)])
    return dict(ok=losses == ref_losses and same_w, losses_equal=losses == ref_losses,
                weights_equal=same_w, steps_while_preparing=during,
                step_s_steady=steady, step_s_while_preparing=prep[len(prep) // 2],
                slowdown=prep[len(prep) // 2] / steady if steady else None,
                prepare_error=getattr(prepared, "error", None))


def w_b_memory_plan() -> dict:
    import torch

    from dynatrain_megatron.elastic.device_manager import DeviceManager
    from dynatrain_megatron.loop.memory_check import CudaMemory, SwitchMemoryCheck
    from dynatrain_megatron.loop.switching import (prepared_switch_args, start_preparation,
                                                   switch_trainer)

    spec, train, builder, tr = _job("gpt-200m")
    dev = CudaMemory()
    check = SwitchMemoryCheck(source=dev)
    rows = []
    for i in range(2):
        for _ in range(2):
            tr.step()
            check.step_boundary()
        src, pl = tr.objs.layout, tr.objs.groups.placement
        plan = check.plan(spec, builder, src, pl, src, pl)
        free_before, total = torch.cuda.mem_get_info()
        torch.cuda.reset_peak_memory_stats()
        dm = start_preparation(DeviceManager(), builder, src, pl, src, dst_placement=pl,
                               src_objs=tr.objs)
        min_free = free_before
        while not dm.ready():
            tr.step()
            min_free = min(min_free, torch.cuda.mem_get_info()[0])
        tr, res = switch_trainer(tr, builder, src, pl, src, dst_devices=pl.devices,
                                 **prepared_switch_args(dm))
        check.forget_peaks()
        peak_reserved = torch.cuda.max_memory_reserved()
        used_peak = total - min(min_free, torch.cuda.mem_get_info()[0])
        need = dict((m, b) for m, b, _ in plan.need_bytes)
        rows.append(dict(switch=i + 1, mode=plan.mode, planned_background=need["background"],
                         max_memory_reserved=peak_reserved, device_used_peak=used_peak,
                         allocated_after=torch.cuda.memory_allocated(),
                         aborted=res.aborted, plan=plan.describe()))
    ok = all(r["aborted"] is None and r["device_used_peak"] <= r["planned_background"]
             for r in rows) and rows[1]["allocated_after"] <= rows[0]["allocated_after"] * 1.05
    return dict(ok=ok, switches=rows)


def w_c_background_comms() -> dict:
    import faulthandler
    import threading

    import torch
    import torch.distributed as dist

    from dynatrain_megatron.compat.torch_features import new_group
    from dynatrain_megatron.elastic.communicators import device_context, group_device, rank_device
    from dynatrain_megatron.transition.transport import warm_up

    faulthandler.dump_traceback_later(35, exit=True)  # the watchdog: a hang ends loudly
    made, errors = [], []
    device = rank_device()

    def background():
        try:
            with device_context(device):
                for _ in range(6):
                    g = new_group(range(dist.get_world_size()), device=group_device())
                    made.append(g)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    t = threading.Thread(target=background)
    x = torch.ones(1 << 16, device="cuda")
    t0 = time.perf_counter()
    t.start()
    collectives = 0
    while t.is_alive() or collectives < 20:
        dist.all_reduce(x)
        collectives += 1
    torch.cuda.synchronize()
    for g in made:  # checked at a point every rank reaches in the same order
        warm_up(g)
    faulthandler.cancel_dump_traceback_later()
    return dict(ok=not errors and len(made) == 6, groups=len(made), errors=errors,
                main_collectives=collectives, seconds=time.perf_counter() - t0)


def w_d_abort_destroy() -> dict:
    import torch
    import torch.distributed as dist

    from dynatrain_megatron.compat.torch_features import new_group
    from dynatrain_megatron.elastic.communicators import group_device
    from dynatrain_megatron.transition.transport import (Pending, abort_group, abort_groups,
                                                         warm_up)

    world = dist.get_world_size()
    out: dict = {}
    idle = new_group(range(world), device=group_device())
    warm_up(idle)
    out["idle_aborted"] = abort_group(idle)
    dist.destroy_process_group(idle)
    busy = new_group(range(world), device=group_device())
    warm_up(busy)
    props = torch.cuda.get_device_properties(0)
    rate = getattr(props, "clock_rate", 2_000_000) * 1000
    torch.cuda._sleep(int(5 * rate))  # ~5 s of a spinning kernel ahead of the collective
    work = dist.all_reduce(torch.ones(1 << 20, device="cuda"), group=busy, async_op=True)
    t0 = time.perf_counter()
    try:
        Pending([work], polled=True, on_timeout=lambda: abort_group(busy)).wait(timeout=1.0)
        out["busy_timed_out"] = False
    except TimeoutError as e:
        out.update(busy_timed_out=True, message=str(e))
    out["raised_after_s"] = time.perf_counter() - t0
    torch.cuda.synchronize()
    try:
        dist.destroy_process_group(busy)
        out["busy_destroyed"] = True
    except Exception as e:  # noqa: BLE001
        out["busy_destroyed"] = f"{type(e).__name__}: {e}"
    fresh = new_group(range(world), device=group_device())
    y = torch.ones(1, device="cuda")
    dist.all_reduce(y, group=fresh)
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    out.update(new_group_ok=float(y) == world, default_group_ok=float(x) == world)
    # a broken layout's communicators: aborted together in one NCCL group call, then
    # destroyed (ParallelGroups.destroy(broken=True)); a group made after still works
    try:
        pair = [new_group(range(world), device=group_device()) for _ in range(2)]
        for g in pair:
            warm_up(g)
        t1 = time.perf_counter()
        out["grouped_aborted"] = abort_groups(pair)
        out["grouped_abort_s"] = time.perf_counter() - t1
        for g in pair:
            dist.destroy_process_group(g)
        z = torch.ones(1, device="cuda")
        dist.all_reduce(z, group=new_group(range(world), device=group_device()))
        out["after_grouped_abort_ok"] = float(z) == world
    except Exception as e:  # noqa: BLE001 - reported; the figures above stand
        out["grouped_abort_error"] = f"{type(e).__name__}: {e}"
    out["ok"] = bool(out["idle_aborted"] and out["busy_timed_out"] and out["raised_after_s"] < 3
                     and out["busy_destroyed"] is True and out["new_group_ok"]
                     and out["default_group_ok"] and out.get("grouped_aborted") == 2
                     and out.get("after_grouped_abort_ok"))
    return out


class _Loopback:
    """A transport whose every peer is this device: sends are read into a sink, receives
    are filled from a source of the same size (device memory traffic of the real thing)."""

    def __init__(self):
        from dynatrain_megatron.transition.transport import Pending, Transport

        class T(Transport):
            def start(self, sends, recvs, tag=0):
                import torch

                for ts in sends.values():
                    for t in ts:
                        torch.empty_like(t).copy_(t)
                for ts in recvs.values():
                    for t in ts:
                        t.copy_(torch.ones_like(t))
                return Pending(())

        self.transport = T()


def w_e_executor_geometry() -> dict:
    import numpy as np
    import torch

    from dynatrain_megatron.routing.links import LinkModel
    from dynatrain_megatron.routing.planner import build_plan
    from dynatrain_megatron.routing.schedule import schedule
    from dynatrain_megatron.transition.checksum import checksums
    from dynatrain_megatron.transition.executor import PACK_ALIGN, Executor
    from dynatrain_megatron.vps.layout import Layout

    spec = _spec("llama3-70b", params_dtype="bf16")
    a, b = Layout.parse("tp8pp4dp4", 128), Layout.parse("tp4pp4dp8", 128)
    t0 = time.perf_counter()
    plan = build_plan(spec, a, b, ranks_per_node=8)
    rounds = schedule(plan, 2 * GiB, align=PACK_ALIGN)
    plan_s = time.perf_counter() - t0
    me = 0
    mine = plan.pieces_for(me)
    local = [p for p in mine if p.is_local]
    per_round = [r.sends(me) + r.recvs(me) for r in rounds]
    dtype = {2: torch.bfloat16, 4: torch.float32}
    views: dict = {}

    def view(p, side):
        k = (p, side)
        if k not in views:
            views[k] = torch.empty(p.box.shape, dtype=dtype[p.itemsize], device="cuda")
        return views[k]

    nbytes = sum(p.box.numel * p.itemsize for p in mine)
    for p in mine:  # allocated up front: the executor's own time only
        if p.src_device == me:
            view(p, "src").fill_(1)
        if p.dst_device == me:
            view(p, "dst")
    torch.cuda.synchronize()
    # the loopback cannot echo a peer's checksums: the executor runs without them and the
    # checksum pass over the same bytes is timed on its own
    ex = Executor(me, _Loopback().transport, src_view=lambda p: view(p, "src"),
                  dst_view=lambda p: view(p, "dst"), device=torch.device("cuda"),
                  checksums=False)
    t1 = time.perf_counter()
    errors = ex.run(local, per_round)
    torch.cuda.synchronize()
    run_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    checksums([v for v in views.values()])
    torch.cuda.synchronize()
    sum_s = time.perf_counter() - t2
    link = LinkModel()
    local_bytes = sum(p.box.numel * p.itemsize for p in local)
    moved = nbytes - local_bytes
    # the loopback makes each remote byte a device copy on both sides
    copy_model_s = (local_bytes + 2 * moved) / (link.local_copy_gbps * 1e9)
    sum_model_s = sum(v.numel() * v.element_size() for v in views.values()) / (
        link.checksum_gbps * 1e9)
    s = ex.stats
    return dict(ok=not errors, errors=list(errors)[:3], plan_s=plan_s, rounds=len(rounds),
                pieces=len(mine), bytes=nbytes, local_bytes=local_bytes,
                executor_s=run_s, executor_model_s=copy_model_s,
                executor_over_model=run_s / copy_model_s if copy_model_s else None,
                checksum_s=sum_s, checksum_model_s=sum_model_s,
                checksum_over_model=sum_s / sum_model_s if sum_model_s else None,
                pause_breakdown=dict(plan_s=plan_s, executor_s=run_s, checksum_s=sum_s,
                                     peak_staging_bytes=s.peak_staging_bytes,
                                     zero_copy_bytes=s.zero_copy_bytes,
                                     checksummed_messages=s.checksummed_messages),
                cost_model=dict(local_copy_gbps=link.local_copy_gbps,
                                checksum_gbps=link.checksum_gbps),
                rank_bytes_total=int(np.int64(nbytes)))


def run_g_megatron_lm(out_dir: Path, limit_s: float) -> dict:
    """Megatron-LM's own training with --dynatrain, where its snapshot and dependencies are
    on the machine (they are not part of this tree)."""
    snap = next((p for p in (ROOT / "shared/megatron-lm/core_v0.16.1",
                             ROOT.parent / "shared/megatron-lm/core_v0.16.1") if p.is_dir()), None)
    if snap is None:
        return dict(ok=None, skipped="the Megatron-LM snapshot did not travel")
    missing = [m for m in ("six", "regex", "pydantic") if not _importable(m)]
    if missing:
        return dict(ok=None, skipped=f"Megatron-LM's dependencies missing here: {missing}")
    script = ROOT / "scripts/launch_megatron_lm_example.sh"
    if not script.is_file():
        return dict(ok=None, skipped="no launch script in this tree")
    env = dict(os.environ, MEGATRON_LM=str(snap), NPROC="1", JOB_DIR=str(out_dir / "mlm"),
               PYTHON=sys.executable)
    try:
        p = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                           timeout=limit_s)
    except subprocess.TimeoutExpired:
        return dict(ok=False, error=f"timed out after {limit_s:.0f} s")
    return dict(ok=p.returncode == 0, tail=(p.stdout + p.stderr)[-2000:])


def _importable(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


# ----------------------------------------------------------------------------- driver
def _worker(name: str, result: str) -> int:
    bootstrap()
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
        import traceback

        out = dict(ok=False, error=f"{type(e).__name__}: {e}",
                   traceback=traceback.format_exc()[-3000:])
    if dist.get_rank() == 0:
        Path(result).write_text(json.dumps(out, default=str))
    return 0


def _run_check(c: Check, limit_s: float, tmp: Path, path: list[str]) -> dict:
    from dynatrain_megatron.loop.launch import free_port

    if c.name == "g_megatron_lm":
        return run_g_megatron_lm(tmp, limit_s)
    result = tmp / f"{c.name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
           "--master-port", str(free_port()), str(Path(__file__).resolve()),
           "--worker", c.name, "--result", str(result)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="4", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit_s)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = None, f"timed out after {limit_s:.0f} s: {str(e.stderr or '')[-2000:]}"
    out = json.loads(result.read_text()) if result.exists() else dict(ok=False)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if not out.get("ok"):
        out.update(returncode=rc, log_tail=tail)
    return out


def render(report: dict) -> str:
    """The report in docs/bench/gpu.md's format."""
    pf = report["preflight"]
    lines = ["# GPU check", "", f"Run {report['started']} UTC, {report.get('seconds', 0)} s"
             + (" (dry run: nothing was run)" if report["dry_run"] else "") + ".", "",
             "## Machine", "", "| what | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in pf.items()]
    lines += ["", "## Checks", "", "| check | result | figures |", "|---|---|---|"]
    for c in CHECKS:
        r = report["checks"].get(c.name, {})
        res = {True: "pass", False: "FAIL", None: r.get("skipped", "not run")}[r.get("ok")]
        figs = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                if k not in ("ok", "log_tail", "traceback", "tail", "switches", "losses")}
        lines.append(f"| {c.what} | {res} | `{json.dumps(figs, default=str)[:600]}` |")
    lines += ["", "## Not verified on this machine", ""] + [f"- {u}" for u in UNVERIFIED_HERE]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="folder for gpu.md and gpu.json")
    ap.add_argument("--dry-run", action="store_true", help="preflight and list the checks")
    ap.add_argument("--only", default="", help="comma list of check names")
    ap.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    if argv is None and "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        return _worker(sys.argv[i + 1], sys.argv[sys.argv.index("--result") + 1])
    args = ap.parse_args(argv)
    only = {s for s in args.only.split(",") if s} or None
    unknown = (only or set()) - {c.name for c in CHECKS}
    if unknown:
        ap.error(f"unknown checks {sorted(unknown)}; known: {[c.name for c in CHECKS]}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    path = bootstrap()
    pf = preflight()
    for k, v in pf.items():
        print(f"preflight {k:36s} {v}", flush=True)
    report: dict = dict(dry_run=args.dry_run, preflight=pf, checks={},
                        started=time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
    todo = [c for c in CHECKS if not only or c.name in only]
    for c in todo:
        print(f"check {c.name:22s} <= {c.limit_s:3d} s: {c.what}", flush=True)
    if not args.dry_run and not pf["gpus"]:
        report["error"] = "no GPU visible: nothing to check"
        print(report["error"], file=sys.stderr)
    elif not args.dry_run:
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            for c in todo:
                left = args.budget_s - (time.perf_counter() - t_start)
                if left < 20:
                    report["checks"][c.name] = dict(ok=None, skipped="out of time")
                elif pf["gpus"] < c.min_gpus:
                    report["checks"][c.name] = dict(ok=None, skipped=f"needs {c.min_gpus} GPUs")
                else:
                    report["checks"][c.name] = _run_check(c, min(c.limit_s, left), Path(tmp), path)
                print(f"result {c.name:22s} {report['checks'][c.name].get('ok')}", flush=True)
                (out / "gpu.json").write_text(json.dumps(report, indent=1, default=str))
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "gpu.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu.md").write_text(render(report))
    print(f"report: {out / 'gpu.md'}")
    if args.dry_run:
        return 0
    return 0 if all(r.get("ok") is not False for r in report["checks"].values()) and pf["gpus"] else 1


if __name__ == "__main__":
    sys.exit(main())
