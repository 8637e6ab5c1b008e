"""Estimated time of one training step of a layout (a documented analytic model).

Per micro-batch and pipeline stage (tokens T = micro-batch * sequence; every rank of a
model replica's TP x CP group does 1/(tp*cp) of the replica's work):
  * compute: 6 * (active parameters of the stage) * T (forward + backward matmuls;
    an MoE layer's active parameters are its dense part plus topk experts) plus the
    attention scores 12 * s * a * d * T per layer (QK^T and AV, forward and backward,
    no causal saving, as Megatron-LM's MFU accounting), plus the output layer on the last
    stage, at `achieved_tflops`;
  * TP: 4 all-gathers + 4 reduce-scatters per layer (sequence parallel; the same bytes
    as 4 all-reduces without it) of T*h activations, each moving (t-1)/t of it per rank;
  * CP: the ring exchange of K and V per layer (forward once, backward twice);
  * EP: 4 all-to-alls per MoE layer (dispatch and combine, forward and backward) of the
    rank's T*topk*h routed activations, (ep-1)/ep of them leaving the rank;
  * PP: one activation send forward and one gradient send backward per micro-batch.
Each collective runs over the link model of `dynatrain plan` (routing/cost.py): NVLink
when the group's ranks lie in one node, else the NIC, plus `collective_latency_us` per
ring step. Nothing is assumed to overlap with compute except the data-parallel part.

Step = m * slowest stage + bubble, with bubble = (pp - 1)/vpp micro-batch times (the
interleaved schedule's (pp-1)/(vpp*m) fraction), plus the distributed optimizer's
gradient reduce-scatter (grad bytes) and parameter all-gather (param bytes) over the
data-parallel group, (S-1)/S of each rank's buffer, times (1 - dp_overlap); with doi
instances, an all-reduce of the shard across instances. Everything times `step_scale`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.naming import DTYPE_BYTES
from .calibration import Calibration, Workload
from .memory import param_counts

GB = 1e9


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """Seconds of one step and its parts (the parts before `step_scale`)."""

    layout: str
    step_seconds: float
    compute_seconds: float  # m x the slowest stage's compute
    tp_seconds: float
    cp_seconds: float
    ep_seconds: float
    pp_seconds: float
    bubble_seconds: float
    dp_seconds: float
    num_microbatches: int

    def __post_init__(self) -> None:
        if not self.step_seconds >= 0 or self.num_microbatches < 1:
            raise ValueError(f"bad step estimate {self!r}")


@functools.lru_cache(maxsize=64)
def _flops_per_token(spec: ModelSpec) -> tuple[float, float, float]:
    """Training FLOPs per token of (one layer, the embedding, the output layer)."""
    dl, el, _, _ = param_counts(spec)
    active = dl + (el // spec.num_moe_experts * spec.moe_router_topk if spec.is_moe else 0)
    attn = 12.0 * spec.seq_length * spec.num_attention_heads * spec.kv_channels
    return 6.0 * active + attn, 0.0, 6.0 * spec.hidden_size * spec.vocab_size


def _ring(bytes_per_rank: float, n: int, gbps: float, latency_s: float) -> float:
    """A ring collective among `n` ranks moving `bytes_per_rank` * (n-1)/n per rank."""
    if n <= 1:
        return 0.0
    return bytes_per_rank * (n - 1) / n / (gbps * GB) + (n - 1) * latency_s


def step_estimate(spec: ModelSpec, layout: Layout, work: Workload, cal: Calibration,
                  num_microbatches: int, *, dense_buffer_elements: float = 0.0,
                  expert_buffer_elements: float = 0.0) -> StepEstimate:
    """The step time of `layout` (module doc). `*_buffer_elements`: the largest rank's
    DDP buffer elements (dense, expert) for the data-parallel traffic; 0 lets the model
    use the unpadded parameter counts."""
    L, m = layout, num_microbatches
    lat = cal.collective_latency_us * 1e-6
    ab = cal.activation_bytes
    flops = cal.achieved_tflops * 1e12
    s = work.seq_length
    T = work.micro_batch_size * s  # tokens of one micro-batch of one replica
    per_layer, _, out_flops = _flops_per_token(spec)
    # attention FLOPs scale with the workload's sequence, not the config's
    per_layer += 12.0 * (s - spec.seq_length) * spec.num_attention_heads * spec.kv_channels
    split = L.tp * L.cp
    stages = L.stage_num_layers(spec.num_layers)
    # group spans: consecutive ranks covered by a group (node-local when <= rpn)
    tp_span, cp_span = L.tp, L.tp * L.cp
    ep_span = L.etp * L.ep
    pp_span = L.tp * L.cp * L.dp * 2  # neighbouring stages
    h = spec.hidden_size
    act = T / L.cp * h * ab  # one replica's activations of a layer, per CP rank
    tp_layer = 8 * _ring(act, L.tp, cal.link_gbps(tp_span), lat)
    kv = 2 * (T / L.cp) * spec.num_query_groups * spec.kv_channels * ab / L.tp
    cp_layer = 3 * (L.cp - 1) * (kv / (cal.link_gbps(cp_span) * GB) + lat) if L.cp > 1 else 0.0
    ep_layer = 0.0
    if spec.is_moe and L.ep > 1:
        routed = T / split * spec.moe_router_topk * h * ab
        ep_layer = 4 * _ring(routed, L.ep, cal.link_gbps(ep_span), lat)
    pp_mb = 0.0
    if L.pp > 1:
        msg = act / (L.tp if cal.sequence_parallel and L.tp > 1 else 1)
        pp_mb = 2 * (msg / (cal.link_gbps(pp_span) * GB) + lat)
    worst = comp_w = tp_w = cp_w = ep_w = 0.0
    for r, n in enumerate(stages):
        c = n * per_layer * T / split / flops
        if r == L.pp - 1:
            c += out_flops * T / split / flops
        t = c + n * (tp_layer + cp_layer + ep_layer)
        if t > worst:
            worst, comp_w, tp_w = t, c, n * tp_layer
            cp_w, ep_w = n * cp_layer, n * ep_layer
    per_mb = worst + pp_mb
    bubble = (L.pp - 1) / L.vpp * per_mb
    # data parallel: reduce-scatter grads + all-gather params of the largest buffers
    dl, el, emb, out = param_counts(spec)
    if not dense_buffer_elements:
        n_max = max(stages)
        dense_buffer_elements = (n_max * dl + max(emb, out)) / L.tp
        if spec.is_moe and L.ep == 1:
            dense_buffer_elements += n_max * el / L.etp
    if not expert_buffer_elements and spec.is_moe and L.ep > 1:
        expert_buffer_elements = max(stages) * el / (L.ep * L.etp)
    pb = DTYPE_BYTES[spec.params_dtype]
    dp_span = L.tp * L.cp * L.dp
    edp_span = L.world_size // L.pp
    dp = 0.0
    for elems, S, span in ((dense_buffer_elements, L.dense_shards, dp_span),
                           (expert_buffer_elements, L.expert_shards, edp_span)):
        if elems and S > 1:
            bw = cal.link_gbps(span)
            dp += _ring(elems * cal.grad_bytes, S, bw, lat) + _ring(elems * pb, S, bw, lat)
        if elems and L.doi > 1:
            dp += 2 * _ring(elems * cal.grad_bytes / max(S, 1), L.doi, cal.inter_node_gbps, lat)
    dp *= 1.0 - cal.dp_overlap
    total = (m * per_mb + bubble + dp) * cal.step_scale
    return StepEstimate(str(layout), total, m * comp_w, m * tp_w, m * cp_w, m * ep_w,
                        m * pp_mb, bubble, dp, m)


__all__ = ["StepEstimate", "step_estimate"]
