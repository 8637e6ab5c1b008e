"""Megatron-LM's world collectives (timers, data rebuild) confined to the ranks of the layout while others are on standby.

Between two steps, Megatron-LM's `train()` talks to the whole world in one place that runs
every `--log-interval`: its global `Timers` object (the `interval-time` barrier and the
all-gather of every timer's elapsed time for the log line, also around evaluation). A rank
that a scale-in put on standby waits inside `dynatrain_step` and never reaches those calls,
so on the ranks of a smaller layout they must run over the layout's group instead of the
world. `confine_timers(group)` does that by giving the live `Timers` object a subclass
whose barrier and gather use `group` (rows of ranks outside it stay zero, which Megatron-LM's
min/max report already skips as "no timing"); `confine_timers(None)` goes back to the world.
The object stays the same, so the reference `train()` holds in a local keeps working.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

_CONFINED: dict[type, type] = {}


def _confined_class(base: type) -> type:
    """`base` (Megatron-LM's Timers) with its world collectives on `dynatrain_group`."""
    if base in _CONFINED.values():
        return base
    if base in _CONFINED:
        return _CONFINED[base]

    class ConfinedTimers(base):  # type: ignore[misc, valid-type]
        dynatrain_group: Any = None

        def __call__(self, name: str, log_level: Optional[int] = None) -> Any:
            timer = super().__call__(name, log_level)
            if hasattr(timer, "set_barrier_group"):  # a real timer (not the dummy one)
                timer.set_barrier_group(self.dynatrain_group)
            return timer

        def _get_elapsed_time_all_ranks(self, names: list, reset: bool, barrier: bool) -> Any:
            import torch
            import torch.distributed as dist

            group = self.dynatrain_group
            if group is None:
                return super()._get_elapsed_time_all_ranks(names, reset, barrier)
            if not names:
                return None
            if barrier:
                dist.barrier(group=group)
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
            mine = torch.zeros(len(names), dtype=torch.float, device=device)
            for i, name in enumerate(names):
                if name in self._timers:
                    mine[i] = self._timers[name].elapsed(reset=reset)
            members = dist.get_process_group_ranks(group)
            parts = [torch.zeros_like(mine) for _ in members]
            dist.all_gather(parts, mine, group=group)
            out = torch.zeros((dist.get_world_size(), len(names)), dtype=torch.float,
                              device=device)
            for rank, part in zip(members, parts):
                out[rank] = part
            return out

    ConfinedTimers.__name__ = ConfinedTimers.__qualname__ = f"Confined{base.__name__}"
    _CONFINED[base] = ConfinedTimers
    return ConfinedTimers


def confine_timers(group: Any) -> None:
    """Run Megatron-LM's global timers' collectives over `group` (the layout's ranks), or
    over the world again with None. Every rank of the layout calls it after a switch."""
    if group is None and not _CONFINED:
        return  # never confined: the timers already run over the world
    from megatron.training.global_vars import get_timers

    timers = get_timers()
    if timers is None:
        return
    if group is None and type(timers) not in _CONFINED.values():
        return
    timers.__class__ = _confined_class(type(timers))
    timers.dynatrain_group = group
    for timer in timers._timers.values():  # those created before: their barrier too
        if hasattr(timer, "set_barrier_group"):
            timer.set_barrier_group(group)
    _confine_rerun_state_machine(group)


def _confine_rerun_state_machine(group: Any) -> None:
    """Megatron-LM's rerun state machine all-reduces its flags over the world at every
    step (`_reduce_any`): over `group` while ranks are on standby."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    machine.__dict__.pop("_reduce_any", None)  # the class's own again
    if group is None:
        return
    own = machine._reduce_any

    def reduce_any(value: Any) -> Any:
        with world_collectives_on(group):
            return own(value)

    machine._reduce_any = reduce_any


@contextlib.contextmanager
def world_collectives_on(group: Any) -> Iterator[None]:
    """While ranks are on standby, the world collectives Megatron-LM makes when it rebuilds
    the data iterators after a switch (the dataset builder's rank-0-first barrier, the
    broadcast of the do-train/valid/test flags) run over `group`, the layout's ranks: a
    call without a group gets `group`. Nothing changes with `group` None. Only for the
    duration of that rebuild, on the main thread, when no preparation runs beside it."""
    import torch.distributed as dist

    if group is None:
        yield
        return
    saved = {name: getattr(dist, name) for name in ("barrier", "broadcast", "all_reduce")}

    def confined(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("group") is None:
                kwargs["group"] = group
            return fn(*args, **kwargs)
        return call

    try:
        for name, fn in saved.items():
            setattr(dist, name, confined(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
