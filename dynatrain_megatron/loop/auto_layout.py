"""The job chooses its layout: the advisor's best layout for a device count.

Used by the controller for a request that names only a world size (`dynatrain request
--world N`), and with `--dynatrain-auto-layout` whenever the job's device count changes
(standby ranks at start, an admitted joiner, the survivors of a rank death). The choice is
a pure function of (model, batch, device count, constants), so every rank would reach the
same one; rank 0 decides and the controller's broadcast carries it. The note it returns
(reason + the ranking's top rows) goes into the log line and `switches.jsonl`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..advisor.calibration import Calibration, Workload
from ..advisor.enumerate import SearchSpace
from ..advisor.errors import AdvisorError
from ..advisor.suggest import Suggestion, suggest
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..mcore.train_config import TrainConfig

@dataclass(frozen=True, slots=True)
class AutoChoice:
    """The layout chosen for a device count, why, and the ranking it came from."""

    layout: Layout
    reason: str
    ranking: tuple[str, ...]  # the top rows, "layout step-s/step memory-GB", best first

    @property
    def note(self) -> str:
        return f"{self.reason}: advisor's best of {self.layout.world_size} devices is " \
               f"{self.layout} (top: {'; '.join(self.ranking)})"


class LayoutAdvisor:
    """The advisor configured for one job (its model, batch and device)."""

    def __init__(self, spec: ModelSpec, train: TrainConfig, *,
                 device_memory_bytes: Optional[int] = None,
                 calibration: Calibration = Calibration(),
                 transformer_engine: Optional[bool] = None, top: int = 3) -> None:
        if transformer_engine is None:
            from ..mcore.builders import transformer_engine_available
            transformer_engine = transformer_engine_available()
        self.spec = spec
        self.work = Workload(train.micro_batch_size, train.global_batch_size, spec.seq_length)
        self.device_memory_bytes = device_memory_bytes
        self.calibration = calibration
        self.transformer_engine = transformer_engine
        # megatron-core's local attention has no context parallelism: CP only with TE
        self.space = SearchSpace(context_parallel=transformer_engine)
        self.top = top

    def ranking(self, world: int) -> Suggestion:
        return suggest(self.spec, world, self.work, self.calibration,
                       device_memory_bytes=self.device_memory_bytes, top=self.top,
                       space=self.space, transformer_engine=self.transformer_engine)

    def best(self, world: int, reason: str) -> AutoChoice:
        """The best layout of exactly `world` devices (AdvisorError when none fits)."""
        s = self.ranking(world)
        rows = tuple(f"{r.layout} {r.step_seconds:.3g} s/step "
                     f"{r.memory_bytes_per_device / 1e9:.3g} GB" for r in s.rows)
        return AutoChoice(s.best, reason, rows)

    def best_at_most(self, n: int, reason: str) -> AutoChoice:
        """The best layout of the largest device count <= `n` that has one (survivors of
        a rank death: a count whose layouts all fail the batch or memory is skipped)."""
        errors = []
        for world in range(n, 0, -1):
            try:
                return self.best(world, reason)
            except AdvisorError as e:
                errors.append(str(e))
        raise DynatrainError(f"{reason}: no layout of {self.spec.name} fits {n} or fewer "
                             f"devices ({errors[0] if errors else 'no device'})")

    def advise(self, world: int, reason: str) -> tuple[str, str]:
        """The controller's hook: (layout string, note) for `world` devices."""
        c = self.best(world, reason)
        return str(c.layout), c.note


__all__ = ["AutoChoice", "LayoutAdvisor"]
