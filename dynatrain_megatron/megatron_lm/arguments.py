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
import os
import sys
from typing import Any, Callable, Optional

from ..loop.arguments import add_dynatrain_args
from ..mcore.train_config import TrainConfig
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.placement import DEFAULT_ORDER, TP_PP_DP_ORDER
from .pipeline_split import PipelineRule, pipeline_args
from ..vps.model_spec import ModelSpec
from .support import support_matrix, unsupported_args

log = logging.getLogger("dynatrain")

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
        return refuse_when_parsed(add_dynatrain_args(parser, host="megatron-lm"))

    return provider


def refuse_when_parsed(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser`, whose parse of a `--dynatrain` command line ends the process (status 2,
    one line per refused option on stderr, from the first rank only) when an option is set
    that a switch cannot carry (`support.unsupported_args`): at start-up, before Megatron-LM
    initialises anything, rather than as a traceback on every rank once the model is built.

    A bad value on such a command line (`--dynatrain-timeout -1`, a typo in any flag) is
    also one line, `prog: error: ...`, from the first rank only: argparse's own error would
    print Megatron-LM's usage first, some 600 lines on every rank."""
    full_error = parser.error

    def one_line_error(message: str) -> None:
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{parser.prog}: error: {message} (--help lists the options)\n")
        sys.exit(2)

    for method in ("parse_args", "parse_known_args"):
        parse = getattr(parser, method)

        def checked(*a: Any, _parse: Callable = parse, **k: Any) -> Any:
            argv = k.get("args", a[0] if a else None)
            argv = sys.argv[1:] if argv is None else argv
            ours = any(str(x).startswith("--dynatrain") for x in argv)
            parser.error = one_line_error if ours else full_error  # type: ignore[method-assign]
            try:
                out = _parse(*a, **k)
            finally:
                parser.error = full_error  # type: ignore[method-assign]
            ns = out[0] if isinstance(out, tuple) else out
            if getattr(ns, "dynatrain", False):
                ns.dynatrain_asked = asked_settings(ns)
                from .startup_death import StartupDeath

                StartupDeath.install()  # a death before the loop: one line (module doc)
                problems = unsupported_args(ns)
                if problems:
                    if os.environ.get("RANK", "0") == "0":
                        for p in problems:
                            sys.stderr.write(f"dynatrain: cannot switch this job: {p}\n")
                    sys.exit(2)
            return out

        setattr(parser, method, checked)
    return parser


# settings Megatron-LM's validation turns off where the launch layout does not allow them
# (sequence parallelism at TP 1; the interleaved schedule's overlaps without VPP), which a
# restart at another layout with the same command line has on (`JobIntents`)
LAYOUT_DEPENDENT_SETTINGS = ("sequence_parallel", "overlap_p2p_comm", "align_param_gather")


def asked_settings(parsed: Any) -> dict[str, Any]:
    """The `LAYOUT_DEPENDENT_SETTINGS` as the command line set them: read from the parse,
    before Megatron-LM validates it (kept on the args as `dynatrain_asked`)."""
    return {k: getattr(parsed, k) for k in LAYOUT_DEPENDENT_SETTINGS if hasattr(parsed, k)}


def arg_value(args: Any, name: str, default: Any = None) -> Any:
    """`args.name`, or `default` where this Megatron-LM release has no such flag."""
    return getattr(args, name, default)


def _first(value: Any) -> Any:
    """Megatron-LM turned some MoE coefficients into lists (one per load-balancing type);
    the spec keeps the first (numerics only: B is built by Megatron-LM from the args)."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else 0.0
    return value


def _moe_layer_pattern(args: Any) -> Optional[tuple[int, ...]]:
    """`--moe-layer-freq` as megatron-core expands it (an int N: every N-th layer from the
    first is MoE; a list: one 0/1 per layer); None when every layer is MoE."""
    freq = arg_value(args, "moe_layer_freq", 1)
    if isinstance(freq, int):
        pattern = tuple(1 if i % freq == 0 else 0 for i in range(args.num_layers))
    elif isinstance(freq, (list, tuple)):
        pattern = tuple(int(x) for x in freq)
    else:
        raise DynatrainError(f"--moe-layer-freq {freq!r}: expected an int or a list")
    return None if all(pattern) else pattern


def _position_embedding(args: Any) -> str:
    """The spec's position embedding: the learned table (a parameter) or none; every rotary
    variant (rope, yarn, mrope) holds no state."""
    kind = arg_value(args, "position_embedding_type", "learned_absolute")
    return kind if kind in ("learned_absolute", "none") else "rope"


def _position_rows(args: Any) -> Optional[int]:
    """Rows of the learned position table where they are not the sequence length (None:
    they are, or there is no table)."""
    rows = arg_value(args, "max_position_embeddings")
    if _position_embedding(args) != "learned_absolute" or rows in (None, args.seq_length):
        return None
    return int(rows)


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
        # gated linear units double fc1 (SwiGLU, quick-GeGLU)
        swiglu=bool(arg_value(args, "swiglu", False) or arg_value(args, "quick_geglu", False)),
        position_embedding_type=_position_embedding(args),
        max_position_embeddings=_position_rows(args),
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
        # without --use-distributed-optimizer every DP replica holds all optimizer state
        distributed_optimizer=bool(arg_value(args, "use_distributed_optimizer", True)),
    )
    if arg_value(args, "multi_latent_attention", False):
        kw.update(multi_latent_attention=True, q_lora_rank=arg_value(args, "q_lora_rank"),
                  **{k: arg_value(args, k) for k in ("kv_lora_rank", "qk_head_dim",
                                                     "qk_pos_emb_head_dim", "v_head_dim")})
    experts = arg_value(args, "num_experts")
    if experts:
        kw.update(
            num_moe_experts=experts,
            moe_ffn_hidden_size=arg_value(args, "moe_ffn_hidden_size"),
            moe_router_topk=arg_value(args, "moe_router_topk", 2),
            moe_token_dispatcher_type=arg_value(args, "moe_token_dispatcher_type", "allgather"),
            moe_aux_loss_coeff=float(_first(arg_value(args, "moe_aux_loss_coeff", 0.0))),
            moe_shared_expert_intermediate_size=arg_value(args, "moe_shared_expert_intermediate_size"),
            moe_layer_pattern=_moe_layer_pattern(args),
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
        decrease_batch_size_if_needed=bool(arg_value(args, "decrease_batch_size_if_needed",
                                                     False)),
    )


def layout_from_megatron_args(args: Any, spec: ModelSpec, world_size: int) -> Layout:
    """The running job's `Layout`, from Megatron-LM's validated parallel sizes."""
    tp = arg_value(args, "tensor_model_parallel_size", 1)
    pp = arg_value(args, "pipeline_model_parallel_size", 1)
    cp = arg_value(args, "context_parallel_size", 1)
    mp = tp * pp * cp
    if world_size % mp:
        raise DynatrainError(f"world size {world_size} is not a multiple of tp*pp*cp = {mp}")
    vpp = arg_value(args, "virtual_pipeline_model_parallel_size") or 1
    # with virtual stages the account-for flags, and a layout string, fix every chunk
    split = PipelineRule.from_args(args).split(spec.num_layers, pp, vpp)
    layout = Layout(tp=tp, pp=pp, dp=world_size // mp, cp=cp, vpp=vpp,
                    ep=arg_value(args, "expert_model_parallel_size", 1),
                    etp=arg_value(args, "expert_tensor_parallel_size") or 0,
                    **({"split": split} if split else _stage_split(args, spec.num_layers, pp)),
                    doi=arg_value(args, "num_distributed_optimizer_instances", 1) or 1)
    layout.check_model(spec)
    return layout


def rank_order_of(args: Any) -> str:
    """megatron-core's rank order of the job (`vps.placement.RANK_ORDERS`), as Megatron-LM's
    `initialize_model_parallel` call chooses it: tp-pp-dp with `--use-tp-pp-dp-mapping`."""
    return TP_PP_DP_ORDER if arg_value(args, "use_tp_pp_dp_mapping", False) else DEFAULT_ORDER


def _stage_split(args: Any, num_layers: int, pp: int) -> dict[str, int]:
    """`ppf`/`ppl` of the job's pipeline split: `--decoder-first/last-pipeline-num-layers`,
    or what `--account-for-embedding/loss-in-pipeline-split` make of it. Those count the
    embedding (the loss) as one more layer of the first (last) stage: with L layers on pp
    stages, every stage gets (L + the flags set) / pp, less one on the stage that holds
    the embedding (the loss), which is the uneven first (last) stage the Layout describes
    (megatron-core's `get_num_layers_to_build`, without virtual stages: with them the
    first *virtual* chunk loses the layer, which the Layout's `split` describes:
    `pipeline_split.py`)."""
    emb = bool(arg_value(args, "account_for_embedding_in_pipeline_split", False))
    loss = bool(arg_value(args, "account_for_loss_in_pipeline_split", False))
    if not (emb or loss) or pp == 1:
        return {"ppf": arg_value(args, "decoder_first_pipeline_num_layers") or 0,
                "ppl": arg_value(args, "decoder_last_pipeline_num_layers") or 0}
    total = num_layers + emb + loss
    per = total // pp
    if total % pp or per < 2:
        raise DynatrainError(f"--account-for-embedding/loss-in-pipeline-split: {num_layers} "
                             f"layers + {int(emb) + int(loss)} on pp {pp} stages leave a stage "
                             f"without a layer or do not split evenly")
    return {"ppf": per - 1 if emb else 0, "ppl": per - 1 if loss else 0}


def args_for_layout(layout: Layout, spec: ModelSpec, *, sequence_parallel: bool = False,
                    like: Any = None) -> dict[str, Any]:
    """Megatron-LM `args` values that describe `layout` (set after a switch, since
    Megatron-LM's loop, logging, data loaders and checkpointing read them).

    `sequence_parallel`: whether the job asked for it (`--sequence-parallel`); as Megatron-LM
    validates it, it holds only with TP, and an MoE job with TP always has it. `like`: the
    job's args; the options its release derives from the layout are added where they exist
    (`compat.megatron_lm.derived_layout_args`)."""
    out = _args_for_layout(layout, spec, sequence_parallel)
    if layout.split:  # every chunk's layers: the job's own flags, or a layout string
        if like is None:
            raise DynatrainError(f"layout {layout}: its split needs the job's args")
        out.update(pipeline_args(layout, spec.num_layers, like))
    elif like is not None and arg_value(like, "pipeline_model_parallel_layout") is not None:
        out["pipeline_model_parallel_layout"] = None  # ppf/ppl say where every layer lives
    if like is not None:
        from ..compat.megatron_lm import derived_layout_args

        out.update(derived_layout_args(like, out))
    return out


def _args_for_layout(layout: Layout, spec: ModelSpec, sequence_parallel: bool) -> dict[str, Any]:
    vpp = layout.vpp if layout.vpp > 1 else None
    per_vstage = None
    if vpp and not (layout.ppf or layout.ppl or layout.split):
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
        "world_size": layout.world_size,  # its throughput line divides by it
        "num_distributed_optimizer_instances": layout.doi,
        "decoder_first_pipeline_num_layers": layout.ppf or None,
        "decoder_last_pipeline_num_layers": layout.ppl or None,
        # the layout's ppf/ppl say where every layer lives (`_stage_split`): megatron-core
        # refuses them beside these flags, which would split the stages again
        "account_for_embedding_in_pipeline_split": False,
        "account_for_loss_in_pipeline_split": False,
        "padded_vocab_size": spec.padded_vocab_size(layout.tp),
        "sequence_parallel": layout.tp > 1 and (sequence_parallel or spec.is_moe),
    }


def _is_set(value: Any) -> bool:
    return value not in (None, False, 0, 0.0, "", [], ())


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


__all__ = ("LAYOUT_DEPENDENT_SETTINGS", "args_for_layout", "asked_settings",
           "chain_extra_args_providers", "layout_from_megatron_args",
           "params_dtype_of", "performance_differences", "rank_order_of", "refuse_when_parsed",
           "spec_from_megatron_args", "support_matrix", "train_config_from_megatron_args",
           "unsupported_args")
