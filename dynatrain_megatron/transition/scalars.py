"""The training state that is not a tensor of the VPS (`switch_types.Scalars`): read from
a layout's objects before a switch, written into B's after it (optimizer step, learning-rate
scheduler, grad scaler; iteration and consumed samples travel with them)."""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

from ..adapters.live import read_optimizer_step, write_optimizer_step
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


def read_scalars(objs, iteration: int, consumed_samples: int) -> Scalars:
    """This rank's scalars of the objects `objs` (a layout's `TrainingObjects`)."""
    step = read_optimizer_step(objs.optimizer)
    scaler = getattr(objs.optimizer, "grad_scaler", None)
    return Scalars(iteration, consumed_samples, step, objs.scheduler.state_dict(),
                   scaler.state_dict() if scaler is not None else None)


def write_scalars(objs, s: Scalars) -> None:
    """Optimizer step (one per parameter, for Adam's bias correction), scheduler, scaler."""
    if s.optimizer_step is not None:
        write_optimizer_step(objs.optimizer, s.optimizer_step)
    with quiet(_SCHEDULER_LOGGER):
        objs.scheduler.load_state_dict(dict(s.scheduler))
    scaler = getattr(objs.optimizer, "grad_scaler", None)
    if scaler is not None and s.grad_scaler is not None:
        scaler.load_state_dict(s.grad_scaler)
