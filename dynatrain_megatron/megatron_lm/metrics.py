"""A switch where Megatron-LM users look: its TensorBoard and W&B writers, and its timers.

`attach(hook)` (at the session's start, every rank) registers, where Megatron-LM made its
writers (`--tensorboard-dir`, `--wandb-project`: on its last rank), a sink for the hook's
metrics: every switch's stall, pause, transfer, bytes and placement at its iteration, and
the layout's axes at every step (one scalar series per axis, `dynatrain/layout/tp`, ...).
It also restarts Megatron-LM's iteration timer on a standby rank when the switch that
brings it back starts: the iteration line printed by that rank (Megatron-LM prints on its
world's last rank) then counts the switch and B's first step, not the time it stood by;
and it times B's first and steady steps on that timer, which stops for evaluation and
checkpoint saves, as Megatron-LM's own iteration time does.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

log = logging.getLogger("dynatrain")


class MegatronWriters:
    """A metric sink over Megatron-LM's TensorBoard writer and W&B run (either may be
    None); text values (the placement) go to TensorBoard as text, to W&B as they are."""

    def __init__(self, tensorboard: Any, wandb: Any) -> None:
        self.tensorboard, self.wandb = tensorboard, wandb

    def __call__(self, iteration: int, scalars: dict) -> None:
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                if isinstance(value, str):
                    self.tensorboard.add_text(tag, value, iteration)
                else:
                    self.tensorboard.add_scalar(tag, value, iteration)
        if self.wandb is not None:
            self.wandb.log(dict(scalars), iteration)

    def __repr__(self) -> str:
        return (f"MegatronWriters(tensorboard={self.tensorboard is not None}, "
                f"wandb={self.wandb is not None})")


def megatron_writers() -> Optional[MegatronWriters]:
    """Megatron-LM's writers on this rank (None where it made none)."""
    from megatron.training import global_vars

    tb = global_vars.get_tensorboard_writer()
    wb = global_vars.get_wandb_writer()
    return MegatronWriters(tb, wb) if tb is not None or wb is not None else None


def restart_iteration_timer() -> None:
    """Megatron-LM's `interval-time` timer (its iteration time and throughput) counts
    from now on (no barrier: only this rank's clock)."""
    from megatron.training import get_timers

    timers = get_timers()
    if timers is not None:
        timers("interval-time").elapsed(reset=True, barrier=False)


def training_clock() -> float:
    """Seconds Megatron-LM's `interval-time` timer has run so far: its iteration clock,
    stopped during evaluation and checkpoint saves (folds the running segment in, which
    leaves the iteration time it will print unchanged)."""
    from megatron.training import get_timers

    timer = get_timers()("interval-time")
    timer.elapsed(reset=False, barrier=False)
    return timer.active_time()


def attach(hook: Any) -> None:
    """Give `hook` (loop.hook.DynatrainHook) Megatron-LM's writers and timers."""
    writers = megatron_writers()
    if writers is not None:
        hook.stall.report.sinks.append(writers)
    hook.stall.on_return_from_standby.append(restart_iteration_timer)
    hook.stall.step_clock = training_clock


__all__ = ["MegatronWriters", "attach", "megatron_writers", "restart_iteration_timer"]
