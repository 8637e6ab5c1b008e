"""After a rank died: re-form the world, say exactly what was lost, and resume from the
user's last checkpoint at a layout the survivors can hold, never with wrong state.

With megatron-core's distributed optimizer, `main_param` / `exp_avg` / `exp_avg_sq` have
no replica across DP, so a dead rank always takes some optimizer state with it (its
weights usually survive on DP replicas); `routing.recovery.lost_state` names the tensors.
Continuing from the survivors' memory would train with wrong optimizer state, so the job
goes back to its last `dist_checkpointing` checkpoint, loaded at the new layout.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch.distributed as dist

from ..elastic.rejoin import NewWorld, reform_world, rendezvous_store
from ..routing.recovery import lost_state
from ..vps.errors import DynatrainError, LayoutError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from . import dist_ckpt
from .builders import bucket_size_of
from .session import release, start_job
from .train_config import TrainConfig
from .training import Trainer

log = logging.getLogger(__name__)


def fit_layout(spec: ModelSpec, train: TrainConfig, old: Layout, n: int) -> Layout:
    """The layout to shrink to on at most `n` ranks: the old one's model parallelism with
    the largest DP that fits (and divides the global batch); failing that, smaller TP/PP."""
    def ok(lay: Layout) -> bool:
        if lay.world_size > n or train.global_batch_size % (train.micro_batch_size * lay.dp):
            return False
        return not lay.model_errors(spec)

    mp_options = [(old.tp, old.pp)] + [(tp, pp) for tp in (8, 4, 2, 1) for pp in (8, 4, 2, 1)
                                       if tp <= old.tp and pp <= old.pp]
    for tp, pp in mp_options:
        for dp in range(n // (tp * pp * old.cp), 0, -1):
            try:
                lay = Layout(tp=tp, pp=pp, dp=dp, cp=old.cp)
            except LayoutError:
                continue
            if ok(lay):
                return lay
    raise DynatrainError(f"no layout of {spec.name} fits {n} surviving ranks")


def recover_after_death(trainer: Trainer, spec: ModelSpec, train: TrainConfig,
                        rendezvous_dir: Optional[str], checkpoint_dir: Optional[str],
                        generation: int = 1) -> tuple[Optional[Trainer], NewWorld, str]:
    """Every survivor calls this after a collective failed because a rank died. Returns
    (the trainer resumed at the new layout, or None on a survivor the new layout does not
    need; the new world; what was lost, in words)."""
    old = trainer.objs
    old_rank, old_world = old.groups.rank, old.layout.world_size
    old_layout, old_placement = old.layout, old.groups.placement
    # drop the old objects first: they hold the broken communicators, whose sockets close
    # only when the last reference goes, and a closed socket is how the survivors still
    # blocked in a collective with this rank learn of the failure quickly
    from megatron.core import parallel_state

    trainer.release_references()
    parallel_state.destroy_model_parallel()  # its globals hold the same communicators
    release(old, broken=True)
    del old
    store = rendezvous_store(rendezvous_dir)
    nw = reform_world(store, old_rank, old_world, generation,
                      keep=lambda n: fit_layout(spec, train, old_layout, n).world_size)
    report = lost_state(spec, old_layout, nw.dead, old_placement,
                        bucket_size_of(train, old_layout))
    what = report.describe()
    log.error("ranks %s died: %s", list(nw.dead), what)
    if nw.rank is None:
        log.warning("rank %d is not needed by the new layout: leaving", old_rank)
        return None, nw, what
    if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
        raise DynatrainError(f"state lost ({what}) and no checkpoint to resume from "
                             f"(--dynatrain-recovery-checkpoint)")
    layout = fit_layout(spec, train, old_layout, len(nw.survivors))
    log.warning("resuming from the checkpoint in %s at %s on %d ranks (optimizer state of the "
                "dead ranks had no replica: the survivors' memory is not used)",
                checkpoint_dir, layout, layout.world_size)
    new = start_job(spec, layout, train)
    new.iteration, new.consumed_samples = dist_ckpt.load(new.objs, checkpoint_dir)
    assert dist.get_world_size() == layout.world_size
    return new, nw, what
