"""Layout B built by Megatron-LM itself, as a restart at B would build it.

`MegatronLMBuilder` is the builder a switch takes (DESIGN.md) inside Megatron-LM: B's model
chunks come from the job's own model provider (`pretrain_gpt.py`'s `model_provider` with its
`gpt_builder`) through Megatron-LM's `get_model` (its Float16Module and DDP wrapping), the
optimizer from `get_megatron_optimizer_config` + megatron-core's `get_megatron_optimizer`,
the scheduler from `get_optimizer_param_scheduler`, all run on a copy of the job's `args`
set to B (`transformer_config.args_at`). Whatever option the job was launched with (rotary
base and scaling, grouped experts, a dense/MoE layer pattern, MLA, multi-token prediction,
Transformer Engine, the optimizer, WSD) carries over with no description of ours.

Those builders read process-global state that is A's while B is built in the background,
so the build runs, on its thread only, inside:
* a view of megatron-core's `parallel_state` set to B's groups and Megatron-LM's `args`
  set to B (`compat.parallel_state_view`); the chunks are registered with the view, so
  their metadata is later read in it too (`adapters.live`);
* the routing of default-group `all_gather_object`s to B's own group
  (`compat.world_collectives`: the optimizer's param-group key exchange);
* private generators for any draw (`compat.private_rng`), and init methods that draw
  nothing: B's weights are filled by the switch, so its build initialises none, while
  megatron's initialisers still mark the tensor-parallel attributes of its weights.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..compat import parallel_state_view as psv
from ..compat.private_rng import private_rng
from ..compat.world_collectives import default_group_as
from ..elastic.groups import ParallelGroups, install
from ..mcore.builders import MegatronBuilder, TrainingObjects, seed_rngs
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from .transformer_config import JobIntents, args_at
from .arguments import rank_order_of
from .pipeline_split import PipelineRule

log = logging.getLogger("dynatrain")


# Megatron-LM's flag for gloo twins of the data-parallel groups, by release
_GLOO_FLAGS = ("enable_gloo_process_groups", "use_gloo_process_groups")


def _no_init(tensor: Any) -> Any:
    """An init method that leaves the tensor as allocated (the switch fills it)."""
    return tensor


def script_model_provider() -> Optional[Callable]:
    """The model provider of the running Megatron-LM script, as its `pretrain()` call passes
    it: `model_provider` bound to the script's `gpt_builder` (pretrain_gpt.py). None where
    the script has none."""
    main = sys.modules.get("__main__")
    provider = getattr(main, "model_provider", None)
    gpt_builder = getattr(main, "gpt_builder", None)
    if not callable(provider) or not callable(gpt_builder):
        return None
    return functools.partial(provider, gpt_builder)


def _call_with_supported(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` without the keywords this release's `fn` does not take."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


@dataclass(frozen=True, eq=False)
class MegatronLMBuilder(MegatronBuilder):
    """`MegatronBuilder`'s interface (`spec`/`train` for planning, `bucket_size`, `build`,
    `build_detached`, `activate`), with the objects made by Megatron-LM (module doc).

    `args`: the job's validated args at its first layout (never modified; its rank order is
    the builder's `rank_order`); `intents`: what
    Megatron-LM's validation turns on or off by layout; `model_provider`: the script's
    (`script_model_provider()`); `data_ahead`: where B's data iterators are built with a
    background build of B (`data_ahead.DataAhead`; None: at the switch)."""

    args: Any = None
    intents: Optional[JobIntents] = None
    model_provider: Optional[Callable] = None
    data_ahead: Any = None

    def __post_init__(self) -> None:
        if self.args is None or self.intents is None or not callable(self.model_provider):
            raise DynatrainError("MegatronLMBuilder needs the job's args, its intents and "
                                 "the script's model provider")
        object.__setattr__(self, "rank_order", rank_order_of(self.args))
        super().__post_init__()

    def complete_layout(self, layout: Layout) -> Layout:
        """A requested layout with the pipeline split Megatron-LM's restart at it would make
        from the job's flags (`pipeline_split.PipelineRule.complete`)."""
        return PipelineRule.from_args(self.args).complete(layout, self.spec.num_layers)

    def args_for(self, layout: Layout, groups: ParallelGroups, init_weights: bool) -> Any:
        """A copy of the job's args describing `layout` as a restart there would have them."""
        out = args_at(self.args, layout, self.spec, self.intents)
        out.world_size = layout.world_size
        out.rank = groups.rank
        if getattr(out, "train_samples", None):
            # trained by samples: a restart's scheduler is made from the samples options
            # (Megatron-LM sets train_iters from them, so the job's own args name both and
            # would make it iteration-based); B's micro-batch calculator, ramp included, is
            # set by the switch (`mcore.training.set_num_microbatches_calculator`): without
            # the ramp here, Megatron-LM's own count of the iterations does not wind the
            # process-wide calculator, which A uses meanwhile, back to the ramp's start
            out.train_iters = None
            out.rampup_batch_size = None
        if not init_weights:
            out.use_cpu_initialization = False  # megatron's CPU initialiser draws whole weights
            out.data_parallel_random_init = False  # no broadcast of weights the switch fills
            out.init_model_with_meta_device = False
        if torch.distributed.get_backend() != "gloo":
            # B's groups have no gloo twins on NCCL (they serve only Megatron-LM's legacy
            # checkpoint formats, which read the globals activate() installs)
            for name in _GLOO_FLAGS:
                if hasattr(out, name):
                    setattr(out, name, False)
        return out

    def build(self, layout: Layout, groups: ParallelGroups,
              init_weights: bool = True) -> TrainingObjects:
        """A layout made current at once (a fresh start after a rank died): the globals
        and the RNGs are set to it first, and the weights initialised as a restart would."""
        install(groups)
        seed_rngs(self.train.seed, groups)
        return self._build(layout, groups, init_weights)

    def build_detached(self, layout: Layout, groups: ParallelGroups) -> TrainingObjects:
        """B's objects without weight initialisation, in this thread's views (module doc):
        A's globals, args and RNGs are untouched, so this may run while A trains.

        B's data iterators come first, where they can be built ahead (`data_ahead`): their
        DataLoader workers are forked from this process, and after a fork every page the
        process then writes is copied once (copy-on-write faults). Forked before B's
        objects exist, B's memory is never shared with the workers, so neither the
        transfer nor B's first step pays those faults, and A's steps until the switch
        take the ones on the memory A and B both use (the allocator's heap)."""
        if self.data_ahead is not None:
            self.data_ahead.build(layout, groups, layout.vpp)
        objs = self._build(layout, groups, init_weights=False)
        _buffers_as_loaded(objs.model)
        return objs

    def build_weights_detached(self, layout: Layout, groups: ParallelGroups) -> TrainingObjects:
        """A layout's model chunks alone, for weights only (`ElasticJob.weights_to`, e.g. a
        generation layout): built by the job's model provider through Megatron-LM's
        `get_model` without DDP (a Float16Module where the job trains in bf16/fp16), no
        optimizer, no scheduler, no weight initialisation; in this thread's views, as
        `build_detached`, so A's globals, args and RNGs are untouched."""
        return self._build(layout, groups, init_weights=False, weights_only=True)

    def _build(self, layout: Layout, groups: ParallelGroups, init_weights: bool,
               weights_only: bool = False) -> TrainingObjects:
        from megatron.core.distributed import finalize_model_grads
        from megatron.training.arguments import core_transformer_config_from_args

        args = self.args_for(layout, groups, init_weights)
        view = psv.ParallelStateView(lambda target: install(groups, target=target))
        with contextlib.ExitStack() as stack:
            stack.enter_context(psv.in_view(view))
            stack.enter_context(psv.thread_args(args))
            stack.enter_context(default_group_as(groups.background))
            if not init_weights:
                stack.enter_context(private_rng())
            config = core_transformer_config_from_args(args)
            saved = _silence_init_methods(config) if not init_weights else {}
            model = self._model(config, groups, wrap_with_ddp=not weights_only)
            for name, fn in saved.items():
                setattr(config, name, fn)  # the config keeps the job's own afterwards
            for m in model:
                while m is not None:  # DDP, Float16Module, the model: any may be asked
                    psv.register(m, view)
                    m = getattr(m, "module", None)
            optimizer, scheduler = ((None, None) if weights_only
                                    else self._optimizer_and_scheduler(model))
        if not weights_only:
            config.finalize_model_grads_func = finalize_model_grads
        return TrainingObjects(layout=layout, groups=groups, config=config, model=model,
                               optimizer=optimizer, scheduler=scheduler)

    def _model(self, config: Any, groups: ParallelGroups, wrap_with_ddp: bool = True) -> list:
        from megatron.core.enums import ModelType
        from megatron.training.training import get_model

        model = _call_with_supported(get_model, self.model_provider, ModelType.encoder_or_decoder,
                                     wrap_with_ddp=wrap_with_ddp, config=config,
                                     pg_collection=groups.pg_collection)
        return model if isinstance(model, list) else [model]

    def _optimizer_and_scheduler(self, model: list) -> tuple[Any, Any]:
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.training import get_args, get_timers
        from megatron.training import training as lm_training

        args = get_args()
        made = lm_training.get_megatron_optimizer_config(args)
        config, overrides = made if isinstance(made, tuple) else (made, None)
        config.timers = get_timers()
        optimizer = _call_with_supported(
            get_megatron_optimizer, config, model, config_overrides=overrides,
            use_gloo_process_groups=any(getattr(args, n, False) for n in _GLOO_FLAGS),
            dump_param_to_param_group_map=getattr(args, "dump_param_to_param_group_map", None))
        return optimizer, lm_training.get_optimizer_param_scheduler(optimizer)


def _buffers_as_loaded(model: list) -> None:
    """Buffers in the dtype a restart's load leaves them in, before the switch writes A's
    values into them: megatron-core's router keeps its expert bias in fp32 (a bf16 model's
    conversion made it bf16; its load, save and forward turn it back), which its
    `_maintain_float32_expert_bias` does; found by feature, not by release."""
    for m in model:
        for mod in m.modules():
            keep = getattr(mod, "_maintain_float32_expert_bias", None)
            if callable(keep):
                keep()


def _silence_init_methods(config: Any) -> dict[str, Callable]:
    """Set every `*init_method` of `config` to one that draws nothing; returns the
    originals. megatron's initialisers still run (they mark the weights' tensor-parallel
    attributes, which the gradient norm and the optimizer read)."""
    saved = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        if f.name.endswith("init_method") and callable(value):
            saved[f.name] = value
            setattr(config, f.name, _no_init)
    return saved


__all__ = ("MegatronLMBuilder", "script_model_provider")
