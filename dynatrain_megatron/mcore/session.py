"""Start a job on this process: distributed init, CPU runtime, groups, objects, trainer."""
from __future__ import annotations

import datetime
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

from .. import process_env
from ..compat import prepare_runtime
from ..elastic.communicators import create_control_group, warm_up_default
from ..elastic.groups import Placement, build_groups
from ..transition.transport import drop_in_background
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from .builders import MegatronBuilder, TrainingObjects
from .train_config import TrainConfig
from .training import Trainer

log = logging.getLogger("dynatrain")


def init_distributed(timeout_s: float = 300.0) -> None:
    """torch.distributed from torchrun's env: NCCL with a GPU, gloo on the CPU."""
    if dist.is_initialized():
        return
    # before the world exists: its collectives take `group=group.WORLD` as a default
    # argument, which would otherwise hold the default group for good (elastic.rejoin)
    import torch.distributed.nn.functional  # noqa: F401
    process_env.apply()  # NCCL's error handling is read when its groups are made
    device = None
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    # not bound to the device (elastic/communicators.py says why); every communicator is
    # made eagerly all the same: this one now, each group's with the group
    dist.init_process_group("nccl" if device is not None else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s))
    warm_up_default()
    create_control_group()


def resolve_layout(spec: ModelSpec, layout: Layout | str, world_size: int) -> Layout:
    """Parse and check a layout against the model and world before any group is built."""
    lay = Layout.parse(layout, world_size) if isinstance(layout, str) else layout
    if lay.world_size != world_size:
        raise ValueError(f"layout {lay} needs {lay.world_size} ranks, world has {world_size}")
    lay.check_model(spec)
    return lay


def start_job(spec: ModelSpec, layout: Layout | str, train: TrainConfig,
              placement: Optional[Placement] = None,
              builder: Optional[MegatronBuilder] = None) -> Optional[Trainer]:
    """Everything up to the first training step, on every rank of the world.

    With a `placement` on fewer devices than the world, the other ranks are *standby*:
    they take part in building the groups (a collective) and get None, holding no
    training state until a scale-out switch brings them in. `builder`: how the objects are
    made (default `MegatronBuilder`; a Megatron-LM job passes its own)."""
    init_distributed()
    prepare_runtime()
    n = len(placement.devices) if placement is not None else dist.get_world_size()
    lay = resolve_layout(spec, layout, n)
    freeze_long_lived_objects()
    groups = build_groups(lay, placement)
    if groups.virtual_rank is None:
        groups.destroy()
        return None
    return Trainer(spec, train, (builder or MegatronBuilder(spec, train)).build(lay, groups))


_FROZEN = {"done": False}


def freeze_long_lived_objects() -> None:
    """Move everything that exists before the first layout is built (imported modules of
    torch and megatron-core: hundreds of thousands of objects) out of the cyclic garbage
    collector's reach, once per process.

    `release` must run a full collection to free a layout at once (see there); without
    this, that collection scans every object of the process on every switch, almost all
    of them long-lived. Only objects created before any layout are frozen, so every
    layout's objects stay collectable."""
    import gc

    if _FROZEN["done"]:
        return
    # the modules the builders import lazily: import them now so that they are frozen too
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.optimizer_param_scheduler  # noqa: F401

    gc.collect()
    gc.freeze()
    _FROZEN["done"] = True


def release(objs: TrainingObjects, broken: bool = False, collect_later: bool = False,
            groups_later: bool = False) -> None:
    """Drop a layout's objects, free their memory now, and destroy their process groups
    (`broken`: a rank died and the groups may be unusable; see ParallelGroups.destroy).
    `collect_later`: the caller runs the collection that frees the memory itself, later
    (`collect_released`): a full collection holds the interpreter lock for its whole
    length, so a thread would not take it out of the training thread's way; after a
    switch it can wait until B's first steps are measured (the devices held both layouts
    during the switch anyway). `groups_later`: the groups are destroyed by that
    collection too (each destroy shuts its communicator down, tens of milliseconds per
    layout on gloo); only where every rank of the layout runs that collection at the same
    step boundary, as a communicator's destroy may be collective (NCCL).

    megatron's objects reference each other in cycles (the TransformerConfig holds bound
    methods of the DDP wrappers, which hold the config), so dropping references is not
    enough: without a collection the old layout's weights, grads and optimizer state stay
    allocated until Python's GC happens to run, and repeated switches pile them up.
    """
    cfg = objs.config
    for name in ("finalize_model_grads_func", "no_sync_func", "param_sync_func", "grad_sync_func"):
        if hasattr(cfg, name):
            setattr(cfg, name, None)
    overlapped = bool(getattr(cfg, "tp_comm_overlap", False))
    later = groups_later and collect_later and not broken
    if later:
        _GROUPS_LATER.append(objs.groups)
    else:
        objs.groups.destroy(broken)
        handles = objs.groups.take_handles()
    objs.model.clear()
    objs.optimizer = None
    objs.scheduler = None
    _clear_module_caches()
    if overlapped:
        free_te_user_buffers()
    if not collect_later or broken:
        collect_released()
    if later:
        return
    if broken:
        handles.clear()  # after a death: the sockets close now, on this thread
    else:
        drop_in_background(handles)


# released layouts' groups whose destroy waits for `collect_released` (`release`)
_GROUPS_LATER: list = []


def collect_released(broken: bool = False) -> None:
    """Free what a released layout held: its process groups left to this point
    (`release(groups_later=True)`; `broken`: a rank died since, see
    ParallelGroups.destroy), its reference cycles, and what the allocator kept of their
    memory (process_env.release_free_memory)."""
    import gc

    while _GROUPS_LATER:
        groups = _GROUPS_LATER.pop(0)
        groups.destroy(broken)
        handles = groups.take_handles()
        if broken:
            handles.clear()
        else:
            drop_in_background(handles)
    gc.collect()
    process_env.release_free_memory()


def free_te_user_buffers() -> bool:
    """Destroy Transformer Engine's tp-comm-overlap user buffers (`--tp-comm-overlap`:
    Megatron-LM sets them up once, at start-up, for the first layout's TP size and
    sequence shape). A layout built by a switch runs with the overlap off, so once the
    layout that used them is released nothing will again: without this their device
    memory and communicators stayed for the whole job. True when there were some."""
    try:
        from transformer_engine.pytorch.module import base as te_base
    except ImportError:  # no TE: nothing was set up
        return False
    destroy = getattr(te_base, "destroy_ub", None)
    if destroy is None or not getattr(te_base, "_ub_communicators", None):
        return False
    destroy()
    log.info("dynatrain: Transformer Engine's tp-comm-overlap buffers of the released "
             "layout are freed (the new layout runs without the overlap)")
    return True


def _clear_module_caches() -> None:
    """megatron-core 0.16.1 memoises `RotaryEmbedding.forward` with a class-level
    `lru_cache`, whose keys hold the module itself: every layout's rotary embedding (and
    with CP > 1 its context-parallel group) would outlive the layout. The cache only
    saves recomputing a small table; emptying it frees them."""
    try:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    except ImportError:  # pragma: no cover - another megatron-core layout
        return
    clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if clear is not None:
        clear()
