"""Build megatron-core GPT/MoE model chunks, DDP, DistributedOptimizer and LR scheduler.

One function per object, all taking the layout's explicit `ParallelGroups`, so a switch can
build layout B's objects while layout A's are still alive. `build_training_objects` is the
*builder* the switch takes (DESIGN.md): everything below `mcore` calls it through a
callable and never imports this module.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..compat.world_collectives import default_group_as
from ..vps.errors import LayoutError
from ..vps.layout import Layout
from ..vps.placement import DEFAULT_ORDER, RANK_ORDERS
from ..vps.model_spec import ModelSpec
from ..vps.validate import validate_layout
from ..elastic.groups import ParallelGroups
from .train_config import TrainConfig

log = logging.getLogger("dynatrain")

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@functools.cache
def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def make_transformer_config(spec: ModelSpec, layout: Layout, init_weights: bool = True):
    """TransformerConfig for `spec` at `layout` (CPU-safe fusions off, dropout off).

    Weights that are initialised are drawn whole on the CPU then split (the same seed gives
    the same model at every TP/EP, which makes layouts comparable). A switch's layout B is
    built without initialisation: on a GPU its parameters are then allocated on the device
    directly (no host allocation, no copy from pageable memory)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if layout.split:
        raise LayoutError(f"layout {layout}: a per-chunk split is a Megatron-LM job's "
                          f"(megatron_lm/pipeline_split.py); this builder splits by ppf/ppl")
    dtype = _TORCH_DTYPES[spec.params_dtype]
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=layout.ppf or None,
        num_layers_in_last_pipeline_stage=layout.ppl or None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=spec.is_moe and layout.tp > 1,
        use_cpu_initialization=init_weights or not torch.cuda.is_available(),
        gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu,
        normalization=spec.normalization,
        add_bias_linear=spec.add_bias_linear,
        qk_layernorm=spec.qk_layernorm,
        init_method_std=spec.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=spec.params_dtype == "bf16",
        fp16=spec.params_dtype == "fp16",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        attention_softmax_in_fp32=spec.attention_softmax_in_fp32,
    )
    if spec.is_moe:
        kw.update(
            num_moe_experts=spec.num_moe_experts,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_topk=spec.moe_router_topk,
            moe_token_dispatcher_type=spec.moe_token_dispatcher_type,
            moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
            moe_grouped_gemm=spec.moe_grouped_gemm,
            moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        )
    return TransformerConfig(**kw)


def with_layer_implementation(spec: ModelSpec) -> ModelSpec:
    """`spec` built with Transformer Engine's layers where TE is usable (a GPU with TE
    installed), megatron's local layers otherwise. The choice is part of the spec because
    the analytic layout must name and order the parameters as the built model does. Grouped
    experts keep the local layers: the planning layout describes megatron-core's own
    GroupedMLP, not Transformer Engine's grouped linear layers."""
    return spec.replace(transformer_engine=transformer_engine_available()
                        and not spec.moe_grouped_gemm)


def layer_spec(spec: ModelSpec):
    """Transformer Engine's spec when `spec.transformer_engine`, megatron's local one
    otherwise (`with_layer_implementation` chooses)."""
    from megatron.core.models.gpt import gpt_layer_specs as s

    experts = spec.num_moe_experts
    if spec.transformer_engine:
        if not transformer_engine_available():
            from ..vps.errors import ModelSpecError

            raise ModelSpecError(f"model {spec.name!r} asks for Transformer Engine layers, "
                                 f"which are not usable here (TE not installed or no GPU)")
        return s.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_layernorm)
    return s.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=spec.moe_grouped_gemm,
                                      qk_layernorm=spec.qk_layernorm,
                                      normalization=spec.normalization)


def seed_torch(seed: int) -> None:
    """`torch.manual_seed` for the generators a Megatron job draws from: the CPU's and,
    where CUDA is up, every GPU's. Without its lazy seeding of devices the process never
    uses: for an uninitialised XPU or MTIA, `torch.manual_seed` records the caller's
    stack, which reads every source file on it from disk (up to 30 ms in a switch's
    pause on a loaded machine, `activate`)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def seed_rngs(seed: int, groups: ParallelGroups) -> None:
    """Megatron-LM's `_set_random_seed`: seed + 100*pp_rank, then the TP/EP tracker states.

    Deterministic per rank coordinate, so a switch can re-derive them for the new layout.
    """
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    c = groups.coords()
    s = seed + 100 * c.pp
    random.seed(s)
    np.random.seed(s)
    seed_torch(s)
    model_parallel_cuda_manual_seed(s, tp_rank=c.tp, ep_rank=c.ep, etp_rank=c.etp,
                                    force_reset_rng=True)


def build_model_chunks(spec: ModelSpec, layout: Layout, groups: ParallelGroups, config,
                       init_weights: bool = True) -> list[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage on this rank (Float16Module for bf16/fp16)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    c = groups.coords()
    config.perform_initialization = init_weights
    chunks = []
    for v in range(layout.vpp):
        m = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(spec),
            vocab_size=spec.padded_vocab_size(layout.tp),
            max_sequence_length=spec.seq_length,
            pre_process=(c.pp == 0 and v == 0),
            post_process=(c.pp == layout.pp - 1 and v == layout.vpp - 1),
            share_embeddings_and_output_weights=spec.tied,
            position_embedding_type=spec.position_embedding_type,
            pg_collection=groups.pg_collection,
            vp_stage=v if layout.vpp > 1 else None,
        )
        if torch.cuda.is_available():  # what CPU initialisation left on the host (as
            m.cuda(torch.cuda.current_device())  # Megatron-LM's get_model does)
        if config.bf16 or config.fp16:
            m = Float16Module(config, m)
        chunks.append(m)
    return chunks


def bucket_size_of(train: TrainConfig, layout: Layout) -> Optional[int]:
    """The bucket size megatron's DDP really uses (None: one bucket per buffer); the
    analytic layout needs this resolved value, not the flag."""
    from ..vps.distopt import resolve_bucket_size

    return resolve_bucket_size(train.ddp_bucket_size, train.overlap_grad_reduce, layout.dp)


def validator_options(train: TrainConfig, layout: Layout,
                      device_memory_bytes: Optional[int] = None) -> dict[str, Any]:
    """The keywords of the one validator (`vps.validate.layout_errors`) for this job's
    builders at `layout`: Transformer Engine, the batch, the bucket size, the device."""
    return dict(transformer_engine=transformer_engine_available(),
                global_batch_size=train.global_batch_size,
                micro_batch_size=train.micro_batch_size,
                ramp_batch_sizes=train.batch_sizes()[:-1],
                decrease_batch_size_if_needed=train.decrease_batch_size_if_needed,
                device_memory_bytes=device_memory_bytes,
                bucket_size=bucket_size_of(train, layout))


def restore_tensor_parallel_attributes(chunks: list[torch.nn.Module], spec: ModelSpec) -> None:
    """megatron-core sets `tensor_model_parallel` / `partition_dim` / `partition_stride` on
    TP-split weights only inside its weight *initialisation*; built without it (a switch
    fills the weights itself) they would look TP-replicated, and the grad norm would drop
    them on all TP ranks but one. Set them as the initialiser would have."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding,
                                                      set_tensor_model_parallel_attributes)

    def mark(t: torch.Tensor, dim: int, stride: int) -> None:
        # biases are marked at construction already (only weights wait for the initialiser)
        if not hasattr(t, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(t, True, dim, stride)

    for chunk in chunks:
        for name, m in chunk.named_modules():
            if isinstance(m, VocabParallelEmbedding):
                mark(m.weight, 0, 1)
            elif isinstance(m, ColumnParallelLinear):
                stride = 2 if spec.swiglu and name.endswith("linear_fc1") else 1
                if m.weight is not None:
                    mark(m.weight, 0, stride)
                if getattr(m, "bias", None) is not None:
                    mark(m.bias, 0, stride)
            elif isinstance(m, RowParallelLinear):
                mark(m.weight, 1, 1)


def wrap_ddp(chunks: list[torch.nn.Module], config, train: TrainConfig, groups: ParallelGroups,
             distributed_optimizer: bool = True):
    """DDP per chunk. Like Megatron-LM, only chunk 0 is bucketed (others: one bucket).
    `distributed_optimizer`: the buffers are laid out for megatron's distributed optimizer
    (`ModelSpec.distributed_optimizer`), else for a plain one (gradients all-reduced)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=train.overlap_grad_reduce,
        overlap_param_gather=train.overlap_param_gather,
        use_distributed_optimizer=distributed_optimizer,
        num_distributed_optimizer_instances=groups.layout.doi,
        check_for_nan_in_grad=False,
        bucket_size=train.ddp_bucket_size,
    )
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=m,
                                    disable_bucketing=(i > 0), pg_collection=groups.pg_collection)
            for i, m in enumerate(chunks)]


def build_optimizer(model: list, spec: ModelSpec, train: TrainConfig, groups: ParallelGroups):
    """Adam, as a ChainedOptimizer (dense and, for MoE, expert) of megatron's
    DistributedOptimizers, or of its plain optimizers when `spec.distributed_optimizer` is
    off (Float16OptimizerWithFloat16Params for bf16/fp16, FP32Optimizer for fp32)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(
        optimizer="adam", lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps,
        clip_grad=train.clip_grad, bf16=spec.params_dtype == "bf16",
        fp16=spec.params_dtype == "fp16", params_dtype=_TORCH_DTYPES[spec.params_dtype],
        use_distributed_optimizer=spec.distributed_optimizer)
    # megatron refuses gloo twins with an explicit pg_collection; they only serve
    # checkpoint code paths, which find the gloo globals set by `install` on CPU
    with default_group_as(groups.background):
        return get_megatron_optimizer(cfg, model, use_gloo_process_groups=False,
                                      pg_collection=groups.pg_collection)


def build_scheduler(optimizer, train: TrainConfig):
    """Megatron's OptimizerParamScheduler; steps are counted in samples, as Megatron-LM does."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = train.global_batch_size
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=train.lr, min_lr=train.min_lr,
        lr_warmup_steps=train.lr_warmup_iters * gbs, lr_decay_steps=train.train_iters * gbs,
        lr_decay_style=train.lr_decay_style, start_wd=train.weight_decay,
        end_wd=train.weight_decay, wd_incr_steps=train.train_iters * gbs,
        wd_incr_style="constant")


@dataclass
class TrainingObjects:
    """What a builder returns for one layout on this rank (live objects, so not frozen)."""

    layout: Layout
    groups: ParallelGroups
    config: Any  # TransformerConfig
    model: list  # DDP-wrapped chunks
    optimizer: Any
    scheduler: Any


ConfigFactory = Callable[[Layout, bool], Any]


def build_training_objects(spec: ModelSpec, layout: Layout, groups: ParallelGroups,
                           train: TrainConfig, init_weights: bool = True,
                           config_factory: Optional[ConfigFactory] = None) -> TrainingObjects:
    """Model chunks, DDP, optimizer and scheduler for `layout` on `groups` (a member rank).

    `config_factory(layout, init_weights)` gives the TransformerConfig (default:
    `make_transformer_config`); a Megatron-LM job passes one that builds Megatron-LM's own
    config for the layout, so B keeps the job's fusions, recompute and sequence parallelism.

    Touches neither the RNGs nor megatron's globals: the caller seeds and installs
    (`MegatronBuilder.build` before, a switch's `activate` at its commit), so the objects
    can be built while another layout trains."""
    from megatron.core.distributed import finalize_model_grads

    validate_layout(spec, layout, **validator_options(train, layout))
    if config_factory is None:
        config = make_transformer_config(spec, layout, init_weights=init_weights)
    else:
        config = config_factory(layout, init_weights)
    chunks = build_model_chunks(spec, layout, groups, config, init_weights=init_weights)
    if not init_weights:
        restore_tensor_parallel_attributes(chunks, spec)
    model = wrap_ddp(chunks, config, train, groups, spec.distributed_optimizer)
    optimizer = build_optimizer(model, spec, train, groups)
    scheduler = build_scheduler(optimizer, train)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    if train.overlap_param_gather:
        config.param_sync_func = ([m.start_param_sync for m in model] if len(model) > 1
                                  else model[0].start_param_sync)
    return TrainingObjects(layout=layout, groups=groups, config=config, model=model,
                           optimizer=optimizer, scheduler=scheduler)


@dataclass(frozen=True)
class MegatronBuilder:
    """The builder a switch takes (DESIGN.md): objects for any layout on given groups.

    `transition` calls it through this small interface and never imports megatron
    builders itself; Megatron-LM users can supply a wrapper of `setup_model_and_optimizer`.
    `plan_from`: how switches with it are planned, from the analytic layout or from every
    rank's live metadata ("metadata", for models the analytic layout does not describe:
    `transition.metadata_exchange`). `unlike_analytic`: key prefixes of tensors the analytic
    layout names but the models shape otherwise (a heterogeneous model's layers), left out
    of the check of live against analytic fragments; only with plans from the metadata.
    """

    spec: ModelSpec
    train: TrainConfig
    config_factory: Optional[ConfigFactory] = None  # see build_training_objects
    plan_from: str = "analytic"
    unlike_analytic: tuple[str, ...] = ()
    # megatron-core's rank order of the job (`vps.placement.RANK_ORDERS`): B's placement
    # under the "default" policy is the one a restart at B would number its ranks in
    rank_order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        if self.rank_order not in RANK_ORDERS:
            raise ValueError(f"rank_order must be one of {RANK_ORDERS}, got {self.rank_order!r}")
        if self.plan_from not in ("analytic", "metadata"):
            raise ValueError(f"plan_from must be 'analytic' or 'metadata', got "
                             f"{self.plan_from!r}")
        if self.unlike_analytic and self.plan_from != "metadata":
            raise ValueError(f"unlike_analytic {self.unlike_analytic} needs plans from the "
                             f"live metadata (plan_from='metadata')")

    def bucket_size(self, layout: Layout) -> Optional[int]:
        return bucket_size_of(self.train, layout)

    def complete_layout(self, layout: Layout) -> Layout:
        """A requested layout as this builder would build it: unchanged here (the Layout's
        own ppf/ppl split); a Megatron-LM job's adds the split its flags make."""
        return layout

    def build(self, layout: Layout, groups: ParallelGroups, init_weights: bool = True) -> TrainingObjects:
        """The objects of a layout made current at once (a job's first layout)."""
        from ..elastic.groups import install

        # megatron reads some ranks from parallel_state globals outside pg_collection (the
        # data-parallel rank of a checkpoint's sharded state dict): point them at `groups`
        install(groups)
        seed_rngs(self.train.seed, groups)  # the weights draw from them
        return build_training_objects(self.spec, layout, groups, self.train,
                                      init_weights=init_weights,
                                      config_factory=self.config_factory)

    def build_detached(self, layout: Layout, groups: ParallelGroups) -> TrainingObjects:
        """Layout B's objects for a switch (no weight initialisation), without touching what
        layout A trains with: megatron's parallel_state globals and the RNGs stay A's (every
        megatron-core 0.16.1 constructor we use takes its groups from `pg_collection`), so
        this may run in a background thread while A trains. `activate` makes them current
        at the commit. B's thread draws from no generator of the process and forks no RNG
        tracker state (`compat.private_rng`): Transformer Engine's construction would
        otherwise fork the process-wide tracker while A's dropout draws from it."""
        from ..compat.private_rng import private_rng

        with private_rng():
            return build_training_objects(self.spec, layout, groups, self.train,
                                          init_weights=False, config_factory=self.config_factory)

    def build_weights_detached(self, layout: Layout, groups: ParallelGroups) -> TrainingObjects:
        """A layout's model chunks alone, for weights only (a generation layout): no DDP
        wrapper, no optimizer, no scheduler, no weight initialisation; like
        `build_detached`, touches neither megatron's globals nor the RNGs."""
        from ..compat.private_rng import private_rng

        with private_rng():
            validate_layout(self.spec, layout, **validator_options(self.train, layout))
            config = (make_transformer_config(self.spec, layout, init_weights=False)
                      if self.config_factory is None else self.config_factory(layout, False))
            chunks = build_model_chunks(self.spec, layout, groups, config, init_weights=False)
            restore_tensor_parallel_attributes(chunks, self.spec)
        return TrainingObjects(layout=layout, groups=groups, config=config, model=chunks,
                               optimizer=None, scheduler=None)

    def activate(self, objs: TrainingObjects) -> None:
        """Make `objs` the current layout: megatron's globals point at its groups and the
        RNGs are seeded for this rank's coordinates (Megatron-LM's `_set_random_seed`,
        deterministic per coordinate, so a switch re-derives them)."""
        from ..elastic.groups import install

        install(objs.groups)
        seed_rngs(self.train.seed, objs.groups)
