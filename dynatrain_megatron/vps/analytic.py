"""The analytic layout: every rank's fragments, as a pure function of (model, layout).

Work is done per logical tensor and per rank *class*, never per pair of ranks:
  * local parameters depend only on (tp, pp, ep, etp) coordinates (cached per class);
  * DDP buffer layouts depend only on (pp rank, chunk); the data-parallel shard index
    (dense: dp_cp, expert: edp) only selects which range of each bucket a rank owns;
  * per-rank byte totals for all ranks are numpy gathers from small per-(pp, tp, shard)
    tables, so 235B MoE on 4096 ranks takes milliseconds.

Replica rule. A local tensor lives in one DDP buffer whose data-parallel group ("shard
group", size S: DPxCP for dense buffers, expert-DP for expert buffers) holds identical
copies of it and splits its optimizer state. Ranks outside the shard group that hold the
same content form further *copies* of the shard group, numbered `copy`:
    dense, TP-split                  copy = 0 (the tied last-stage output layer: 1)
    dense, TP-replicated             copy = tp
    expert (EP > 1), ETP-split       copy = 0
    expert (EP > 1), ETP-replicated  copy = etp
    expert (EP = 1: dense buffer)    copy = tp // ETP (ETP-split), tp (ETP-replicated)
With `doi` distributed-optimizer instances (megatron's partial distributed optimizer)
the data-parallel group of size N splits into `doi` blocks of S = N / doi consecutive
ranks; each block shards the optimizer state on its own, so the same shard exists once
per instance (`instance = dp_index // S`, `shard_index = dp_index % S`). Then
    param:                         replica = copy * N + dp_index
    main_param, exp_avg(_sq):      replica = copy * doi + instance
                                   (fragments exist only for owned ranges)
so the replica-0 fragments cover each logical tensor exactly once for every kind: for the
parameter, shard index 0 of copy 0; for optimizer state, the disjoint owned ranges of all
shard indices of copy 0 (they partition every local tensor).

Without the distributed optimizer (`ModelSpec.distributed_optimizer` False: megatron-core's
`Float16OptimizerWithFloat16Params` or `FP32Optimizer` under plain DDP) every rank owns the
whole of each local tensor's optimizer state, replicated exactly as the parameter is:
    main_param, exp_avg(_sq):      replica = copy * N + dp_index   (the parameter's)
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .box import Box
from .distopt import BufferLayout, build_buffer_layout, effective_bucket_size
from .errors import LayoutError
from .fragment import KINDS, OPT_KINDS, Fragment
from .layout import Layout, RankCoords
from .model_spec import ModelSpec
from .naming import (DTYPE_BYTES, LocalTensor, LogicalTensor, ParamSpec, chunk_param_specs,
                     local_tensors, logical_tensors)

OPT_DTYPE_BYTES = 4  # fp32 main params and Adam moments


@dataclass(frozen=True, slots=True)
class RankSummary:
    """What one rank holds of the VPS (vocab padding excluded)."""

    rank: int
    tensors: int  # local params holding VPS elements
    owned_tensors: int  # local params of which the rank owns optimizer state
    param_bytes: int
    main_param_bytes: int
    exp_avg_bytes: int
    exp_avg_sq_bytes: int

    @property
    def bytes(self) -> dict[str, int]:
        return {"param": self.param_bytes, "main_param": self.main_param_bytes,
                "exp_avg": self.exp_avg_bytes, "exp_avg_sq": self.exp_avg_sq_bytes}


def _vps_prefix(p: ParamSpec, spec: ModelSpec, tp_rank: int) -> int:
    """VPS elements of `p` on a rank with TP index `tp_rank`: a prefix of its flat order."""
    if p.rule != "vocab":
        return p.numel
    r = p.local_shape[0]
    keep = max(0, min(r, spec.vocab_size - tp_rank * r))
    return keep * math.prod(p.local_shape[1:])


class AnalyticLayout:
    """Fragments and sizes of every rank of `layout` training `spec` (see module doc)."""

    def __init__(self, spec: ModelSpec, layout: Layout, bucket_size: Optional[int] = None,
                 *, bucket_chunks_after_first: bool = False,
                 pad_buckets_for_high_nccl_busbw: bool = False) -> None:
        layout.check_model(spec)
        if layout.doi > 1 and not spec.distributed_optimizer:
            raise LayoutError(f"layout {layout}: doi{layout.doi} distributed-optimizer "
                              f"instances need the distributed optimizer (model "
                              f"{spec.name!r} is trained without it)")
        if spec.is_moe and layout.ep == 1 and layout.tp % layout.etp:
            # megatron-core 0.16.1 keeps expert weights in the dense buffer when EP = 1;
            # its DP x CP shard groups would then mix different expert-TP shards
            raise LayoutError(
                f"layout {layout}: with ep1, etp {layout.etp} must divide tp {layout.tp} "
                f"(megatron-core 0.16.1 shards expert weights over the dense DPxCP group)")
        self.spec, self.layout = spec, layout
        self.bucket_size = bucket_size
        self.bucket_chunks_after_first = bucket_chunks_after_first
        self._pad_busbw = pad_buckets_for_high_nccl_busbw
        self._class_cache: dict[tuple[int, int, int, int], list[LocalTensor]] = {}
        self._buffer_cache: dict[tuple[int, int], list[BufferLayout]] = {}
        self._tables: Optional[dict[str, np.ndarray]] = None

    def __repr__(self) -> str:
        return (f"AnalyticLayout({self.spec.name!r}, {self.layout}, "
                f"bucket_size={self.bucket_size})")

    # ------------------------------------------------------------------ structure
    @property
    def logical_tensors(self) -> tuple[LogicalTensor, ...]:
        return logical_tensors(self.spec)

    def chunk_params(self, pp_rank: int, chunk: int) -> tuple[ParamSpec, ...]:
        return chunk_param_specs(self.spec, self.layout, pp_rank, chunk)

    def in_expert_buffer(self, p: ParamSpec) -> bool:
        """megatron-core 0.16.1: `allreduce = not (is_expert and EP > 1)`."""
        return p.is_expert and self.layout.ep > 1

    def buffers(self, pp_rank: int, chunk: int) -> list[BufferLayout]:
        """DDP buffers of a model chunk: the dense one, then the expert one (if any)."""
        k = (pp_rank, chunk)
        got = self._buffer_cache.get(k)
        if got is None:
            L = self.layout
            bs = effective_bucket_size(self.bucket_size, pp_rank, chunk,
                                       self.bucket_chunks_after_first)
            params = self.chunk_params(pp_rank, chunk)
            got = []
            for expert, S in ((False, L.dense_shards), (True, L.expert_shards)):
                group = [(p.local_name, p.numel, p.shared_embedding) for p in params
                         if self.in_expert_buffer(p) == expert]
                if group:
                    got.append(build_buffer_layout(
                        group, S, bs, chunk=chunk, is_expert=expert,
                        pad_buckets_for_high_nccl_busbw=self._pad_busbw))
            self._buffer_cache[k] = got
        return got

    def local_tensors(self, rank: int) -> list[LocalTensor]:
        """Local params of `rank` (all chunks, named_parameters order) with their blocks.

        Each item has `chunk, local_name, local_shape, key, blocks` (+ its ParamSpec).
        """
        c = self.layout.coords(rank)
        k = (c.tp, c.pp, c.ep, c.etp)
        got = self._class_cache.get(k)
        if got is None:
            got = local_tensors(self.spec, self.layout, c)
            self._class_cache[k] = got
        return got

    def dp_index(self, p: ParamSpec, c: RankCoords) -> tuple[int, int]:
        """(size of the data-parallel group of the buffer holding `p`, the rank's index)."""
        if self.in_expert_buffer(p):
            return self.layout.edp, c.edp
        return self.layout.dp_cp, c.dp_cp

    def shard_index(self, p: ParamSpec, c: RankCoords) -> tuple[int, int, int]:
        """(shard group size S, index of the rank in it, distributed-optimizer instance)
        of the buffer holding `p`: instance i owns the data-parallel block [i*S, (i+1)*S)."""
        n, i = self.dp_index(p, c)
        S = n // self.layout.doi
        return S, i % S, i // S

    def copy_index(self, p: ParamSpec, c: RankCoords) -> int:
        """Which copy of its shard group a rank's tensor is (module doc, replica rule)."""
        if p.tied_copy:
            return 1
        rep = p.rule == "rep"
        if p.axis == "tp":
            return c.tp if rep else 0
        if self.in_expert_buffer(p):
            return c.etp if rep else 0
        return c.tp if rep else c.tp // self.layout.etp

    def opt_replica(self, p: ParamSpec, c: RankCoords) -> int:
        """Replica number of the optimizer state a rank holds of `p` (module doc)."""
        if not self.spec.distributed_optimizer:
            n, idx = self.dp_index(p, c)
            return self.copy_index(p, c) * n + idx
        return self.copy_index(p, c) * self.layout.doi + self.shard_index(p, c)[2]

    def owned_ranges(self, rank: int) -> dict[tuple[int, str], tuple[int, int]]:
        """`(chunk, local_name) -> (start, stop)`: megatron's `param_range_map["param"]`,
        the flat range of the TP-local param whose optimizer state `rank` owns (vocab
        padding included; params it owns nothing of are absent). Without the distributed
        optimizer: every local param, whole."""
        c = self.layout.coords(rank)
        out: dict[tuple[int, str], tuple[int, int]] = {}
        if not self.spec.distributed_optimizer:
            for chunk in range(self.layout.vpp):
                for p in self.chunk_params(c.pp, chunk):
                    out[(chunk, p.local_name)] = (0, p.numel)
            return out
        for chunk in range(self.layout.vpp):
            for buf in self.buffers(c.pp, chunk):
                r = (c.edp if buf.is_expert else c.dp_cp) % buf.shard_size
                for name, s, e in buf.owned_param_ranges(r):
                    out[(chunk, name)] = (s, e)
        return out

    # ------------------------------------------------------------------ fragments
    def fragments(self, rank: int, kinds: Sequence[str] = KINDS) -> list[Fragment]:
        """Fragments of `rank`, grouped by kind in `KINDS` order, then model order."""
        bad = [k for k in kinds if k not in KINDS]
        if bad:
            raise LayoutError(f"unknown state kinds {bad}; known: {KINDS}")
        c = self.layout.coords(rank)
        lts = self.local_tensors(rank)
        out: list[Fragment] = []
        if "param" in kinds:
            for lt in lts:
                n, idx = self.dp_index(lt.spec, c)
                rep = self.copy_index(lt.spec, c) * n + idx
                for b in lt.blocks:
                    out.append(Fragment(lt.key, "param", b.logical, rank, rep, lt.chunk,
                                        lt.local_name, b.local.offsets))
        opt = [k for k in OPT_KINDS if k in kinds]
        if not opt:
            return out
        owned = self.owned_ranges(rank)
        pieces: list[tuple[LocalTensor, int, Box, Box]] = []
        for lt in lts:
            rng = owned.get((lt.chunk, lt.local_name))
            if rng is None or not lt.blocks:
                continue
            s, e = rng
            inner = math.prod(lt.local_shape[1:])
            # replicas: the TP copies, and the same shard in every optimizer instance (or,
            # without the distributed optimizer, every data-parallel replica)
            copy = self.opt_replica(lt.spec, c)
            for b in lt.blocks:  # blocks are dim-0 row ranges: one flat range each
                b0 = b.local.offsets[0] * inner
                cs, ce = max(s, b0), min(e, b0 + b.local.shape[0] * inner)
                if ce > cs:
                    for box in Box.from_flat_range(lt.local_shape, cs, ce):
                        pieces.append((lt, copy, box,
                                       box.translate(b.local.offsets, b.logical.offsets)))
        for kind in opt:
            for lt, copy, lbox, gbox in pieces:
                out.append(Fragment(lt.key, kind, gbox, rank, copy, lt.chunk, lt.local_name,
                                    lbox.offsets))
        return out

    # ------------------------------------------------------------------ sizes
    def _rank_coords_arrays(self) -> dict[str, np.ndarray]:
        L = self.layout
        rank = np.arange(L.world_size, dtype=np.int64)
        r = rank // L.tp
        cp, dp, pp = r % L.cp, (r // L.cp) % L.dp, r // (L.cp * L.dp)
        r2 = rank // L.etp
        return {"tp": rank % L.tp, "pp": pp, "dp_cp": cp + L.cp * dp,
                "edp": (r2 // L.ep) % L.edp}

    def _build_tables(self) -> dict[str, np.ndarray]:
        L, spec = self.layout, self.spec
        PP, TP, Sd, Se = L.pp, L.tp, L.dense_shards, L.expert_shards
        pnum = np.zeros((PP, TP), np.int64)
        ntens = np.zeros((PP, TP), np.int64)
        dense = np.zeros((PP, TP, Sd), np.int64)
        dense_n = np.zeros((PP, TP, Sd), np.int64)
        expert = np.zeros((PP, Se), np.int64)
        expert_n = np.zeros((PP, Se), np.int64)
        for pp in range(PP):
            for chunk in range(L.vpp):
                params = {p.local_name: p for p in self.chunk_params(pp, chunk)}
                vocab = any(p.rule == "vocab" for p in params.values())
                for t in range(TP if vocab else 1):
                    pre = [_vps_prefix(p, spec, t) for p in params.values()]
                    sl = slice(t, t + 1) if vocab else slice(None)
                    pnum[pp, sl] += sum(pre)
                    ntens[pp, sl] += sum(1 for x in pre if x)
                # without the distributed optimizer a rank owns all it holds (below)
                for buf in self.buffers(pp, chunk) if spec.distributed_optimizer else ():
                    bp = [params[q.local_name] for q in buf.params]
                    bvocab = any(p.rule == "vocab" for p in bp)
                    for t in range(TP if bvocab else 1):
                        el, n = buf.owned_prefix_counts([_vps_prefix(p, spec, t) for p in bp])
                        if buf.is_expert:
                            expert[pp] += el
                            expert_n[pp] += n
                        else:
                            sl = slice(t, t + 1) if bvocab else slice(None)
                            dense[pp, sl] += el
                            dense_n[pp, sl] += n
        a = self._rank_coords_arrays()
        pp, tp = a["pp"], a["tp"]
        if not spec.distributed_optimizer:  # each rank owns the state of all it holds
            return {"param_numel": pnum[pp, tp], "tensors": ntens[pp, tp],
                    "owned_numel": pnum[pp, tp], "owned_tensors": ntens[pp, tp]}
        dc, ed = a["dp_cp"] % Sd, a["edp"] % Se  # the shard index inside an instance
        opt = dense[pp, tp, dc] + expert[pp, ed]
        return {"param_numel": pnum[pp, tp], "tensors": ntens[pp, tp],
                "owned_numel": opt, "owned_tensors": dense_n[pp, tp, dc] + expert_n[pp, ed]}

    def _table(self, name: str) -> np.ndarray:
        if self._tables is None:
            self._tables = self._build_tables()
        return self._tables[name]

    def bytes_per_rank(self) -> dict[str, np.ndarray]:
        """Bytes of each state kind held by every rank (arrays indexed by rank)."""
        pb = self._table("param_numel") * DTYPE_BYTES[self.spec.params_dtype]
        ob = self._table("owned_numel") * OPT_DTYPE_BYTES
        return {"param": pb, "main_param": ob, "exp_avg": ob.copy(), "exp_avg_sq": ob.copy()}

    def summary(self, rank: int) -> RankSummary:
        self.layout.coords(rank)  # validates the rank
        pb = int(self._table("param_numel")[rank]) * DTYPE_BYTES[self.spec.params_dtype]
        ob = int(self._table("owned_numel")[rank]) * OPT_DTYPE_BYTES
        return RankSummary(rank, int(self._table("tensors")[rank]),
                           int(self._table("owned_tensors")[rank]), pb, ob, ob, ob)

    def summaries(self) -> list[RankSummary]:
        return [self.summary(r) for r in range(self.layout.world_size)]


@functools.lru_cache(maxsize=64)
def analytic_layout(spec: ModelSpec, layout: Layout, bucket_size: Optional[int] = None, *,
                    bucket_chunks_after_first: bool = False,
                    pad_buckets_for_high_nccl_busbw: bool = False) -> AnalyticLayout:
    """The (memoised) analytic layout of `layout` training `spec`.

    `bucket_size`: the resolved DDP bucket size (None = one bucket per buffer); it applies
    to chunk 0 on pp rank 0 only, as DDP + Megatron-LM's get_model do (see distopt).
    """
    return AnalyticLayout(spec, layout, bucket_size,
                          bucket_chunks_after_first=bucket_chunks_after_first,
                          pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw)


__all__ = ["AnalyticLayout", "RankSummary", "analytic_layout", "OPT_DTYPE_BYTES"]
