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
from ..elastic.communicators import (control_group, create_control_group, everyone_ok,
                                      warm_up_default)
from ..elastic.groups import Placement, build_groups
from ..transition.transport import drop_in_background
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from .builders import MegatronBuilder, TrainingObjects
from .held_memory import cut_callbacks, layout_tensors, release_storages
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
    # every rank has connected every group before a standby rank destroys them: gloo's
    # full-mesh set-up of a peer still connecting fails when the other end closes first
    everyone_ok(True, control_group())
    if groups.virtual_rank is None:
        groups.destroy()
        return None
    return Trainer(spec, train, (builder or MegatronBuilder(spec, train)).build(lay, groups))


_FROZEN = {"done": False}


def freeze_long_lived_objects() -> None:
    """Move everything that exists before the first layout is built (imported modules of
    torch and megatron-core: hundreds of thousands of objects) out of the cyclic garbage
    collector's reach, once per process.

    A full collection (`collect_released`, where `release` could not free a layout's
    tensors in place, and Python's own) would otherwise scan every object of the process,
    almost all of them long-lived. Called before the first layout is built (`start_job`,
    a joining process before it asks in), so every layout's objects stay collectable (a
    dead layout's communicators close only when its objects are collected). Not in a
    Megatron-LM job, which builds its first layout itself, nor inside a switch: a rank back
    from standby ran it in the switch that brought it back, and every other rank waited
    for it (0.17-0.2 s of votes in `make run`'s scale-out)."""
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
            groups_later: bool = False, free: bool = False,
            keep: Optional[TrainingObjects] = None) -> None:
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

    Dropping references is not enough to free the memory: megatron's objects reference
    each other in cycles, and Megatron-LM's own frames and module globals keep the first
    layout's objects for the whole run (`held_memory`). The model config's callbacks into
    the layout are cut here, and with `free` (a switch that committed: nothing reads A's
    tensors any more) the layout's weights, grads and optimizer state are freed in place,
    except storages `keep` (the layout that goes on) uses; the collection then only runs
    where a storage could not be freed so (`collect_released`). Without `free` (the
    caller may still read the tensors, e.g. a death's recovery from them) the collection
    frees what nothing references any more.
    """
    cfg = objs.config
    if keep is None or keep.config is not cfg:  # a config B goes on with keeps its own
        cut_callbacks(cfg)
    if not free:
        _UNFREED[0] += 1
    else:
        kept = (layout_tensors(keep.model, keep.optimizer) if keep is not None else ())
        freed = release_storages(objs.model, objs.optimizer, keep=kept)
        _UNFREED[0] += freed.unknown
        log.debug("dynatrain: released %s: %.1f MB in %d storages freed", objs.layout,
                  freed.bytes / 1e6, freed.storages)
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
# released layouts (or tensors of them) whose memory `release` did not free itself since
# the last collection: the collection runs while this is not 0
_UNFREED = [0]


def collect_released(broken: bool = False) -> None:
    """Free what a released layout held: its process groups left to this point
    (`release(groups_later=True)`; `broken`: a rank died since, see
    ParallelGroups.destroy), its reference cycles where `release` could not free a
    tensor's storage itself, and what the allocator kept of that memory
    (process_env.release_free_memory)."""
    import gc

    while _GROUPS_LATER:
        groups = _GROUPS_LATER.pop(0)
        groups.destroy(broken)
        handles = groups.take_handles()
        if broken:
            handles.clear()
        else:
            drop_in_background(handles)
    if _UNFREED[0]:
        gc.collect()
        _UNFREED[0] = 0
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
