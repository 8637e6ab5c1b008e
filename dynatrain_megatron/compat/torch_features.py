"""torch.distributed features the elastic layer relies on, detected, not assumed.

The project pins torch 2.13 on the CPU; the lent GPU machine runs another torch (2.11 with
CUDA 13). What differs, found by signature and attribute:
  * `new_group(sort_ranks=...)`: groups whose members keep a chosen order (a placement's
    virtual ranks). Without it every group sorts its members by global rank, so only
    rank-ordered placements can be used (`ordered_groups`).
  * `new_group(device_id=...)`: a group's NCCL communicator made with the group, eagerly.
    Without it the communicator is made at its first collective (`warm_up` does that at
    a point every rank reaches in the same order).
  * `ProcessGroup.abort()`: end a broken NCCL communicator's kernels and free it. Older
    releases expose the backend's `abort` only (`abort_group`).
  * `torch.distributed.config.use_torchcomms`: the TorchComms path, which creates groups by
    splitting (members sorted by global rank). Absent: off.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

log = logging.getLogger("dynatrain")


@functools.cache
def _new_group_params() -> frozenset[str]:
    try:
        return frozenset(inspect.signature(dist.new_group).parameters)
    except (TypeError, ValueError):
        return frozenset()


def ordered_groups() -> bool:
    """Whether `new_group` can keep a given member order (`sort_ranks=False`)."""
    return "sort_ranks" in _new_group_params() and not use_torchcomms()


def eager_groups() -> bool:
    """Whether `new_group` takes a `device_id` (communicator made with the group)."""
    return "device_id" in _new_group_params()


def process_group_abort() -> bool:
    """Whether `ProcessGroup.abort()` exists."""
    return callable(getattr(dist.ProcessGroup, "abort", None))


def use_torchcomms() -> bool:
    """Whether torch's TorchComms path is on (False where the setting does not exist)."""
    config = getattr(dist, "config", None)
    return bool(getattr(config, "use_torchcomms", False))


def new_group(ranks: Sequence[int], *, backend: Optional[str] = None,
              device: Optional[torch.device] = None, keep_order: bool = False,
              pg_options=None):
    """`dist.new_group(ranks)` with the member order kept where asked and supported
    (`keep_order`; callers check `ordered_groups()` before choosing an unsorted order),
    the communicator made eagerly on `device` where supported, and `pg_options` (NCCL's
    per-group options) where given."""
    kw: dict = {}
    if backend is not None:
        kw["backend"] = backend
    if pg_options is not None:
        kw["pg_options"] = pg_options
    params = _new_group_params()
    if device is not None and "device_id" in params:
        kw["device_id"] = device
    if "sort_ranks" in params:
        kw["sort_ranks"] = not keep_order
    elif keep_order and list(ranks) != sorted(ranks):
        raise RuntimeError(f"this torch ({torch.__version__}) cannot make a group with members "
                           f"in the order {list(ranks)[:8]}: new_group has no sort_ranks")
    return dist.new_group(list(ranks), **kw)


def abort_group_now(group) -> None:
    """Abort `group`'s communicator with whatever this torch offers (raises if none)."""
    if process_group_abort():
        group.abort()
        return
    backend = group._get_backend(torch.device("cuda"))
    backend.abort()


@contextlib.contextmanager
def nccl_group_call(group) -> Iterator[bool]:
    """The block inside one NCCL group call (ncclGroupStart/End) on `group`'s NCCL backend,
    where this torch exposes it (`_group_start`/`_group_end`, as torch's own abort of its
    whole world uses); yields whether it did."""
    try:
        backend = group._get_backend(torch.device("cuda"))
    except Exception:  # noqa: BLE001 - no NCCL backend on this group or this torch
        backend = None
    start, end = getattr(backend, "_group_start", None), getattr(backend, "_group_end", None)
    if not (callable(start) and callable(end)):
        yield False
        return
    start()
    try:
        yield True
    finally:
        end()


def report() -> dict[str, object]:
    """What this torch offers (the GPU check's preflight prints it)."""
    nccl = None
    if dist.is_available() and torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL
            nccl = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            "new_group(sort_ranks=)": "sort_ranks" in _new_group_params(),
            "new_group(device_id=)": eager_groups(),
            "ProcessGroup.abort": process_group_abort(),
            "distributed.config.use_torchcomms": hasattr(getattr(dist, "config", None),
                                                         "use_torchcomms"),
            "torchcomms_on": use_torchcomms()}
