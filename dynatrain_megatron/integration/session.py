"""Start a job on this process: distributed init, CPU runtime, groups, objects, trainer."""
from __future__ import annotations

import datetime
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

from ..compat import prepare_runtime
from ..elastic.groups import Placement, build_groups, install
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from .builders import TrainingObjects, build_training_objects
from .train_config import TrainConfig
from .training import Trainer

log = logging.getLogger(__name__)


def init_distributed(timeout_s: float = 300.0) -> None:
    """torch.distributed from torchrun's env: NCCL with a GPU, gloo on the CPU."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def resolve_layout(spec: ModelSpec, layout: Layout | str, world_size: int) -> Layout:
    """Parse and check a layout against the model and world before any group is built."""
    lay = Layout.parse(layout, world_size) if isinstance(layout, str) else layout
    if lay.world_size != world_size:
        raise ValueError(f"layout {lay} needs {lay.world_size} ranks, world has {world_size}")
    lay.check_model(spec)
    return lay


def start_job(spec: ModelSpec, layout: Layout | str, train: TrainConfig,
              placement: Optional[Placement] = None) -> Trainer:
    """Everything up to the first training step, on every rank of the world."""
    init_distributed()
    prepare_runtime()
    lay = resolve_layout(spec, layout, dist.get_world_size())
    groups = build_groups(lay, placement)
    install(groups)
    objs = build_training_objects(spec, lay, groups, train)
    return Trainer(spec, train, objs)


def release(objs: TrainingObjects) -> None:
    """Drop a layout's objects and destroy its process groups."""
    objs.groups.destroy()
    objs.model.clear()
    objs.optimizer = None
    objs.scheduler = None
