"""The objects (not tensors) of a live model's sharded metadata, handled as dist_checkpointing does.

A module's `_extra_state` (Transformer Engine's FP8 scaling state and amax history, or a
user's module's own `get_extra_state`) is a `ShardedObject` in the model's
`sharded_state_dict()`, never a tensor: it has no box, only a *unique key* (its key, global
offset and shape in shards: a layer's object is one shard of the layer axis). What
dist_checkpointing does with it, and so what a switch does:
  - save: the main replica's value (replica id all zeros) is written, once per unique key,
    serialised by `torch.save` into a buffer (its torch backend);
  - load: every rank asking for a unique key gets that value, deserialised; a key the
    checkpoint does not hold fails the load (an object cannot be resharded);
  - Megatron-LM then calls the model's `load_state_dict`, which hands each object to its
    module's `set_extra_state` through the module's own load hooks.
This module says where each object sits in a model chunk (`ObjectSlot`: its state-dict key),
reads the current values and sets received ones (`set_objects`). It also holds the one way
this package asks a chunk for its sharded state dict (`chunk_sharded_state_dict`).
"""
from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch

from ..compat.parallel_state_view import view_of
from ..vps.errors import DynatrainError

log = logging.getLogger("dynatrain")


class ObjectCarryError(DynatrainError, ValueError):
    """Sharded objects cannot be carried as dist_checkpointing would load them (a key B
    asks for that A does not hold, or a value that does not arrive or does not load)."""


@dataclass(frozen=True, slots=True, order=True)
class ObjectSlot:
    """One `ShardedObject` of a rank's model chunk: `unique_key` (megatron-core's
    `ShardedObject.unique_key`), the `local_key` the chunk's state dict holds it under
    (where `load_state_dict` puts it), whether this rank holds its main replica, and
    whether it held a value (not None) when read."""

    unique_key: str
    chunk: int
    local_key: str
    main: bool
    holds_state: bool = True

    def __post_init__(self) -> None:
        if "/shard_" not in self.unique_key or not self.local_key or self.chunk < 0:
            raise ObjectCarryError(f"malformed object slot: {self!r}")


def chunk_sharded_state_dict(chunk: torch.nn.Module) -> dict:
    """`chunk.sharded_state_dict()` (an unwrapped model chunk) with the chunk's own
    data-parallel group, not megatron's global one (B is bound while megatron's globals
    still describe A), inside the view of megatron's parallel_state it was built in, if any
    (its replica ids read ranks there: B's, built by Megatron-LM in the background)."""
    pgc = getattr(chunk, "pg_collection", None)
    dp_cp = getattr(pgc, "dp_cp", None)
    with view_of(chunk), _global_dp_cp_while_unset(dp_cp):
        return chunk.sharded_state_dict(prefix="", metadata=None if dp_cp is None
                                        else {"dp_cp_group": dp_cp})


def object_slots(chunk_index: int, sd: Mapping[str, Any]) -> list[ObjectSlot]:
    """The objects of one chunk's sharded state dict (`chunk_sharded_state_dict`, before
    its factories are applied). Only top-level entries: what Megatron-LM's load hands to
    `load_state_dict` is that dict, keyed by state-dict keys."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, is_main_replica

    return sorted(ObjectSlot(v.unique_key, chunk_index, k, bool(is_main_replica(v.replica_id)),
                             v.data is not None)
                  for k, v in sd.items() if isinstance(v, ShardedObject))


def object_values(sd: Mapping[str, Any], local_keys: Iterable[str]) -> dict[str, Any]:
    """The current values (`ShardedObject.data`) of `local_keys` in a freshly read sharded
    state dict: what a save now would write."""
    return {k: sd[k].data for k in local_keys}


def serialize(obj: Any) -> bytes:
    """An object as dist_checkpointing's torch backend writes it (`torch.save`)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def deserialize(data: bytes) -> Any:
    """The reverse of `serialize`, as the backend's load reads it (the full unpickler:
    the bytes come from this job's own ranks, as a checkpoint it wrote would)."""
    return torch.load(io.BytesIO(data), weights_only=False)


def set_objects(chunk: torch.nn.Module, values: Mapping[str, Any]) -> None:
    """Hand received objects (by state-dict key) to the chunk's modules the way
    Megatron-LM's load does: `load_state_dict(strict=False)` with only these keys, so every
    module's load hooks and `set_extra_state` run; the parameters are not touched. A key
    no module takes is left, as Megatron-LM's non-strict fallback leaves it."""
    if not values:
        return
    result = chunk.load_state_dict(dict(values), strict=False)
    if result.unexpected_keys:
        log.debug("sharded objects no module took: %s", result.unexpected_keys[:4])


@contextlib.contextmanager
def _global_dp_cp_while_unset(dp_cp: Any) -> Iterator[None]:
    """megatron-core 0.16.1's tied output layer on the last pipeline stage numbers its
    replica with the *global* data-parallel rank (`language_module.py`,
    `tie_embeddings_and_output_weights_state_dict`), whatever group the metadata names.
    Between a rank death and the end of the recovery's switch no global group is set (the
    broken world's were dropped): the chunk's own group stands in for the read."""
    from megatron.core import parallel_state as ps

    if dp_cp is None or ps._DATA_PARALLEL_GROUP_WITH_CP is not None:
        yield
        return
    ps._DATA_PARALLEL_GROUP_WITH_CP = dp_cp
    try:
        yield
    finally:
        ps._DATA_PARALLEL_GROUP_WITH_CP = None


__all__ = ["ObjectCarryError", "ObjectSlot", "chunk_sharded_state_dict", "deserialize",
           "object_slots", "object_values", "serialize", "set_objects"]
