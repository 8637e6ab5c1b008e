"""Every rank's live metadata of A and B, gathered on every rank: what a metadata plan is made of.

Where the analytic layout does not describe the model (`plans_from_metadata`), each rank
reads its own state's coordinates at A and at B from megatron-core's sharded metadata
(`adapters.live.LiveState`: keys, global boxes, local places, the optimizer's owned ranges)
and one all-gather over the world gives every rank everyone's. It runs inside the switch's
preparation, in the background while A trains, on B's transfer group (which nothing else
uses until the transfer). It is small: one record per (parameter box, kind), the three
optimizer kinds sharing their boxes and sent once.

The plan (`routing.metadata_plan`) and the vocabulary padding plan made from it depend only
on the gathered records, so they are the same on every rank.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch.distributed as dist

from ..adapters.live import LiveState
from ..routing.metadata_plan import MetadataPlan, StateRecord, metadata_plan
from ..vps.fragment import KINDS, OPT_KINDS
from .vocab_padding import Holding, PaddingPlan, padding_plan_from

log = logging.getLogger("dynatrain")

PLAN_SOURCES = ("analytic", "metadata")


def plans_from_metadata(builder: Any) -> bool:
    """Whether a switch made with `builder` is planned from the live metadata (its
    `plan_from`; the analytic layout by default)."""
    how = getattr(builder, "plan_from", "analytic")
    if how not in PLAN_SOURCES:
        raise ValueError(f"builder.plan_from must be one of {PLAN_SOURCES}, got {how!r}")
    return how == "metadata"


def unlike_analytic(builder: Any) -> tuple[str, ...]:
    """Key prefixes of tensors the analytic layout names but `builder`'s models shape
    otherwise (its `unlike_analytic`; none by default): left out of the check of live
    against analytic fragments, which only a plan from the live metadata allows."""
    prefixes = tuple(getattr(builder, "unlike_analytic", ()))
    if prefixes and not plans_from_metadata(builder):
        raise ValueError(f"builder.unlike_analytic {prefixes} needs plan_from='metadata'")
    return prefixes


def _flat_lo(shape: Sequence[int], offsets: Sequence[int]) -> int:
    return sum(o * math.prod(shape[i + 1:]) for i, o in enumerate(offsets))


def _side(live: Optional[LiveState], device: int, kinds: tuple[str, ...]) -> tuple:
    """This rank's part of one side: (records, padding holdings, global shapes, buffer
    records, sharded objects). Records of the optimizer kinds are sent once, as
    `main_param` (they share their boxes); buffers (no optimizer state) always, whatever
    `kinds`; the objects as (unique key, device, main replica) (`object_carry`)."""
    if live is None:
        return [], [], {}, [], []
    if live.unplaced:
        raise ValueError(f"megatron-core's sharded metadata names state that is neither a "
                         f"parameter nor a buffer here: {live.unplaced[:3]}")
    one = tuple(k for k in kinds if k == "param") + (("main_param",) if any(
        k in OPT_KINDS for k in kinds) else ())
    recs = [(f.key, f.kind, f.box.offsets, f.box.shape, device, f.chunk, f.local_name,
             f.local_offsets, live.params[f.chunk][f.local_name].element_size()
             if f.kind == "param" else 4) for f in live.fragments(one)]
    pads = []
    for f in live.padding_fragments(one):
        # padded vocab tensors are split by rows only: a box's global flat range
        cols = live.shape_of(f.chunk, f.local_name)[1:]
        lo = _flat_lo((0,) + tuple(cols), f.box.offsets)
        pads.append((f.key, f.kind, lo, lo + f.box.numel, device))
    bufs = [(f.key, "param", f.box.offsets, f.box.shape, device, f.chunk, f.local_name,
             f.local_offsets, live.buffers[f.chunk][f.local_name].element_size())
            for f in live.buffer_fragments]
    objs = [(s.unique_key, device, s.main) for s in live.objects]
    return recs, pads, dict(live.global_shapes), bufs, objs


def _expand(rows: Sequence[tuple], kinds: tuple[str, ...]) -> list[tuple]:
    out = []
    for r in rows:
        if r[1] == "main_param":
            out += [(r[0], k) + tuple(r[2:]) for k in kinds if k in OPT_KINDS]
        elif r[1] in kinds:
            out.append(r)
    return out


@dataclass
class GatheredMetadata:
    """Everyone's records of both sides (what `metadata_plan` takes)."""

    # the buffers' records are among them, as "param" records (`buffers`: whether any)
    src: list[StateRecord] = field(default_factory=list)
    dst: list[StateRecord] = field(default_factory=list)
    src_padding: list[Holding] = field(default_factory=list)
    dst_padding: list[Holding] = field(default_factory=list)
    src_shapes: dict = field(default_factory=dict)
    dst_shapes: dict = field(default_factory=dict)
    buffers: bool = False
    # the sharded objects: A's (unique key, device, main replica), B's (unique key, device)
    src_objects: list = field(default_factory=list)
    dst_objects: list = field(default_factory=list)
    payload_bytes: int = 0
    seconds: float = 0.0


def _merge_shapes(into: dict, got: dict, side: str, errors: list[str]) -> None:
    for k, v in got.items():
        if into.setdefault(k, tuple(v)) != tuple(v):
            errors.append(f"{k}: ranks of {side} disagree on its global shape")


def gather_metadata(src_live: Optional[LiveState], dst_live: Optional[LiveState],
                    kinds: Sequence[str], group: Any = None,
                    error: Optional[str] = None) -> GatheredMetadata:
    """Collective over `group` (every rank of the world, each with its own bindings at A
    and at B, None where it holds nothing there): every rank's records, on every rank.
    A rank that failed before (`error`) or here still joins; then every rank raises
    ValueError with every rank's reasons."""
    import pickle

    t0 = time.perf_counter()
    kinds = tuple(k for k in KINDS if k in set(kinds))
    me = dist.get_rank()
    mine: Any = error
    if error is None:
        try:
            mine = (_side(src_live, me, kinds), _side(dst_live, me, kinds))
        except Exception as e:  # noqa: BLE001 - sent to every rank, raised below
            mine = f"rank {me}: reading the live metadata: {type(e).__name__}: {e}"
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    failed = [x for x in everyone if isinstance(x, str)]
    if failed:
        raise ValueError("gathering the live metadata failed: " + "; ".join(failed[:4]))
    out = GatheredMetadata(payload_bytes=len(pickle.dumps(mine)))
    errors: list[str] = []
    for a, b in everyone:
        out.src_objects += a[4]
        out.dst_objects += [(k, dev) for k, dev, _ in b[4]]
        for (recs, pads, shapes, bufs, _), records, holdings, all_shapes, side in (
                (a, out.src, out.src_padding, out.src_shapes, "A"),
                (b, out.dst, out.dst_padding, out.dst_shapes, "B")):
            records += [StateRecord.from_tuple(r) for r in _expand(recs, kinds) + list(bufs)]
            out.buffers = out.buffers or bool(bufs)
            holdings += [Holding(key, kind, lo, hi, dev) for key, kind0, lo, hi, dev in pads
                         for kind in ((kind0,) if kind0 == "param" else
                                      tuple(k for k in kinds if k in OPT_KINDS))]
            _merge_shapes(all_shapes, shapes, side, errors)
    if errors:
        raise ValueError("the live metadata is inconsistent: " + "; ".join(errors[:4]))
    out.seconds = time.perf_counter() - t0
    return out


def plan_from_metadata(meta: GatheredMetadata, *, src_layout, dst_layout,
                       src_devices: Sequence[int], dst_devices: Sequence[int],
                       kinds: Sequence[str], itemsize: dict, ranks_per_node: int,
                       unavailable: Sequence[int] = ()) -> tuple[MetadataPlan, PaddingPlan]:
    """The transfer plan and the vocabulary padding plan of a switch, from `meta`."""
    # buffers travel as "param" records, whatever the switch moves of the weights
    kinds = tuple(kinds) + (("param",) if meta.buffers and "param" not in kinds else ())
    plan = metadata_plan(meta.src, meta.dst, src_layout=src_layout, dst_layout=dst_layout,
                         src_devices=src_devices, dst_devices=dst_devices, kinds=kinds,
                         itemsize=itemsize, ranks_per_node=ranks_per_node,
                         unavailable=unavailable, src_shapes=meta.src_shapes,
                         dst_shapes=meta.dst_shapes)
    pad = padding_plan_from(meta.src_padding, meta.dst_padding, unavailable)
    return plan, pad


__all__ = ["GatheredMetadata", "PLAN_SOURCES", "gather_metadata",
           "plan_from_metadata", "plans_from_metadata", "unlike_analytic"]
