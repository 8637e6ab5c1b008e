"""Park a live optimizer's state in host memory and bring it back, bit for bit.

A weights-only switch to a generation layout leaves the optimizer state of the training
layout where it is; when the devices need its memory meanwhile, the state is parked on the
host instead (`park_optimizer_state`) and restored before training goes on.

The unit is a tensor *storage*, not a tensor: every view megatron-core's optimizer keeps of
the state (its shards, the states its Adam holds, the fp32 masters) stays the same Python
object on the same storage, which is emptied (`resize_(0)`, its device memory freed) and
later refilled at the same size from the host copy. Storage shared with a model parameter
(an fp32 model's masters are views of its weights) is never parked: the weights stay.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..vps.errors import DynatrainError
from .live import optimizers_of, param_optimizer_states, unwrap

log = logging.getLogger("dynatrain")

_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # megatron's names: fp32 master, Adam moments


class OffloadError(DynatrainError, RuntimeError):
    """Optimizer state that cannot be parked (nothing was changed) or restored."""


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def optimizer_storages(optimizer, model: list) -> list[torch.UntypedStorage]:
    """The distinct storages of the optimizer's fp32 masters and Adam moments that no model
    parameter shares, in a fixed order (the optimizer's parameter order)."""
    weights = {p.untyped_storage().data_ptr() for m in model for p in unwrap(m).parameters()}
    out: dict[int, torch.UntypedStorage] = {}
    for opt in optimizers_of(optimizer):
        for _, _, _, states in param_optimizer_states(opt):
            for k in _STATE_KEYS:
                t = states.get(k)
                if not torch.is_tensor(t):
                    continue
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if st.nbytes() and ptr not in weights and ptr not in out:
                    out[ptr] = st
    return list(out.values())


@dataclass
class ParkedState:
    """Optimizer storages emptied on the device, their bytes held on the host. `restore()`
    once (a second call does nothing)."""

    storages: list[torch.UntypedStorage]
    host: list[torch.Tensor]
    restored: bool = field(default=False)

    @property
    def nbytes(self) -> int:
        return sum(h.numel() for h in self.host)

    def restore(self) -> None:
        """Refill every storage at its size from the host copy (bit for bit)."""
        if self.restored:
            return
        for st, h in zip(self.storages, self.host):
            st.resize_(h.numel())
            _bytes_of(st).copy_(h)
        if self.storages and self.storages[0].device.type == "cuda":
            torch.cuda.synchronize()
        self.restored = True
        self.host = []


def park_optimizer_state(optimizer, model: list) -> ParkedState:
    """Copy the optimizer's own state storages to host memory (pinned on a GPU) and free
    them on the device. Checks every storage first: one that cannot be resized raises
    `OffloadError` with nothing changed."""
    storages = optimizer_storages(optimizer, model)
    fixed = [i for i, st in enumerate(storages) if not st.resizable()]
    if fixed:
        raise OffloadError(f"{len(fixed)} of the optimizer's {len(storages)} state storages "
                           f"cannot be resized (not allocated by torch): not parked")
    pin = torch.cuda.is_available()
    host = []
    for st in storages:
        h = torch.empty(st.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
        h.copy_(_bytes_of(st))
        host.append(h)
    if pin:
        torch.cuda.synchronize()
    for st in storages:
        st.resize_(0)
    parked = ParkedState(storages, host)
    log.debug("parked %d optimizer storages (%d bytes) in host memory", len(storages),
              parked.nbytes)
    return parked


__all__ = ["OffloadError", "ParkedState", "optimizer_storages", "park_optimizer_state"]
