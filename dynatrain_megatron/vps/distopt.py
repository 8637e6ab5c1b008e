"""Distributed-optimizer ownership, computed exactly as megatron-core 0.16.1 does.

Sources mirrored (megatron/core/...):
  distributed/distributed_data_parallel.py  DistributedDataParallel.__init__
      * one DDP (so one set of buffers) per model chunk (VPP stage);
      * params with `allreduce=False` go to the expert buffers (on the intra expert-DP
        group), the rest to the dense buffers (on the intra DP x CP group); in 0.16.1 the
        local ColumnParallel/RowParallelLinear set `allreduce = not (is_expert and EP > 1)`,
        so with EP = 1 expert weights live in the DENSE buffer;
      * buffers are grouped by (param dtype, grad dtype): one per group here, since every
        parameter has the model's dtype;
      * `bucket_size = None` (one bucket) when `disable_bucketing` or pp_rank > 0;
        Megatron-LM's get_model passes `disable_bucketing = (model_chunk_idx > 0)`.
  distributed/param_and_grad_buffer.py  _ParamAndGradBuffer.__init__
      * params in REVERSE named_parameters() order; each param start padded to 64;
      * a bucket closes once its unpadded size reaches bucket_size; a `shared_embedding`
        param (tied embedding / output layer with PP > 1) closes the open bucket before it
        and gets a bucket of its own;
      * each bucket end padded to lcm(S, 128) (lcm(S, 128, 2**16) with
        pad_buckets_for_high_nccl_busbw), S = size of the buffer's data-parallel group.
  optimizer/distrib_optimizer.py  _build_model_gbuf_range / _build_model_gbuf_param_range_map
      * shard r owns [bucket.offset + r*n_b/S, bucket.offset + (r+1)*n_b/S) of every bucket;
      * the owned part of a param is `param_range_map["param"]`: a flat range of the
        TP-local parameter tensor. Main params and Adam moments use the same ranges.

The shard index r is the rank in the DP x CP group (cp + CP*dp) for dense buffers and the
expert-DP rank for expert buffers (one distributed-optimizer instance).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .errors import LayoutError

PARAM_ALIGN = 64
BUCKET_ALIGN = 128


@dataclass(frozen=True, slots=True)
class Bucket:
    """A bucket of a buffer: `[offset, offset + numel)`, `numel` padded."""

    index: int
    offset: int
    numel: int
    numel_unpadded: int

    def shard(self, shard_index: int, shard_size: int) -> tuple[int, int]:
        """Buffer range owned by shard `shard_index` (megatron's `gbuf_world` range)."""
        n = self.numel // shard_size
        return self.offset + shard_index * n, self.offset + (shard_index + 1) * n


@dataclass(frozen=True, slots=True)
class BufferParam:
    """A parameter's place in a buffer: `[start, end)` in buffer coordinates."""

    local_name: str
    numel: int
    start: int
    bucket: int

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True, slots=True)
class BufferLayout:
    """The layout of one `_ParamAndGradBuffer` (params in buffer order, i.e. reversed)."""

    chunk: int
    is_expert: bool
    shard_size: int
    params: tuple[BufferParam, ...]
    buckets: tuple[Bucket, ...]

    def __post_init__(self) -> None:
        if self.numel % self.shard_size:
            raise LayoutError(f"buffer of chunk {self.chunk}: {self.numel} elements not "
                              f"divisible by its shard group size {self.shard_size}")

    @property
    def numel(self) -> int:
        return self.buckets[-1].offset + self.buckets[-1].numel if self.buckets else 0

    @property
    def numel_unpadded(self) -> int:
        return sum(b.numel_unpadded for b in self.buckets)

    def owned_param_ranges(self, shard_index: int) -> list[tuple[str, int, int]]:
        """`(local_name, start, stop)` flat ranges of the TP-local params owned by a shard.

        In buffer order; params the shard owns nothing of are left out.
        """
        S = self.shard_size
        if not 0 <= shard_index < S:
            raise LayoutError(f"shard index {shard_index} outside group of size {S}")
        rng = [b.shard(shard_index, S) for b in self.buckets]
        out = []
        for p in self.params:
            lo, hi = rng[p.bucket]
            s, e = max(lo, p.start), min(hi, p.start + p.numel)
            if e > s:
                out.append((p.local_name, s - p.start, e - p.start))
        return out

    def owned_prefix_counts(self, prefix_numel: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """For every shard index: owned elements, and owned params, counting only the first
        `prefix_numel[i]` flat elements of param i (its VPS part; see naming, vocab).

        Vectorised over all shard indices: O((P + S*B) log P) with numpy.
        """
        S = self.shard_size
        starts = np.fromiter((p.start for p in self.params), np.int64, len(self.params))
        plen = np.asarray(prefix_numel, dtype=np.int64)
        keep = plen > 0
        starts, plen = starts[keep], plen[keep]
        ends = starts + plen
        cum = np.concatenate(([0], np.cumsum(plen)))
        off = np.fromiter((b.offset for b in self.buckets), np.int64, len(self.buckets))
        n = np.fromiter((b.numel // S for b in self.buckets), np.int64, len(self.buckets))
        r = np.arange(S, dtype=np.int64)
        lo = off[None, :] + r[:, None] * n[None, :]  # [S, B]
        hi = lo + n[None, :]

        def covered(x: np.ndarray) -> np.ndarray:  # VPS elements in [0, x)
            if not len(starts):
                return np.zeros_like(x)
            i = np.searchsorted(starts, x, side="right") - 1
            ic = np.maximum(i, 0)
            part = np.clip(x - starts[ic], 0, plen[ic])
            return np.where(i >= 0, cum[ic] + part, 0)

        elems = (covered(hi) - covered(lo)).sum(axis=1)
        # params i with start_i < hi and end_i > lo (intervals are disjoint and sorted)
        cnt = (np.searchsorted(starts, hi, side="left")
               - np.searchsorted(ends, lo, side="right")).sum(axis=1)
        return elems, cnt

    def __str__(self) -> str:
        kind = "expert" if self.is_expert else "dense"
        return (f"{kind} buffer c{self.chunk} S={self.shard_size}: {self.numel} "
                f"({self.numel_unpadded} unpadded), buckets "
                + " ".join(f"[{b.offset}:{b.offset + b.numel})" for b in self.buckets))


def build_buffer_layout(params: Sequence[tuple[str, int, bool]], shard_size: int,
                        bucket_size: Optional[int], *, chunk: int = 0, is_expert: bool = False,
                        pad_buckets_for_high_nccl_busbw: bool = False) -> BufferLayout:
    """Mirror of `_ParamAndGradBuffer.__init__` with the distributed optimizer on.

    `params`: `(local_name, numel, shared_embedding)` in named_parameters() order.
    `bucket_size`: the value DDP passes (None = one bucket).
    """
    if shard_size < 1:
        raise LayoutError(f"shard group size must be >= 1, got {shard_size}")
    div = math.lcm(shard_size, BUCKET_ALIGN)
    if pad_buckets_for_high_nccl_busbw:
        div = math.lcm(div, 2 ** 16)

    def pad(x: int, m: int) -> int:
        return -(-x // m) * m

    placed: list[BufferParam] = []
    buckets: list[Bucket] = []
    start = 0
    bucket_start = 0
    n_in_bucket = 0
    end = 0

    def close(param_end: int) -> int:
        nonlocal bucket_start, n_in_bucket
        bucket_end = pad(param_end, div)
        buckets.append(Bucket(len(buckets), bucket_start, bucket_end - bucket_start,
                              param_end - bucket_start))
        bucket_start, n_in_bucket = bucket_end, 0
        return bucket_end

    for name, numel, shared in reversed(params):
        start = pad(start, PARAM_ALIGN)
        if shared and n_in_bucket:
            start = close(start)  # megatron closes at the *padded* start: same numbers
        end = start + numel
        placed.append(BufferParam(name, numel, start, len(buckets)))
        n_in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            start = close(end)
        else:
            start = end
    if n_in_bucket:
        close(end)
    return BufferLayout(chunk, is_expert, shard_size, tuple(placed), tuple(buckets))


def resolve_bucket_size(bucket_size: Optional[int], overlap_grad_reduce: bool,
                        dp: int) -> Optional[int]:
    """The bucket size DDP resolves from its config (before the per-chunk rule below):
    None without overlap_grad_reduce, else `bucket_size` or max(4e7, 1e6 * DP) (DP
    without CP: DDP's `dp_group`)."""
    if not overlap_grad_reduce:
        return None
    return bucket_size if bucket_size is not None else max(40_000_000, 1_000_000 * dp)


def effective_bucket_size(bucket_size: Optional[int], pp_rank: int, chunk: int,
                          bucket_chunks_after_first: bool = False) -> Optional[int]:
    """The bucket size DDP of (pp_rank, chunk) uses.

    `bucket_size` is the resolved `DistributedDataParallelConfig.bucket_size` (None when
    overlap_grad_reduce is off; megatron's default is max(4e7, 1e6 * dp)). DDP itself drops
    it on pp ranks > 0; Megatron-LM's get_model drops it for chunks > 0
    (`disable_bucketing`), unless a builder does otherwise (`bucket_chunks_after_first`).
    """
    if bucket_size is None or pp_rank > 0 or (chunk > 0 and not bucket_chunks_after_first):
        return None
    if bucket_size < 1:
        raise LayoutError(f"bucket_size must be >= 1 or None, got {bucket_size}")
    return bucket_size


__all__ = ["Bucket", "BufferParam", "BufferLayout", "build_buffer_layout",
           "effective_bucket_size", "resolve_bucket_size", "PARAM_ALIGN", "BUCKET_ALIGN"]
