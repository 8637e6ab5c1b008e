"""The one answer to "can this layout run this model on this world".

Every caller that accepts a layout (the `dynatrain layout` / `request` CLI, the controller
before it accepts a request, the schedule loader at start-up, the builders, the hook's
memory check, the layout advisor) asks `layout_errors`, so they cannot disagree. It
returns every violated constraint at once (an empty list means megatron-core can build
the layout and this package can switch to it), and `validate_layout` raises them as one
`LayoutError`.

The constraints, beyond the grid arithmetic `Layout` checks when it is made (tp*pp*cp and
the expert grid etp*ep*pp both divide the world, vpp needs pp > 1, doi divides both
data-parallel groups), are megatron-core 0.16.1's own:

* TP splits heads, query groups and the FFN (`layout.model_errors`); MoE with TP turns
  on sequence parallelism, which splits the sequence;
* every pipeline stage holds at least one layer, stages split evenly over virtual
  stages (`TransformerConfig`: uneven first/last stages, the middle ones even; checked
  in `layout.model_errors`);
* CP > 1 exists only with Transformer Engine's attention (the local
  `DotProductAttention` refuses it), and splits the sequence into 2*cp chunks;
* EP and expert-TP apply to experts: a dense model has neither (etp != tp there would be
  silently ignored); with EP = 1 megatron-core keeps expert weights in the dense DDP
  buffer, sharded over the dense DPxCP group, so etp must divide tp;
* the interleaved schedule (vpp > 1) runs micro-batches in groups of pp: their number
  must be a multiple of pp (`forward_backward_pipelining_with_interleaving`);
* the global batch (and each of a batch-size ramp's) splits into micro-batches over DP;
* the layout's training state fits the device (when a device size is given).

Pure: no torch.distributed, no megatron import, so it runs anywhere at any scale.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .errors import LayoutError
from .layout import Layout
from .model_spec import ModelSpec


def layout_errors(spec: ModelSpec, layout: Layout, *, transformer_engine: bool = False,
                  device_memory_bytes: Optional[int] = None, headroom_bytes: int = 0,
                  bucket_size: Optional[int] = None, global_batch_size: Optional[int] = None,
                  micro_batch_size: Optional[int] = None,
                  ramp_batch_sizes: Sequence[int] = (),
                  decrease_batch_size_if_needed: bool = False) -> list[str]:
    """Every reason `layout` cannot hold `spec` (empty: it can).

    `transformer_engine`: whether megatron-core may use Transformer Engine layers (CP > 1
    exists only with them). `device_memory_bytes`: when given, the layout's per-rank
    training state plus `headroom_bytes` must fit it. `global_batch_size` and
    `micro_batch_size`: when given, the batch must split over DP (and, with vpp, into
    groups of pp micro-batches).
    `ramp_batch_sizes`: the global batch sizes of a batch-size ramp (`--rampup-batch-size`),
    each of which must split over DP too (megatron-core's calculator checks it every step).
    `decrease_batch_size_if_needed` (Megatron-LM's flag): every batch is rounded down to a
    multiple of micro batch * DP instead, which must leave at least one micro-batch.
    """
    errs = layout.model_errors(spec)
    errs += _axis_errors(spec, layout, transformer_engine)
    errs += _batch_errors(layout, global_batch_size, micro_batch_size,
                          decrease_batch_size_if_needed)
    if micro_batch_size is not None:
        per = micro_batch_size * layout.dp
        errs += [f"the batch-size ramp's global batch {b} is not divisible by micro batch "
                 f"{micro_batch_size} * dp {layout.dp}"
                 + (" (it rounds down to none)" if decrease_batch_size_if_needed else "")
                 for b in ramp_batch_sizes
                 if (b < per if decrease_batch_size_if_needed else b % per)]
    if errs or device_memory_bytes is None:
        return errs
    from .memory import estimate_state_memory

    est = estimate_state_memory(spec, layout, bucket_size)
    if est.max_bytes + headroom_bytes > device_memory_bytes:
        errs.append(f"rank {est.worst_rank} needs {est.max_bytes / 2**30:.2f} GiB of weights, "
                    f"grads and optimizer state (+ {headroom_bytes / 2**30:.2f} GiB headroom) > "
                    f"{device_memory_bytes / 2**30:.2f} GiB per device")
    return errs


def _axis_errors(spec: ModelSpec, layout: Layout, transformer_engine: bool) -> list[str]:
    e: list[str] = []
    if layout.cp > 1 and not transformer_engine:
        e.append(f"cp{layout.cp} needs Transformer Engine's attention (megatron-core's local "
                 f"DotProductAttention refuses context_parallel_size > 1)")
    if layout.doi > 1 and not spec.distributed_optimizer:
        e.append(f"doi{layout.doi} (several distributed-optimizer instances) needs the "
                 f"distributed optimizer; this job's optimizer is not distributed")
    if not spec.is_moe:
        if layout.etp != layout.tp:
            e.append(f"etp{layout.etp} needs an MoE model (num_moe_experts is not set): expert "
                     f"tensor parallelism has no experts to split")
    elif layout.ep == 1 and layout.tp % layout.etp:
        e.append(f"with ep1, etp {layout.etp} must divide tp {layout.tp} (megatron-core keeps "
                 f"expert weights in the dense buffer, sharded over the dense DPxCP group)")
    return e


def _batch_errors(layout: Layout, gbs: Optional[int], mbs: Optional[int],
                  decrease: bool) -> list[str]:
    if gbs is None or mbs is None:
        return []
    if decrease and gbs < mbs * layout.dp:
        return [f"global batch {gbs} rounds down to no micro batch {mbs} * dp {layout.dp} "
                f"(--decrease-batch-size-if-needed)"]
    if not decrease and gbs % (mbs * layout.dp):
        return [f"global batch {gbs} is not divisible by micro batch {mbs} * dp {layout.dp}"]
    n = gbs // (mbs * layout.dp)
    if layout.vpp > 1 and n % layout.pp:
        return [f"vpp{layout.vpp}: the interleaved schedule runs micro-batches in groups of "
                f"pp {layout.pp}; {n} micro-batches (global batch {gbs} / (micro batch {mbs} * "
                f"dp {layout.dp})) is not a multiple of it"]
    return []


def validate_layout(spec: ModelSpec, layout: Layout, **kw) -> None:
    """Raise one LayoutError listing every reason of `layout_errors` (see there for `kw`)."""
    errs = layout_errors(spec, layout, **kw)
    if errs:
        raise LayoutError(f"layout {layout} cannot hold model {spec.name!r}: " + "; ".join(errs))
