"""One training step and the per-iteration bookkeeping of a megatron-core job.

Mirrors Megatron-LM's `train_step`: zero grad buffers, forward/backward through megatron's
pipeline schedule, `optimizer.step()`, scheduler step by the global batch in samples, then
`iteration += 1` and `consumed_samples += global_batch_size`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..transition.scalars import quiet
from ..transition.transport import collective_device
from ..vps.model_spec import ModelSpec
from .builders import TrainingObjects
from .data import SyntheticGPTData, iterators_for_chunks
from .train_config import TrainConfig

log = logging.getLogger("dynatrain")


@dataclass
class StepResult:
    iteration: int
    loss: float  # mean LM loss over the global batch (same value on every rank)
    grad_norm: float
    lr: float
    seconds: float


def num_micro_batches(train: TrainConfig, dp: int) -> int:
    """Micro-batches per step at `dp` (of the batch rounded down to a multiple of micro batch
    * DP with `train.decrease_batch_size_if_needed`)."""
    if not train.splits_over(dp):
        raise ValueError(f"global_batch_size {train.global_batch_size} not divisible by "
                         f"micro_batch_size*dp = {train.micro_batch_size}*{dp}")
    return train.running_batch_size(train.global_batch_size, dp) // (train.micro_batch_size * dp)


def set_num_microbatches_calculator(train: TrainConfig, dp: int, consumed_samples: int = 0) -> None:
    """Keep megatron's global micro-batch calculator in step with the layout's DP: with a
    batch-size ramp, at the ramp's position for `consumed_samples`, as megatron-core's
    calculator made at this DP and updated to them (a restart at this layout) would be,
    rounding the batch down where the job does (`decrease_batch_size_if_needed`)."""
    from megatron.core import num_microbatches_calculator as nmc

    rank = dist.get_rank()
    ramp = list(train.rampup_batch_size) if train.rampup_batch_size is not None else None
    if nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        nmc.init_num_microbatches_calculator(rank, ramp, train.global_batch_size,
                                             train.micro_batch_size, dp,
                                             train.decrease_batch_size_if_needed)
    else:  # without its line per switch ("setting number of microbatches to ...")
        with quiet(nmc.__name__):
            nmc.reconfigure_num_microbatches_calculator(rank, ramp, train.global_batch_size,
                                                        train.micro_batch_size, dp,
                                                        train.decrease_batch_size_if_needed)
    if ramp is not None:
        nmc.update_num_microbatches(consumed_samples, consistency_check=True)


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float()
    loss = torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out, partial(_loss_func, batch["loss_mask"])


class Trainer:
    """Runs steps of one `TrainingObjects`; rebinding to new objects is `rebind()`."""

    def __init__(self, spec: ModelSpec, train: TrainConfig, objs: TrainingObjects,
                 iteration: int = 0, consumed_samples: int = 0) -> None:
        self.spec = spec
        self.train = train
        self.data = SyntheticGPTData(spec.vocab_size, spec.seq_length, train.data_seed)
        # where the model lives: the batches go there (the rank's GPU, or the CPU)
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if torch.cuda.is_available() else torch.device("cpu"))
        self.iteration = iteration
        self.consumed_samples = consumed_samples
        # inside the optimizer's update of the step after `iteration`: a failure there may
        # leave this rank's state part one iteration, part the next (loop/death_recovery)
        self.mid_update = False
        self.objs: TrainingObjects
        self.rebind(objs)

    def rebind(self, objs: TrainingObjects) -> None:
        """Point the loop at (new) model, optimizer, scheduler and schedule function."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        self.objs = objs
        L = objs.layout
        self.num_micro = num_micro_batches(self.train, L.dp)
        set_num_microbatches_calculator(self.train, L.dp, self.consumed_samples)
        self.forward_backward = get_forward_backward_func(pp_size=L.pp,
                                                          vp_size=L.vpp if L.vpp > 1 else None)
        self.p2p = P2PCommunicator(pp_group=objs.groups.pg_collection.pp, config=objs.config)
        c = objs.groups.coords()
        self._reporter = c.pp == L.pp - 1 and c.tp == 0 and c.dp_cp == 0
        self._world = objs.groups.layout_group

    def release_references(self) -> None:
        """Drop every reference to the layout's objects and communicators (after a rank
        died: a communicator's sockets close only with its last reference)."""
        self.objs = None
        self.p2p = None
        self._world = None
        self.forward_backward = None

    def step(self) -> StepResult:
        o, L = self.objs, self.objs.layout
        t0 = time.perf_counter()
        c = o.groups.coords()
        batches = self.data.micro_batches(self.consumed_samples, self.num_micro,
                                          self.train.micro_batch_size, L.dp, c.dp,
                                          self.device)
        for m in o.model:
            m.zero_grad_buffer()
        o.optimizer.zero_grad()
        losses = self.forward_backward(
            forward_step_func=_forward_step,
            data_iterator=iterators_for_chunks(batches, L.vpp),
            model=o.model,
            num_microbatches=self.num_micro,
            seq_length=self.spec.seq_length,
            micro_batch_size=self.train.micro_batch_size,
            forward_only=False,
            p2p_communicator=self.p2p,
            pg_collection=o.groups.pg_collection,
        )
        self.mid_update = True
        ok, grad_norm, _ = o.optimizer.step()
        if not ok:
            raise RuntimeError(f"optimizer step failed at iteration {self.iteration}")
        batch = self.train.running_batch_size(self.train.global_batch_size, L.dp)
        o.scheduler.step(increment=batch)
        self.iteration += 1
        self.consumed_samples += batch
        self.mid_update = False  # the state is the new iteration's, whatever fails next
        loss = self._global_loss(losses)
        lr = o.optimizer.param_groups[0]["lr"]
        return StepResult(self.iteration, loss, float(grad_norm or 0.0), lr,
                          time.perf_counter() - t0)

    def evaluate(self, first_sample: int = 10**7) -> float:
        """Forward-only LM loss of one fixed global batch (samples from `first_sample`, which
        training never reaches): comparable across steps, unlike the training loss."""
        o, L = self.objs, self.objs.layout
        c = o.groups.coords()
        batches = self.data.micro_batches(first_sample, self.num_micro,
                                          self.train.micro_batch_size, L.dp, c.dp,
                                          self.device)
        losses = self.forward_backward(
            forward_step_func=_forward_step, data_iterator=iterators_for_chunks(batches, L.vpp),
            model=o.model, num_microbatches=self.num_micro, seq_length=self.spec.seq_length,
            micro_batch_size=self.train.micro_batch_size, forward_only=True,
            p2p_communicator=self.p2p, pg_collection=o.groups.pg_collection)
        return self._global_loss(losses)

    def _global_loss(self, losses: list[dict[str, Any]]) -> float:
        """Mean loss over the global batch, identical on every rank (one small all-reduce)."""
        L = self.objs.layout
        t = torch.zeros(1, dtype=torch.float64, device=collective_device(self._world))
        c = self.objs.groups.coords()
        if c.pp == L.pp - 1 and c.tp == 0 and c.cp == 0 and losses:
            # every DP rank of the last stage contributes its micro-batch mean; one TP rank
            t[0] = sum(float(x["lm loss"]) for x in losses) / len(losses) / L.dp
        dist.all_reduce(t, group=self._world)
        return float(t[0])

    def sync_params(self) -> None:
        """Bring bf16 params in sync with the DistOpt shards (needed with overlap_param_gather)."""
        if self.train.overlap_param_gather:
            for m in self.objs.model:
                m.start_param_sync(force_sync=True)
