"""Canonical names: layout-independent logical tensors and the local parameters that hold them.

Logical tensors (the Virtual Parameter Space) are keyed by the *global* layer index and
the *global* expert index, and have the shape of the whole unsharded weight:

    embedding.word_embeddings.weight                       [V, h]    (UNPADDED vocab)
    decoder.layers.3.self_attention.linear_qkv.weight      [(a+2g)*d, h]
    decoder.layers.3.mlp.linear_fc1.weight                 [2F, h] = [gate_full; up_full]
    decoder.layers.3.mlp.experts.5.linear_fc1.weight       [2Fe, h]
    decoder.layers.3.mlp.router.weight                     [E, h]
    decoder.final_layernorm.weight, output_layer.weight    ...

A *local* parameter is one entry of `named_parameters()` of ONE model chunk of
megatron-core's GPTModel built with `get_gpt_layer_local_spec(num_experts,
moe_grouped_gemm=False, qk_layernorm, normalization)`: layer paths use the index inside the
chunk (`decoder.layers.0...`), experts are `mlp.experts.local_experts.<i>`.

How a local tensor maps to its logical tensor (`Rule`):
  rows   column-parallel (qkv, non-GLU fc1, their biases): contiguous dim-0 block
  cols   row-parallel (linear_proj, fc2 weights): contiguous dim-1 block
  glu    GLU fc1 (stride 2): local `[gate_r; up_r]` -> two dim-0 blocks of `[gate; up]`
  vocab  embedding / output layer: dim-0 block of the PADDED vocab, clipped to rows < V
  rep    replicated (norms, router, row-parallel biases, position embedding)
  ecols  grouped experts (below): dim-0 block of the EP rank, dim-1 block of the expert-TP rank
Dense weights are split over TP, expert weights over expert-TP (`axis` "tp" / "etp").
Global expert = ep_rank * (E / EP) + local index.

Grouped experts (`moe_grouped_gemm`: megatron-core 0.16's GroupedMLP, built by its local spec
for `--moe-grouped-gemm`) keep all local experts of a layer in two parameters, read in its
forward as `weight1.view(E_l, h, X)` and `weight2.view(E_l, Y, h)` (X = gF/ETP with g = 2
for GLU, whose fc1 output is `[gate_r | up_r]`, else 1; Y = F/ETP; F the expert FFN size).
Their memory order is not megatron's checkpoint order (that is the transpose, expert by
expert), so the logical tensors are chosen in memory order, one per layer and parameter:

    decoder.layers.3.mlp.experts.weight1   [E*h*g, F]  row (e, i, j): column f = expert e's
                                                       fc1 weight [j*F + f, i] (j: gate, up)
    decoder.layers.3.mlp.experts.weight2   [E, F*h]    row e, column y*h + i = expert e's
                                                       fc2 weight [i, y]

and the local tensors viewed 2-D in memory order, `weight1` as [E_l*h*g, F/ETP] and
`weight2` as [E_l, (F/ETP)*h]: each is ONE box of its logical tensor, at rows
ep_rank * (local rows) and columns etp_rank * (local columns) (rule "ecols"). `local_shape`
is that 2-D view, not the parameter's own shape (`weight1` is [h, E_l*X] as registered). Layers per chunk follow
`Layout.stage_layers` (megatron-core's assignment: even, uneven first/last stages, or the
`split` a custom pipeline layout fixes).

Documented exception: the padded vocab rows `[V, V')` (V' = ceil(V/(m*TP))*m*TP, so their
number changes with TP) are not part of the VPS; a rank may even hold only padding rows.
With tied embeddings and PP > 1 the last stage's `output_layer.weight` is a *copy* of
`embedding.word_embeddings.weight` (same key, `tied_copy=True`); with PP = 1 it does not
exist. Position embeddings (learned_absolute) have `max_position_embeddings` rows
(`seq_length` when unset). All parameters are
assumed to have `spec.params_dtype` (Megatron-LM's Float16Module casts every parameter).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .box import Box, BoxError
from .errors import LayoutError
from .layout import Layout, RankCoords
from .model_spec import ModelSpec

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

RULES = ("rep", "rows", "cols", "glu", "vocab", "ecols")
SPLIT_AXES = ("tp", "etp")


@dataclass(frozen=True, slots=True)
class LogicalTensor:
    """One tensor of the VPS: its key, global shape and element size of the model weight."""

    key: str
    shape: tuple[int, ...]
    dtype_bytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class Block:
    """A box of a local tensor and the box of the logical tensor it holds (same shape)."""

    local: Box
    logical: Box

    def __post_init__(self) -> None:
        if self.local.shape != self.logical.shape:
            raise BoxError(f"block {self}: local and logical boxes differ in shape")

    def __str__(self) -> str:
        return f"{self.local}->{self.logical}"


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One local parameter of a model chunk, independent of the rank's TP/EP coordinates.

    `key` is the logical key, except for expert weights, whose key depends on the EP rank:
    use `logical_key(ep_rank)`.
    """

    local_name: str
    local_shape: tuple[int, ...]
    logical_shape: tuple[int, ...]
    rule: str
    axis: str  # the parallel axis that splits (or replicates) it: "tp" or "etp"
    key: str
    is_expert: bool = False
    local_expert: int = -1  # index in mlp.experts.local_experts, experts only
    num_local_experts: int = 0
    shared_embedding: bool = False  # megatron's attribute: gets its own DDP bucket
    tied_copy: bool = False  # last-stage output_layer holding embedding.word_embeddings

    def __post_init__(self) -> None:
        if self.rule not in RULES or self.axis not in SPLIT_AXES:
            raise LayoutError(f"param spec {self}: unknown rule/axis")
        if self.rule != "vocab" and any(s < 1 for s in self.local_shape):
            raise LayoutError(f"param spec {self}: empty local shape")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    def logical_key(self, ep_rank: int) -> str:
        if self.local_expert < 0:
            return self.key
        return self.key.format(e=ep_rank * self.num_local_experts + self.local_expert)


@dataclass(frozen=True, slots=True)
class LocalTensor:
    """A local parameter of a rank bound to its logical tensor.

    `blocks` map boxes of the local tensor (`local_shape`) to boxes of the logical tensor
    `key`; every block is a range of dim-0 rows of the local tensor (full trailing dims),
    so its part of a flat range is again one flat range. `blocks` is empty when the local
    tensor holds only vocab padding.
    """

    chunk: int
    local_name: str
    local_shape: tuple[int, ...]
    key: str
    blocks: tuple[Block, ...]
    spec: ParamSpec

    @property
    def vps_numel(self) -> int:
        """Elements of the local tensor that are part of the VPS (all but vocab padding)."""
        return sum(b.local.numel for b in self.blocks)

    def __str__(self) -> str:
        return (f"c{self.chunk}:{self.local_name}{list(self.local_shape)} -> {self.key} "
                + " ".join(map(str, self.blocks)))


# ---------------------------------------------------------------------------------------
# the named_parameters() of one chunk, in megatron-core's order (verified on 0.16.1)
# ---------------------------------------------------------------------------------------
class _ChunkBuilder:
    def __init__(self, spec: ModelSpec, layout: Layout) -> None:
        self.spec, self.layout = spec, layout
        self.out: list[ParamSpec] = []

    def add(self, local_name: str, key: str, logical_shape: tuple[int, ...], rule: str,
            axis: str = "tp", **kw) -> None:
        n = self.layout.tp if axis == "tp" else self.layout.etp
        shp = list(logical_shape)
        if rule in ("rows", "glu"):
            shp[0] //= n
        elif rule == "cols":
            shp[1] //= n
        elif rule == "vocab":
            shp[0] = self.spec.padded_vocab_size(self.layout.tp) // self.layout.tp
        elif rule == "ecols":
            shp[0] //= self.layout.ep
            shp[1] //= n
        self.out.append(ParamSpec(local_name, tuple(shp), tuple(logical_shape), rule, axis,
                                  key, **kw))

    def norm(self, local: str, key: str, size: int, axis: str = "tp") -> None:
        self.add(local + ".weight", key + ".weight", (size,), "rep", axis)
        if self.spec.normalization == "LayerNorm":
            self.add(local + ".bias", key + ".bias", (size,), "rep", axis)

    def fused_norm(self, layer_local: str, layer_key: str, norm: str, size: int) -> None:
        """Transformer Engine's norm fused into the next linear layer (LayerNormLinear): its
        parameters sit on that layer as `layer_norm_weight` / `layer_norm_bias`, registered
        before the layer's own weight, and keep the analytic key of the separate norm."""
        host = TE_FUSED_NORMS[norm]
        self.add(layer_local + host + ".layer_norm_weight", layer_key + norm + ".weight",
                 (size,), "rep")
        if self.spec.normalization == "LayerNorm":
            self.add(layer_local + host + ".layer_norm_bias", layer_key + norm + ".bias",
                     (size,), "rep")

    def mlp(self, local: str, key: str, ffn: int, axis: str, **kw) -> None:
        s = self.spec
        h, bias = s.hidden_size, s.add_bias_linear
        fc1_rule = "glu" if s.swiglu else "rows"
        rows = ffn * (2 if s.swiglu else 1)
        self.add(local + ".linear_fc1.weight", key + ".linear_fc1.weight", (rows, h),
                 fc1_rule, axis, **kw)
        if bias:
            self.add(local + ".linear_fc1.bias", key + ".linear_fc1.bias", (rows,),
                     fc1_rule, axis, **kw)
        self.add(local + ".linear_fc2.weight", key + ".linear_fc2.weight", (h, ffn),
                 "cols", axis, **kw)
        if bias:
            self.add(local + ".linear_fc2.bias", key + ".linear_fc2.bias", (h,), "rep",
                     axis, **kw)


    def layer_mlp(self, lp: str, kp: str, moe: bool, te: bool) -> None:
        """A layer's MLP: the router, experts and shared experts of an MoE layer, or the
        dense MLP (TE: with the pre-MLP norm fused into its fc1)."""
        s = self.spec
        if moe:
            E = s.num_moe_experts
            h = s.hidden_size
            self.add(lp + "mlp.router.weight", kp + "mlp.router.weight", (E, h), "rep")
            if s.add_bias_linear:
                self.add(lp + "mlp.router.bias", kp + "mlp.router.bias", (E,), "rep")
            nl = E // self.layout.ep
            if s.moe_grouped_gemm:
                self.grouped_experts(lp + "mlp.experts.", kp + "mlp.experts.", nl)
            for i in range(nl if not s.moe_grouped_gemm else 0):
                self.mlp(lp + f"mlp.experts.local_experts.{i}", kp + "mlp.experts.{e}",
                         s.moe_ffn_hidden_size, "etp", is_expert=True, local_expert=i,
                         num_local_experts=nl)
            if s.moe_shared_expert_intermediate_size:
                self.mlp(lp + "mlp.shared_experts", kp + "mlp.shared_experts",
                         s.moe_shared_expert_intermediate_size, "tp")
        else:
            if te:
                self.fused_norm(lp, kp, "pre_mlp_layernorm", s.hidden_size)
            self.mlp(lp + "mlp", kp + "mlp", s.ffn_hidden_size, "tp")

    def grouped_experts(self, local: str, key: str, nl: int) -> None:
        """GroupedMLP's `weight1`, `weight2` (module doc: grouped experts)."""
        s = self.spec
        h, F = s.hidden_size, s.moe_ffn_hidden_size
        g = 2 if s.swiglu else 1
        E = s.num_moe_experts
        self.add(local + "weight1", key + "weight1", (E * h * g, F), "ecols", "etp",
                 is_expert=True, num_local_experts=nl)
        self.add(local + "weight2", key + "weight2", (E, F * h), "ecols", "etp",
                 is_expert=True, num_local_experts=nl)

    def mla(self, local: str, key: str) -> None:
        """Multi-latent attention as megatron-core's local spec builds it (0.16.1): the
        output projection (row-parallel), then the column-parallel query (low-rank down and
        up, or one projection) and key-value (down, up) projections, then the query and
        key-value norms over the low ranks (with --qk-layernorm)."""
        s = self.spec
        h, heads = s.hidden_size, s.num_attention_heads
        q_head = s.qk_head_dim + s.qk_pos_emb_head_dim

        def linear(name: str, shape: tuple[int, ...], rule: str) -> None:
            self.add(local + name + ".weight", key + name + ".weight", shape, rule)

        linear("linear_proj", (h, heads * s.v_head_dim), "cols")
        if s.q_lora_rank is None:
            linear("linear_q_proj", (heads * q_head, h), "rows")
        else:
            linear("linear_q_down_proj", (s.q_lora_rank, h), "rows")
            linear("linear_q_up_proj", (heads * q_head, s.q_lora_rank), "rows")
        linear("linear_kv_down_proj", (s.kv_lora_rank + s.qk_pos_emb_head_dim, h), "rows")
        linear("linear_kv_up_proj", (heads * (s.qk_head_dim + s.v_head_dim), s.kv_lora_rank),
               "rows")
        if s.qk_layernorm:
            if s.q_lora_rank is not None:
                self.norm(local + "q_layernorm", key + "q_layernorm", s.q_lora_rank)
            self.norm(local + "kv_layernorm", key + "kv_layernorm", s.kv_lora_rank)


def _check_divisible(spec: ModelSpec, layout: Layout) -> None:
    errs = layout.model_errors(spec)
    if errs:
        raise LayoutError(f"layout {layout} cannot hold model {spec.name!r}: " + "; ".join(errs))


@functools.cache
def chunk_param_specs(spec: ModelSpec, layout: Layout, pp_rank: int,
                      chunk: int) -> tuple[ParamSpec, ...]:
    """`named_parameters()` of model chunk `chunk` (vp stage) on pipeline rank `pp_rank`."""
    _check_divisible(spec, layout)
    if not (0 <= pp_rank < layout.pp and 0 <= chunk < layout.vpp):
        raise LayoutError(f"layout {layout}: no chunk {chunk} on pp rank {pp_rank}")
    s, b = spec, _ChunkBuilder(spec, layout)
    h, d = s.hidden_size, s.kv_channels
    pre = pp_rank == 0 and chunk == 0
    post = pp_rank == layout.pp - 1 and chunk == layout.vpp - 1
    tied_pp = s.tied and layout.pp > 1
    if pre:
        b.add("embedding.word_embeddings.weight", "embedding.word_embeddings.weight",
              (s.vocab_size, h), "vocab", shared_embedding=tied_pp)
        if s.position_embedding_type == "learned_absolute":
            b.add("embedding.position_embeddings.weight", "embedding.position_embeddings.weight",
                  (s.max_position_embeddings or s.seq_length, h), "rep")
    te = s.transformer_engine
    for j, L in enumerate(layout.stage_layers(s.num_layers, pp_rank, chunk)):
        lp, kp = f"decoder.layers.{j}.", f"decoder.layers.{L}."
        moe = s.is_moe_layer(L)  # an MoE model may have dense layers (moe_layer_pattern)
        if not te:
            b.norm(lp + "input_layernorm", kp + "input_layernorm", h)
        if s.multi_latent_attention:
            b.mla(lp + "self_attention.", kp + "self_attention.")
            if not te or moe:
                b.norm(lp + "pre_mlp_layernorm", kp + "pre_mlp_layernorm", h)
            b.layer_mlp(lp, kp, moe, te)
            continue
        # SelfAttention registers linear_qkv first, but named_parameters() yields
        # linear_proj first: megatron builds linear_proj before linear_qkv (checked on 0.16.1)
        b.add(lp + "self_attention.linear_proj.weight", kp + "self_attention.linear_proj.weight",
              (h, s.num_attention_heads * d), "cols")
        if s.add_bias_linear:
            b.add(lp + "self_attention.linear_proj.bias", kp + "self_attention.linear_proj.bias",
                  (h,), "rep")
        if te:
            b.fused_norm(lp, kp, "input_layernorm", h)
        b.add(lp + "self_attention.linear_qkv.weight", kp + "self_attention.linear_qkv.weight",
              (s.qkv_rows, h), "rows")
        if s.add_bias_linear:
            b.add(lp + "self_attention.linear_qkv.bias", kp + "self_attention.linear_qkv.bias",
                  (s.qkv_rows,), "rows")
        if s.qk_layernorm:
            b.norm(lp + "self_attention.q_layernorm", kp + "self_attention.q_layernorm", d)
            b.norm(lp + "self_attention.k_layernorm", kp + "self_attention.k_layernorm", d)
        if not te or moe:  # TE fuses it into a dense MLP's fc1; MoE keeps a TENorm
            b.norm(lp + "pre_mlp_layernorm", kp + "pre_mlp_layernorm", h)
        b.layer_mlp(lp, kp, moe, te)
    if post:
        b.norm("decoder.final_layernorm", "decoder.final_layernorm", h)
        if not s.tied:
            b.add("output_layer.weight", "output_layer.weight", (s.vocab_size, h), "vocab")
        elif layout.pp > 1:
            b.add("output_layer.weight", "embedding.word_embeddings.weight", (s.vocab_size, h),
                  "vocab", shared_embedding=True, tied_copy=True)
    return tuple(b.out)


# Transformer Engine's layer spec (`get_gpt_layer_with_transformer_engine_spec`) has no
# separate input / pre-MLP norm in a dense layer: each is fused into the linear layer that
# follows it (TE LayerNormLinear), whose parameters then include the norm's. Analytic norm
# (module of a layer) -> the layer module that holds it.
TE_FUSED_NORMS = {"input_layernorm": "self_attention.linear_qkv",
                  "pre_mlp_layernorm": "mlp.linear_fc1"}
_TE_LOCAL = re.compile(r"^(decoder\.layers\.\d+\.)(self_attention\.linear_qkv|mlp\.linear_fc1)"
                       r"\.layer_norm_(weight|bias)$")
_TE_HOST_NORM = {host: norm for norm, host in TE_FUSED_NORMS.items()}


def analytic_param_name(name: str) -> str:
    """The local-spec name of a parameter named by TE's spec: a fused norm parameter
    (`decoder.layers.3.self_attention.linear_qkv.layer_norm_weight`) becomes the separate
    norm's (`decoder.layers.3.input_layernorm.weight`); every other name is the same in
    both specs and is returned unchanged."""
    m = _TE_LOCAL.match(name)
    if m is None:
        return name
    return f"{m.group(1)}{_TE_HOST_NORM[m.group(2)]}.{m.group(3)}"


def local_blocks(p: ParamSpec, spec: ModelSpec, layout: Layout,
                 coords: RankCoords) -> tuple[Block, ...]:
    """Blocks (local box -> logical box) of parameter `p` on a rank at `coords`."""
    i = coords.tp if p.axis == "tp" else coords.etp
    ls = p.local_shape
    nd = len(ls)
    if p.rule == "rep":
        full = Box.full(ls)
        return (Block(full, full),)
    if p.rule == "rows":
        return (Block(Box.full(ls), Box((i * ls[0],) + (0,) * (nd - 1), ls)),)
    if p.rule == "cols":
        return (Block(Box.full(ls), Box((0, i * ls[1]) + (0,) * (nd - 2), ls)),)
    if p.rule == "ecols":
        return (Block(Box.full(ls), Box((coords.ep * ls[0], i * ls[1]), ls)),)
    if p.rule == "glu":
        half = ls[0] // 2
        ffn = p.logical_shape[0] // 2
        shp = (half,) + ls[1:]
        z = (0,) * (nd - 1)
        return (Block(Box((0,) + z, shp), Box((i * half,) + z, shp)),
                Block(Box((half,) + z, shp), Box((ffn + i * half,) + z, shp)))
    # vocab: rows [i*r, (i+1)*r) of the padded vocab, of which rows < V are in the VPS
    r = ls[0]
    keep = min(r, p.logical_shape[0] - i * r)
    if keep <= 0:
        return ()
    shp = (keep,) + ls[1:]
    return (Block(Box.full(shp), Box((i * r,) + (0,) * (nd - 1), shp)),)


def local_tensors(spec: ModelSpec, layout: Layout, coords: RankCoords) -> list[LocalTensor]:
    """Every local parameter of a rank (all its chunks, named_parameters order)."""
    out: list[LocalTensor] = []
    for c in range(layout.vpp):
        for p in chunk_param_specs(spec, layout, coords.pp, c):
            out.append(LocalTensor(c, p.local_name, p.local_shape, p.logical_key(coords.ep),
                                   local_blocks(p, spec, layout, coords), p))
    return out


@functools.cache
def logical_tensors(spec: ModelSpec) -> tuple[LogicalTensor, ...]:
    """Every tensor of the VPS of `spec` (layout independent), in model order."""
    one = Layout(vpp=1)  # tp1pp1: holds every layer and expert once
    nb = DTYPE_BYTES[spec.params_dtype]
    out: list[LogicalTensor] = []
    seen: set[str] = set()
    for p in chunk_param_specs(spec, one, 0, 0):
        k = p.logical_key(0)  # ep1: local expert i is global expert i
        if k not in seen:
            seen.add(k)
            out.append(LogicalTensor(k, p.logical_shape, nb))
    return tuple(out)


def logical_tensor_map(spec: ModelSpec) -> dict[str, LogicalTensor]:
    return {t.key: t for t in logical_tensors(spec)}


def param_numel(spec: ModelSpec) -> int:
    """Parameters of the model (VPS elements of one kind)."""
    return sum(t.numel for t in logical_tensors(spec))


__all__ = ["DTYPE_BYTES", "RULES", "TE_FUSED_NORMS", "Block", "LocalTensor", "LogicalTensor", "ParamSpec",
           "analytic_param_name", "chunk_param_specs", "local_blocks", "local_tensors", "logical_tensors",
           "logical_tensor_map", "param_numel"]
