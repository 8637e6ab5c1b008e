"""The training state that is not a tensor of the VPS (`switch_types.Scalars`): read from
a layout's objects before a switch, written into B's after it (optimizer step, learning-rate
scheduler, grad scaler; iteration and consumed samples travel with them)."""
from __future__ import annotations

import contextlib
import copy
import logging
from typing import Iterator

import torch

from ..adapters.live import optimizers_of, read_optimizer_step, write_optimizer_step
from .switch_types import Scalars

# megatron-core logs each of the scheduler's values it takes from a state dict ("> using
# checkpoint value ..."), right for a checkpoint's load, noise at every switch
_SCHEDULER_LOGGER = "megatron.core.optimizer_param_scheduler"


@contextlib.contextmanager
def quiet(name: str) -> Iterator[None]:
    """The logger `name` passes warnings and errors only, for the duration."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _scalers(optimizer) -> list:
    """The loss scaler of each optimizer inside `optimizer` (megatron-core's ChainedOptimizer
    holds one optimizer per parameter kind, each with its own; None where it has none)."""
    return [getattr(opt, "grad_scaler", None) for opt in optimizers_of(optimizer)]


def _host_copy(state: dict) -> dict:
    """A scaler's state with its tensors (the scale) copied to the host: sent as an object
    to ranks that held none at A, and kept apart from A's, which is released."""
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in state.items()}


def read_scalars(objs, iteration: int, consumed_samples: int) -> Scalars:
    """This rank's scalars of the objects `objs` (a layout's `TrainingObjects`)."""
    step = read_optimizer_step(objs.optimizer)
    scalers = tuple(_host_copy(sc.state_dict()) if sc is not None else None
                    for sc in _scalers(objs.optimizer))
    return Scalars(iteration, consumed_samples, step, objs.scheduler.state_dict(), scalers)


def write_scalars(objs, s: Scalars) -> None:
    """Optimizer step (one per parameter, for Adam's bias correction), scheduler, and the
    loss scalers (fp16): B's i-th optimizer takes A's i-th scaler state (the same kind of
    parameters; every rank holding it agrees, its overflow check being reduced over
    them), or the first A had where A had no i-th (a rank whose stage held no experts)."""
    if s.optimizer_step is not None:
        write_optimizer_step(objs.optimizer, s.optimizer_step)
    with quiet(_SCHEDULER_LOGGER):
        objs.scheduler.load_state_dict(dict(s.scheduler))
    held = [st for st in s.grad_scalers if st is not None]
    for i, scaler in enumerate(_scalers(objs.optimizer)):
        if scaler is None or not held:
            continue
        st = s.grad_scalers[i] if i < len(s.grad_scalers) else None
        scaler.load_state_dict(_host_copy(st if st is not None else held[0]))
