"""Megatron-LM's arguments as this package reads them: our `--dynatrain*` flags chained
after the script's own `extra_args_provider`, the `ModelSpec` / `TrainConfig` / `Layout` a
job's `args` describe, the `args` a layout sets, and the options our builder would not
reproduce (a job using one is refused at start-up, naming the flag).

Pure argument handling: no megatron import, so the checks run before Megatron-LM builds
anything.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, Optional

from ..loop.arguments import add_dynatrain_args
from ..mcore.train_config import TrainConfig
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec

log = logging.getLogger("dynatrain")

# Megatron-LM's default rotary base, the one GPTModel argument of ours it could differ in
_ROTARY_BASE = 10000

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


# ---------------------------------------------------------------------------- arguments
def chain_extra_args_providers(*providers: Optional[ExtraArgsProvider]) -> ExtraArgsProvider:
    """One `extra_args_provider` that runs `providers` (None entries skipped), then ours.

    Megatron-LM's `pretrain()` takes a single provider; `pretrain_gpt.py` may already pass
    one (ModelOpt's), so the patch wraps it instead of replacing it.
    """
    chain = [p for p in providers if p is not None]

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        # Megatron-LM parses its arguments before it makes the process groups: NCCL's
        # error handling must be in the environment by then (plain torchrun sets none)
        from .. import process_env

        process_env.apply()
        for p in chain:
            out = p(parser)
            parser = out if out is not None else parser
        return add_dynatrain_args(parser)

    return provider


def arg_value(args: Any, name: str, default: Any = None) -> Any:
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
    if arg_value(args, "bf16", False):
        return "bf16"
    if arg_value(args, "fp16", False):
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
    gqa = bool(arg_value(args, "group_query_attention", False))
    heads = args.num_attention_heads
    vocab = vocab_size or arg_value(args, "padded_vocab_size") or arg_value(args, "vocab_size")
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
        num_query_groups=(arg_value(args, "num_query_groups") or heads) if gqa else heads,
        kv_channels=arg_value(args, "kv_channels"),
        make_vocab_size_divisible_by=arg_value(args, "make_vocab_size_divisible_by", 128),
        swiglu=bool(arg_value(args, "swiglu", False)),
        position_embedding_type=arg_value(args, "position_embedding_type", "learned_absolute"),
        untie_embeddings_and_output_weights=bool(
            arg_value(args, "untie_embeddings_and_output_weights", False)),
        normalization=arg_value(args, "normalization", "LayerNorm"),
        add_bias_linear=bool(arg_value(args, "add_bias_linear", True)),
        qk_layernorm=bool(arg_value(args, "qk_layernorm", False)),
        params_dtype=params_dtype_of(args),
        init_method_std=arg_value(args, "init_method_std", 0.02),
        # as Megatron-LM's config (changes bf16/fp16 numerics; fp32 is unaffected)
        attention_softmax_in_fp32=bool(arg_value(args, "attention_softmax_in_fp32", False)
                                       or arg_value(args, "apply_query_key_layer_scaling", False)),
    )
    experts = arg_value(args, "num_experts")
    if experts:
        kw.update(
            num_moe_experts=experts,
            moe_ffn_hidden_size=arg_value(args, "moe_ffn_hidden_size"),
            moe_router_topk=arg_value(args, "moe_router_topk", 2),
            moe_token_dispatcher_type=arg_value(args, "moe_token_dispatcher_type", "allgather"),
            moe_aux_loss_coeff=float(_single(arg_value(args, "moe_aux_loss_coeff", 0.0),
                                             "moe_aux_loss_coeff")),
            moe_shared_expert_intermediate_size=arg_value(args, "moe_shared_expert_intermediate_size"),
        )
    spec = ModelSpec(**kw)
    padded = arg_value(args, "padded_vocab_size")
    tp = arg_value(args, "tensor_model_parallel_size", 1)
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
        train_iters=arg_value(args, "train_iters") or max(1, (arg_value(args, "train_samples") or gbs) // gbs),
        lr=args.lr,
        min_lr=arg_value(args, "min_lr", 0.0),
        lr_warmup_iters=arg_value(args, "lr_warmup_iters", 0) or 0,
        lr_decay_style=arg_value(args, "lr_decay_style", "linear"),
        weight_decay=arg_value(args, "weight_decay", 0.01),
        adam_beta1=arg_value(args, "adam_beta1", 0.9),
        adam_beta2=arg_value(args, "adam_beta2", 0.999),
        adam_eps=arg_value(args, "adam_eps", 1e-8),
        clip_grad=arg_value(args, "clip_grad", 1.0),
        seed=arg_value(args, "seed", 1234),
        ddp_bucket_size=arg_value(args, "ddp_bucket_size"),
        overlap_grad_reduce=bool(arg_value(args, "overlap_grad_reduce", False)),
        overlap_param_gather=bool(arg_value(args, "overlap_param_gather", False)),
    )


def layout_from_megatron_args(args: Any, spec: ModelSpec, world_size: int) -> Layout:
    """The running job's `Layout`, from Megatron-LM's validated parallel sizes."""
    tp = arg_value(args, "tensor_model_parallel_size", 1)
    pp = arg_value(args, "pipeline_model_parallel_size", 1)
    cp = arg_value(args, "context_parallel_size", 1)
    mp = tp * pp * cp
    if world_size % mp:
        raise DynatrainError(f"world size {world_size} is not a multiple of tp*pp*cp = {mp}")
    layout = Layout(tp=tp, pp=pp, dp=world_size // mp, cp=cp,
                    vpp=arg_value(args, "virtual_pipeline_model_parallel_size") or 1,
                    ep=arg_value(args, "expert_model_parallel_size", 1),
                    etp=arg_value(args, "expert_tensor_parallel_size") or 0,
                    ppf=arg_value(args, "decoder_first_pipeline_num_layers") or 0,
                    ppl=arg_value(args, "decoder_last_pipeline_num_layers") or 0,
                    doi=arg_value(args, "num_distributed_optimizer_instances", 1) or 1)
    layout.check_model(spec)
    return layout


def args_for_layout(layout: Layout, spec: ModelSpec, *,
                    sequence_parallel: bool = False) -> dict[str, Any]:
    """Megatron-LM `args` values that describe `layout` (set after a switch, since
    Megatron-LM's loop, logging, data loaders and checkpointing read them).

    `sequence_parallel`: whether the job asked for it (`--sequence-parallel`); as Megatron-LM
    validates it, it holds only with TP, and an MoE job with TP always has it."""
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
        "num_distributed_optimizer_instances": layout.doi,
        "decoder_first_pipeline_num_layers": layout.ppf or None,
        "decoder_last_pipeline_num_layers": layout.ppl or None,
        "padded_vocab_size": spec.padded_vocab_size(layout.tp),
        "sequence_parallel": layout.tp > 1 and (sequence_parallel or spec.is_moe),
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

    impl = arg_value(args, "transformer_impl", "transformer_engine")
    want = "transformer_engine" if te_available else "local"
    refuse(impl != want, f"--transformer-impl {impl}: after a switch our builder uses {want} "
                         f"layers (Transformer Engine {'is' if te_available else 'is not'} usable here)")
    refuse(arg_value(args, "use_legacy_models", False), "--use-legacy-models")
    refuse(arg_value(args, "spec") is not None, "--spec (a custom layer spec)")
    refuse(arg_value(args, "heterogeneous_layers_config_path") is not None,
           "--heterogeneous-layers-config-path")
    refuse(arg_value(args, "multi_latent_attention", False), "--multi-latent-attention")
    refuse(_is_set(arg_value(args, "mtp_num_layers")), "--mtp-num-layers")
    refuse(arg_value(args, "position_embedding_type", "learned_absolute")
           not in ("rope", "learned_absolute", "none"),
           f"--position-embedding-type {arg_value(args, 'position_embedding_type')}")
    refuse(arg_value(args, "position_embedding_type") == "learned_absolute"
           and arg_value(args, "max_position_embeddings", args.seq_length) != args.seq_length,
           "--max-position-embeddings != --seq-length with learned absolute positions "
           "(the table would change shape)")
    refuse(arg_value(args, "rotary_base", _ROTARY_BASE) != _ROTARY_BASE, "--rotary-base other than 10000")
    refuse(arg_value(args, "rotary_percent", 1.0) != 1.0, "--rotary-percent other than 1.0")
    refuse(arg_value(args, "use_rope_scaling", False), "--use-rope-scaling")
    refuse(arg_value(args, "rotary_seq_len_interpolation_factor") is not None,
           "--rotary-seq-len-interpolation-factor")
    refuse(arg_value(args, "add_qkv_bias", False) and not arg_value(args, "add_bias_linear", True),
           "--add-qkv-bias without linear biases")
    # gated: fc1's shape follows, which our ModelSpec does not describe
    for flag in ("quick_geglu", "onnx_safe"):
        refuse(arg_value(args, flag, False), f"--{flag.replace('_', '-')} (activation)")
    refuse(arg_value(args, "fp16_lm_cross_entropy", False), "--fp16-lm-cross-entropy")
    refuse(arg_value(args, "calculate_per_token_loss", False), "--calculate-per-token-loss")
    if arg_value(args, "num_experts"):
        freq = arg_value(args, "moe_layer_freq", 1)
        refuse(not (freq == 1 or (isinstance(freq, (list, tuple)) and all(f == 1 for f in freq))),
               "--moe-layer-freq (our builder makes every layer MoE)")
        refuse(arg_value(args, "moe_grouped_gemm", False), "--moe-grouped-gemm")
        coeff = arg_value(args, "moe_aux_loss_coeff", 0.0)
        refuse(isinstance(coeff, (list, tuple)) and len(coeff) != 1,
               "--moe-aux-loss-coeff with several values")
    # optimizer and data parallelism: the switch moves DistributedOptimizer shards of Adam
    refuse(not arg_value(args, "use_distributed_optimizer", False),
           "no --use-distributed-optimizer (the switch moves DistributedOptimizer shards)")
    refuse(arg_value(args, "optimizer", "adam") != "adam", f"--optimizer {arg_value(args, 'optimizer')}")
    for flag in ("use_torch_fsdp2", "use_megatron_fsdp", "use_custom_fsdp",
                 "use_layer_wise_distributed_optimizer", "optimizer_cpu_offload",
                 "use_precision_aware_optimizer"):
        refuse(arg_value(args, flag, False), f"--{flag.replace('_', '-')}")
    refuse(arg_value(args, "ddp_num_buckets") is not None, "--ddp-num-buckets (use --ddp-bucket-size)")
    # the switch plans with the analytic buffer layout, which does not model this padding
    refuse(arg_value(args, "ddp_pad_buckets_for_high_nccl_busbw", False),
           "--ddp-pad-buckets-for-high-nccl-busbw")
    # megatron enables SHARP through the environment while it makes its data-parallel
    # groups; B's groups are made later, in the background, without it
    refuse(arg_value(args, "use_sharp", False), "--use-sharp (B's groups would not get SHARP)")
    refuse(arg_value(args, "fp16", False) and arg_value(args, "loss_scale") is not None,
           "--loss-scale (static fp16 loss scale)")
    refuse(_is_set(arg_value(args, "fp8")), "--fp8-format")
    refuse(_is_set(arg_value(args, "fp4")), "--fp4-format")
    # schedule and batch accounting the switch cannot carry
    refuse(arg_value(args, "rampup_batch_size") is not None, "--rampup-batch-size")
    refuse(arg_value(args, "decrease_batch_size_if_needed", False), "--decrease-batch-size-if-needed")
    refuse(arg_value(args, "lr_decay_style", "linear") == "WSD",
           "--lr-decay-style WSD (its decay steps are not in the scheduler's state dict)")
    refuse(_is_set(arg_value(args, "lr_warmup_init", 0.0)),
           "--lr-warmup-init (not in the scheduler's state dict)")
    # rank order and pipeline split: our Layout must describe Megatron-LM's groups
    refuse(arg_value(args, "use_tp_pp_dp_mapping", False), "--use-tp-pp-dp-mapping (rank order)")
    refuse(arg_value(args, "pipeline_model_parallel_layout") is not None,
           "--pipeline-model-parallel-layout")
    refuse(arg_value(args, "account_for_embedding_in_pipeline_split", False),
           "--account-for-embedding-in-pipeline-split")
    refuse(arg_value(args, "account_for_loss_in_pipeline_split", False),
           "--account-for-loss-in-pipeline-split")
    refuse(arg_value(args, "hierarchical_context_parallel_sizes") is not None,
           "--hierarchical-context-parallel-sizes")
    refuse(arg_value(args, "hybrid_context_parallel", False), "--hybrid-context-parallel")
    # loop features that hold on to the first layout's objects
    refuse(arg_value(args, "cuda_graph_impl", "none") not in (None, "none"),
           f"--cuda-graph-impl {arg_value(args, 'cuda_graph_impl')}")
    refuse(arg_value(args, "perform_rl_step", False), "--perform-rl-step")
    return out


def performance_differences(args: Any) -> list[str]:
    """Options accepted but not reproduced after a switch: same training, other speed or
    memory. Logged as a warning when the session starts. (B's TransformerConfig is
    Megatron-LM's own for the new layout, so recompute, fusions and sequence parallelism
    carry over; see `transformer_config.py`.)"""
    out = []
    if arg_value(args, "tp_comm_overlap", False):
        out.append("--tp-comm-overlap is off after a switch (its user buffers are set up for "
                   "the first layout's TP size)")
    dropout = [f"--{n.replace('_', '-')} {arg_value(args, n)}" for n in
               ("hidden_dropout", "attention_dropout") if _is_set(arg_value(args, n, 0.0))]
    if dropout:
        out.append(f"dropout ({', '.join(dropout)}) stays on after a switch, with the random "
                   f"generators seeded for the new layout as at a job's start (the switch does "
                   f"not carry RNG states): the same training in distribution, not bit for bit "
                   f"a restart's")
    return out


__all__ = ("args_for_layout", "chain_extra_args_providers", "layout_from_megatron_args",
           "params_dtype_of", "performance_differences", "spec_from_megatron_args",
           "train_config_from_megatron_args", "unsupported_args")
