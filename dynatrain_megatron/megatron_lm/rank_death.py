"""A rank that dies inside Megatron-LM's own `train()`: the survivors re-form the world and go
on in the same processes, at a layout that fits them (`loop/death_recovery.py`).

It needs a launcher that lets the survivors live: torchrun's agent stops every worker when
one fails, so under torchrun a death still ends the job (restart from the last `--save`);
`dynatrain launch` (or Slurm's `srun --kill-on-bad-exit=0`) only watches, and
`--dynatrain-rendezvous-dir` is where the survivors meet.

The patched loop catches the failed collective around `train_step` and around
`dynatrain_step` (where a death surfaces: a gloo error on every survivor), hands its text to
`failure_of` (anything that is not a dead peer is re-raised), and once outside the
exception handler (its traceback holds the broken communicators) calls `recover`, then
rebinds what `recover` returns, as after a switch. What is recovered from where:

* Where every shard of the dead ranks has a replica on a survivor (several optimizer
  instances, `--num-distributed-optimizer-instances` > 1), `recover_after_death` switches
  the survivors' own tensors to the largest layout that fits them: nothing is lost and the
  loop goes on from the current iteration.
* Megatron-LM's distributed optimizer with one instance keeps every `main_param` /
  `exp_avg` / `exp_avg_sq` shard on one rank only: the dead ranks' shards are gone. The
  survivors then build that layout and load Megatron-LM's own last checkpoint (`--save`,
  with Megatron-LM's `load_checkpoint`: iteration, consumed samples, scheduler, rerun
  state); the loop goes on from that iteration. Without a checkpoint the job ends with
  the lost tensors named.

Megatron-LM's globals end consistent with the new world: `parallel_state` (our groups
installed), `args` (world size, rank, layout sizes, consumed samples), the micro-batch
calculator, the stand-in world of Megatron-LM's code, the model config's callbacks, the data
iterators (rebuilt at the consumed samples). A survivor the new world does not need ends
its process with status 0 (`dynatrain launch` reports the job by its last workers); one it
keeps on standby waits there, and recovers with the others if a layout rank dies next.

A survivor blocked in a collective with another survivor learns of the death only when that
one's sockets close, which on gloo happens only when nothing holds them any more; a survivor
that keeps one open leaves that peer blocked until the process-group timeout (and out of the
new world). Inside Megatron-LM two things hold them besides our objects: its frames
(`train()`, `pretrain()`) reference the broken layout's optimizer, model config and last
model chunk, and its data loaders' worker processes, forked after the world was made, hold
copies of every socket. `_let_go` empties those objects in place (the loop continues with
new ones) and stops those workers (the iterators are rebuilt on the new world).

A death inside a training step (forward, backward, a pipeline send, the data-parallel
gradient reduction, the optimizer step) is recovered like one at the step boundary, from the
last boundary's state: `step_guard.py` resets what the failed step left in Megatron-LM's
globals (its rerun state machine, its timers), and, where a survivor may have begun the
optimizer update, makes the recovery resume from the last `--save` rather than from memory.

A death first seen after the step, in the rest of the iteration (its log line's reductions,
an evaluation, a `--save`), is held until the step boundary and recovered there from that
step's state (`post_step.py`, `recover_at_boundary`).

A death inside the loop's first step is recovered like one in any later step: the session
begins before that step (`seam.LoopSeam.guard`), on the state the loop starts from. Where
the survivors resume from a checkpoint and this job has saved none yet, they load the one
it started from (`--load`, `_last_checkpoint`); with neither, every survivor ends with a
one-line error. A recovery from a checkpoint loads Megatron-LM's latest complete one (its
tracker file is written last).

Not covered: a death during Megatron-LM's start-up (before `train()`'s loop: the model,
optimizer and data are still being built, there is no state to recover) ends every
survivor, in one line (`startup_death.py`). A death after `train()` (the final save,
validation, test) is recovered in memory where the state allows (`after_train.py`,
`recover_after_train`), else ends every survivor with one line.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Optional

from ..compat import stand_in_world
from ..loop.death_recovery import HostLoop
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from .adapter import LoopObjects, MegatronLMSession, current_session
from .arguments import arg_value

log = logging.getLogger("dynatrain")


def failure_of(error: BaseException) -> str:
    """The text of a failure the session can recover from (a dead peer); re-raises
    `error` otherwise (a bug, or no session, rendezvous directory or recovery budget)."""
    s = current_session()
    if s is None or s.trainer is None and s.hook.layout is None:
        raise error
    if not s.hook.can_recover(error):
        if s.hook.rendezvous_dir is None and _looks_like_dead_peer(error):
            log.error("dynatrain: a peer died (%s); without --dynatrain-rendezvous-dir (and "
                      "a launcher that keeps the survivors alive: `dynatrain launch`) the job "
                      "cannot recover: restart it from the last --save",
                      str(error).splitlines()[0][:200])
        raise error
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"


def _looks_like_dead_peer(error: BaseException) -> bool:
    text = str(error)
    return any(m in text for m in ("Connection closed by peer", "Connection reset by peer",
                                   "Broken pipe"))


def recover(args: Any, iteration: int, failure: str,
            checkpointing_context: Optional[dict] = None) -> LoopObjects:
    """Every survivor, after `failure_of`, outside the exception handler: re-form the
    world, recover the training state (module doc) and return what `train()` continues
    with (`changed`; `stop` on a survivor that waited on standby until the job ended).
    A survivor the new world does not need exits the process here (status 0)."""
    s = current_session()
    if s is None:
        raise DynatrainError("recover() before the first dynatrain_step")
    # the recovery's collectives, its roster and the world it re-forms are the real world's,
    # not the layout's that Megatron-LM's code sees while some survivors are on standby
    # (a failure inside train_step arrives here with that stand-in in use)
    stand_in_world.use(None)
    old_config = s.trainer.objs.config if s.trainer is not None else None
    held = _held_by_megatron_lm(s)
    box: dict = {}
    # what a failure inside train_step left mid-run in Megatron-LM's globals (step_guard.py)
    s.guard.reset_after_failed_step()
    s.hook.host = HostLoop(let_go=lambda: _let_go(held, old_config, checkpointing_context),
                           resume=lambda dst: _resume_from_save(s, dst, box),
                           mid_update=s.guard.mid_update)
    trainer, s.trainer = s.trainer, None
    what, trainer = s.hook.recover(trainer, failure)
    s.hook.host = None
    s.guard.mid_update = False  # this recovery took it into account
    if what == "leave":
        log.warning("dynatrain: this survivor is not needed by the new layout: the process "
                    "ends")
        sys.stdout.flush()
        raise SystemExit(0)
    if what == "standby":
        log.info("dynatrain: on standby after the recovery")
        try:
            trainer = s.hook.standby()
        except Exception as error:  # noqa: BLE001 - handed on or re-raised
            failure = failure_of(error)
        else:
            failure = ""
        if failure:  # a layout rank died while this one waited: recover from that too
            return recover(args, iteration, failure, checkpointing_context)
        if trainer is None:
            return LoopObjects([], None, None, None, None, None,
                               iteration=arg_value(args, "train_iters", iteration), stop=True)
    _follow_world(args)
    log.warning("dynatrain: training goes on at %s on %d ranks after iteration %d, %s",
                trainer.objs.layout, trainer.objs.layout.world_size, trainer.iteration,
                "from the last checkpoint" if box else "recovered in memory")
    loop = s.rebind_loop(trainer, old_config, flops=box.get("flops"))
    s.guard.resume_at(trainer.iteration)
    s.guard.at_boundary(trainer.iteration, trainer.objs)
    s.enter_layout_world()
    return loop


def recover_at_boundary(args: Any, iteration: int, failure: str,
                        checkpointing_context: Optional[dict] = None) -> LoopObjects:
    """`recover` after a failure first seen past `train_step` in iteration `iteration`
    (`post_step.py`): that step completed on every survivor, so the recovery starts from
    its state, at the boundary after `iteration` (its consumed samples counted)."""
    s = current_session()
    if s is None or s.trainer is None:
        raise DynatrainError(f"a peer died after the step of iteration {iteration}, before "
                             f"dynatrain's session began: {failure}")
    s.trainer.iteration = iteration
    s.trainer.consumed_samples = arg_value(args, "consumed_train_samples",
                                           s.trainer.consumed_samples)
    s.guard.step_completed()
    return recover(args, iteration, failure, checkpointing_context)


def recover_after_train(args: Any, iteration: int, failure: str,
                        checkpointing_context: Optional[dict] = None) -> LoopObjects:
    """`recover` after a failure in `pretrain()`'s calls after `train()` returned
    (`after_train.py`): every step completed on every survivor, so the recovery starts from
    the final state (iteration `iteration`), in memory only (the training since the last
    `--save` cannot be redone outside `train()`: DynatrainError, one line). The ranks of
    the new layout then release the survivors it keeps on standby (`end_job`), whose
    objects come back with `stop`."""
    s = current_session()
    if s is None or s.trainer is None:
        raise DynatrainError(f"a peer died after train() at iteration {iteration}, on a "
                             f"process holding no training state: {failure}")
    s.after_train = iteration
    s.trainer.iteration = iteration
    s.trainer.consumed_samples = arg_value(args, "consumed_train_samples",
                                           s.trainer.consumed_samples)
    s.guard.step_completed()
    loop = recover(args, iteration, failure, checkpointing_context)
    if not loop.stop:  # with the survivors on standby (a real-world collective): they leave
        with stand_in_world.real_world():
            s.hook.end_job(s.trainer)
    return loop


def _follow_world(args: Any) -> None:
    """Megatron-LM's `args` that describe the world (its checkpoint code compares them)."""
    import torch.distributed as dist

    args.world_size = dist.get_world_size()
    args.rank = dist.get_rank()


def _held_by_megatron_lm(s: MegatronLMSession) -> list:
    """The broken layout's objects that Megatron-LM's frames may still reference and that
    hold its communicators: the optimizer (and those it chains), the model chunks and their
    process-group collections (`train()` keeps one in a local)."""
    from megatron.core.utils import get_attr_wrapped_model

    if s.trainer is None:
        return []
    o = s.trainer.objs
    out, pending = [], [o.optimizer]
    while pending:
        opt = pending.pop()
        if opt is not None:
            out.append(opt)
            pending += list(getattr(opt, "chained_optimizers", None) or [])
    for chunk in o.model:
        pgc = get_attr_wrapped_model(chunk, "pg_collection", allow_none=True)
        if pgc is not None and all(pgc is not x for x in out):
            out.append(pgc)
        out.append(chunk)  # `train()` keeps the last one in a loop variable (`model_module`)
    return out


def _let_go(held: list, old_config: Any, checkpointing_context: Optional[dict]) -> None:
    """Empty in place what Megatron-LM's frames still reference of the broken layout
    (module doc), after the hook read this rank's state and released its objects; the
    checkpoint strategies Megatron-LM cached with the old groups are dropped, and
    Megatron-LM's code is given the real world again (`compat/stand_in_world.py`)."""
    import gc

    from ..compat import stand_in_world

    for obj in held:
        vars(obj).clear()
    held.clear()
    if old_config is not None:
        for name in ("grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
                     "finalize_model_grads_func"):
            if hasattr(old_config, name):
                setattr(old_config, name, None)
    if checkpointing_context is not None:
        checkpointing_context.clear()
    stand_in_world.use(None)  # it may hold the broken layout's group
    gc.collect()
    stopped = _stop_data_loader_workers()
    if stopped:
        log.info("dynatrain: stopped %d data-loader worker process(es) of the broken world",
                 stopped)


def _stop_data_loader_workers() -> int:
    """Stop the worker processes of every live multi-process data-loader iterator. They
    were forked from this process after the world was made, so each holds a copy of every
    communicator socket of that time: the peers blocked on this rank would see its
    sockets close only when the workers end (with persistent workers, at the job's end).
    The iterators are rebuilt on the new world (`rebind_loop`). Returns the workers stopped."""
    import gc

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    n = 0
    for obj in gc.get_objects():
        if isinstance(obj, _MultiProcessingDataLoaderIter):
            n += len(getattr(obj, "_workers", ()))
            obj._shutdown_workers()
    return n


def _last_checkpoint(args: Any) -> str:
    """Which of Megatron-LM's checkpoint arguments holds the job's last checkpoint: `save`
    (what this job wrote), or, before its first save, `load` (what it started from: a
    death in the first steps after a restart), unless the job did not start from all of
    it (`--finetune`, `--no-load-optim`, `--no-load-rng`). DynatrainError (one line) when
    there is none."""
    from megatron.training.checkpointing import checkpoint_exists

    save, load = arg_value(args, "save"), arg_value(args, "load")
    if save and checkpoint_exists(save):
        return "save"
    partial = [f for f in ("finetune", "no_load_optim", "no_load_rng") if arg_value(args, f)]
    if load and checkpoint_exists(load) and not partial:
        return "load"
    why = (f"--load {load} was loaded only in part (--{', --'.join(partial)})".replace("_", "-")
           if load and partial else f"nor --load {load}" if load else "and no --load")
    raise DynatrainError(
        "a rank died and its optimizer state had no replica (one distributed-optimizer "
        f"instance, or a death inside the optimizer update), and there is no Megatron-LM "
        f"checkpoint to resume from (nothing yet in --save {save}, {why}): the job ends; "
        f"restart it (--num-distributed-optimizer-instances 2 keeps a replica of every "
        f"shard)")


def _resume_from_save(s: MegatronLMSession, dst: Layout, box: dict):
    """`HostLoop.resume`: build `dst` on the re-formed world and load Megatron-LM's last
    checkpoint (`--save`, else the `--load` the job started from: `_last_checkpoint`) into
    it with Megatron-LM's own `load_checkpoint`."""
    import torch.distributed as dist
    from megatron.training.checkpointing import load_checkpoint

    from ..mcore.session import start_job
    from ..mcore.training import Trainer

    args = s.args
    if s.after_train is not None:
        raise DynatrainError(
            f"a rank died after train() returned (Megatron-LM's final save, validation or "
            f"test) and its optimizer state had no replica: the final state of iteration "
            f"{s.after_train} is lost and the training since the "
            f"last checkpoint cannot be redone here; the job ends: restart it from the last "
            f"complete checkpoint (--save {arg_value(args, 'save')}; an interrupted save is "
            f"never loaded)")
    which = _last_checkpoint(args)
    s.set_args_for(dst)  # what load_checkpoint compares the checkpoint's args with
    _follow_world(args)
    new = start_job(s.spec, dst, s.train, builder=s.hook.builder)
    o = new.objs
    # Megatron-LM reads --ckpt-step (the iteration of --load to start from) for any
    # directory: this job's own --save resumes from its latest
    ckpt_step = getattr(args, "ckpt_step", None)
    if which == "save" and ckpt_step is not None:
        args.ckpt_step = None
    try:
        iteration, flops = load_checkpoint(o.model, o.optimizer, o.scheduler, load_arg=which)
    finally:
        if which == "save" and ckpt_step is not None:
            args.ckpt_step = ckpt_step
    box["flops"] = flops
    consumed = arg_value(args, "consumed_train_samples", 0)
    log.warning("dynatrain: loaded Megatron-LM's checkpoint of iteration %d (%d samples "
                "consumed) from %s at %s on %d ranks (its --%s)", iteration, consumed,
                arg_value(args, which), dst, dist.get_world_size(), which)
    return Trainer(s.spec, s.train, o, iteration, consumed)


__all__ = ("failure_of", "recover", "recover_after_train", "recover_at_boundary")
