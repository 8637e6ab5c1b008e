"""The constants of the advisor's memory and step-time models, and the workload.

Every field is a `dynatrain suggest` flag; the defaults describe an H100/H200-class node
(README, "Choosing the layout", gives each default's source):
  * `achieved_tflops`: 400 TFLOP/s of bf16 matmul per GPU actually achieved in training
    (H100 SXM peak dense bf16 is 989 TFLOP/s; Megatron-LM reports 41-47% MFU at scale);
  * `intra_node_gbps` / `inter_node_gbps`: NVLink 450 GB/s and a 400 Gb/s NIC (50 GB/s)
    per device and direction, the link model of `dynatrain plan` (routing/cost.py);
  * `ranks_per_node`: 8 GPUs per node;
  * `collective_latency_us`: fixed cost of one collective step (ring hop);
  * `grad_bytes`: 4: Megatron-LM accumulates and reduces gradients in fp32 for bf16
    training unless `--grad-reduce-in-bf16`;
  * `activation_bytes`: 2 (bf16 activations), `flash_attention`: the s^2 attention-score
    terms are not stored (fused / flash attention, as Transformer Engine does);
  * `sequence_parallel`: TP > 1 uses sequence parallelism (Megatron-LM's recommended
    setting, required with MoE);
  * `reserve_bytes`: memory per device kept free for the CUDA context, NCCL buffers,
    allocator fragmentation and temporaries (6 GiB);
  * `dp_overlap`: fraction of the data-parallel gradient reduce-scatter and parameter
    all-gather hidden behind compute (0 = none, the conservative default);
  * `step_scale`: multiplies every estimated step time (1; `--measured-step` or a
    calibration file fits it from step times measured on the user's cluster).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


from ..safe_files import read_yaml
from .errors import AdvisorError

GiB = 2 ** 30


@dataclass(frozen=True, slots=True)
class Calibration:
    """Constants of the memory and step-time models (module doc)."""

    achieved_tflops: float = 400.0
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    ranks_per_node: int = 8
    collective_latency_us: float = 10.0
    grad_bytes: int = 4
    activation_bytes: int = 2
    flash_attention: bool = True
    sequence_parallel: bool = True
    reserve_bytes: int = 6 * GiB
    dp_overlap: float = 0.0
    step_scale: float = 1.0

    def __post_init__(self) -> None:
        for f in ("achieved_tflops", "intra_node_gbps", "inter_node_gbps", "step_scale"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                    and math.isfinite(v)):
                raise AdvisorError(f"calibration: {f} must be a positive number, got {v!r}")
        for f in ("ranks_per_node", "grad_bytes", "activation_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise AdvisorError(f"calibration: {f} must be a positive int, got {v!r}")
        if not isinstance(self.reserve_bytes, int) or self.reserve_bytes < 0:
            raise AdvisorError(f"calibration: reserve_bytes must be an int >= 0, got "
                               f"{self.reserve_bytes!r}")
        if not (isinstance(self.collective_latency_us, (int, float))
                and self.collective_latency_us >= 0):
            raise AdvisorError(f"calibration: collective_latency_us must be >= 0, got "
                               f"{self.collective_latency_us!r}")
        if not (isinstance(self.dp_overlap, (int, float)) and 0 <= self.dp_overlap <= 1):
            raise AdvisorError(f"calibration: dp_overlap must be in [0, 1], got "
                               f"{self.dp_overlap!r}")
        for f in ("flash_attention", "sequence_parallel"):
            if not isinstance(getattr(self, f), bool):
                raise AdvisorError(f"calibration: {f} must be true or false, got "
                                   f"{getattr(self, f)!r}")

    def replace(self, **kw: Any) -> "Calibration":
        return dataclasses.replace(self, **kw)

    def link_gbps(self, span: int) -> float:
        """Bandwidth of a collective whose members are `span` consecutive ranks apart at
        most: NVLink when they sit on one node, else the NIC."""
        return self.intra_node_gbps if span <= self.ranks_per_node else self.inter_node_gbps


@dataclass(frozen=True, slots=True)
class Workload:
    """What one training step processes: Megatron-LM's --micro-batch-size,
    --global-batch-size, --seq-length."""

    micro_batch_size: int
    global_batch_size: int
    seq_length: int

    def __post_init__(self) -> None:
        for f in ("micro_batch_size", "global_batch_size", "seq_length"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise AdvisorError(f"workload: {f} must be a positive int, got {v!r}")
        if self.global_batch_size % self.micro_batch_size:
            raise AdvisorError(f"workload: global_batch_size {self.global_batch_size} is not a "
                               f"multiple of micro_batch_size {self.micro_batch_size}")

    def num_microbatches(self, dp: int) -> Optional[int]:
        """Micro-batches per step and data-parallel rank; None when the global batch does
        not split over `dp` replicas (megatron refuses that layout for this workload)."""
        per = self.micro_batch_size * dp
        if self.global_batch_size % per:
            return None
        return self.global_batch_size // per


@dataclass(frozen=True, slots=True)
class Measurement:
    """A step time measured on the user's cluster for one layout."""

    layout: str
    step_seconds: float

    def __post_init__(self) -> None:
        if not isinstance(self.layout, str) or not self.layout:
            raise AdvisorError(f"measured step: layout must be a layout string, got "
                               f"{self.layout!r}")
        v = self.step_seconds
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise AdvisorError(f"measured step {self.layout}: step_seconds must be a positive "
                               f"number, got {v!r}")

    @classmethod
    def parse(cls, text: str) -> "Measurement":
        """`LAYOUT=SECONDS`, e.g. `tp8pp4dp4=5.2`."""
        lay, sep, sec = str(text).partition("=")
        if not sep:
            raise AdvisorError(f"--measured-step {text!r}: expected LAYOUT=SECONDS")
        try:
            val = float(sec)
        except ValueError:
            raise AdvisorError(f"--measured-step {text!r}: step_seconds {sec!r} is not a "
                               f"number") from None
        return cls(lay.strip(), val)


def load_calibration(path: str | Path, base: Calibration = Calibration()
                     ) -> tuple[Calibration, tuple[Measurement, ...]]:
    """Read a YAML/JSON calibration file: any `Calibration` field, plus `measured`: a list
    of `{layout, step_seconds}`. Unknown keys and bad values are errors naming the field."""
    p = Path(path)
    data = read_yaml(p, "calibration file", AdvisorError)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise AdvisorError(f"calibration file {str(p)!r}: expected a mapping of fields, got "
                           f"{type(data).__name__}")
    known = {f.name for f in dataclasses.fields(Calibration)}
    bad = sorted(k for k in data if k not in known and k != "measured")
    if bad:
        raise AdvisorError(f"calibration file {str(p)!r}: unknown field(s) {bad}; known: "
                           f"{sorted(known | {'measured'})}")
    meas_raw = data.pop("measured", []) or []
    if not isinstance(meas_raw, list):
        raise AdvisorError(f"calibration file {str(p)!r}: field 'measured' must be a list of "
                           f"{{layout, step_seconds}}")
    meas = []
    for i, m in enumerate(meas_raw):
        if not isinstance(m, dict) or set(m) != {"layout", "step_seconds"}:
            raise AdvisorError(f"calibration file {str(p)!r}: measured[{i}] must have exactly "
                               f"the fields layout and step_seconds, got {m!r}")
        meas.append(Measurement(m["layout"], m["step_seconds"]))
    try:
        cal = base.replace(**data)
    except AdvisorError as e:
        raise AdvisorError(f"calibration file {str(p)!r}: {e}") from None
    return cal, tuple(meas)


def describe(cal: Calibration) -> dict[str, Any]:
    """Every constant, JSON-ready (printed beside the figures)."""
    return dataclasses.asdict(cal)


__all__ = ["Calibration", "Workload", "Measurement", "load_calibration", "describe", "GiB"]
