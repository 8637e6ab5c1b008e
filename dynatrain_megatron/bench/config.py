"""The configuration of one `bench-switch` run (plain data, sent to every spawned rank)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..mcore.train_config import TrainConfig
from ..vps.errors import DynatrainError

SKIPPABLE = ("checkpoint", "refit", "raw")
PLACEMENTS = ("best", "default")
PREPARE_MODES = ("background", "inline")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What `dynatrain bench-switch` measures (the CLI checks the user's flags and builds
    it; the checks here keep a config built any other way from reaching the ranks)."""

    model_path: str  # the model's YAML, absolute: the spawned ranks load it themselves
    model_name: str
    nproc: int  # gloo ranks to spawn
    src: str  # layout A (canonical text)
    dst: str  # layout B
    train: TrainConfig
    ranks_per_node: int  # for the planner
    iters_before: int = 1  # steps at A before measuring: Adam's state must exist
    repeat: int = 3  # repetitions of each measurement (medians are reported)
    memory_budget: Optional[int] = None  # staging bytes per rank and round
    placement: str = "best"  # B's placement for our switch
    move_weights: bool = False
    link_bytes: int = 64 << 20  # buffer of the bandwidth test
    skip: tuple[str, ...] = ()  # measurements left out (SKIPPABLE)
    ckpt_dir: Optional[str] = None  # where the checkpoint path writes (None: default_ckpt_dir)
    ckpt_repeat: Optional[int] = None  # runs of the checkpoint path (None: `repeat`)
    prepare: str = "background"  # B prepared while A trains, or inside the pause
    progress: bool = True  # one stderr line per stage from rank 0

    def __post_init__(self) -> None:
        errors = []
        if self.nproc < 2:
            errors.append(f"nproc {self.nproc} < 2 (the bandwidth test pairs ranks)")
        for name in ("iters_before", "repeat", "ranks_per_node"):
            if getattr(self, name) < 1:
                errors.append(f"{name} {getattr(self, name)} < 1")
        if self.ckpt_repeat is not None and self.ckpt_repeat < 1:
            errors.append(f"ckpt_repeat {self.ckpt_repeat} < 1")
        if self.memory_budget is not None and self.memory_budget <= 0:
            errors.append(f"memory_budget {self.memory_budget} is not positive")
        if self.link_bytes < 4:
            errors.append(f"link_bytes {self.link_bytes} < 4")
        if self.placement not in PLACEMENTS:
            errors.append(f"placement {self.placement!r} not in {PLACEMENTS}")
        if self.prepare not in PREPARE_MODES:
            errors.append(f"prepare {self.prepare!r} not in {PREPARE_MODES}")
        if not set(self.skip) <= set(SKIPPABLE):
            errors.append(f"skip {list(self.skip)}: can skip only {list(SKIPPABLE)}")
        if errors:
            raise DynatrainError("bench-switch config: " + "; ".join(errors))

    @property
    def checkpoint_runs(self) -> int:
        return self.ckpt_repeat or self.repeat

    @property
    def background(self) -> bool:
        return self.prepare == "background"
