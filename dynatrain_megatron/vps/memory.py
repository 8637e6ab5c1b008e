"""Memory a layout needs on each rank, from the analytic layout (validation before a switch).

Per rank: the weights (params dtype), the fp32 main copy when the weights are not fp32
(for fp32 weights the distributed optimizer's main shard is a view of the weight), the two
Adam moments, and the fp32 gradient buffer (megatron keeps `main_grad` for every local
weight element). Activations are not modelled: `headroom_bytes` is the caller's margin.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .analytic import analytic_layout
from .errors import LayoutError
from .layout import Layout
from .model_spec import ModelSpec
from .naming import DTYPE_BYTES


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    layout: str
    max_bytes: int
    worst_rank: int
    mean_bytes: float


def estimate_state_memory(spec: ModelSpec, layout: Layout,
                          bucket_size: Optional[int] = None) -> MemoryEstimate:
    b = analytic_layout(spec, layout, bucket_size).bytes_per_rank()
    params = b["param"]
    grads = params // DTYPE_BYTES[spec.params_dtype] * 4
    main = b["main_param"] if spec.params_dtype != "fp32" else np.zeros_like(params)
    total = params + grads + main + b["exp_avg"] + b["exp_avg_sq"]
    worst = int(np.argmax(total))
    return MemoryEstimate(str(layout), int(total[worst]), worst, float(total.mean()))


def check_memory_fit(spec: ModelSpec, layout: Layout, device_memory_bytes: int,
                     headroom_bytes: int = 0, bucket_size: Optional[int] = None) -> MemoryEstimate:
    """Raise LayoutError when the layout's state does not fit a device's memory."""
    est = estimate_state_memory(spec, layout, bucket_size)
    if est.max_bytes + headroom_bytes > device_memory_bytes:
        raise LayoutError(
            f"layout {layout} does not fit: rank {est.worst_rank} needs {est.max_bytes / 2**30:.2f} "
            f"GiB of weights, grads and optimizer state (+ {headroom_bytes / 2**30:.2f} GiB "
            f"headroom) > {device_memory_bytes / 2**30:.2f} GiB per device")
    return est
