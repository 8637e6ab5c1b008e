"""A released layout's memory, freed whoever still holds its objects.

A switch releases layout A once B has its state. Dropping our references to A's objects
is not enough to free A's memory: Megatron-LM's `pretrain()` keeps the first layout's
model, optimizer and scheduler in its locals for as long as `train()` runs, `train()`
keeps a model chunk in a loop variable, core_v0.19.0's `pretrain_gpt.py` keeps the first
layout's TransformerConfig in a module-level model config (whose `grad_scale_func` is the
optimizer's `scale_loss`), and a user's callback may capture any of them. Python's
garbage collector cannot free what is still referenced; a full collection only costs a
scan of every object of the process (hundreds of thousands with torch and megatron-core
imported; 0.2-0.4 s on a 2-core CPU, holding the interpreter lock, in a training step).

So `release_storages` frees the storages of what holds a layout's memory (its model
chunks' parameters and buffers, their gradients and `main_grad`s, the DDP parameter and
gradient buffers, the optimizers' parameters and state) in place, as megatron-core's own
`offload_grad_buffers` frees gradient buffers: each storage is resized to zero bytes.
A's objects may live on as empty shells: their tensors hold zero elements, and nothing of
ours or of Megatron-LM's reads them once the switch committed. Storages a kept layout
shares (`keep`) are never freed. `cut_callbacks` cuts the
model config's callbacks into A's objects, so that a config that outlives its layout
does not keep the optimizer and DDP wrappers (their Python objects) either.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

# the model config's callbacks into a layout's objects that Megatron-LM's `train()` and
# megatron-core set (DDP's gradient/parameter syncs, the optimizer's loss scaling)
_CALLBACKS = ("finalize_model_grads_func", "no_sync_func", "param_sync_func",
              "grad_sync_func", "grad_scale_func")
# DDP attributes that hold a model chunk's flat buffers (megatron-core's
# DistributedDataParallel): their `param_data` / `grad_data`
_DDP_BUFFER_LISTS = ("buffers", "expert_parallel_buffers")


def _bound(value: Any) -> bool:
    """A method bound to an object (not a class), or a partial or list of such."""
    if isinstance(value, functools.partial):
        return _bound(value.func) or any(_bound(a) for a in value.args)
    if isinstance(value, (list, tuple)):
        return any(_bound(v) for v in value)
    return inspect.ismethod(value) and not isinstance(value.__self__, type)


def cut_callbacks(config: Any) -> list[str]:
    """Set to None every callback of a released layout's model config into live objects
    (the `_CALLBACKS` and any other attribute holding bound methods); returns their
    names. The config may outlive its layout (module doc)."""
    cut = []
    for name, value in list(getattr(config, "__dict__", {}).items()):
        if value is not None and (name in _CALLBACKS or _bound(value)):
            setattr(config, name, None)
            cut.append(name)
    return cut


def _with_grads(p: torch.Tensor) -> Iterator[torch.Tensor]:
    yield p
    for name in ("grad", "main_grad"):
        g = getattr(p, name, None)
        if isinstance(g, torch.Tensor):
            yield g


def _module_tensors(chunk: Any) -> Iterator[torch.Tensor]:
    if not isinstance(chunk, torch.nn.Module):
        return
    # the class's methods: megatron-core's DDP sets an attribute `buffers` (a list)
    for p in torch.nn.Module.parameters(chunk):
        yield from _with_grads(p)
    yield from torch.nn.Module.buffers(chunk)
    for name in _DDP_BUFFER_LISTS:
        bufs = getattr(chunk, name, None)
        for buf in bufs if isinstance(bufs, (list, tuple)) else ():
            for attr in ("param_data", "grad_data"):
                t = getattr(buf, attr, None)
                if isinstance(t, torch.Tensor):
                    yield t


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    pending, seen = [optimizer], set()
    while pending:
        opt = pending.pop()
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        chained = getattr(opt, "chained_optimizers", None)
        if chained:  # megatron-core's ChainedOptimizer (its `optimizer` asserts one)
            pending.extend(chained)
        elif not isinstance(opt, torch.optim.Optimizer):
            pending.append(getattr(opt, "optimizer", None))  # a megatron optimizer's torch one
        if isinstance(opt, torch.optim.Optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    if isinstance(p, torch.Tensor):
                        yield from _with_grads(p)
            for state in opt.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def layout_tensors(model: Iterable[Any], optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor that holds a layout's memory (module doc), repeats included."""
    for chunk in model:
        yield from _module_tensors(chunk)
    yield from _optimizer_tensors(optimizer)


def _storages(tensors: Iterable[torch.Tensor]
              ) -> tuple[list[tuple[torch.Tensor, int]], dict[int, Any], int]:
    """(tensor, address of its storage object) for every tensor with a plain storage,
    {address: storage}, and how many tensors had none to free (tensor subclasses without
    one); meta tensors are left out."""
    pairs: list[tuple[torch.Tensor, int]] = []
    out: dict[int, Any] = {}
    unknown = 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            unknown += 1
            continue
        pairs.append((t, s._cdata))
        out.setdefault(s._cdata, s)
    return pairs, out, unknown


@dataclass(frozen=True)
class Freed:
    """What `release_storages` freed: bytes and storages, and the tensors whose storage
    it could not see or resize (their memory is left to Python's collector)."""

    bytes: int = 0
    storages: int = 0
    unknown: int = 0

    def __post_init__(self) -> None:
        if min(self.bytes, self.storages, self.unknown) < 0:
            raise ValueError(f"freed counts must be non-negative, got {self}")


def release_storages(model: Iterable[Any], optimizer: Any,
                     keep: Iterable[torch.Tensor] = ()) -> Freed:
    """Free every storage of a released layout's tensors that no tensor of `keep` uses
    (module doc): each tensor found is first made an empty tensor (so that code still
    holding it sees zero elements, never freed memory), then each storage is resized to
    zero bytes, which frees it under the views found nowhere (e.g. DDP's bucket views).
    On a GPU the caching allocator gets the memory back at once; on the CPU the C
    allocator does."""
    pairs, mine, unknown = _storages(layout_tensors(model, optimizer))
    _, kept, _ = _storages(keep)
    free = {k: s for k, s in mine.items() if k not in kept and s.nbytes() > 0}
    with torch.no_grad():
        for t, key in pairs:
            if key not in free:
                continue
            try:
                t.set_()
            except (RuntimeError, NotImplementedError, TypeError):
                unknown += 1
    nbytes = count = 0
    for s in free.values():
        size = s.nbytes()
        try:
            s.resize_(0)
        except RuntimeError:  # not resizable (memory it does not own)
            unknown += 1
            continue
        nbytes += size
        count += 1
    return Freed(nbytes, count, unknown)


__all__ = ["Freed", "cut_callbacks", "layout_tensors", "release_storages"]
