"""The public API attached to a running Megatron-LM job.

`elastic_job` is for code that owns its loop on top of Megatron-LM's training objects (an
RL framework's trainer: `get_model`'s chunks, Megatron-LM's optimizer and scheduler): it
returns an `api.ElasticJob` whose other layouts are built by Megatron-LM itself
(`builder.MegatronLMBuilder`), so `weights_to` a generation layout and `switch` build
exactly what a restart there would.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..transition.switch_types import SwitchOptions
from .description import describe_job

if TYPE_CHECKING:
    from ..api import ElasticJob


def elastic_job(model: list, optimizer: Any, scheduler: Any, config: Any, *,
                args: Any = None, model_provider: Optional[Callable] = None,
                options: SwitchOptions = SwitchOptions()) -> "ElasticJob":
    """The public API (`api.ElasticJob`) on a running Megatron-LM job's own objects: its
    model chunks (`get_model`'s, in DDP), its optimizer and its scheduler
    (`setup_model_and_optimizer`'s), `config` the chunks' TransformerConfig. `args`:
    Megatron-LM's validated args (default: its global ones); `model_provider`: how the
    job's model is built (default: the running script's `model_provider` bound to its
    `gpt_builder`, as `pretrain_gpt.py` passes it to `pretrain()`).

    Every rank calls it, once Megatron-LM is initialised. The live state is checked against
    the analytic layout first (a job whose state would be misread is refused here).

    Example::

        model, optimizer, scheduler = setup_model_and_optimizer(model_provider, model_type)
        job = elastic_job(model, optimizer, scheduler, get_model_config(model[0]))
        gen = job.weights_to("tp4pp1dp1")
    """
    import torch.distributed as dist

    from ..api import ElasticJob
    from ..api_types import ApiError
    from ..elastic.communicators import ensure_control_group
    from ..elastic.groups import GroupOptions, set_group_options
    from ..mcore.builders import TrainingObjects
    from .adapter import check_live_state, check_switchable, wrap_megatron_groups
    from .arguments import rank_order_of
    from .builder import MegatronLMBuilder, script_model_provider
    from .support import plans_from_metadata
    from .transformer_config import JobIntents

    if not model or optimizer is None or scheduler is None:
        raise ApiError("elastic_job needs Megatron-LM's model chunks, optimizer and scheduler "
                       "(setup_model_and_optimizer's)")
    if args is None:
        from megatron.training import get_args

        args = get_args()
    provider = model_provider or script_model_provider()
    if provider is None:
        raise ApiError("elastic_job: pass model_provider= (the running script has no "
                       "model_provider and gpt_builder)")
    check_switchable(args)
    ensure_control_group()  # the votes' CPU group
    set_group_options(GroupOptions.from_megatron_args(args))
    spec, train, layout = describe_job(args, dist.get_world_size())
    groups = wrap_megatron_groups(layout, rank_order_of(args))
    metadata = bool(plans_from_metadata(args))  # what the analytic layout does not describe
    check_live_state(spec, train, TrainingObjects(layout=layout, groups=groups, config=config,
                                                  model=list(model), optimizer=optimizer,
                                                  scheduler=scheduler), metadata)
    builder = MegatronLMBuilder(spec, train, args=copy.copy(args),
                                intents=JobIntents.from_args(args), model_provider=provider,
                                plan_from="metadata" if metadata else "analytic")
    return ElasticJob(model, optimizer, scheduler, config=config, groups=groups,
                      builder=builder, options=options)


__all__ = ("elastic_job",)
