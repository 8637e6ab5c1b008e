"""Layout B's TransformerConfig as Megatron-LM itself would make it for B.

A switch builds B's model with megatron-core's `GPTModel` (our builder), but the config it
runs with comes from Megatron-LM's own `core_transformer_config_from_args`, applied to a copy
of the job's `args` set to B's layout. So whatever the job configured that does not depend
on the layout stays on after a switch as it would after a restart at B: activation
recompute, fused kernels, sequence parallelism, the attention backend, deterministic mode,
and the numerics a restart reproduces. What depends on the layout follows Megatron-LM's
validation rules for B (`JobIntents`). TP communication overlap stays off (its user
buffers were made for A's TP size).

Imports Megatron-LM (`megatron.training`) only when a config is made.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from .arguments import arg_value, args_for_layout


@dataclass(frozen=True)
class JobIntents:
    """What the job asked for that Megatron-LM's validation turns on or off by layout.

    Read from the first layout's validated `args`; where that layout did not allow a
    setting, Megatron-LM's validation turned it off, and the command line's value (noted
    at the parse, `arguments.asked_settings`; else Megatron-LM's default) stands for the
    intent, as a restart at another layout with that command line would have it.
    `sequence_parallel`: `--sequence-parallel` (kept only with TP; an MoE job with TP
    always has it). `overlap_p2p_comm`: the overlapped P2P exchange of the interleaved
    schedule (on by default; Megatron-LM requires it for VPP with pp2).
    `align_param_gather`: the overlapped parameter all-gathers aligned across the virtual
    stages (`--no-align-param-gather` turns it off; off without VPP)."""

    sequence_parallel: bool
    overlap_p2p_comm: bool
    align_param_gather: bool = True

    @classmethod
    def from_args(cls, args: Any) -> "JobIntents":
        tp = arg_value(args, "tensor_model_parallel_size", 1)
        interleaved = (arg_value(args, "virtual_pipeline_model_parallel_size") or 1) > 1
        asked = arg_value(args, "dynatrain_asked", None) or {}

        def intent(name: str, allowed: bool, default: bool) -> bool:
            return bool(arg_value(args, name, default) if allowed else asked.get(name, default))

        return cls(sequence_parallel=intent("sequence_parallel", tp > 1, False),
                   overlap_p2p_comm=intent("overlap_p2p_comm", interleaved, True),
                   align_param_gather=intent("align_param_gather", interleaved, True))

    def overlap_for(self, layout: Layout) -> bool:
        return layout.vpp > 1 and (self.overlap_p2p_comm or layout.pp == 2)


def args_at(args: Any, layout: Layout, spec: ModelSpec, intents: JobIntents) -> Any:
    """A copy of Megatron-LM's `args` describing `layout` (the job's own stay untouched)."""
    out = copy.copy(args)
    for k, v in args_for_layout(layout, spec, sequence_parallel=intents.sequence_parallel,
                                like=args).items():
        setattr(out, k, v)
    for k, v in settings_at(args, layout, intents).items():
        setattr(out, k, v)
    out.tp_comm_overlap = False
    return out


def settings_at(args: Any, layout: Layout, intents: JobIntents) -> dict[str, bool]:
    """The job's settings that Megatron-LM's validation decides by layout, at `layout`
    (for B's copy of the args, and for the job's own args once B is current: `train()`
    reads `align_param_gather` when it sets the model config's callbacks)."""
    out = {"overlap_p2p_comm": intents.overlap_for(layout)}
    if hasattr(args, "align_param_gather"):
        out["align_param_gather"] = intents.align_param_gather and layout.vpp > 1
    return out


def megatron_lm_config_factory(args: Any, spec: ModelSpec,
                               intents: JobIntents) -> Callable[[Layout, bool], Any]:
    """`config_factory` for `MegatronBuilder`: (layout, init_weights) -> Megatron-LM's
    TransformerConfig for `layout`. B's weights are not initialised (the switch fills
    them); on a GPU they are then allocated on the device directly."""

    def make(layout: Layout, init_weights: bool) -> Any:
        from megatron.training.arguments import core_transformer_config_from_args

        config = core_transformer_config_from_args(args_at(args, layout, spec, intents))
        config.perform_initialization = init_weights
        config.use_cpu_initialization = bool(
            init_weights or config.use_cpu_initialization or not torch.cuda.is_available())
        return config

    return make


__all__ = ("JobIntents", "args_at", "megatron_lm_config_factory", "settings_at")
