"""Peak memory per device of a layout: exact training state + modelled activations.

State (exact, from the analytic layout: the DDP buffers and distributed-optimizer shards
megatron-core 0.16.1 allocates, vps/distopt.py):
  * the parameter buffer: every local parameter, bucket and alignment padding included,
    in the parameter dtype (with the distributed optimizer the parameters are views of it);
  * the gradient buffer: the same elements in the gradient dtype (`grad_bytes`);
  * the optimizer shard: for the elements the rank owns (vocab padding rows included,
    bucket padding excluded), the Adam moments (fp32, two) and the fp32 main copy when the
    parameters are not fp32 (for fp32 parameters the main copy is a view of the buffer).
This is what `state_bytes_per_rank` returns; tests compare it with the distinct storages
of live megatron-core jobs, byte for byte.

Activations (a documented model: Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4): bytes stored per transformer layer
and micro-batch, s = sequence / cp, b = micro-batch, h = hidden, a = heads, t = TP,
written for `activation_bytes` = 2 as in the paper and generalised to GQA, SwiGLU and
MoE by counting the same tensors:
  attention  2sbh (QKV input) + 2sb(a + 2g)d (Q, K, V) + 2sbh (projection input)
             + sbh (dropout mask) [+ 5abs^2 softmax / mask / scores unless flash attention]
  MLP        2sbh (fc1 input) + 2sb*fc1_rows (fc1 output) + 2sb*ffn (activation output)
             + sbh (dropout mask); an MoE layer stores, for each of a rank's tokens
             routed topk times, the expert input (all-gathered over expert-TP: x etp)
             and the fc1 / activation outputs, plus the router's 2sbh input
  norms      4sbh
With the paper's GPT (4h MLP, a = g) this is sbh(34 + 5as/h). Tensor parallelism divides
everything inside the TP region by t; sequence parallelism divides the rest by t too
(the paper's 10sbh term: norms, QKV / fc1 inputs, dropout masks); without it that part
is replicated. The last stage also holds the fp32 logits of one micro-batch, 4sbV/t.
In-flight micro-batches: pipeline rank r holds the activations of `warmup + 1` forward
passes (megatron-core's schedules): pp - r for 1F1B, and 2(pp - r - 1) + (vpp - 1)pp + 1
model chunks (each 1/vpp of the stage) for the interleaved schedule, never more than the
step's micro-batches. Peak = max over ranks of state + activations; `reserve_bytes` is
added by the caller.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..vps.analytic import OPT_DTYPE_BYTES, analytic_layout
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.naming import DTYPE_BYTES, logical_tensors
from .calibration import Calibration, Workload


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Training-state bytes of one rank, by part."""

    param: int
    grad: int
    main_param: int
    optimizer: int  # Adam moments

    @property
    def total(self) -> int:
        return self.param + self.grad + self.main_param + self.optimizer


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Peak bytes per device of a layout: its worst rank's state plus activations."""

    layout: str
    state_bytes: int  # the largest per-rank state
    activation_bytes: int  # the largest per-rank activations
    peak_bytes: int  # max over ranks of state + activations (reserve not included)
    worst_stage: int  # pipeline stage of the worst rank

    def __post_init__(self) -> None:
        if min(self.state_bytes, self.activation_bytes, self.peak_bytes, self.worst_stage) < 0:
            raise ValueError(f"negative memory estimate {self!r}")


def state_bytes_per_rank(spec: ModelSpec, layout: Layout, bucket_size: Optional[int] = None,
                         grad_bytes: Optional[int] = None) -> list[StateBytes]:
    """Exact training-state bytes of every rank of `layout` (module doc). `grad_bytes`:
    gradient element size (default: fp32, megatron's main_grad)."""
    pb = DTYPE_BYTES[spec.params_dtype]
    gb = OPT_DTYPE_BYTES if grad_bytes is None else grad_bytes
    nopt = 2 + (spec.params_dtype != "fp32")
    L = layout
    Sd, Se = L.dense_shards, L.expert_shards
    buf, dense, expert = _stage_tables(spec, layout, bucket_size)
    out = []
    for r in range(L.world_size):
        c = L.coords(r)
        owned = int(dense[c.pp, c.dp_cp % Sd] + expert[c.pp, c.edp % Se])
        n = int(buf[c.pp])
        out.append(StateBytes(n * pb, n * gb, owned * OPT_DTYPE_BYTES * (nopt - 2),
                              owned * OPT_DTYPE_BYTES * 2))
    return out


def state_bytes_by_stage(spec: ModelSpec, layout: Layout, bucket_size: Optional[int] = None,
                         grad_bytes: Optional[int] = None) -> np.ndarray:
    """The largest state bytes of each pipeline stage (array of `pp`), computed from the
    per-(stage, shard) tables without visiting every rank."""
    pb = DTYPE_BYTES[spec.params_dtype]
    gb = OPT_DTYPE_BYTES if grad_bytes is None else grad_bytes
    per_owned = OPT_DTYPE_BYTES * (2 + (spec.params_dtype != "fp32"))
    L = layout
    out = np.zeros(L.pp, np.int64)
    bufs, dense_t, expert_t = _stage_tables(spec, layout, bucket_size)
    for pp in range(L.pp):
        n, dense, expert = int(bufs[pp]), dense_t[pp], expert_t[pp]
        # every (dense shard, expert shard) pair occurs on some rank of the stage when
        # either group is 1; otherwise the ranks pair them by position: visit them
        if L.dense_shards == 1 or L.expert_shards == 1:
            worst = int(dense.max()) + int(expert.max())
        else:
            dc, ed = _stage_shard_pairs(L)
            worst = int((dense[dc] + expert[ed]).max())
        out[pp] = n * (pb + gb) + worst * per_owned
    return out


def _stage_tables(spec: ModelSpec, layout: Layout, bucket_size: Optional[int]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pipeline stage: DDP buffer elements, and owned optimizer elements per dense and
    per expert shard index (arrays [pp], [pp, Sd], [pp, Se]).

    Chunks with the same role (first chunk of the first stage: the embedding and the only
    bucketed buffer; last chunk of the last stage: the output layer) and the same number of
    layers have the same local parameters (local names number layers from 0), hence the
    same buffers: each such class is built once."""
    an = analytic_layout(spec, layout, bucket_size)
    L = layout
    buf = np.zeros(L.pp, np.int64)
    dense = np.zeros((L.pp, L.dense_shards), np.int64)
    expert = np.zeros((L.pp, L.expert_shards), np.int64)
    seen: dict[tuple, tuple[int, np.ndarray, np.ndarray]] = {}
    for pp in range(L.pp):
        for chunk in range(L.vpp):
            key = (pp == 0 and chunk == 0, pp == L.pp - 1 and chunk == L.vpp - 1,
                   len(L.stage_layers(spec.num_layers, pp, chunk)))
            got = seen.get(key)
            if got is None:
                n, d, e = 0, np.zeros(L.dense_shards, np.int64), np.zeros(L.expert_shards,
                                                                           np.int64)
                for b in an.buffers(pp, chunk):
                    n += b.numel
                    if spec.distributed_optimizer:
                        el, _ = b.owned_prefix_counts([p.numel for p in b.params])
                    else:  # plain DDP: every replica owns all of its parameters' state
                        el = sum(p.numel for p in b.params)
                    if b.is_expert:
                        e = e + el
                    else:
                        d = d + el
                got = seen[key] = (n, d, e)
            buf[pp] += got[0]
            dense[pp] += got[1]
            expert[pp] += got[2]
    return buf, dense, expert


@functools.lru_cache(maxsize=256)
def _stage_shard_pairs(L: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(dense shard index, expert shard index) of the ranks of pipeline stage 0 (every
    stage has the same pairs: pp is the slowest axis of both grids)."""
    n = L.world_size // L.pp
    rank = np.arange(n, dtype=np.int64)
    r = rank // L.tp
    dp_cp = r % L.cp + L.cp * ((r // L.cp) % L.dp)
    edp = (rank // (L.etp * L.ep)) % L.edp
    return dp_cp % L.dense_shards, edp % L.expert_shards


@functools.lru_cache(maxsize=64)
def param_counts(spec: ModelSpec) -> tuple[int, int, int, int]:
    """(dense elements per layer, expert elements per layer (all experts), elements of
    the embedding, elements of the output layer + final norm) of `spec`, unpadded."""
    dense_layer = expert_layer = emb = out = 0
    for t in logical_tensors(spec):
        if t.key.startswith("decoder.layers.0."):
            if ".experts." in t.key and "shared_experts" not in t.key:
                expert_layer += t.numel
            else:
                dense_layer += t.numel
        elif t.key.startswith("embedding."):
            emb += t.numel
        elif not t.key.startswith("decoder.layers."):
            out += t.numel
    return dense_layer, expert_layer, emb, out


def state_lower_bound(spec: ModelSpec, layout: Layout, grad_bytes: int = 4) -> np.ndarray:
    """A cheap lower bound on each stage's largest per-rank state bytes (no padding, norms
    split as if TP-sharded, the optimizer shard at its mean): prunes layouts that cannot
    fit before the exact computation. Tests check it never exceeds
    `state_bytes_by_stage`."""
    L = layout
    dl, el, emb, out = param_counts(spec)
    pb = DTYPE_BYTES[spec.params_dtype]
    per_owned = OPT_DTYPE_BYTES * (2 + (spec.params_dtype != "fp32"))
    expert_split = L.ep * L.etp
    dense_shards = L.dense_shards if spec.distributed_optimizer else 1
    expert_shards = L.expert_shards if L.ep > 1 else L.dense_shards
    if not spec.distributed_optimizer:
        expert_shards = 1
    stages = L.stage_num_layers(spec.num_layers)
    best = np.zeros(L.pp)
    for i, n in enumerate(stages):
        d = n * dl / L.tp + (emb / L.tp if i == 0 else 0) + (out / L.tp if i == L.pp - 1 else 0)
        e = n * el / expert_split
        v = (d + e) * (pb + grad_bytes) + (d / dense_shards + e / expert_shards) * per_owned
        best[i] = np.floor(v)
    return best


def layer_activation_bytes(spec: ModelSpec, layout: Layout, work: Workload,
                           cal: Calibration) -> float:
    """Activation bytes one transformer layer stores for one micro-batch on one rank."""
    s = work.seq_length / layout.cp
    b = work.micro_batch_size
    h, a, g, d = spec.hidden_size, spec.num_attention_heads, spec.num_query_groups, \
        spec.kv_channels
    t = layout.tp
    sp = cal.sequence_parallel and t > 1
    k = cal.activation_bytes / 2  # the paper's constants are for 2-byte activations
    # parts inside the TP region (split by t) and outside it (split only with SP)
    inside = 2 * s * b * (a + 2 * g) * d + 2 * s * b * h + (0 if cal.flash_attention
                                                            else 5 * a * s * s * b)
    outside = 2 * s * b * h + s * b * h + 4 * s * b * h  # QKV input, proj dropout, norms
    if spec.is_moe:
        f = spec.moe_ffn_hidden_size
        topk = spec.moe_router_topk
        rows = spec.moe_fc1_rows
        # a rank's tokens (s*b/t with sequence parallelism) go topk times to experts; ETP
        # all-gathers them over its etp ranks and splits the expert's width by etp, so
        # each rank stores etp x the inputs and the full-width share of the outputs
        expert = topk * s * b / t * (2 * h * layout.etp + 2 * rows + 2 * f)
        outside += 2 * s * b * h + s * b * h  # router / dispatcher input, dropout mask
        mlp_inside = 0.0
    else:
        expert = 0.0
        mlp_inside = 2 * s * b * spec.fc1_rows + 2 * s * b * spec.ffn_hidden_size
        outside += 2 * s * b * h + s * b * h  # fc1 input, dropout mask
    return k * ((inside + mlp_inside) / t + outside / (t if sp else 1) + expert)


def in_flight(layout: Layout, pp_rank: int, num_microbatches: int) -> float:
    """Stages' worth of activations pipeline rank `pp_rank` holds at its peak (module doc):
    micro-batches in flight times the fraction of the stage each one covers."""
    p, v = layout.pp, layout.vpp
    if p == 1:
        return 1.0
    if v == 1:
        return float(min(num_microbatches, p - pp_rank))
    chunks = min(num_microbatches * v, 2 * (p - pp_rank - 1) + (v - 1) * p + 1)
    return chunks / v


def activation_bytes_by_stage(spec: ModelSpec, layout: Layout, work: Workload,
                              cal: Calibration, num_microbatches: int) -> np.ndarray:
    """Peak activation bytes of each pipeline stage (module doc)."""
    per_layer = layer_activation_bytes(spec, layout, work, cal)
    stages = layout.stage_num_layers(spec.num_layers)
    out = np.empty(layout.pp)
    for r, n in enumerate(stages):
        out[r] = n * per_layer * in_flight(layout, r, num_microbatches)
    s = work.seq_length / layout.cp
    out[-1] += 4 * s * work.micro_batch_size * spec.padded_vocab_size(layout.tp) / layout.tp
    return out


def memory_estimate(spec: ModelSpec, layout: Layout, work: Workload, cal: Calibration,
                    num_microbatches: int, bucket_size: Optional[int] = None
                    ) -> MemoryEstimate:
    """Exact state plus modelled activations of `layout`'s worst rank (reserve excluded)."""
    st = state_bytes_by_stage(spec, layout, bucket_size, cal.grad_bytes)
    act = activation_bytes_by_stage(spec, layout, work, cal, num_microbatches)
    tot = st + act
    worst = int(np.argmax(tot))
    return MemoryEstimate(str(layout), int(st.max()), int(act.max()), int(tot[worst]), worst)


__all__ = ["StateBytes", "MemoryEstimate", "state_bytes_per_rank", "state_bytes_by_stage",
           "state_lower_bound", "layer_activation_bytes", "activation_bytes_by_stage",
           "in_flight", "memory_estimate", "param_counts"]
