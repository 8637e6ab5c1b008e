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


def _flat_lo(shape: Sequence[int], offsets: Sequence[int]) -> int:
    return sum(o * math.prod(shape[i + 1:]) for i, o in enumerate(offsets))


def _side(live: Optional[LiveState], device: int, kinds: tuple[str, ...]) -> tuple:
    """This rank's part of one side: (records, padding holdings, global shapes). Records
    of the optimizer kinds are sent once, as `main_param` (they share their boxes)."""
    if live is None:
        return [], [], {}
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
    return recs, pads, dict(live.global_shapes)


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

    src: list[StateRecord] = field(default_factory=list)
    dst: list[StateRecord] = field(default_factory=list)
    src_padding: list[Holding] = field(default_factory=list)
    dst_padding: list[Holding] = field(default_factory=list)
    src_shapes: dict = field(default_factory=dict)
    dst_shapes: dict = field(default_factory=dict)
    payload_bytes: int = 0
    seconds: float = 0.0


def _merge_shapes(into: dict, got: dict, side: str, errors: list[str]) -> None:
    for k, v in got.items():
        if into.setdefault(k, tuple(v)) != tuple(v):
            errors.append(f"{k}: ranks of {side} disagree on its global shape")


def gather_metadata(src_live: Optional[LiveState], dst_live: Optional[LiveState],
                    kinds: Sequence[str], group: Any = None) -> GatheredMetadata:
    """Collective over `group` (every rank of the world, each with its own bindings at A
    and at B, None where it holds nothing there): every rank's records, on every rank."""
    import pickle

    t0 = time.perf_counter()
    kinds = tuple(k for k in KINDS if k in set(kinds))
    me = dist.get_rank()
    mine = (_side(src_live, me, kinds), _side(dst_live, me, kinds))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    out = GatheredMetadata(payload_bytes=len(pickle.dumps(mine)))
    errors: list[str] = []
    for a, b in everyone:
        for (recs, pads, shapes), records, holdings, all_shapes, side in (
                (a, out.src, out.src_padding, out.src_shapes, "A"),
                (b, out.dst, out.dst_padding, out.dst_shapes, "B")):
            records += [StateRecord.from_tuple(r) for r in _expand(recs, kinds)]
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
    plan = metadata_plan(meta.src, meta.dst, src_layout=src_layout, dst_layout=dst_layout,
                         src_devices=src_devices, dst_devices=dst_devices, kinds=kinds,
                         itemsize=itemsize, ranks_per_node=ranks_per_node,
                         unavailable=unavailable, src_shapes=meta.src_shapes,
                         dst_shapes=meta.dst_shapes)
    pad = padding_plan_from(meta.src_padding, meta.dst_padding, unavailable)
    return plan, pad


__all__ = ["GatheredMetadata", "PLAN_SOURCES", "gather_metadata",
           "plan_from_metadata", "plans_from_metadata"]
