"""What a Megatron-LM job may use with `--dynatrain`, and why the rest is refused.

Layout B is built by Megatron-LM itself (`builder.py`), so an option that only changes what
the model computes or how the loop trains (rotary base and scaling, activations, dropout,
fused kernels, recompute, the LR schedule, loss options, ...) carries over with nothing of
ours. What stays refused is listed in `REFUSALS`, one row per reason, each with its class:

* `restart`: Megatron-LM's own restart (`--save` at A, `--load` at B) cannot do it either;
* `hardware`: it needs hardware this project cannot test on (handled by design, unverified);
* `not_yet`: Megatron-LM's restart can, but the switch cannot yet.

A model the analytic layout (`vps/`) does not describe (`plans_from_metadata`) is switched
by plans made from every rank's live sharded metadata instead.

`unsupported_args(args)` reads only flags (no derived values), so it runs on the parsed
command line, before Megatron-LM builds anything; `support_matrix()` gives the rows the
README's and `docs/recipes.md`'s tables are generated from.

Pure argument handling: no megatron import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

CLASSES = ("restart", "hardware", "not_yet")


def _v(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _set(value: Any) -> bool:
    return value not in (None, False, 0, 0.0, "", [], ())


@dataclass(frozen=True)
class Refusal:
    """Options refused for one reason. `flags`: as a user types them; `test(args)`: the
    offending flags of `args` (empty: none set); `why`: the reason, one line."""

    flags: str
    cls: str
    why: str
    test: Callable[[Any], list[str]]

    def __post_init__(self) -> None:
        if self.cls not in CLASSES:
            raise ValueError(f"refusal {self.flags!r}: class {self.cls!r} not in {CLASSES}")


def _flags(*names: str) -> Callable[[Any], list[str]]:
    """A test naming each of `names` (attribute names) that is set."""
    return lambda a: ["--" + n.replace("_", "-") for n in names if _set(_v(a, n))]


def _optimizer(a: Any) -> list[str]:
    opt = _v(a, "optimizer", "adam")
    return [] if opt == "adam" else [f"--optimizer {opt}"]


def _te_layers(a: Any) -> list[str]:
    out = []
    te = _v(a, "transformer_impl", "transformer_engine") == "transformer_engine"
    if te and _set(_v(a, "multi_latent_attention")):
        out.append("--multi-latent-attention with --transformer-impl transformer_engine")
    if te and _set(_v(a, "num_experts")) and _set(_v(a, "moe_grouped_gemm")):
        out.append("--moe-grouped-gemm with --transformer-impl transformer_engine")
    return out


def _attention_variant(a: Any) -> list[str]:
    variant = _v(a, "experimental_attention_variant")
    return [] if variant is None else [f"--experimental-attention-variant {variant}"]


def _mtp_tied(a: Any) -> list[str]:
    if _set(_v(a, "mtp_num_layers")) and not _v(a, "untie_embeddings_and_output_weights", False):
        return ["--mtp-num-layers without --untie-embeddings-and-output-weights"]
    return []


def plans_from_metadata(args: Any) -> list[str]:
    """The options of `args` whose state the analytic layout (`vps/`) does not describe:
    a job with any is planned from every rank's live metadata of A and B
    (`transition.metadata_exchange`) instead of the analytic layout."""
    out = [f for f, n in (("--mtp-num-layers", "mtp_num_layers"),
                           ("--moe-router-enable-expert-bias", "moe_router_enable_expert_bias"),
                           # per-layer attention and MLP shapes, no-op or linear blocks
                           ("--heterogeneous-layers-config-path",
                            "heterogeneous_layers_config_path"),
                           # a user's layer-spec module builds what the analytic layout
                           # cannot know
                           ("--spec", "spec"),
                           # the distributed optimizer's shards follow megatron-core's bucket
                           # cuts and padding: read from its own bookkeeping (`gbuf_ranges`)
                           ("--ddp-num-buckets", "ddp_num_buckets"),
                           ("--ddp-pad-buckets-for-high-nccl-busbw",
                            "ddp_pad_buckets_for_high_nccl_busbw"))
            if _set(_v(args, n))]
    # Qwen2's attention biases without the other linear biases (Megatron-LM sets
    # add_qkv_bias with --add-bias-linear too: biases everywhere, which the analytic
    # layout describes)
    if _v(args, "add_qkv_bias", False) and not _v(args, "add_bias_linear", True):
        out.append("--add-qkv-bias")
    return out


def _context_parallel_variants(a: Any) -> list[str]:
    # hierarchical sizes of 1 split nothing (CP 1: megatron-core's groups of one rank)
    sizes = _v(a, "hierarchical_context_parallel_sizes") or []
    out = ["--hierarchical-context-parallel-sizes"] if any(n > 1 for n in sizes) else []
    return out + _flags("hybrid_context_parallel")(a)


def _hardware(a: Any) -> list[str]:
    out = [f for f, n in (("--fp8-format", "fp8"), ("--fp4-format", "fp4")) if _set(_v(a, n))]
    impl = _v(a, "cuda_graph_impl", "none")
    if impl not in (None, "none"):
        out.append(f"--cuda-graph-impl {impl}")
    return out + _flags("use_sharp")(a)


REFUSALS: tuple[Refusal, ...] = (
    Refusal("--use-legacy-models", "restart",
            "the legacy models have no sharded metadata: dist_checkpointing cannot reshard "
            "them", _flags("use_legacy_models")),
    Refusal("--optimizer sgd / muon / other than adam, --use-layer-wise-distributed-optimizer",
            "restart",
            "Megatron-LM's own --load cannot resume an SGD job, even at the layout that "
            "saved it: it calls the optimizer's state initialiser, which megatron-core "
            "defines for Adam but not SGD (TypeError). Its distributed optimizer "
            "refuses SGD when built (both checked on the CPU, core_v0.16.1 and "
            "core_v0.19.0). Muon, Lion and SOAP come from NVIDIA's emerging_optimizers, "
            "which is not on PyPI and cannot be installed here, so neither a restart nor a "
            "switch of them can be run (untested); their layer-wise state is not read by the "
            "switch",
            lambda a: _optimizer(a) + _flags("use_layer_wise_distributed_optimizer")(a)),
    Refusal("--use-torch-fsdp2, --use-megatron-fsdp, --use-custom-fsdp", "hardware",
            "Megatron-LM's FSDP needs CUDA and NCCL: with --use-torch-fsdp2 its argument "
            "validation puts the data-parallel group on a high-priority NCCL stream, which "
            "fails without NCCL (torch.distributed.ProcessGroupNCCL, both releases); "
            "Megatron-FSDP places its buffers on cuda:<device>. Their optimizer state lives in "
            "FSDP's own shards (fsdp_dtensor checkpoints), which the switch does not read "
            "(unverified)",
            _flags("use_torch_fsdp2", "use_megatron_fsdp", "use_custom_fsdp")),
    Refusal("--mtp-num-layers with tied embeddings", "restart",
            "Megatron-LM's own --save cannot write multi-token prediction with tied "
            "embeddings at PP > 1 (it asserts, core_v0.16.1), so no restart to such a layout "
            "exists to switch like", _mtp_tied),
    Refusal("--moe-grouped-gemm or --multi-latent-attention with TE layers, "
            "--use-precision-aware-optimizer, --optimizer-cpu-offload", "hardware",
            "need Transformer Engine, which needs CUDA (unverified). TE's layers are in "
            "megatron-core's sharded metadata (TEGroupedMLP's weight<i> per expert, TE's "
            "fused MLA projections) and would be planned from it. Their _extra_state (FP8 "
            "scaling state, an object) is carried as dist_checkpointing loads it, as checked "
            "with a CPU module's extra state. The precision-aware optimizer is "
            "TE's FusedAdam (megatron-core hands it the moments' dtypes, which torch's Adam "
            "does not take). CPU offload requires it (Megatron-LM's arguments), and the "
            "switch does not read their reduced-precision moments or host copies",
            lambda a: _te_layers(a) + _flags("use_precision_aware_optimizer",
                                             "optimizer_cpu_offload")(a)),
    Refusal("--experimental-attention-variant (gated_delta_net, dsa)", "hardware",
            "Megatron-LM builds these layers only with Transformer Engine, which needs CUDA: "
            "on the CPU its own job fails with either variant, asserting with "
            "--transformer-impl local and missing TE's spec provider otherwise (checked, "
            "core_v0.16.1 and core_v0.19.0); gated_delta_net also needs "
            "flash-linear-attention's triton kernels. Their state would be planned from the "
            "live metadata (unverified)", _attention_variant),
    Refusal("--hierarchical-context-parallel-sizes, --hybrid-context-parallel", "hardware",
            "need Transformer Engine's attention, which needs CUDA (unverified). Megatron-LM's "
            "own CPU job fails with either (checked on core_v0.19.0): hierarchical sizes above 1 "
            "need CP > 1, and the local DotProductAttention asserts 'Context parallelism is only "
            "supported by TEDotProductAttention'. Hybrid CP trains packed sub-sequences "
            "(packed_seq_params), which the local attention refuses, and its data wrapper "
            "fails Megatron-LM's own step on the CPU ('data iterator is not wrapped with "
            "RerunDataIterator')",
            _context_parallel_variants),
    Refusal("--fp8-format, --fp4-format, --cuda-graph-impl, --use-sharp", "hardware",
            "needs Hopper/Blackwell kernels, CUDA graphs or a SHARP fabric. B would be built by "
            "Megatron-LM. TE's FP8 scaling state (_extra_state, a sharded object) is carried "
            "as dist_checkpointing loads it: A's main replica to every rank holding it at B. "
            "A CPU module's extra state checks that; FP8 itself never switched (unverified). "
            "SHARP is turned on through the environment while megatron-core "
            "makes its own data-parallel groups, which B's, made later, would not get",
            _hardware),
    Refusal("--perform-rl-step", "hardware",
            "Megatron-LM's RL loop generates with megatron-core's dynamic inference engine, "
            "which needs CUDA: its attention asserts FlashAttention 2.7.3 or later for dynamic "
            "batching (checked on the CPU, core_v0.16.1 and core_v0.19.0), and core_v0.19.0's "
            "context pins host memory. The loop also holds the first layout's inference engine, "
            "which a switch would have to rebuild at B (unverified)", _flags("perform_rl_step")),
)


def unsupported_args(args: Any) -> list[str]:
    """One line per refused option of `args`: the flag and the reason (module doc)."""
    out = []
    for r in REFUSALS:
        for flag in r.test(args):
            out.append(f"{flag}: {r.why}")
    return out


def unlike_analytic(args: Any) -> tuple[str, ...]:
    """Key prefixes of the model tensors the analytic layout names but the job of `args`
    shapes otherwise: a heterogeneous model's layers (`--heterogeneous-layers-config-path`:
    per-layer query groups and MLP sizes, no-op or linear blocks), where the analytic layout
    repeats one layer. Its switches are planned from the live metadata
    (`plans_from_metadata`); these tensors are left out of the check against the analytic
    layout, the embedding, final norm and output layer are still checked."""
    return ("decoder.layers.",) if _v(args, "heterogeneous_layers_config_path") else ()


# what the switch is checked to carry inside real Megatron-LM (tests named), beside what it
# refuses: the rows of the README's support matrix
SUPPORTED: tuple[tuple[str, str], ...] = (
    ("dense GPT, TP/PP/VPP/DP/CP changes, fp32, bf16 and fp16 (dynamic loss scaling: each "
     "optimizer's scaler carried, tests/test_megatron_lm_moe_variants.py::fp16), tied or "
     "untied embeddings, "
     "LayerNorm or RMSNorm, GQA, SwiGLU, biases or none. --use-tp-pp-dp-mapping (A's groups "
     "read as a placement). A --pipeline-model-parallel-layout, kept by switches that keep "
     "PP x VPP; another PP or VPP needs B's split named in the request (split<n>-<n>-...), "
     "else it is refused when requested. --account-for-embedding/loss-in-pipeline-split "
     "with virtual stages (each chunk's layers: the Layout's split)",
     "tests/test_megatron_lm_train.py"),
    ("Llama-3.1 recipe: --rotary-base 500000 --use-rope-scaling, GQA, SwiGLU, RMSNorm, "
     "untied, no biases, bf16; --lr-decay-style WSD, --lr-warmup-init. A user's --spec "
     "module; --account-for-embedding-in-pipeline-split (the Layout's ppf); "
     "--add-qkv-bias (Qwen2's attention biases without the others); "
     "--ddp-num-buckets with --ddp-pad-buckets-for-high-nccl-busbw (the distributed "
     "optimizer's shards read from its own bookkeeping). Planned from the live metadata",
     "tests/test_megatron_lm_recipes.py::llama"),
    ("MoE: top-k routing with the aux loss, shared experts, --moe-layer-freq dense/MoE "
     "patterns, --qk-layernorm, --moe-grouped-gemm (local layers), EP changes; "
     "--account-for-loss-in-pipeline-split (the Layout's ppl); --train-samples with "
     "--rampup-batch-size, switched inside the ramp (core_v0.16.1). Expert-TP changes with "
     "TP, SP and PP (etp1 -> etp2; no MoE biases, which Megatron-LM allows only at ETP 1)",
     "tests/test_megatron_lm_recipes.py::qwen_moe, tests/test_megatron_lm_moe_variants.py::etp"),
    ("DeepSeek recipe: multi-latent attention (--multi-latent-attention, --q-lora-rank, "
     "--kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim, --qk-layernorm), "
     "local layers. Aux-loss-free MoE (--moe-router-score-function sigmoid "
     "--moe-router-enable-expert-bias: the router's expert bias, a buffer, carried). "
     "Multi-token prediction (--mtp-num-layers 1, untied, with the last stage's embedding "
     "copy). These two are planned from every rank's live sharded metadata. No "
     "--use-distributed-optimizer (plain DDP: each piece moved from one DP replica)",
     "tests/test_megatron_lm_recipes.py::deepseek"),
    ("Llama-Nemotron-NAS-shaped heterogeneous layers (--heterogeneous-layers-config-path, "
     "core_v0.19.0, local layers): per-layer MLP sizes, no-op attention or MLP, attention "
     "and MLP replaced by linear layers; planned from the live metadata. "
     "--decrease-batch-size-if-needed: B's batch rounded down at its DP, as the restart's. "
     "No virtual stages (Megatron-LM builds none for these layers, its restart fails too): "
     "a vpp layout is refused when requested",
     "tests/test_megatron_lm_recipes.py::nemotron_nas"),
    ("any option that changes no state shape (activations, dropout, fusions, recompute, "
     "attention backend, loss options, rotary variants): carried by B, built by Megatron-LM",
     "megatron_lm/builder.py"),
)


def support_matrix() -> list[dict[str, str]]:
    """Rows for the README's support matrix: supported recipes (with the test that checks
    each) then every refusal with its class and reason."""
    rows = [{"what": what, "status": "switches in memory", "why": f"checked: {where}"}
            for what, where in SUPPORTED]
    label = {"restart": "refused (Megatron-LM's restart cannot either)",
             "hardware": "refused (needs hardware we cannot test)",
             "not_yet": "refused (not done yet)"}
    rows += [{"what": r.flags, "status": label[r.cls], "why": r.why} for r in REFUSALS]
    return rows


def support_markdown() -> str:
    """`support_matrix()` as a markdown table."""
    lines = ["| Megatron-LM job | `--dynatrain` | why |", "|---|---|---|"]
    for row in support_matrix():
        lines.append(f"| {row['what']} | {row['status']} | {row['why']} |")
    return "\n".join(lines) + "\n"


__all__ = ("CLASSES", "REFUSALS", "Refusal", "plans_from_metadata", "support_markdown",
           "support_matrix", "unlike_analytic", "unsupported_args")
