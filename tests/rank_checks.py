"""Checks a test's ranks share, with no import at module level (a Megatron-LM job imports
this beside the checkout's own megatron-core): agreement of a flag over the world, and the
RNG states a switch must leave as they were, the bytes a layout's tensors still hold."""
from __future__ import annotations


def all_ranks(flag: bool) -> bool:
    """True when `flag` holds on every rank (collective over the default group)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([0 if flag else 1])
    dist.all_reduce(t)
    return int(t.item()) == 0


def rng_states() -> tuple:
    """The CPU generator's state and megatron-core's tracked states, copied."""
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return (torch.get_rng_state(),
            {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()})


def same_rng(a: tuple, b: tuple) -> bool:
    import torch

    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(
        torch.equal(a[1][k], b[1][k]) for k in a[1])


def storage_bytes(tensors) -> int:
    """Bytes still allocated in the distinct storages of `tensors` (a released layout's:
    0 once it is freed in place, `mcore.held_memory`)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in tensors}
    return sum(s.nbytes() for s in storages.values())


def layout_bytes(model, optimizer) -> int:
    """`storage_bytes` of every tensor that holds a layout's memory."""
    from dynatrain_megatron.mcore.held_memory import layout_tensors

    return storage_bytes(layout_tensors(model, optimizer))
