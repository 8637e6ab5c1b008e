"""Layout-independent description of a GPT / MoE model, read from `configs/models/*.yaml`.

Pure data: the analytic layouts (planning 235B models on a laptop) and the megatron-core
builders both start from it, so the two cannot disagree about a shape.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


from .errors import ModelSpecError

# the values a model config may name (the README's support matrix is generated from them)
PARAMS_DTYPES = ("fp32", "bf16", "fp16")
POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute", "none")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
_DTYPES = PARAMS_DTYPES


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shapes and options of a megatron-core GPTModel (names follow Megatron-LM's flags)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    swiglu: bool = True
    position_embedding_type: str = "rope"
    # rows of the learned position table (`--max-position-embeddings`); None: seq_length
    max_position_embeddings: Optional[int] = None
    untie_embeddings_and_output_weights: bool = True
    normalization: str = "RMSNorm"
    add_bias_linear: bool = False
    qk_layernorm: bool = False
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: int = 2
    moe_token_dispatcher_type: str = "alltoall"
    moe_aux_loss_coeff: float = 0.0
    moe_shared_expert_intermediate_size: Optional[int] = None
    # which layers are MoE (1) and which dense (0), one entry per layer (megatron-core's
    # `moe_layer_freq` expanded); None: every layer of an MoE model is MoE
    moe_layer_pattern: Optional[tuple[int, ...]] = None
    # the experts of an MoE layer as megatron-core 0.16's GroupedMLP (`--moe-grouped-gemm`
    # with local layers): two parameters per layer, `weight1` and `weight2`, holding every
    # local expert's fc1 / fc2 (vps.naming: rule "ecols"); False: one module per expert
    moe_grouped_gemm: bool = False
    # multi-latent attention (megatron-core's local MLA spec) in place of linear_qkv: the
    # query's low rank (None: a full-rank query projection), the key-value's, and the head
    # sizes of the query-key part without / with rotary positions and of the values
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    params_dtype: str = "fp32"
    init_method_std: float = 0.02
    # built with Transformer Engine's layer spec (GPU): its fused norm+linear layers name and
    # order some parameters differently (vps.naming.TE_FUSED_NORMS); the state is the same
    transformer_engine: bool = False
    # numerics only (no state shape): megatron-core's default; Megatron-LM's is False
    # unless --attention-softmax-in-fp32 / --apply-query-key-layer-scaling
    attention_softmax_in_fp32: bool = True
    # where the fp32 main params and Adam moments live: sharded over data parallelism by
    # megatron-core's distributed optimizer (Megatron-LM's --use-distributed-optimizer), or
    # False: a plain optimizer (Float16OptimizerWithFloat16Params / FP32Optimizer) whose
    # every data-parallel replica holds all of the state of its TP/PP/EP shard
    distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                  "vocab_size", "seq_length", "make_vocab_size_divisible_by"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ModelSpecError(f"model {self.name!r}: {f} must be a positive int, got {v!r}")
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ModelSpecError(
                    f"model {self.name!r}: hidden_size {self.hidden_size} not divisible by "
                    f"num_attention_heads {self.num_attention_heads}; set kv_channels")
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_query_groups:
            raise ModelSpecError(
                f"model {self.name!r}: num_attention_heads {self.num_attention_heads} not "
                f"divisible by num_query_groups {self.num_query_groups}")
        if self.params_dtype not in _DTYPES:
            raise ModelSpecError(f"model {self.name!r}: params_dtype must be one of {_DTYPES}")
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ModelSpecError(f"model {self.name!r}: max_position_embeddings "
                                 f"{self.max_position_embeddings} < 1")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ModelSpecError(
                f"model {self.name!r}: unknown position_embedding_type "
                f"{self.position_embedding_type!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ModelSpecError(f"model {self.name!r}: unknown normalization {self.normalization!r}")
        if self.num_moe_experts is not None:
            if self.num_moe_experts <= 0:
                raise ModelSpecError(f"model {self.name!r}: num_moe_experts must be positive")
            if self.moe_ffn_hidden_size is None:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
            pat = self.moe_layer_pattern
            if pat is not None:
                object.__setattr__(self, "moe_layer_pattern", tuple(int(x) for x in pat))
                if (len(self.moe_layer_pattern) != self.num_layers
                        or set(self.moe_layer_pattern) - {0, 1}):
                    raise ModelSpecError(
                        f"model {self.name!r}: moe_layer_pattern {list(pat)} must have one 0 "
                        f"(dense) or 1 (MoE) per layer ({self.num_layers})")
            if self.moe_grouped_gemm and self.add_bias_linear:
                raise ModelSpecError(
                    f"model {self.name!r}: moe_grouped_gemm has no biases (megatron-core's "
                    f"GroupedMLP: --disable-bias-linear)")
            if not 0 < self.moe_router_topk <= self.num_moe_experts:
                raise ModelSpecError(
                    f"model {self.name!r}: moe_router_topk {self.moe_router_topk} must be in "
                    f"[1, num_moe_experts={self.num_moe_experts}]")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ModelSpecError(f"model config has unknown keys {unknown}; known: {sorted(known)}")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in d
                         and f.default is dataclasses.MISSING)
        if missing:
            raise ModelSpecError(f"model config incomplete: missing keys {missing}")
        for key, value in d.items():
            _check_type(key, value, _FIELD_TYPES[key])
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ModelSpec":
        # here, not at the top: safe_files' errors come from this package
        from ..safe_files import read_yaml

        p = Path(path)
        data = read_yaml(p, "model config", ModelSpecError)
        if not isinstance(data, dict):
            raise ModelSpecError(f"model config {str(p)!r} is not a mapping")
        data.setdefault("name", p.stem)
        return cls.from_dict(data)

    def replace(self, **kw: Any) -> "ModelSpec":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ derived shapes
    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` has experts (`moe_layer_pattern`)."""
        if not self.is_moe:
            return False
        return self.moe_layer_pattern is None or self.moe_layer_pattern[layer] == 1

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron's rule: ceil(V / (m*TP)) * m*TP; the only shape that depends on layout."""
        m = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / m) * m)

    @property
    def qkv_rows(self) -> int:
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    @property
    def fc1_rows(self) -> int:
        """Output rows of a dense MLP's fc1 (SwiGLU: [gate; up])."""
        return self.ffn_hidden_size * (2 if self.swiglu else 1)

    @property
    def moe_fc1_rows(self) -> int:
        """Output rows of an expert's fc1 (SwiGLU: [gate; up])."""
        if self.moe_ffn_hidden_size is None:
            raise ModelSpecError(f"model {self.name!r} has no moe_ffn_hidden_size")
        return self.moe_ffn_hidden_size * (2 if self.swiglu else 1)


# the annotated type of each field, as written (annotations are strings here)
_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(ModelSpec)}


def _check_type(key: str, value: Any, annotation: str) -> None:
    """A config value of the field's own type (YAML reads `four` as a string, `1e3` as a
    string, `yes` as a bool): refused with the key, so no arithmetic fails later on it."""
    optional = annotation.startswith("Optional[")
    base = annotation[len("Optional["):-1] if optional else annotation
    if value is None and optional:
        return
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "bool": isinstance(value, bool),
          "str": isinstance(value, str)}.get(base, True)
    if not ok:
        raise ModelSpecError(f"model config key {key!r} must be {'null or ' if optional else ''}"
                             f"a {base}, got {value!r}")
