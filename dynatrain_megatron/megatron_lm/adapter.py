"""Glue between Megatron-LM's own training loop and the dynatrain step hook.

`patches/` adds three calls to Megatron-LM (`megatron/training/training.py`,
`pretrain_gpt.py`): `chain_extra_args_providers` registers our `--dynatrain*` flags,
`register_dataset_provider` remembers how `pretrain()` built its data, and `dynatrain_step`
runs after every optimizer step, next to `checkpoint_and_decide_exit`, and hands back the
objects `train()` must continue with. `finish_training` gives `pretrain()` the objects the
loop ended with (its own references point at a layout that was released).

What this can do, and what it cannot (the honest part):

* The switch engine works on our `TrainingObjects`. At the first step we *wrap* Megatron-LM's
  live model chunks, optimizer, scheduler and process groups into one, after checking that
  Megatron-LM's groups are the ones our `Layout` computes and that the live state agrees,
  fragment for fragment, with the analytic layout (the same check the switch does). A job
  whose state we would misread is refused at that point, before anything moves.
* The *new* layout's objects are built by our `MegatronBuilder` from a `ModelSpec` derived
  from Megatron-LM's arguments, not by Megatron-LM's `model_provider`. So only jobs whose
  model our builder reproduces are accepted: `unsupported_args` lists every Megatron-LM
  option that would change the model's function or the optimizer's state layout (dropout,
  grouped GEMM, MLA, FSDP, batch-size ramp-up, ...), and the session refuses to start if
  any is set. Options that change only speed or memory (recompute, fusions, communication
  overlap) are accepted with a warning: after a switch the model runs without them.
* After a switch, Megatron-LM's `args` are updated to the new layout, the micro-batch
  calculator is reconfigured, and the data iterators are rebuilt with Megatron-LM's own
  `build_train_valid_test_data_iterators` at `args.consumed_train_samples`, so the sample
  stream continues exactly where it was, at any data-parallel size.
* Scale-in/out: a rank that a switch leaves out waits on standby inside `dynatrain_step`
  (the hook's `standby()`: the controller's broadcasts, B's groups) and comes back into
  `train()` with the new objects and the current iteration, or leaves the loop when the job
  ends. Meanwhile the world collectives Megatron-LM makes between steps on the layout's
  ranks (timers, the rerun state machine, the data rebuild) run over the layout's group
  (`megatron_lm/timers.py`). Not done: a job that ends with ranks on standby and then saves or
  evaluates in `pretrain()` (those use the world), and exits other than `--train-iters`
  (`--exit-interval`, signals, duration) while ranks are on standby.
* Not done: Megatron-LM's gloo twin groups
  of the first layout are dropped and its first process groups are left alive (not
  destroyed) because `parallel_state` may still hand them out elsewhere.

Importing this module needs megatron-core and this package only; Megatron-LM
(`megatron.training`) is imported inside the functions that run within its loop.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from ..vps.errors import DynatrainError
from ..vps.layout import GROUP_AXES, Layout
from ..vps.model_spec import ModelSpec
from ..loop.arguments import add_dynatrain_args
from ..mcore.train_config import TrainConfig
from .timers import confine_timers, world_collectives_on

log = logging.getLogger("dynatrain")

# Megatron-LM defaults that our builder reproduces; any other value changes the model
_ROTARY_BASE = 10000
_NORM_EPSILON = 1e-5

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


# ---------------------------------------------------------------------------- arguments
def chain_extra_args_providers(*providers: Optional[ExtraArgsProvider]) -> ExtraArgsProvider:
    """One `extra_args_provider` that runs `providers` (None entries skipped), then ours.

    Megatron-LM's `pretrain()` takes a single provider; `pretrain_gpt.py` may already pass
    one (ModelOpt's), so the patch wraps it instead of replacing it.
    """
    chain = [p for p in providers if p is not None]

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in chain:
            out = p(parser)
            parser = out if out is not None else parser
        return add_dynatrain_args(parser)

    return provider


def _get(args: Any, name: str, default: Any = None) -> Any:
    """`args.name`, or `default` where this Megatron-LM release has no such flag."""
    return getattr(args, name, default)


def _single(value: Any, name: str) -> Any:
    """Megatron-LM turned some MoE coefficients into lists (one per load-balancing type)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise DynatrainError(f"--{name.replace('_', '-')} with {len(value)} values is not "
                                 f"supported (our builder has one)")
        return value[0]
    return value


def params_dtype_of(args: Any) -> str:
    if _get(args, "bf16", False):
        return "bf16"
    if _get(args, "fp16", False):
        return "fp16"
    return "fp32"


def spec_from_megatron_args(args: Any, vocab_size: Optional[int] = None,
                            name: str = "megatron-lm") -> ModelSpec:
    """The `ModelSpec` of the GPT model Megatron-LM built from `args` (after its validation).

    `vocab_size` is the tokenizer's (unpadded) vocabulary. Without it `args.padded_vocab_size`
    is used: the padding rows then count as real rows, which is always consistent (a little
    more is moved). `args.vocab_size` is the last resort only, since Megatron-LM's tokenizers
    may add tokens to it (NullTokenizer adds an end-of-document id). The result is checked
    against `args.padded_vocab_size`, the one layout-dependent shape.
    """
    gqa = bool(_get(args, "group_query_attention", False))
    heads = args.num_attention_heads
    vocab = vocab_size or _get(args, "padded_vocab_size") or _get(args, "vocab_size")
    if not vocab:
        raise DynatrainError("cannot tell the vocabulary size: neither the tokenizer, "
                             "--vocab-size nor args.padded_vocab_size is known")
    kw: dict[str, Any] = dict(
        name=name,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=int(vocab),
        seq_length=args.seq_length,
        num_query_groups=(_get(args, "num_query_groups") or heads) if gqa else heads,
        kv_channels=_get(args, "kv_channels"),
        make_vocab_size_divisible_by=_get(args, "make_vocab_size_divisible_by", 128),
        swiglu=bool(_get(args, "swiglu", False)),
        position_embedding_type=_get(args, "position_embedding_type", "learned_absolute"),
        untie_embeddings_and_output_weights=bool(
            _get(args, "untie_embeddings_and_output_weights", False)),
        normalization=_get(args, "normalization", "LayerNorm"),
        add_bias_linear=bool(_get(args, "add_bias_linear", True)),
        qk_layernorm=bool(_get(args, "qk_layernorm", False)),
        params_dtype=params_dtype_of(args),
        init_method_std=_get(args, "init_method_std", 0.02),
        # as Megatron-LM's config (changes bf16/fp16 numerics; fp32 is unaffected)
        attention_softmax_in_fp32=bool(_get(args, "attention_softmax_in_fp32", False)
                                       or _get(args, "apply_query_key_layer_scaling", False)),
    )
    experts = _get(args, "num_experts")
    if experts:
        kw.update(
            num_moe_experts=experts,
            moe_ffn_hidden_size=_get(args, "moe_ffn_hidden_size"),
            moe_router_topk=_get(args, "moe_router_topk", 2),
            moe_token_dispatcher_type=_get(args, "moe_token_dispatcher_type", "allgather"),
            moe_aux_loss_coeff=float(_single(_get(args, "moe_aux_loss_coeff", 0.0),
                                             "moe_aux_loss_coeff")),
            moe_shared_expert_intermediate_size=_get(args, "moe_shared_expert_intermediate_size"),
        )
    spec = ModelSpec(**kw)
    padded = _get(args, "padded_vocab_size")
    tp = _get(args, "tensor_model_parallel_size", 1)
    if padded is not None and spec.padded_vocab_size(tp) != padded:
        raise DynatrainError(
            f"vocabulary {spec.vocab_size} pads to {spec.padded_vocab_size(tp)} rows at tp{tp} "
            f"by megatron's rule, but Megatron-LM has padded_vocab_size={padded}")
    return spec


def train_config_from_megatron_args(args: Any) -> TrainConfig:
    """The layout-independent training settings our builder needs for a new layout.

    The learning-rate schedule itself is not rebuilt from these: the switch carries the
    scheduler's state dict (max/min LR, warm-up and decay steps, style, weight-decay ramp,
    step count), which overrides what the new scheduler was constructed with.
    """
    gbs = args.global_batch_size
    return TrainConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=gbs,
        train_iters=_get(args, "train_iters") or max(1, (_get(args, "train_samples") or gbs) // gbs),
        lr=args.lr,
        min_lr=_get(args, "min_lr", 0.0),
        lr_warmup_iters=_get(args, "lr_warmup_iters", 0) or 0,
        lr_decay_style=_get(args, "lr_decay_style", "linear"),
        weight_decay=_get(args, "weight_decay", 0.01),
        adam_beta1=_get(args, "adam_beta1", 0.9),
        adam_beta2=_get(args, "adam_beta2", 0.999),
        adam_eps=_get(args, "adam_eps", 1e-8),
        clip_grad=_get(args, "clip_grad", 1.0),
        seed=_get(args, "seed", 1234),
        ddp_bucket_size=_get(args, "ddp_bucket_size"),
        overlap_grad_reduce=bool(_get(args, "overlap_grad_reduce", False)),
        overlap_param_gather=bool(_get(args, "overlap_param_gather", False)),
    )


def layout_from_megatron_args(args: Any, spec: ModelSpec, world_size: int) -> Layout:
    """The running job's `Layout`, from Megatron-LM's validated parallel sizes."""
    tp = _get(args, "tensor_model_parallel_size", 1)
    pp = _get(args, "pipeline_model_parallel_size", 1)
    cp = _get(args, "context_parallel_size", 1)
    mp = tp * pp * cp
    if world_size % mp:
        raise DynatrainError(f"world size {world_size} is not a multiple of tp*pp*cp = {mp}")
    layout = Layout(tp=tp, pp=pp, dp=world_size // mp, cp=cp,
                    vpp=_get(args, "virtual_pipeline_model_parallel_size") or 1,
                    ep=_get(args, "expert_model_parallel_size", 1),
                    etp=_get(args, "expert_tensor_parallel_size") or 0,
                    ppf=_get(args, "decoder_first_pipeline_num_layers") or 0,
                    ppl=_get(args, "decoder_last_pipeline_num_layers") or 0)
    layout.check_model(spec)
    return layout


def args_for_layout(layout: Layout, spec: ModelSpec) -> dict[str, Any]:
    """Megatron-LM `args` values that describe `layout` (set after a switch, since
    Megatron-LM's loop, logging, data loaders and checkpointing read them)."""
    vpp = layout.vpp if layout.vpp > 1 else None
    per_vstage = None
    if vpp and not (layout.ppf or layout.ppl):
        per_vstage = spec.num_layers // (layout.pp * layout.vpp)
    return {
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": vpp,
        "num_layers_per_virtual_pipeline_stage": per_vstage,
        "context_parallel_size": layout.cp,
        "expert_model_parallel_size": layout.ep,
        "expert_tensor_parallel_size": layout.etp,
        "data_parallel_size": layout.dp,
        "decoder_first_pipeline_num_layers": layout.ppf or None,
        "decoder_last_pipeline_num_layers": layout.ppl or None,
        "padded_vocab_size": spec.padded_vocab_size(layout.tp),
        # what our builder does (make_transformer_config): SP only for MoE with TP
        "sequence_parallel": spec.is_moe and layout.tp > 1,
    }


def _is_set(value: Any) -> bool:
    return value not in (None, False, 0, 0.0, "", [], ())


def unsupported_args(args: Any, *, te_available: bool) -> list[str]:
    """Megatron-LM options our builder would not reproduce after a switch (one line each).

    Each changes the model's function, the optimizer's state layout, or how the loop
    counts batches, so a layout built without it would silently train a different job.
    `te_available`: whether our builder will use Transformer Engine layers (it does when
    TE imports and CUDA is present), which must match `--transformer-impl`.
    """
    out: list[str] = []

    def refuse(cond: bool, what: str) -> None:
        if cond:
            out.append(what)

    impl = _get(args, "transformer_impl", "transformer_engine")
    want = "transformer_engine" if te_available else "local"
    refuse(impl != want, f"--transformer-impl {impl}: after a switch our builder uses {want} "
                         f"layers (Transformer Engine {'is' if te_available else 'is not'} usable here)")
    refuse(_get(args, "use_legacy_models", False), "--use-legacy-models")
    refuse(_get(args, "spec") is not None, "--spec (a custom layer spec)")
    refuse(_get(args, "heterogeneous_layers_config_path") is not None,
           "--heterogeneous-layers-config-path")
    refuse(_get(args, "multi_latent_attention", False), "--multi-latent-attention")
    refuse(_is_set(_get(args, "mtp_num_layers")), "--mtp-num-layers")
    refuse(_is_set(_get(args, "hidden_dropout", 0.0)),
           f"--hidden-dropout {_get(args, 'hidden_dropout')} (our builder trains without dropout)")
    refuse(_is_set(_get(args, "attention_dropout", 0.0)),
           f"--attention-dropout {_get(args, 'attention_dropout')} (our builder trains without dropout)")
    refuse(_get(args, "position_embedding_type", "learned_absolute")
           not in ("rope", "learned_absolute", "none"),
           f"--position-embedding-type {_get(args, 'position_embedding_type')}")
    refuse(_get(args, "position_embedding_type") == "learned_absolute"
           and _get(args, "max_position_embeddings", args.seq_length) != args.seq_length,
           "--max-position-embeddings != --seq-length with learned absolute positions "
           "(the table would change shape)")
    refuse(_get(args, "rotary_base", _ROTARY_BASE) != _ROTARY_BASE, "--rotary-base other than 10000")
    refuse(_get(args, "rotary_percent", 1.0) != 1.0, "--rotary-percent other than 1.0")
    refuse(_get(args, "use_rope_scaling", False), "--use-rope-scaling")
    refuse(_get(args, "rotary_seq_len_interpolation_factor") is not None,
           "--rotary-seq-len-interpolation-factor")
    refuse(_get(args, "norm_epsilon", _NORM_EPSILON) != _NORM_EPSILON, "--norm-epsilon other than 1e-5")
    refuse(_get(args, "apply_layernorm_1p", False), "--apply-layernorm-1p")
    refuse(_get(args, "add_qkv_bias", False) and not _get(args, "add_bias_linear", True),
           "--add-qkv-bias without linear biases")
    for flag in ("squared_relu", "openai_gelu", "quick_geglu", "onnx_safe"):
        refuse(_get(args, flag, False), f"--{flag.replace('_', '-')} (activation)")
    refuse(_get(args, "fp16_lm_cross_entropy", False), "--fp16-lm-cross-entropy")
    refuse(_get(args, "calculate_per_token_loss", False), "--calculate-per-token-loss")
    if _get(args, "num_experts"):
        freq = _get(args, "moe_layer_freq", 1)
        refuse(not (freq == 1 or (isinstance(freq, (list, tuple)) and all(f == 1 for f in freq))),
               "--moe-layer-freq (our builder makes every layer MoE)")
        refuse(_get(args, "moe_grouped_gemm", False), "--moe-grouped-gemm")
        coeff = _get(args, "moe_aux_loss_coeff", 0.0)
        refuse(isinstance(coeff, (list, tuple)) and len(coeff) != 1,
               "--moe-aux-loss-coeff with several values")
    # optimizer and data parallelism: the switch moves DistributedOptimizer shards of Adam
    refuse(not _get(args, "use_distributed_optimizer", False),
           "no --use-distributed-optimizer (the switch moves DistributedOptimizer shards)")
    refuse(_get(args, "optimizer", "adam") != "adam", f"--optimizer {_get(args, 'optimizer')}")
    for flag in ("use_torch_fsdp2", "use_megatron_fsdp", "use_custom_fsdp",
                 "use_layer_wise_distributed_optimizer", "optimizer_cpu_offload",
                 "use_precision_aware_optimizer"):
        refuse(_get(args, flag, False), f"--{flag.replace('_', '-')}")
    refuse((_get(args, "num_distributed_optimizer_instances", 1) or 1) != 1,
           "--num-distributed-optimizer-instances > 1")
    refuse(_get(args, "ddp_num_buckets") is not None, "--ddp-num-buckets (use --ddp-bucket-size)")
    refuse(_get(args, "fp16", False) and _get(args, "loss_scale") is not None,
           "--loss-scale (static fp16 loss scale)")
    refuse(_is_set(_get(args, "fp8")), "--fp8-format")
    refuse(_is_set(_get(args, "fp4")), "--fp4-format")
    # schedule and batch accounting the switch cannot carry
    refuse(_get(args, "rampup_batch_size") is not None, "--rampup-batch-size")
    refuse(_get(args, "decrease_batch_size_if_needed", False), "--decrease-batch-size-if-needed")
    refuse(_get(args, "lr_decay_style", "linear") == "WSD",
           "--lr-decay-style WSD (its decay steps are not in the scheduler's state dict)")
    refuse(_is_set(_get(args, "lr_warmup_init", 0.0)),
           "--lr-warmup-init (not in the scheduler's state dict)")
    # rank order and pipeline split: our Layout must describe Megatron-LM's groups
    refuse(_get(args, "use_tp_pp_dp_mapping", False), "--use-tp-pp-dp-mapping (rank order)")
    refuse(_get(args, "pipeline_model_parallel_layout") is not None,
           "--pipeline-model-parallel-layout")
    refuse(_get(args, "account_for_embedding_in_pipeline_split", False),
           "--account-for-embedding-in-pipeline-split")
    refuse(_get(args, "account_for_loss_in_pipeline_split", False),
           "--account-for-loss-in-pipeline-split")
    refuse(_get(args, "hierarchical_context_parallel_sizes") is not None,
           "--hierarchical-context-parallel-sizes")
    refuse(_get(args, "hybrid_context_parallel", False), "--hybrid-context-parallel")
    # loop features that hold on to the first layout's objects
    refuse(_get(args, "cuda_graph_impl", "none") not in (None, "none"),
           f"--cuda-graph-impl {_get(args, 'cuda_graph_impl')}")
    refuse(_get(args, "perform_rl_step", False), "--perform-rl-step")
    return out


def performance_differences(args: Any) -> list[str]:
    """Options accepted but not reproduced after a switch: same training, other speed or
    memory. Logged as a warning when the session starts."""
    out = []
    if _get(args, "recompute_granularity") is not None:
        out.append(f"activation recompute ({_get(args, 'recompute_granularity')}) is off after a "
                   f"switch: more activation memory")
    for flag in ("tp_comm_overlap", "overlap_p2p_comm", "gradient_accumulation_fusion",
                 "bias_gelu_fusion", "bias_swiglu_fusion", "masked_softmax_fusion",
                 "bias_dropout_fusion", "apply_rope_fusion", "cross_entropy_loss_fusion"):
        if _get(args, flag, False):
            out.append(f"--{flag.replace('_', '-')} is off after a switch")
    if _get(args, "check_for_nan_in_loss_and_grad", False):
        out.append("the DDP NaN check on gradients is off after a switch")
    if _get(args, "sequence_parallel", False) and not _get(args, "num_experts"):
        out.append("sequence parallelism is off after a switch (our builder uses it for MoE only)")
    return out


# ---------------------------------------------------------------------------- live state
@dataclass
class LoopObjects:
    """What Megatron-LM's `train()` holds and must rebind after a switch."""

    model: list
    optimizer: Any
    opt_param_scheduler: Any
    train_data_iterator: Any
    valid_data_iterator: Any
    config: Any
    test_data_iterator: Any = None
    changed: bool = False
    iteration: int = 0  # where the loop goes on (a rank back from standby catches up)
    stop: bool = False  # this rank was on standby when the job ended: leave the loop


_DATASET_PROVIDER: Optional[Callable] = None
_SESSION: Optional["MegatronLMSession"] = None


def register_dataset_provider(provider: Callable, args: Any = None) -> None:
    """Called by the patched `pretrain()` before `train()`: the provider rebuilds the data
    iterators when a switch changes the data-parallel size or the pipeline stages that read
    data. It is also where a job we could not switch is refused: at start-up, before its
    first step, naming every flag (`args`: Megatron-LM's global args when not given)."""
    global _DATASET_PROVIDER
    if args is None:
        from megatron.training import get_args

        args = get_args()
    check_switchable(args)
    _DATASET_PROVIDER = provider


def check_switchable(args: Any) -> None:
    """Raise naming every Megatron-LM flag after which our builder would not rebuild the
    job at another layout (`unsupported_args`)."""
    problems = unsupported_args(args, te_available=_transformer_engine_available())
    if problems:
        raise DynatrainError("--dynatrain cannot switch this Megatron-LM job, because after "
                             "a switch our builder would not reproduce: " + "; ".join(problems))


def _transformer_engine_available() -> bool:
    from ..mcore.builders import transformer_engine_available

    return transformer_engine_available()


def _tokenizer_vocab_size() -> Optional[int]:
    """The unpadded vocabulary of Megatron-LM's global tokenizer, when it has one."""
    try:
        from megatron.training import get_tokenizer

        tok = get_tokenizer()
        return int(tok.vocab_size) if tok is not None else None
    except Exception:  # no global tokenizer in this release/config: fall back to args
        return None


def wrap_megatron_groups(layout: Layout):
    """Megatron-LM's `parallel_state` groups as our `ParallelGroups`, after checking that
    every group has exactly the ranks `layout` gives it with the default placement (so the
    planner's idea of who holds what is Megatron-LM's). Creates no group."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from ..elastic.groups import ParallelGroups
    from ..vps.placement import Placement

    pgc = ProcessGroupCollection.use_mpu_process_groups()
    rank = dist.get_rank()
    mine: dict[str, list[int]] = {}
    wrong = []
    for name, axes in GROUP_AXES.items():
        group = getattr(pgc, name, None)
        expected = next(g for g in layout.groups(axes) if rank in g)
        if group is None:
            if len(expected) > 1:
                wrong.append(f"{name}: Megatron-LM has none, {layout} needs {expected}")
            continue
        actual = sorted(dist.get_process_group_ranks(group))
        if actual != sorted(expected):
            wrong.append(f"{name}: Megatron-LM {actual}, {layout} {sorted(expected)}")
        mine[name] = sorted(expected)
    if wrong:
        raise DynatrainError(f"rank {rank}: Megatron-LM's process groups are not those of "
                             f"{layout} in the default rank order: " + "; ".join(wrong[:4]))
    for name in ("embd", "pos_embd"):
        g = getattr(pgc, name, None)
        if g is not None:
            mine[name] = sorted(dist.get_process_group_ranks(g))
    return ParallelGroups(layout=layout, placement=Placement.default(layout.world_size),
                          rank=rank, pg_collection=pgc, group_ranks=mine, created=[],
                          # one optimizer instance (refused otherwise): it spans the layout
                          layout_group=getattr(pgc, "intra_dist_opt", None))


def _check_live_state(spec: ModelSpec, train: TrainConfig, objs) -> None:
    """The switch's own pre-flight check, run once up front: the live model/optimizer state
    must be exactly what the analytic layout says, or we refuse before training goes on."""
    from ..adapters.live import LiveState
    from ..adapters.verify import check_live_matches_analytic
    from ..vps.analytic import analytic_layout
    from ..vps.fragment import OPT_KINDS
    from ..mcore.builders import bucket_size_of

    vr = objs.groups.virtual_rank
    live = LiveState(objs.model, objs.optimizer, vr, spec.vocab_size)
    expected = analytic_layout(spec, objs.layout, bucket_size_of(train, objs.layout))
    check_live_matches_analytic(live.fragments(OPT_KINDS), expected.fragments(vr, OPT_KINDS), vr)


def _prepare_config(args: Any, model: list, optimizer: Any, config: Any, old_config: Any) -> None:
    """Set the callbacks on the new model's config as Megatron-LM's `train()` does at its
    start (grad scaling, timers, no-sync / grad-sync / param-sync, grad finalisation)."""
    from megatron.core.distributed import finalize_model_grads

    def per_chunk(attr: str):
        fns = [getattr(m, attr) for m in model]
        return fns[0] if len(fns) == 1 else fns

    config.grad_scale_func = optimizer.scale_loss
    config.timers = getattr(old_config, "timers", None)
    config.no_sync_func = None
    config.grad_sync_func = None
    config.param_sync_func = None
    if _get(args, "overlap_grad_reduce", False):
        config.no_sync_func = per_chunk("no_sync")
        if _get(args, "align_grad_reduce", True):
            config.grad_sync_func = per_chunk("start_grad_sync")
    if _get(args, "overlap_param_gather", False) and _get(args, "align_param_gather", True):
        config.param_sync_func = per_chunk("start_param_sync")
    config.finalize_model_grads_func = finalize_model_grads


def _rebuild_data_iterators(args: Any, num_chunks: int) -> tuple[Any, Any, Any]:
    """Train/valid/test iterators for the current layout, as `pretrain()` builds them (one
    per virtual stage with VPP), positioned at `args.consumed_train_samples`."""
    if _DATASET_PROVIDER is None:
        raise DynatrainError("no dataset provider registered: the patched pretrain() calls "
                             "register_dataset_provider(); is the training.py patch applied?")
    from megatron.training.training import build_train_valid_test_data_iterators

    if _get(args, "virtual_pipeline_model_parallel_size") is None:
        return build_train_valid_test_data_iterators(_DATASET_PROVIDER)
    out: tuple[list, list, list] = ([], [], [])
    for vp_stage in range(num_chunks):
        provider = functools.partial(_DATASET_PROVIDER, vp_stage=vp_stage)
        if getattr(_DATASET_PROVIDER, "is_distributed", False):
            provider.is_distributed = True  # type: ignore[attr-defined]
        for lst, it in zip(out, build_train_valid_test_data_iterators(provider)):
            lst.append(it)
    return out


class MegatronLMSession:
    """The hook and our view of Megatron-LM's live objects, for one training run."""

    def __init__(self, args: Any, model: list, optimizer: Any, opt_param_scheduler: Any,
                 config: Any) -> None:
        import torch.distributed as dist

        from ..mcore.builders import TrainingObjects, with_layer_implementation
        from ..loop.hook import DynatrainHook
        from ..mcore.training import Trainer

        check_switchable(args)
        for note in performance_differences(args):
            log.warning("dynatrain: %s", note)
        self.args = args
        try:
            self.spec = spec_from_megatron_args(args, vocab_size=_tokenizer_vocab_size())
        except DynatrainError as e:  # a tokenizer whose size does not explain the padding
            log.warning("dynatrain: %s; treating all %s rows as vocabulary", e,
                        _get(args, "padded_vocab_size"))
            self.spec = spec_from_megatron_args(args)
        # TE layers exactly where our builder uses them (`unsupported_args` checked that
        # Megatron-LM built the first layout the same way): the analytic names follow
        self.spec = with_layer_implementation(self.spec)
        self.train = train_config_from_megatron_args(args)
        layout = layout_from_megatron_args(args, self.spec, dist.get_world_size())
        objs = TrainingObjects(layout=layout, groups=wrap_megatron_groups(layout), config=config,
                               model=model, optimizer=optimizer, scheduler=opt_param_scheduler)
        _check_live_state(self.spec, self.train, objs)
        self.trainer = Trainer(self.spec, self.train, objs,
                               consumed_samples=_get(args, "consumed_train_samples", 0))
        self.hook = DynatrainHook.from_args(args, self.spec, self.train)
        self.test_data_iterator: Any = None
        self.latest: Optional[LoopObjects] = None
        log.info("dynatrain: wrapping Megatron-LM's %s job (%s); switches are polled every %d "
                 "iteration(s)", layout, self.spec.name, args.dynatrain_poll_interval)

    def step(self, iteration: int, loop: LoopObjects) -> LoopObjects:
        import torch.distributed as dist

        t = self.trainer
        if loop.model is not t.objs.model:
            raise DynatrainError("train() holds other objects than the last switch returned; "
                                 "is every rebinding of the training.py patch applied?")
        t.iteration = iteration
        t.consumed_samples = _get(self.args, "consumed_train_samples", t.consumed_samples)
        old_config = t.objs.config
        before = t.objs
        t = self.hook.after_step(t)
        if t is None:  # a scale-in left this rank out: on standby until one brings it back
            log.info("dynatrain: iteration %d: this rank is on standby", iteration)
            t = self.hook.standby()
            if t is None:  # the job ended while this rank was out
                self.trainer = None
                return dataclasses.replace(loop, iteration=_get(self.args, "train_iters",
                                                                iteration), stop=True)
            log.info("dynatrain: back from standby at iteration %d", t.iteration)
        self.trainer = t
        world = dist.get_world_size()
        if (self.hook.layout.world_size < world
                and t.iteration >= _get(self.args, "train_iters", t.iteration)):
            self.hook.stop_standby()  # the last step: the ranks on standby leave train()
        if self.hook.layout.world_size < world and dist.get_rank() == 0:
            # Megatron-LM prints its iteration line on the world's last rank, maybe on standby
            log.info("dynatrain: iteration %d done at %s on %d of %d ranks (the others on "
                     "standby)", t.iteration, self.hook.layout, self.hook.layout.world_size,
                     world)
        if t.objs is before:
            return loop
        o = t.objs
        confine_timers(o.groups.layout_group if o.layout.world_size < world else None)
        self.args.consumed_train_samples = t.consumed_samples
        for k, v in args_for_layout(o.layout, self.spec).items():
            setattr(self.args, k, v)
        _prepare_config(self.args, o.model, o.optimizer, o.config, old_config)
        with world_collectives_on(o.groups.layout_group if o.layout.world_size < world
                                  else None):
            train_it, valid_it, test_it = _rebuild_data_iterators(self.args, len(o.model))
        self.test_data_iterator = test_it
        self.latest = LoopObjects(o.model, o.optimizer, o.scheduler, train_it, valid_it,
                                  o.config, test_it, changed=True, iteration=t.iteration)
        return self.latest


def dynatrain_step(args: Any, iteration: int, model: list, optimizer: Any,
                   opt_param_scheduler: Any, train_data_iterator: Any, valid_data_iterator: Any,
                   config: Any) -> LoopObjects:
    """The per-step call of the patched `train()`, on every rank, after the optimizer step,
    the iteration/consumed-samples accounting and `checkpoint_and_decide_exit`.

    Returns the objects to continue with; `changed` is True after a switch, when the
    caller must also refresh `get_forward_backward_func()` and `get_num_microbatches()`.
    """
    global _SESSION
    loop = LoopObjects(model, optimizer, opt_param_scheduler, train_data_iterator,
                       valid_data_iterator, config)
    if _SESSION is None:
        _SESSION = MegatronLMSession(args, model, optimizer, opt_param_scheduler, config)
    return _SESSION.step(iteration, loop)


def finish_training(model: list, optimizer: Any, opt_param_scheduler: Any,
                    train_data_iterator: Any, valid_data_iterator: Any,
                    test_data_iterator: Any, config: Any) -> tuple:
    """Called by the patched `pretrain()` after `train()` returns: the objects the loop
    ended with (the caller's are released if a switch happened) and the switch summary."""
    s = _SESSION
    if s is None or s.trainer is None:  # no session, or on standby at the end
        return (model, optimizer, opt_param_scheduler, train_data_iterator,
                valid_data_iterator, test_data_iterator, config)
    s.hook.finish(s.trainer)
    if s.latest is None:
        return (model, optimizer, opt_param_scheduler, train_data_iterator,
                valid_data_iterator, test_data_iterator, config)
    o = s.trainer.objs
    last = s.latest
    return (o.model, o.optimizer, o.scheduler, last.train_data_iterator,
            last.valid_data_iterator, s.test_data_iterator, o.config)


def reset_session() -> None:
    """Forget the session and the dataset provider (tests, in-process restarts)."""
    global _SESSION, _DATASET_PROVIDER
    _SESSION = None
    _DATASET_PROVIDER = None


__all__: Iterable[str] = (
    "LoopObjects", "MegatronLMSession", "args_for_layout", "chain_extra_args_providers",
    "check_switchable",
    "dynatrain_step", "finish_training", "layout_from_megatron_args", "params_dtype_of",
    "performance_differences", "register_dataset_provider", "reset_session",
    "spec_from_megatron_args", "train_config_from_megatron_args", "unsupported_args",
    "wrap_megatron_groups",
)
