"""The one answer to "can this layout run this model on this world".

Every caller that accepts a layout (the `dynatrain layout` / `request` CLI, the controller
before it accepts a request, the schedule loader at start-up, the builders, the layout
advisor) asks `layout_errors`, so they cannot disagree. It returns every violated
constraint at once (an empty list means megatron-core can build the layout), and
`validate_layout` raises them as one `LayoutError`.

Pure: no torch.distributed, no megatron import, so it runs anywhere at any scale.
"""
from __future__ import annotations

from typing import Optional

from .errors import LayoutError
from .layout import Layout
from .model_spec import ModelSpec


def layout_errors(spec: ModelSpec, layout: Layout, *, transformer_engine: bool = False,
                  device_memory_bytes: Optional[int] = None, headroom_bytes: int = 0,
                  bucket_size: Optional[int] = None) -> list[str]:
    """Every reason `layout` cannot hold `spec` (empty: it can).

    `transformer_engine`: whether megatron-core may use Transformer Engine layers (some
    axes, e.g. CP > 1, exist only with them). `device_memory_bytes`: when given, the
    layout's per-rank training state plus `headroom_bytes` must fit it.
    """
    errs = layout.model_errors(spec)
    if errs or device_memory_bytes is None:
        return errs
    from .memory import estimate_state_memory

    est = estimate_state_memory(spec, layout, bucket_size)
    if est.max_bytes + headroom_bytes > device_memory_bytes:
        errs.append(f"rank {est.worst_rank} needs {est.max_bytes / 2**30:.2f} GiB of weights, "
                    f"grads and optimizer state (+ {headroom_bytes / 2**30:.2f} GiB headroom) > "
                    f"{device_memory_bytes / 2**30:.2f} GiB per device")
    return errs


def validate_layout(spec: ModelSpec, layout: Layout, **kw) -> None:
    """Raise one LayoutError listing every reason of `layout_errors` (see there for `kw`)."""
    errs = layout_errors(spec, layout, **kw)
    if errs:
        raise LayoutError(f"layout {layout} cannot hold model {spec.name!r}: " + "; ".join(errs))
