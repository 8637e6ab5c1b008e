"""The training entry point behind `scripts/pretrain_gpt.py` (runs under torchrun)."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

import torch.distributed as dist

from ..configs import load_model
from ..vps.errors import DynatrainError
from ..vps.model_spec import ModelSpec
from ..vps.placement import Placement
from .arguments import add_dynatrain_args, add_training_args, layout_from_args, train_config_from_args
from ..mcore.builders import with_layer_implementation
from ..mcore.training import StepResult, Trainer

log = logging.getLogger("dynatrain")


def setup_logging() -> None:
    import warnings

    # megatron-core warns about missing apex/TE and CUDA tuning on every rank: noise on CPU
    for cat in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=cat)
    rank = dist.get_rank() if dist.is_initialized() else 0
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its INFO dumps configs per build
    from .logs import configure

    configure(rank)  # the hook's from_args sets it again with the job's --dynatrain-log-all-ranks


def format_iteration(r: StepResult, train_iters: int, consumed: int, gbs: int, layout) -> str:
    """Megatron-LM's per-iteration log line (same fields, same order)."""
    return (f" iteration {r.iteration:8d}/{train_iters:8d} | consumed samples: {consumed:12d} | "
            f"elapsed time per iteration (ms): {r.seconds * 1000:.1f} | learning rate: "
            f"{r.lr:.6E} | global batch size: {gbs:5d} | lm loss: {r.loss:.6E} | "
            f"grad norm: {r.grad_norm:.3f} | layout: {layout}")


def measure_checkpoint_path(trainer: Trainer) -> float:
    """Seconds of the checkpoint-based path at the final layout (dist_checkpointing save,
    rebuild, load), for the summary's comparison column."""
    import os
    import shutil
    import tempfile
    import time

    from ..mcore import dist_ckpt
    from ..mcore.builders import MegatronBuilder

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    box = [tempfile.mkdtemp(prefix="dynatrain-ckpt-", dir=base) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    t0 = time.perf_counter()
    try:
        dist_ckpt.save(trainer.objs, trainer.iteration, trainer.consumed_samples, box[0])
        objs = MegatronBuilder(trainer.spec, trainer.train).build(trainer.objs.layout,
                                                                  trainer.objs.groups)
        dist_ckpt.load(objs, box[0])
        dist.barrier()
        dt = time.perf_counter() - t0
        # the copy's objects share the trainer's groups: free them without destroying those
        objs.model.clear()
        objs.optimizer = objs.scheduler = None
    finally:
        if dist.get_rank() == 0:  # a checkpoint in /dev/shm holds memory until removed
            shutil.rmtree(box[0], ignore_errors=True)
    log.info("checkpoint path at %s (save + rebuild + load): %.2f s", trainer.objs.layout, dt)
    return dt


def _write_summary(log_dir: str, trainer: Trainer, hook) -> None:
    """`summary.json` in the log directory: where the job ended and what happened to it;
    written whole or not at all, a failure logged (`safe_files.OutputDir`), never raised."""
    from ..safe_files import OutputDir

    OutputDir(log_dir).write_json("summary.json", dict(
        iteration=trainer.iteration, layout=str(trainer.objs.layout),
        world=dist.get_world_size(), switches=len(hook.history), rejected=hook.rejected,
        rolled_back=hook.failed, recoveries=hook.recoveries, admitted=hook.admitted))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="megatron-core GPT training with dynatrain")
    add_training_args(parser)
    add_dynatrain_args(parser)
    args = parser.parse_args(argv)

    from ..mcore.session import init_distributed, start_job

    if args.dynatrain and args.dynatrain_join:
        return _join_and_run(args)
    init_distributed()
    setup_logging()
    spec = load_model(args.model_config)
    if args.bf16:
        spec = spec.replace(params_dtype="bf16")
    spec = with_layer_implementation(spec)
    processes = dist.get_world_size()
    standby = args.dynatrain_standby_ranks if args.dynatrain else 0
    if not 0 <= standby < processes:
        parser.error(f"--dynatrain-standby-ranks {standby}: must leave at least one of the "
                     f"{processes} processes training")
    layout = layout_from_args(args, spec, processes - standby)
    train = train_config_from_args(args)
    log.info("model %s (%s), layout %s on %d ranks%s", spec.name, args.model_config, layout,
             layout.world_size, f" ({standby} more on standby)" if standby else "")
    placement = Placement(tuple(range(layout.world_size)))
    trainer: Optional[Trainer] = start_job(spec, layout, train, placement)
    hook = None
    if args.dynatrain:
        from ..elastic.job_secret import share_with_ranks
        from .hook import DynatrainHook

        try:  # a bad secret, schedule or DYNATRAIN_FAULTS: a clear error before the first step
            # the secret a joining process must prove it holds: generated here when none is
            # given, handed to every rank through its environment (elastic/job_secret.py)
            share_with_ranks(args.dynatrain_secret_file, args.dynatrain_rendezvous_dir)
            hook = DynatrainHook.from_args(args, spec, train)
            hook.start(trainer, layout, placement)
        except DynatrainError as e:
            parser.error(str(e))
    return _run(args, spec, train, trainer, hook)


def _join_and_run(args: argparse.Namespace) -> int:
    """`--dynatrain-join`: ask the running job (through the rendezvous directory) to take
    this process in, proving the job's secret; once accepted, enter its grown world on
    standby (loop/growth.py) and follow it like any standby rank."""
    import torch.distributed.nn.functional  # noqa: F401  (before any world: see rejoin)

    from ..compat import prepare_runtime
    from ..elastic.job_secret import load_secret
    from ..elastic.join import JoinError, current_nonce, join_store, post_request, wait_verdict
    from .growth import join_world, meeting_prefix, ready
    from .hook import DynatrainHook

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s joiner] %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    if not args.dynatrain_rendezvous_dir:
        log.error("--dynatrain-join needs --dynatrain-rendezvous-dir (where the job meets)")
        return 2
    spec = load_model(args.model_config)
    if args.bf16:
        spec = spec.replace(params_dtype="bf16")
    spec = with_layer_implementation(spec)
    train = train_config_from_args(args)
    try:
        store = join_store(args.dynatrain_rendezvous_dir)  # the job's, even under torchrun
    except JoinError as e:
        log.error("%s", e)
        return 2
    secret = load_secret(args.dynatrain_secret_file, rendezvous_dir=None)
    if secret is None:
        log.error("--dynatrain-join needs the job's secret (--dynatrain-secret-file or $%s)",
                  "DYNATRAIN_JOB_SECRET")
        return 2
    # everything slow first: once accepted, the job waits for this process in the new world
    prepare_runtime()
    from ..mcore.session import freeze_long_lived_objects

    freeze_long_lived_objects()
    slot, req = post_request(store, secret)
    verdict = wait_verdict(store, slot, secret)
    if not verdict.accepted:
        log.error("the job refused this process: %s", verdict.reason)
        return 1
    log.info("accepted: generation %d, rank %d", verdict.generation, verdict.rank)
    nonce = current_nonce(store)  # the one the job's tag on the verdict was checked with
    ready(store, verdict.generation, verdict.rank, secret, nonce, req.request_id)
    layout, placement = join_world(spec, train, store,
                                   meeting_prefix(secret, nonce, verdict.generation),
                                   verdict.rank, secret)
    setup_logging()
    hook = DynatrainHook.from_args(args, spec, train)
    hook.start(None, layout, placement)
    return _run(args, spec, train, None, hook)


def _run(args: argparse.Namespace, spec: ModelSpec, train, trainer: Optional[Trainer],
         hook) -> int:
    """The training loop of every process (standby ones start with `trainer` None)."""
    while True:
        failure: Optional[str] = None
        try:
            if trainer is None:  # standby: no training state, follows the controller
                trainer = hook.standby()
                if trainer is None:
                    break  # the job ended
                continue
            if trainer.iteration >= train.train_iters:
                break
            r = trainer.step()
            if r.iteration % args.log_interval == 0:
                log.info(format_iteration(r, train.train_iters, trainer.consumed_samples,
                                          train.global_batch_size, trainer.objs.layout))
            if hook is not None:
                trainer = hook.after_step(trainer)
        except Exception as e:  # noqa: BLE001 - a dead peer, when the hook says so
            if hook is None or not hook.can_recover(e):
                raise
            failure = f"{type(e).__name__}: {e}"
        if failure is not None:
            # outside the handler: its traceback would keep the broken communicators open
            what, trainer = hook.recover(trainer, failure)
            if what == "leave":
                log.warning("this process is not needed after the recovery: it ends")
                return 0
    if hook is not None and trainer is not None:
        hook.end_job(trainer)
        everyone = trainer.objs.layout.world_size == dist.get_world_size()
        if args.dynatrain_compare_checkpoint and not everyone:
            log.info("checkpoint-path comparison skipped: ranks on standby at the end")
        ckpt_s = (measure_checkpoint_path(trainer)
                  if args.dynatrain_compare_checkpoint and everyone else None)
        hook.finish(trainer, ckpt_s)
        if args.dynatrain_log_dir and dist.get_rank() == 0:
            _write_summary(args.dynatrain_log_dir, trainer, hook)
    dist.barrier()
    dist.destroy_process_group()
    return 0
