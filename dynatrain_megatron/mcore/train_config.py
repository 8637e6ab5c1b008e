"""Training hyper-parameters that do not depend on the layout (plain data)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def running_batch(batch: int, micro_batch_size: int, dp: int, decrease: bool) -> int:
    """The global batch `batch` as trained at `dp`: rounded down to a multiple of micro
    batch * DP where the job decreases it if needed (Megatron-LM's
    `--decrease-batch-size-if-needed`), else itself."""
    if not decrease:
        return batch
    per = micro_batch_size * dp
    return batch // per * per


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """What Megatron-LM takes as --micro-batch-size, --global-batch-size, --lr, ... ."""

    micro_batch_size: int = 2
    global_batch_size: int = 16
    train_iters: int = 20
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 2
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    ddp_bucket_size: Optional[int] = None  # elements; None = one bucket per buffer
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    data_seed: int = 0
    # Megatron-LM's --rampup-batch-size (start, increment, ramp samples), where the job's
    # release drives its micro-batch calculator with it: the global batch grows with the
    # consumed samples, to `global_batch_size`
    rampup_batch_size: Optional[tuple[int, int, int]] = None
    # Megatron-LM's --decrease-batch-size-if-needed: at each layout the global batch (each
    # of the ramp's too) is rounded down to a multiple of micro batch * DP, as megatron-core's
    # calculator made at that DP (a restart there) rounds it
    decrease_batch_size_if_needed: bool = False

    def __post_init__(self) -> None:
        if self.rampup_batch_size is not None:
            start, inc, samples = self.rampup_batch_size
            if (start < 1 or inc < 1 or samples < 0 or start > self.global_batch_size
                    or (self.global_batch_size - start) % inc):
                raise ValueError(f"rampup_batch_size {self.rampup_batch_size}: start and "
                                 f"increment must be >= 1 and step from start to the global "
                                 f"batch {self.global_batch_size}")
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ValueError("micro/global batch size must be >= 1")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size {self.global_batch_size} % micro_batch_size "
                             f"{self.micro_batch_size} != 0")

    def running_batch_size(self, batch: int, dp: int) -> int:
        """The global batch `batch` as trained at `dp` (`running_batch`)."""
        return running_batch(batch, self.micro_batch_size, dp,
                             self.decrease_batch_size_if_needed)

    def splits_over(self, dp: int) -> bool:
        """Whether the global batch as trained at `dp` (`running_batch_size`) is a whole
        number, at least one, of micro-batches on each of `dp` ranks."""
        per = self.micro_batch_size * dp
        batch = self.running_batch_size(self.global_batch_size, dp)
        return batch >= per and batch % per == 0

    def batch_sizes(self) -> tuple[int, ...]:
        """Every global batch size the job trains with: the ramp's, then the global one."""
        if self.rampup_batch_size is None:
            return (self.global_batch_size,)
        start, inc, _ = self.rampup_batch_size
        return tuple(range(start, self.global_batch_size, inc)) + (self.global_batch_size,)

